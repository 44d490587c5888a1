#!/usr/bin/env python3
"""Decode-step benchmark: thin wrapper over ``onnx_light_ep.bench``.

Same options as ``onnx-light bench``; the source revision
(``$OLEP_SOURCE_REVISION``, else ``git rev-parse`` of the checkout, else the
package version: ``onnx_light_ep.bench.machine.source_revision``) is recorded in
the JSON and in every table.

    python tools/bench_decode.py --quick                       # smoke test, < 1 min
    python tools/bench_decode.py --out-dir bench_out --benchmarks-md BENCHMARKS.md   # full run
"""

import argparse
import shlex
import sys

from onnx_light_ep import bench
from onnx_light_ep.bench import machine


def _source_revision():
    # $OLEP_SOURCE_REVISION (e.g. when benchmarking a build of a snapshot), else git rev-parse of
    # the checkout the package is imported from, else the package version
    return machine.source_revision()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_arguments(parser)
    args = parser.parse_args(argv)
    command = shlex.join(["python", "tools/bench_decode.py"] + (sys.argv[1:] if argv is None else argv))
    return bench.main_from_args(args, command=command,
                                metadata={"source_revision": _source_revision()})


if __name__ == "__main__":
    sys.exit(main())
