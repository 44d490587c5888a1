"""The ``onnx-light bench`` command line (also ``tools/bench_decode.py``): options, and the
dispatch to the decode grid and end to end (``decode.run_bench``), the arena benchmarks
(``arena.run_arena``) and the prefill-attention benchmark (``prefill.run_prefill``)."""

from __future__ import annotations

import os
from typing import Dict, Optional

from .decode import CANDIDATES, BenchConfig, run_bench

def _parse_config(text: str) -> BenchConfig:
    """``Hq,Hkv,B,L,dtype[,layers]`` -> BenchConfig (layers 0 or absent: planned)."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) not in (5, 6):
        raise ValueError(f"--config: expected Hq,Hkv,B,L,dtype[,layers], got {text!r}")
    try:
        hq, hkv, b, L = (int(p) for p in parts[:4])
    except ValueError:
        raise ValueError(f"--config: expected integers Hq,Hkv,B,L then a dtype, got {text!r}") from None
    dtype = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}.get(parts[4], parts[4])
    return BenchConfig(hq, hkv, b, L, dtype, num_layers=int(parts[5]) if len(parts) == 6 else 0)


def add_arguments(parser) -> None:
    """Add the ``bench`` options to an ``argparse`` parser."""
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: tiny subset, 2 warm-up + 3 measured steps (< 1 min)")
    parser.add_argument("--threads", default="1,2", help="intra_op_num_threads values (default 1,2)")
    parser.add_argument("--out-dir", default="bench_out",
                        help="where bench_decode.{json,md,png} go (default bench_out)")
    parser.add_argument("--config", action="append", default=None, metavar="Hq,Hkv,B,L,dtype[,layers]",
                        help="run only these configurations (repeatable); default: the full grid, (Hq, Hkv) in "
                             "{(32,32), (32,8), (32,1)} x B in {1,4} x L in {1K,4K,16K,32K} x {fp32,fp16,bf16}, D=128")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up rounds (default 5, quick 2)")
    parser.add_argument("--reps", type=int, default=None, help="measured rounds (default 15, quick 3)")
    parser.add_argument("--candidates", default=",".join(CANDIDATES),
                        help=f"comma-separated subset of {','.join(CANDIDATES)}")
    parser.add_argument("--memory-budget-gb", type=float, default=12.0,
                        help="skip candidates/configurations estimated above this (default 12)")
    parser.add_argument("--slow-step-s", type=float, default=3.0,
                        help="a candidate whose second step is slower runs 2 + 5 steps (default 3)")
    parser.add_argument("--spin", action="store_true", help="let ORT intra-op threads spin (default off)")
    parser.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    parser.add_argument("--page-tokens", type=int, default=None,
                        help="page size of the ep_kvcache candidate (default: the library's)")
    parser.add_argument("--e2e", action="store_true",
                        help="also run end to end on SmolLM2-135M (EP vs plain ORT vs onnxruntime-genai)")
    parser.add_argument("--e2e-only", action="store_true", help="only the end-to-end part")
    parser.add_argument("--arena", action="store_true",
                        help="also run the generation-operation benchmarks (bench/arena.py: beam search, "
                             "fork, checkpoint/restore, sliding-window memory, page-table overhead)")
    parser.add_argument("--arena-only", action="store_true", help="only the arena benchmarks")
    parser.add_argument("--prefill", action="store_true",
                        help="also run the prefill-attention benchmark (bench/prefill.py: causal S in {512, 2048}, "
                             "GQA 32/8 and MHA, D=128, fp32, EP vs ORT Attention / GQA vs the compute floor)")
    parser.add_argument("--prefill-only", action="store_true", help="only the prefill-attention benchmark")
    parser.add_argument("--prefill-threads", default="1", help="prefill benchmark intra_op_num_threads (default 1)")
    parser.add_argument("--e2e-contexts", default="256,4096,8192",
                        help="end-to-end context lengths (default 256,4096,8192; one beyond the model's positions "
                             "minus the measured steps is clamped, with a note)")
    parser.add_argument("--e2e-threads", default="1,2", help="end-to-end intra_op_num_threads values (default 1,2)")
    parser.add_argument("--e2e-models", default="fp32,int4",
                        help="end-to-end SmolLM2-135M exports: fp32 and/or int4 (MatMulNBits weights)")
    parser.add_argument("--benchmarks-md", default=None, metavar="PATH",
                        help="also replace the generated section of this BENCHMARKS.md")


#: Environment variables that change what a benchmark measures (the attention ISA level).
MEASURED_ENV = ("ONNX_LIGHT_ISA",)


def reproducible_command(command: str, environ: Optional[Dict[str, str]] = None) -> str:
    """``command`` with the settings of :data:`MEASURED_ENV` that are set in ``environ`` (default
    ``os.environ``) written in front, as a POSIX shell takes them
    (``ONNX_LIGHT_ISA=avx2 python tools/bench_decode.py ...``), so that the command line a report
    prints reproduces the run; unchanged when none is set or the command already starts with it."""
    import shlex

    env = os.environ if environ is None else environ
    prefix = [f"{k}={shlex.quote(env[k])}" for k in MEASURED_ENV
              if env.get(k) and not command.startswith(f"{k}=")]
    return " ".join(prefix + [command])


def main_from_args(args, command: Optional[str] = None, metadata: Optional[Dict] = None) -> int:
    """Run :func:`run_bench` from parsed ``add_arguments`` options; returns the exit status."""
    import shlex
    import sys

    from . import report

    if command is None:
        command = shlex.join(["onnx-light"] + sys.argv[1:])
    command = reproducible_command(command)
    try:
        configs = [_parse_config(c) for c in args.config] if args.config else None
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.arena or args.arena_only:
        from .arena import run_arena

        arena = run_arena(args.out_dir, quick=args.quick, threads=int(args.threads.split(",")[0]), command=command)
        if args.benchmarks_md:
            report.update_benchmarks_md_section(args.benchmarks_md, "arena", arena)
        written = [os.path.join(args.out_dir, n) for n in ("bench_arena.json", "bench_arena.md")]
        if args.benchmarks_md:
            written.append(args.benchmarks_md)
        print(f"wrote {', '.join(w for w in written if os.path.exists(w))} ({arena['settings']['elapsed_s']:.0f} s)")
        if args.arena_only:
            return 0
    if args.prefill or args.prefill_only:
        from . import prefill

        res = prefill.run_prefill(args.out_dir, threads=[int(t) for t in args.prefill_threads.split(",")],
                                  quick=args.quick, command=command)
        if args.benchmarks_md:
            prefill.update_benchmarks_md(args.benchmarks_md, res)
        written = [os.path.join(args.out_dir, n) for n in ("bench_prefill.json", "bench_prefill.md")]
        if args.benchmarks_md:
            written.append(args.benchmarks_md)
        print(f"wrote {', '.join(w for w in written if os.path.exists(w))} ({res['settings']['elapsed_s']:.0f} s)")
        if args.prefill_only:
            return 0
    result = run_bench(configs, threads=[int(t) for t in args.threads.split(",")], quick=args.quick,
                       out_dir=args.out_dir, warmup=args.warmup, reps=args.reps,
                       candidates=[c for c in args.candidates.split(",") if c],
                       memory_budget_bytes=args.memory_budget_gb * 1e9, slow_step_s=args.slow_step_s,
                       allow_spinning=args.spin, plot=not args.no_plot, grid=not args.e2e_only,
                       e2e=args.e2e or args.e2e_only,
                       e2e_contexts=[int(c) for c in args.e2e_contexts.split(",")],
                       e2e_threads=[int(t) for t in args.e2e_threads.split(",")],
                       e2e_models=[m for m in args.e2e_models.split(",") if m],
                       command=command, metadata=metadata, page_tokens=args.page_tokens)
    if args.benchmarks_md:
        report.update_benchmarks_md(args.benchmarks_md, result,
                                    os.path.join(args.out_dir, "bench_decode.png"))
    written = [os.path.join(args.out_dir, n) for n in ("bench_decode.json", "bench_decode.md", "bench_decode.png")]
    if args.benchmarks_md:
        written.append(args.benchmarks_md)
    print(f"wrote {', '.join(w for w in written if os.path.exists(w))} ({result['settings']['elapsed_s']:.0f} s)")
    return 0
