#!/usr/bin/env python3
"""Generation-loop benchmarks on the pretrained SmolLM2-135M-Instruct (fp32, onnxruntime-genai export).

    python tools/bench_generation.py --out-dir bench_out [--sections prefix_cache] [--threads 1] [--reps 3] \
        [--benchmarks-md BENCHMARKS.md]

One section per generation feature, each a function ``bench_<section>(ctx) -> dict`` registered in
``SECTIONS`` and rendered by its own ``markdown_<section>(result)``; ``--sections`` picks them (default:
all). Writes ``<out-dir>/bench_generation.json`` (every sample, the machine, the command) and
``<out-dir>/bench_generation.md`` (one table per section) and prints the markdown;
``--benchmarks-md`` replaces each section's generated block ``bench_generation_<section>`` of that
file. The model is
obtained and converted as ``onnx-light demo`` does (``<model>-onnx-light/``); one EP session with
``--threads`` intra-op threads serves every request. Times are wall-clock medians over ``--reps``
repetitions with min and max; the configurations of one repetition run back to back (interleaved).

Section ``prefix_cache``: the time to first token (TTFT) of a request whose ~2K-token system
prompt (``onnx_light_ep.bench.prompts``) an earlier request already prefilled. Per repetition, on a
fresh ``KVPool`` and ``PrefixCache``: ``uncached`` (``generate`` without a prefix cache: the padded
batch loop, one prefill run), ``cold`` (question A with an empty PrefixCache: every token prefilled,
in runs of ``PREFILL_CHUNK_TOKENS``) and ``warm`` (question B, reusing the blocks A left). TTFT =
``generate(..., max_new_tokens=1)`` wall time (prompt ids given, session reused: lookup, fork,
prefill, the first token) and ``GenerateResult.prefill_seconds``. Also: bytes the PrefixCache
holds after request A (``PrefixCache.stats()``: ``bytes`` and ``exclusive_bytes``) and the pool's
``live_bytes``; and once, untimed, whether 32 greedy tokens of the warm request equal the uncached
run's.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from typing import Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this tree's package


def _spread(xs: List[float]) -> Dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "samples": xs}


# -- section: prefix_cache -------------------------------------------------------------------------

def bench_prefix_cache(ctx: Dict) -> Dict:
    """TTFT cold vs warm for a second request sharing a ~2K-token system prompt; bytes the cache holds."""
    from onnx_light_ep import KVPool
    from onnx_light_ep.bench.prompts import catalogue_questions, catalogue_system_prompt
    from onnx_light_ep.generate import PrefixCache, generate
    from onnx_light_ep.generate._prefix_loop import PREFILL_CHUNK_TOKENS

    model, tok, sess, args = ctx["model"], ctx["tokenizer"], ctx["session"], ctx["args"]
    system = catalogue_system_prompt(tok, args.system_tokens)
    questions = catalogue_questions(2 * args.reps + 1)
    rows = [tok.encode(tok.chat_prompt(q, system=system)) for q in questions]
    times: Dict[str, List[float]] = {"uncached": [], "cold": [], "warm": []}
    prefill: Dict[str, List[float]] = {k: [] for k in times}
    cached: Dict[str, int] = {}
    held: Dict[str, int] = {}
    for rep in range(args.reps):
        a, b = rows[2 * rep], rows[2 * rep + 1]
        t0 = time.perf_counter()
        r = generate(model, prompt_ids=[b], max_new_tokens=1, session=sess)
        times["uncached"].append(time.perf_counter() - t0)
        prefill["uncached"].append(r.prefill_seconds)
        with KVPool() as pool, PrefixCache(pool) as pc:
            for name, row in (("cold", a), ("warm", b)):
                t0 = time.perf_counter()
                r = generate(model, prompt_ids=[row], max_new_tokens=1, session=sess, prefix_cache=pc)
                times[name].append(time.perf_counter() - t0)
                prefill[name].append(r.prefill_seconds)
                cached[name] = r.cached_tokens
                if name == "cold":
                    s = pc.stats()
                    held = {"entries": s["entries"], "cached_tokens": s["cached_tokens"], "bytes": s["bytes"],
                            "exclusive_bytes": s["exclusive_bytes"], "pool_live_bytes": pool.stats()["live_bytes"]}
        print(f"prefix_cache: rep {rep + 1}/{args.reps}: " + ", ".join(
            f"{k} {v[-1] * 1e3:.0f} ms" for k, v in times.items()), file=sys.stderr, flush=True)
    a, b = rows[-1], rows[0]  # untimed: the warm answer against the uncached one (32 greedy tokens)
    with KVPool() as pool, PrefixCache(pool) as pc:
        generate(model, prompt_ids=[a], max_new_tokens=1, session=sess, prefix_cache=pc)
        warm = generate(model, prompt_ids=[b], max_new_tokens=32, session=sess, prefix_cache=pc)
    ref = generate(model, prompt_ids=[b], max_new_tokens=32, session=sess)
    return {"system_prompt_tokens": len(tok.encode(system)), "prompt_tokens": [len(r) for r in rows],
            "prefill_chunk_tokens": PREFILL_CHUNK_TOKENS, "cached_tokens": cached,
            "ttft_s": {k: _spread(v) for k, v in times.items()},
            "prefill_s": {k: _spread(v) for k, v in prefill.items()},
            "after_first_request": held, "warm_tokens_identical_to_uncached_32": warm.token_ids == ref.token_ids,
            "warm_text": warm.text}


def markdown_prefix_cache(res: Dict) -> List[str]:
    ttft, pre = res["ttft_s"], res["prefill_s"]
    base = ttft["uncached"]["median"]
    lines = [f"### Prefix cache: TTFT of a request sharing a {res['system_prompt_tokens']}-token system prompt",
             "", "| request | cached tokens | TTFT ms (median, min-max) | prefill ms | vs uncached |",
             "|---|---:|---:|---:|---:|"]
    labels = {"uncached": "uncached (no PrefixCache, one prefill run)",
              "cold": "cold (empty PrefixCache)", "warm": "warm (system prompt cached)"}
    for k in ("uncached", "cold", "warm"):
        t = ttft[k]
        lines.append(f"| {labels[k]} | {res['cached_tokens'].get(k, 0)} | {t['median'] * 1e3:.0f} "
                     f"({t['min'] * 1e3:.0f}-{t['max'] * 1e3:.0f}) | {pre[k]['median'] * 1e3:.0f} | "
                     f"{base / t['median']:.2f}x |")
    h = res["after_first_request"]
    lines += ["", f"After the first request the PrefixCache holds {h['entries']} blocks ({h['cached_tokens']} "
              f"tokens): {h['bytes'] / 2**20:.1f} MiB of pages ({h['exclusive_bytes'] / 2**20:.1f} MiB only it "
              f"holds; pool live {h['pool_live_bytes'] / 2**20:.1f} MiB). Warm request's 32 greedy tokens "
              f"identical to the uncached run's: {res['warm_tokens_identical_to_uncached_32']}. TTFT is the "
              f"wall time of `generate(..., max_new_tokens=1)`; prefill = `prefill_seconds` (lookup, fork, "
              f"prefill of the tokens after the cached prefix, in runs of at most "
              f"{res['prefill_chunk_tokens']}); the rest is generate's setup (it reads tokenizer.json on "
              f"every call)."]
    return lines


# -- driver ----------------------------------------------------------------------------------------

SECTIONS: Dict[str, Callable[[Dict], Dict]] = {"prefix_cache": bench_prefix_cache}
MARKDOWN: Dict[str, Callable[[Dict], List[str]]] = {"prefix_cache": markdown_prefix_cache}


def _context(args) -> Dict:
    from pathlib import Path

    import onnxruntime as ort

    from onnx_light_ep import InferenceSession
    from onnx_light_ep._text import TextTokenizer
    from onnx_light_ep.demo import ensure_converted
    from onnx_light_ep.models.smollm2 import ensure_smollm2_onnx

    src = Path(ensure_smollm2_onnx(progress=True))
    model = str(ensure_converted(src, out=sys.stderr))
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = args.threads
    return {"args": args, "model": model, "tokenizer": TextTokenizer.find([str(src)]),
            "session": InferenceSession(model, so)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", required=True, help="folder for bench_generation.json and .md")
    ap.add_argument("--sections", nargs="+", choices=sorted(SECTIONS), default=sorted(SECTIONS))
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads of the session (default 1)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions per section (default 3)")
    ap.add_argument("--system-tokens", type=int, default=2048, help="prefix_cache: system prompt length")
    ap.add_argument("--benchmarks-md", help="replace the sections' generated blocks of this markdown file")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.threads < 1 or args.system_tokens < 1:
        ap.error("--reps, --threads and --system-tokens must be >= 1")
    from onnx_light_ep.bench.machine import machine_info

    ctx = _context(args)
    result = {"command": shlex.join(["python", "tools/bench_generation.py"] + sys.argv[1:]),
              "machine": machine_info(measure_bandwidth=False), "threads": args.threads, "model": ctx["model"],
              "sections": {}}
    for name in args.sections:
        result["sections"][name] = SECTIONS[name](ctx)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "bench_generation.json"), "w") as f:
        json.dump(result, f, indent=1)
    from onnx_light_ep.bench import report

    head = [f"Command: `{result['command']}` ({args.threads} thread(s), {args.reps} reps; "
            f"{result['machine'].get('cpu_model', 'CPU')})", ""]
    lines = list(head)
    for name in args.sections:
        body = MARKDOWN[name](result["sections"][name])
        lines += body + [""]
        if args.benchmarks_md:
            block = "\n".join(body[:1] + [""] + head[:1] + body[1:])
            report.update_block(args.benchmarks_md, f"bench_generation_{name}", block)
    md = "\n".join(lines)
    with open(os.path.join(args.out_dir, "bench_generation.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
