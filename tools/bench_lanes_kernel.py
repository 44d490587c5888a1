#!/usr/bin/env python3
"""Compute-bound attention groups (the lanes path), the kernel alone, against the compute and read floors.

Builds ``tools/cpp/bench_lanes_attention.cc`` and ``bench_fma_peak`` / ``bench_scattered_read``,
measures this core's peak FMA throughput per ISA level and its sequential read bandwidth, then
runs, per ISA level and dtype, one kv head's group (MQA decode 32/1 by default; ``--shapes``) over
K/V in pages from memory (``dram``) and from the caches (``hot``). Reports, per case, the median
ms per call over ``--repeats`` runs of the driver (each the median of ``--rounds`` interleaved
samples), and

- ``/ compute``: time / (the call's multiply-adds at the measured fp32 FMA peak of the level:
  group x visible keys x (head_dim for q . k + head_dim for P . V));
- ``/ read``: time / (the call's K/V bytes at the measured sequential read bandwidth).

``--baseline-build DIR``: also runs DIR's bench_lanes_attention (built from another commit),
alternating the two executables run by run, and prints new / baseline.

    python tools/bench_lanes_kernel.py --isa avx2,avx512,avx512_bf16
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEAK = {"scalar": None, "avx2": "fp32_avx2", "avx512": "fp32_avx512", "avx512_bf16": "fp32_avx512"}
HEAD = re.compile(r"macs=([\d.]+) bytes=(\d+)")
LINE = re.compile(r"^\s+(\w+)\s+median\s+([\d.]+) ms\s+min\s+([\d.]+) ms")


def build(build_dir):
    if not os.path.exists(os.path.join(build_dir, "CMakeCache.txt")):
        subprocess.run(["cmake", "-S", ROOT, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release",
                        "-DONNX_LIGHT_BUILD_TESTS=ON"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", build_dir, "-j2", "--target", "bench_lanes_attention", "bench_fma_peak",
                    "bench_scattered_read"], check=True, stdout=subprocess.DEVNULL)
    return lambda name: os.path.join(build_dir, name)


def fma_peaks(exe):
    out = subprocess.run([exe, "200", "5"], check=True, capture_output=True, text=True).stdout
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^\s+(\w+)\s+([\d.]+) GFMA/s", out, re.M)}


def read_gb_s(exe):
    out = subprocess.run([exe, "65536", str(4 << 20), "8"], check=True, capture_output=True, text=True).stdout
    m = re.search(r"^\s+sequential\s+median\s+([\d.]+) GB/s", out, re.M)
    return float(m.group(1))


def run(exe, isa, dtype, ctx, group, rows, d, rounds):
    env = dict(os.environ, ONNX_LIGHT_ISA=isa)
    out = subprocess.run([exe, dtype, str(ctx), str(group), str(rows), str(d), str(rounds)], check=True,
                         capture_output=True, text=True, env=env).stdout
    h = HEAD.search(out)
    ms = {m.group(1): float(m.group(2)) for m in map(LINE.match, out.splitlines()) if m}
    return float(h.group(1)), int(h.group(2)), ms


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build-dev"))
    ap.add_argument("--baseline-build", default=None, help="build dir of another commit to compare against")
    ap.add_argument("--isa", default="avx2,avx512,avx512_bf16")
    ap.add_argument("--dtypes", default="f32,f16,bf16")
    ap.add_argument("--shapes", default="32x1@4096",
                    help="comma-separated GROUPxROWS@CONTEXT (32x1@4096: MQA decode; 8x1: GQA 32/4; 1x512: prefill)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)

    exe = build(args.build_dir)
    base = build(args.baseline_build) if args.baseline_build else None
    peaks = fma_peaks(exe("bench_fma_peak"))
    bw = read_gb_s(exe("bench_scattered_read"))
    print("fma peak (GFMA/s): " + ", ".join(f"{k} {v:.1f}" for k, v in peaks.items() if k.startswith("fp32")))
    print(f"sequential read: {bw:.2f} GB/s (one core)")
    print("(machine shared unless stated otherwise; medians over runs of in-run medians)")
    results = []
    for isa in [s for s in args.isa.split(",") if s]:
        peak = peaks.get(PEAK[isa]) if PEAK.get(isa) else None
        for dtype in [s for s in args.dtypes.split(",") if s]:
            for shape in args.shapes.split(","):
                gr, ctx = shape.split("@")
                group, rows = map(int, gr.split("x"))
                cur, old = {}, {}
                for _ in range(args.repeats):
                    for which, e in (("new", exe), ("old", base)):
                        if e is None:
                            continue
                        macs, nbytes, ms = run(e("bench_lanes_attention"), isa, dtype, int(ctx), group, rows,
                                               args.head_dim, args.rounds)
                        for k, v in ms.items():
                            (cur if which == "new" else old).setdefault(k, []).append(v)
                comp_ms = macs / (peak * 1e9) * 1e3 if peak else None
                read_ms = nbytes / (bw * 1e9) * 1e3
                row = {"isa": isa, "dtype": dtype, "group": group, "rows": rows, "context": int(ctx),
                       "macs": macs, "bytes": nbytes, "compute_floor_ms": comp_ms, "read_floor_ms": read_ms}
                for place in ("dram", "hot"):
                    t = statistics.median(cur[place])
                    row[place + "_ms"] = t
                    s = (f"{isa:11s} {dtype:4s} {group}x{rows}@{ctx} {place:4s} {t:8.3f} ms "
                         f"(spread {min(cur[place]):.3f}-{max(cur[place]):.3f})")
                    if comp_ms:
                        s += f"  / compute x{t / comp_ms:.2f}"
                    s += f"  / read x{t / read_ms:.2f}"
                    if old:
                        to = statistics.median(old[place])
                        row[place + "_baseline_ms"] = to
                        s += f"  | baseline {to:8.3f} ms"
                        if comp_ms:
                            s += f" (x{to / comp_ms:.2f})"
                        s += f"  new/baseline {t / to:.3f}"
                    print(s, flush=True)
                results.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"settings": vars(args), "fma_peak_gfma_s": peaks, "read_gb_s": bw, "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    sys.exit(main())
