#!/usr/bin/env python3
"""Decode-step benchmark: thin wrapper over ``onnx_light_ep.bench``.

Same options as ``onnx-light bench``; additionally records the source
revision (``$OLEP_SOURCE_REVISION``, else ``git describe --always --dirty`` of
this checkout) in the JSON.

    python tools/bench_decode.py --quick                       # smoke test, < 1 min
    python tools/bench_decode.py --out-dir bench_out --benchmarks-md BENCHMARKS.md   # full run
"""

import argparse
import os
import shlex
import subprocess
import sys

from onnx_light_ep import bench


def _source_revision():
    if os.environ.get("OLEP_SOURCE_REVISION"):  # e.g. when benchmarking a build of a snapshot
        return os.environ["OLEP_SOURCE_REVISION"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        return subprocess.run(["git", "-C", root, "describe", "--always", "--dirty"],
                              capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_arguments(parser)
    args = parser.parse_args(argv)
    command = shlex.join(["python", "tools/bench_decode.py"] + (sys.argv[1:] if argv is None else argv))
    return bench.main_from_args(args, command=command,
                                metadata={"source_revision": _source_revision()})


if __name__ == "__main__":
    sys.exit(main())
