#!/usr/bin/env python3
"""Generation loops on SmolLM2-135M-Instruct, measured: one section per feature.

    python tools/bench_generation.py --out-dir bench_out [--sections beam] [--threads 1,0] [--benchmarks-md BENCHMARKS.md]

Writes ``<out-dir>/bench_generation.json`` (machine, command, every section's raw samples) and
``<out-dir>/bench_generation.md`` (one table per section); ``--benchmarks-md`` replaces the block
``bench_generation_NAME`` of that file for each section run. A section is a function
``section_NAME(args) -> dict`` with a ``"markdown"`` list of lines, registered in ``SECTIONS``;
its own options are added to the parser by ``add_NAME_arguments``.

Sections (modules of ``onnx_light_ep.bench``, each a ``SECTION = (name, section(args) -> dict,
add_arguments(parser))``):

- ``beam`` (``gen_beam``): beam search tokens/s and bytes copied per step, EP KVCache (fork +
  reorder) vs plain ORT with per-beam gathered pasts vs onnxruntime-genai's beam search.
- ``prefix_cache`` (``gen_prefix``): time to first token of a request sharing a ~2K-token system
  prompt with an earlier one, cold vs warm, and the bytes the PrefixCache holds.
- ``speculative`` (``gen_speculative``): prompt-lookup and draft-model speculative decoding
  against plain greedy on a copy task: decode tokens per second (wall and CPU), acceptance, and
  whether the tokens equal greedy's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable, Dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# -- driver ----------------------------------------------------------------------------------------

from onnx_light_ep.bench import gen_beam, gen_prefix, gen_speculative  # noqa: E402

SECTIONS: Dict[str, Callable] = {}
SECTION_ARGUMENTS: Dict[str, Callable] = {}
for _name, _run, _add in (gen_beam.SECTION, gen_prefix.SECTION, gen_speculative.SECTION):
    SECTIONS[_name], SECTION_ARGUMENTS[_name] = _run, _add


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default="bench_out")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    ap.add_argument("--threads", default="1,0", help="intra-op thread counts, 0 = ORT's default")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=3, help="repetitions of the prefix_cache and speculative sections")
    ap.add_argument("--benchmarks-md", default=None, metavar="FILE",
                    help="replace each run section's block bench_generation_NAME of FILE")
    for add in SECTION_ARGUMENTS.values():
        add(ap)
    args = ap.parse_args(argv)
    try:
        args.threads = [int(x) for x in args.threads.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--threads; expected comma-separated integers, got {args.threads!r}")
    wanted = [s for s in args.sections.split(",") if s]
    unknown = [s for s in wanted if s not in SECTIONS]
    if unknown:
        ap.error(f"--sections; unknown {', '.join(unknown)}: expected any of {', '.join(SECTIONS)}")
    os.makedirs(args.out_dir, exist_ok=True)
    from onnx_light_ep.bench.machine import machine_info
    from onnx_light_ep.bench.report import machine_lines, update_block

    result = {"machine": machine_info(measure_bandwidth=False), "command": " ".join(sys.argv), "sections": {}}
    head = [f"Command: `python {result['command']}`", ""] + machine_lines(result["machine"]) + [""]
    md = ["## bench_generation", ""] + head
    for name in wanted:
        print(f"section {name} ...", file=sys.stderr)
        t0 = time.time()
        result["sections"][name] = SECTIONS[name](args)
        md += result["sections"][name]["markdown"] + [""]
        if args.benchmarks_md:
            update_block(args.benchmarks_md, f"bench_generation_{name}",
                         "\n".join(head + result["sections"][name]["markdown"]
                                   + ["", f"Section run took {(time.time() - t0) / 60:.1f} min."]),
                         machine=result["machine"])
    with open(os.path.join(args.out_dir, "bench_generation.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out_dir, "bench_generation.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
