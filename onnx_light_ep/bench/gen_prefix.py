"""Section ``prefix_cache`` of ``tools/bench_generation.py``: time to first token with a shared system prompt.

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

import statistics
import sys
import time
from typing import Dict, List


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
    lines = [f"### Prefix cache: TTFT of a request sharing a {res['system_prompt_tokens']}-token system prompt "
             f"({res.get('threads') or 'default'} thread(s), {res.get('reps')} reps)",
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


def _context(args, threads: int) -> Dict:
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
    if threads:
        so.intra_op_num_threads = threads
    return {"args": args, "model": model, "tokenizer": TextTokenizer.find([str(src)]),
            "session": InferenceSession(model, so)}



def add_prefix_cache_arguments(ap) -> None:
    g = ap.add_argument_group("prefix_cache")
    g.add_argument("--system-tokens", type=int, default=2048, help="system prompt length (default 2048)")


def section_prefix_cache(args) -> Dict:
    """Runs at the first of ``--threads`` (0 = ORT's default) with ``--reps`` repetitions."""
    if args.reps < 1 or args.system_tokens < 1:
        raise SystemExit("error: --reps and --system-tokens must be >= 1")
    threads = args.threads[0] if args.threads else 1
    res = bench_prefix_cache(_context(args, threads))
    res["threads"] = threads
    res["reps"] = args.reps
    res["markdown"] = markdown_prefix_cache(res)
    return res


SECTION = ("prefix_cache", section_prefix_cache, add_prefix_cache_arguments)
