#!/usr/bin/env python3
"""Paged vs one-block attention, the kernel alone, against the physical floor.

Builds the two C++ drivers (``tools/cpp/bench_paged_attention.cc``,
``tools/cpp/bench_scattered_read.cc``) and runs, for MHA and GQA decode in
fp16/bf16/float32 at each ISA level asked for:

- the attention kernel on one contiguous block per (layer, kv head) and on the
  same bytes in pages (decode order), at the default page size
  (``onnx_light_ep.default_page_tokens``) and at 128 tokens (vLLM's CPU default);
- the read bandwidth of the same access patterns without arithmetic, which is
  the least a page costs against one block on this machine.

Every figure is the median over ``--repeats`` runs of the driver, each of which
interleaves the layouts round by round (median and minimum per run: the
minimum is the one least disturbed by other load on a shared machine).

    python tools/bench_paged_kernel.py --out-dir bench_out --benchmarks-md BENCHMARKS.md
"""

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = [  # (dtype, kv heads, query heads per kv head)
    ("f16", 32, 1), ("bf16", 32, 1), ("f32", 32, 1),
    ("f16", 8, 4), ("bf16", 8, 4), ("f32", 8, 4),
]
NP_NAME = {"f16": "float16", "bf16": "bfloat16", "f32": "float32"}
ELEM = {"f16": 2, "bf16": 2, "f32": 4}
LINE = re.compile(r"^\s+(\w+)\s+median\s+([\d.]+) ms x[\d.]+\s+min\s+([\d.]+) ms(?:.* / read x([\d.]+))?")
READ_LINE = re.compile(r"^\s+(\w+)\s+median\s+([\d.]+) GB/s\s+best\s+([\d.]+) GB/s")


def build(build_dir):
    subprocess.run(["cmake", "-S", ROOT, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release",
                    "-DONNX_LIGHT_BUILD_TESTS=ON"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", build_dir, "-j2", "--target", "bench_paged_attention",
                    "bench_scattered_read"], check=True, stdout=subprocess.DEVNULL)
    return os.path.join(build_dir, "bench_paged_attention"), os.path.join(build_dir, "bench_scattered_read")


def run_kernel(exe, isa, dtype, context, page, heads, group, head_dim, rounds):
    env = dict(os.environ, ONNX_LIGHT_ISA=isa)
    out = subprocess.run([exe, dtype, str(context), str(page), str(heads), str(group), str(head_dim), str(rounds)],
                         check=True, capture_output=True, text=True, env=env).stdout
    ms = {m.group(1): (float(m.group(2)), float(m.group(3)), float(m.group(4) or "nan"))
          for m in map(LINE.match, out.splitlines()) if m}
    return {k: {"median_ms": v[0], "min_ms": v[1], "vs_read": v[2]} for k, v in ms.items()}


def run_read(exe, page_bytes, unit_bytes, rounds):
    out = subprocess.run([exe, str(page_bytes), str(unit_bytes), str(rounds)], check=True, capture_output=True,
                         text=True).stdout
    return {m.group(1): {"median_gb_s": float(m.group(2)), "best_gb_s": float(m.group(3))}
            for m in map(READ_LINE.match, out.splitlines()) if m}


def med(xs):
    return statistics.median(xs) if xs else None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build-bench"))
    ap.add_argument("--isa", default="", help="comma-separated ISA levels (default: the detected one)")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=24)
    ap.add_argument("--out-dir", default="bench_out")
    ap.add_argument("--benchmarks-md", default=None)
    args = ap.parse_args(argv)

    import onnx_light_ep
    from onnx_light_ep import _core
    from onnx_light_ep.bench import machine, report

    t0 = time.time()
    kexe, rexe = build(args.build_dir)
    isas = [s for s in args.isa.split(",") if s] or [_core.detected_isa()]
    D = args.head_dim
    kernel = []
    for isa in isas:
        for dtype, heads, group in CONFIGS:
            pages = sorted({onnx_light_ep.default_page_tokens(D, NP_NAME[dtype]), 128})
            for page in pages:
                runs = [run_kernel(kexe, isa, dtype, args.context, page, heads, group, D, args.rounds)
                        for _ in range(args.repeats)]
                row = {"isa": isa, "dtype": NP_NAME[dtype], "kv_heads": heads, "group": group, "page_tokens": page,
                       "page_bytes": page * 2 * D * ELEM[dtype],
                       "default": page == onnx_light_ep.default_page_tokens(D, NP_NAME[dtype])}
                for layout in ("one", "paged", "paged_row"):
                    row[layout + "_ms"] = med([r[layout]["median_ms"] for r in runs])
                for layout in ("one", "paged"):  # time / the read floor (the same bytes, read in the same rounds)
                    row[layout + "_vs_read"] = med([r[layout]["vs_read"] for r in runs])
                for layout in ("paged", "paged_row"):
                    row[layout + "_vs_one"] = med([r[layout]["median_ms"] / r["one"]["median_ms"] for r in runs])
                    row[layout + "_vs_one_min"] = med([r[layout]["min_ms"] / r["one"]["min_ms"] for r in runs])
                kernel.append(row)
                print(f"{isa} {row['dtype']} {heads}x{group} page {page}: paged/one {row['paged_vs_one']:.3f} "
                      f"(min {row['paged_vs_one_min']:.3f}), page rows/one {row['paged_row_vs_one']:.3f}, "
                      f"paged/read {row['paged_vs_read']:.3f}", flush=True)
    floor = []
    unit = args.context * 2 * D * 2  # one (layer, kv head) of fp16 K+V at this context
    for page_bytes in (64 << 10, 128 << 10, 256 << 10):
        runs = [run_read(rexe, page_bytes, unit, max(8, args.rounds // 2)) for _ in range(args.repeats)]
        row = {"page_bytes": page_bytes, "unit_bytes": unit}
        for p in ("sequential", "one_block", "pages", "pages_2"):
            row[p + "_gb_s"] = med([r[p]["median_gb_s"] for r in runs])
        for p in ("pages", "pages_2"):
            row[p + "_vs_one"] = med([r["one_block"]["median_gb_s"] / r[p]["median_gb_s"] for r in runs])
            row[p + "_vs_one_best"] = med([r["one_block"]["best_gb_s"] / r[p]["best_gb_s"] for r in runs])
        floor.append(row)
        print(f"read floor {page_bytes >> 10} KiB pages: x{row['pages_vs_one']:.3f} one stream per page, "
              f"x{row['pages_2_vs_one']:.3f} two", flush=True)

    cmd = "python tools/bench_paged_kernel.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    result = {"settings": {**vars(args), "command": cmd.strip(), "elapsed_s": time.time() - t0},
              "machine": machine.machine_info(measure_bandwidth=False), "kernel": kernel, "floor": floor}
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "bench_paged_kernel.json"), "w") as f:
        json.dump(result, f, indent=1)
    if args.benchmarks_md:
        update_md(args.benchmarks_md, result, report)


def markdown(result, report):
    s = result["settings"]
    lines = ["## Paged vs one block: the attention kernel and the read floor", ""]
    lines += report.machine_lines(result["machine"])
    lines += ["", f"Command: `{s['command']}`; run took {s['elapsed_s'] / 60:.1f} min. One decode step (one query "
              f"row per query head), context {s['context']}, head_dim {s['head_dim']}, layers enough for >= 256 MiB "
              f"of K/V; the same bytes in one block per (layer, kv head) and in pages placed in decode order (page "
              f"b of every head, then page b + 1). Ratios: time on pages / time on one block, median over "
              f"{s['repeats']} runs of the in-run median (and of the in-run minimum); `/ read`: time / the read time "
              f"of the same bytes (one sequential pass, stream_read at the same ISA level, in the same rounds: the "
              f"floor of a memory-bound step); `page rows` reads page b of "
              f"every head of a layer before page b + 1 (not what the op does; shown for the record).", "",
              "| ISA | dtype | heads (kv x group) | page_tokens (KiB) | one block ms | paged / one | (min) | "
              "page rows / one | one / read | paged / read |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["kernel"]:
        tag = " **default**" if r["default"] else ""
        lines.append(f"| {r['isa']} | {r['dtype']} | {r['kv_heads']} x {r['group']} | {r['page_tokens']} "
                     f"({r['page_bytes'] >> 10}){tag} | {r['one_ms']:.2f} | x{r['paged_vs_one']:.3f} | "
                     f"x{r['paged_vs_one_min']:.3f} | x{r['paged_row_vs_one']:.3f} | x{r['one_vs_read']:.3f} | "
                     f"x{r['paged_vs_read']:.3f} |")
    lines += ["", "Read floor (`bench_scattered_read`): one core reading the same patterns with no arithmetic; "
              "`one block` = two streams (K, V) advancing 4 KiB at a time over contiguous rows; `pages` = each "
              "page one stream (how the kernel reads a page); `pages, 2 streams` = each page's K and V halves "
              "read as two streams (the kernel before it read pages whole).", "",
              "| page KiB | one block GB/s | pages GB/s | pages / one (best) | pages, 2 streams / one |",
              "|---|---|---|---|---|"]
    for r in result["floor"]:
        lines.append(f"| {r['page_bytes'] >> 10} | {r['one_block_gb_s']:.1f} | {r['pages_gb_s']:.1f} | "
                     f"x{r['pages_vs_one']:.3f} (x{r['pages_vs_one_best']:.3f}) | x{r['pages_2_vs_one']:.3f} |")
    return "\n".join(lines)


def update_md(path, result, report):
    report.update_block(path, "bench_paged_kernel", markdown(result, report), machine=result["machine"])


if __name__ == "__main__":
    main()
