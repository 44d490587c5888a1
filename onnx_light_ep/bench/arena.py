"""Generation operations on the paged arena, measured (``onnx-light bench --arena``).

``run_arena(out_dir, quick=False, threads=1) -> dict`` writes ``bench_arena.json`` and
``bench_arena.md``. What it measures, each in one process with the same inputs:

- **beam search**: a prompt of ``L`` tokens prefilled once, ``fork([0] * 4)`` into 4 beams,
  then decode steps each followed by a beam reorder with repeated parents. EP: one
  ``CacheAttention`` step (B=4) + ``KVCache.reorder`` (copy-on-write copies a shared tail
  page at the next write). ORT as onnxruntime-genai runs beam search with tensor past/present:
  one ONNX ``Attention`` step (B=4) whose presents are then gathered by parent beam (a copy
  of every beam's past). Per step: median time (ms) and bytes copied (EP: ``bytes_copied``;
  ORT: the presents it writes plus the gathered pasts).
- **fork vs copy**: ``KVCache.fork()`` of an ``L``-token cache against a full copy of the same
  cache (``export`` of every layer + ``KVCache.from_past``), and against ``memcpy`` of its bytes.
- **speculative**: ``checkpoint()`` + ``restore()``, and ``truncate`` by 8 tokens then re-append
  (the cost of rolling a rejected draft back), at ``L`` tokens.
- **truncate churn**: a decode step that starts a new page, then ``truncate`` back (a rejected
  speculative draft at a page start), in a pool that unmaps empty slabs at once
  (``keep_free_bytes=0``) against one that keeps them for reuse (the default), interleaved:
  median time per step + truncate and the bytes the process maps per step.
- **sliding window**: committed KV bytes of a layer with ``sliding_window=512`` against one that
  keeps everything, for contexts up to 32K appended in chunks of 512 through real runs.
- **page-table overhead and fragmentation**: ``stats()`` of a decode cache at several contexts.

Shapes: GQA 32/8, head_dim 128, float16, 4 layers (the beam search), 1 thread by default.
Times are medians with p25/p75 over interleaved repetitions; absolute times on a shared
machine are noise, the ratios in one run are the figures.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from . import candidates as cands
from . import models
from .machine import machine_info

__all__ = ["run_arena", "markdown"]

HQ, HKV, D, DTYPE = 32, 8, 128, "float16"
BEAMS = 4
PARENTS = ([0, 0, 1, 2], [1, 1, 0, 3], [0, 1, 2, 3], [2, 2, 2, 1], [3, 0, 0, 1])


def _stats(xs: Sequence[float]) -> Dict[str, float]:
    a = np.asarray(xs, np.float64)
    return {"median_ms": float(np.median(a)), "p25_ms": float(np.quantile(a, 0.25)),
            "p75_ms": float(np.quantile(a, 0.75)), "num_samples": len(xs)}


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _feeds(data, cache=None, pasts=None):
    f = {"query": data.query}
    for l in range(data.num_layers):
        f[f"key_{l}"], f[f"value_{l}"] = data.keys[l], data.values[l]
        if pasts is not None:
            f[f"past_key_{l}"], f[f"past_value_{l}"] = pasts[l]
    if cache is not None:
        f["kv_cache"] = cache.handle
    return f


def bench_beam(L: int, layers: int, steps: int, threads: int) -> Dict:
    """Beam search with 4 beams at context L: EP fork + reorder vs ORT tensor pasts gathered per beam."""
    from ..cache import KVCache

    data = cands.make_step_data(q_num_heads=HQ, kv_num_heads=HKV, head_dim=D, batch_size=BEAMS,
                                context_length=L, dtype=DTYPE, num_layers=layers, capacity=L + steps + 8)
    ep = cands._make_session(models.cache_attention_model(layers, HQ, HKV, D, DTYPE), threads, True)
    ort = cands._make_session(models.attention_past_model(layers, HQ, HKV, D, DTYPE), threads, False)
    # The prompt, prefilled once (batch 1), then forked into the beams: they share its pages.
    prompt = KVCache.from_past([k[:1] for k in data.past_keys], [v[:1] for v in data.past_values],
                               max_sequence_length=L + steps + 8)
    beams = prompt.fork([0] * BEAMS)
    prompt.close()
    pasts = [(data.past_keys[l][:1].repeat(BEAMS, 0), data.past_values[l][:1].repeat(BEAMS, 0))
             for l in range(layers)]
    ep_ms, ep_reorder_ms, ort_ms, ep_copied = [], [], [], []
    ort_copied = 0
    for s in range(steps):
        parents = PARENTS[s % len(PARENTS)]
        before = beams.stats()["bytes_copied"]

        def ep_step():
            ep.run(["Y"], _feeds(data, cache=beams))

        t_run = _timed(ep_step)
        t_re = _timed(lambda: beams.reorder(parents))
        ep_copied.append(beams.stats()["bytes_copied"] - before)

        def ort_step():
            out = ort.run(None, _feeds(data, pasts=pasts))
            for l in range(layers):  # genai: gather every beam's present by its parent beam
                pasts[l] = (np.take(out[1 + 2 * l], parents, axis=0), np.take(out[2 + 2 * l], parents, axis=0))

        t_ort = _timed(ort_step)
        ort_copied = 2 * sum(a.nbytes + b.nbytes for a, b in pasts)  # presents written + gathered
        if s >= 2:  # warm-up excluded
            ep_ms.append(t_run + t_re)
            ep_reorder_ms.append(t_re)
            ort_ms.append(t_ort)
    beams.close()
    e, o = _stats(ep_ms), _stats(ort_ms)
    return {"context_length": L, "num_layers": layers, "beams": BEAMS, "threads": threads,
            "ep": e, "ep_reorder": _stats(ep_reorder_ms), "ort_gather": o,
            "ep_bytes_copied_per_step": float(np.median(ep_copied[2:])),
            "ort_bytes_copied_per_step": float(ort_copied),
            "speedup": o["median_ms"] / e["median_ms"]}


def bench_fork(L: int, layers: int, reps: int) -> Dict:
    from ..cache import KVCache

    data = cands.make_step_data(q_num_heads=HQ, kv_num_heads=HKV, head_dim=D, batch_size=1, context_length=L,
                                dtype=DTYPE, num_layers=layers, capacity=L + 8)
    c = KVCache.from_past(data.past_keys, data.past_values, max_sequence_length=L + 8)
    fork_ms, copy_ms, memcpy_ms = [], [], []
    flat = [a for pair in zip(data.past_keys, data.past_values) for a in pair]
    dst = [np.empty_like(a) for a in flat]
    for _ in range(reps):
        t0 = time.perf_counter()
        f = c.fork()
        fork_ms.append((time.perf_counter() - t0) * 1e3)
        f.close()
        t0 = time.perf_counter()
        ks, vs = zip(*(c.export(l) for l in range(layers)))
        g = KVCache.from_past(list(ks), list(vs), max_sequence_length=L + 8)
        copy_ms.append((time.perf_counter() - t0) * 1e3)
        g.close()
        t0 = time.perf_counter()
        for s, d in zip(flat, dst):
            np.copyto(d, s)
        memcpy_ms.append((time.perf_counter() - t0) * 1e3)
    st = c.stats()
    c.close()
    return {"context_length": L, "num_layers": layers, "cache_bytes": st["committed_bytes"],
            "fork": _stats(fork_ms), "full_copy": _stats(copy_ms), "memcpy": _stats(memcpy_ms)}


def bench_speculative(L: int, layers: int, reps: int, threads: int) -> Dict:
    """checkpoint(), truncate by 8 tokens (a rejected draft), restore() the checkpoint, at L tokens."""
    from ..cache import KVCache

    data = cands.make_step_data(q_num_heads=HQ, kv_num_heads=HKV, head_dim=D, batch_size=1, context_length=L,
                                dtype=DTYPE, num_layers=layers, capacity=L + 64)
    c = KVCache.from_past(data.past_keys, data.past_values, max_sequence_length=L + 64)
    cp_ms, restore_ms, trunc_ms = [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        cp = c.checkpoint()
        cp_ms.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        c.truncate(L - 8)
        trunc_ms.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        c.restore(cp)
        restore_ms.append((time.perf_counter() - t0) * 1e3)
        cp.close()
        assert c.seq_lens.tolist() == [L]
    copied = c.stats()["bytes_copied"]
    c.close()
    return {"context_length": L, "num_layers": layers, "checkpoint": _stats(cp_ms), "restore": _stats(restore_ms),
            "truncate": _stats(trunc_ms), "bytes_copied": copied}


def bench_truncate_churn(layers: int, reps: int, threads: int) -> Dict:
    """Step across a page start + truncate back, keep_free_bytes=0 vs the default, interleaved."""
    from .. import _core
    from ..cache import KVCache, default_page_tokens
    from ..pool import KVPool

    L = default_page_tokens(D, DTYPE)  # the cache ends at a page end: the step starts a new page
    data = cands.make_step_data(q_num_heads=HQ, kv_num_heads=HKV, head_dim=D, batch_size=1, context_length=L,
                                dtype=DTYPE, num_layers=layers, capacity=L + 64)
    ep = cands._make_session(models.cache_attention_model(layers, HQ, HKV, D, DTYPE), threads, True)
    arms = {}
    for name, keep in (("unmap_at_once", 0), ("keep_free", None)):
        pool = KVPool(keep_free_bytes=keep)
        arms[name] = (pool, KVCache.from_past(data.past_keys, data.past_values, max_sequence_length=L + 64,
                                              pool=pool), [], [])
    for r in range(reps + 2):
        for name, (pool, c, ms, mapped) in arms.items():
            before = _core.process_committed_bytes()
            after_run = [before]  # slab bytes mapped once the step has run, before the truncate

            def step():
                ep.run(["Y"], _feeds(data, cache=c))
                after_run[0] = _core.process_committed_bytes()
                c.truncate(L)

            t = _timed(step)
            if r >= 2:  # warm-up excluded
                ms.append(t)
                mapped.append(after_run[0] - before)
    out = {"context_length": L, "num_layers": layers, "threads": threads,
           "page_bytes": L * 2 * D * np.dtype(DTYPE).itemsize}  # K and V of one page
    for name, (pool, c, ms, mapped) in arms.items():
        out[name] = _stats(ms)
        out[name + "_mapped_bytes_per_step"] = float(np.median(mapped))
        c.close()
        pool.close()
    out["speedup"] = out["unmap_at_once"]["median_ms"] / out["keep_free"]["median_ms"]
    return out


def bench_sliding_window(max_context: int, window: int, chunk: int, threads: int) -> Dict:
    """Committed bytes of a sliding-window layer vs one that keeps everything, by context."""
    import onnx

    from ..cache import KVCache
    from onnx import TensorProto, helper

    t = TensorProto.FLOAT16
    ins = [helper.make_tensor_value_info("query", t, [1, chunk, HQ * D]),
           helper.make_tensor_value_info("key_0", t, [1, chunk, HKV * D]),
           helper.make_tensor_value_info("value_0", t, [1, chunk, HKV * D]),
           helper.make_tensor_value_info("kv_cache", TensorProto.INT64, [1])]
    node = helper.make_node("CacheAttention", ["query", "key_0", "value_0", "kv_cache"], ["Y"], domain="ai.onnx_light",
                            layer=0, q_num_heads=HQ, kv_num_heads=HKV, is_causal=1, local_window_size=window)
    g = helper.make_graph([node], "swa", ins, [helper.make_tensor_value_info("Y", t, [1, chunk, HQ * D])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("ai.onnx_light", 1)],
                          ir_version=10)
    onnx.checker.check_model(m)
    sess = cands._make_session(m, threads, True)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, chunk, HQ * D)).astype(np.float16)
    kv = rng.standard_normal((1, chunk, HKV * D)).astype(np.float16)
    ev = KVCache(1, 1, HKV, D, dtype=DTYPE, max_sequence_length=max_context, sliding_window=window)
    keep = KVCache(1, 1, HKV, D, dtype=DTYPE, max_sequence_length=max_context)
    rows = []
    n = 0
    marks = {1024, 2048, 4096, 8192, 16384, 32768, max_context}
    while n + chunk <= max_context:
        for c in (ev, keep):
            sess.run(["Y"], {"query": q, "key_0": kv, "value_0": kv, "kv_cache": c.handle})
        n += chunk
        if n in marks:
            rows.append({"context": n, "evicting_committed_bytes": ev.stats()["committed_bytes"],
                         "keeping_committed_bytes": keep.stats()["committed_bytes"],
                         "evicting_pages": ev.stats()["num_pages"]})
    bound = (window + 2 * ev.page_tokens) * HKV * 2 * D * 2
    ev.close()
    keep.close()
    return {"window": window, "chunk": chunk, "rows": rows, "bound_bytes": bound}


def bench_overhead(layers: int) -> Dict:
    from ..cache import KVCache
    from ..pool import KVPool

    rows = []
    with KVPool() as pool:
        for L in (100, 1000, 4000, 16000):
            data = cands.make_step_data(q_num_heads=HQ, kv_num_heads=HKV, head_dim=D, batch_size=1,
                                        context_length=L, dtype=DTYPE, num_layers=layers, capacity=L)
            c = KVCache.from_past(data.past_keys, data.past_values, max_sequence_length=L, pool=pool)
            s, ps = c.stats(), pool.stats()
            rows.append({"context": L, "committed_bytes": s["committed_bytes"], "live_bytes": s["live_bytes"],
                         "fragmentation_bytes": s["fragmentation_bytes"], "page_table_bytes": s["page_table_bytes"],
                         "num_pages": s["num_pages"], "pool_committed_bytes": ps["committed_bytes"],
                         "pool_free_bytes": ps["free_bytes"], "pool_overhead_bytes": ps["overhead_bytes"]})
            c.close()
    return {"num_layers": layers, "rows": rows}


def run_arena(out_dir: str = "bench_out", *, quick: bool = False, threads: int = 1,
              command: Optional[str] = None, progress: Callable[[str], None] = print) -> Dict:
    """Run every arena benchmark; write ``bench_arena.json`` / ``bench_arena.md`` into ``out_dir``."""
    t0 = time.perf_counter()
    os.makedirs(out_dir, exist_ok=True)
    result = {"machine": machine_info(), "settings": {"quick": quick, "threads": threads, "command": command,
                                                    "shape": {"q_num_heads": HQ, "kv_num_heads": HKV,
                                                              "head_dim": D, "dtype": DTYPE}}}
    contexts = (256,) if quick else (2048, 8192)
    steps = 5 if quick else 20
    layers = 2 if quick else 4
    result["beam"] = []
    for L in contexts:
        progress(f"beam search, 4 beams, L={L}")
        result["beam"].append(bench_beam(L, layers, steps, threads))
    progress("fork vs copy")
    result["fork"] = [bench_fork(L, layers, 3 if quick else 9) for L in contexts]
    progress("checkpoint / restore / truncate")
    result["speculative"] = [bench_speculative(L, layers, 3 if quick else 15, threads) for L in contexts]
    progress("truncate churn at a page start")
    result["truncate_churn"] = bench_truncate_churn(layers, 10 if quick else 60, threads)
    progress("sliding window")
    result["sliding_window"] = bench_sliding_window(2048 if quick else 32768, 512, 512, threads)
    progress("page-table overhead")
    result["overhead"] = bench_overhead(layers)
    result["settings"]["elapsed_s"] = time.perf_counter() - t0
    with open(os.path.join(out_dir, "bench_arena.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out_dir, "bench_arena.md"), "w") as f:
        f.write("\n".join(markdown(result)) + "\n")
    return result


def _ms(e: Dict) -> str:
    return f"{e['median_ms']:.3g} [{e['p25_ms']:.3g}–{e['p75_ms']:.3g}]"


def _mib(b: float) -> str:
    return f"{b / 2**20:.1f} MiB" if b >= 2**20 else f"{b / 1024:.1f} KiB"


def markdown(result: Dict) -> List[str]:
    """The report: one table per benchmark, medians [p25–p75] in ms."""
    s = result["settings"]["shape"]
    out = [f"Shape: GQA {s['q_num_heads']}/{s['kv_num_heads']}, head_dim {s['head_dim']}, {s['dtype']}; "
           f"{result['settings']['threads']} thread(s).", "",
           "Beam search, 4 beams (one decode step + reorder; ORT: tensor pasts gathered per beam as "
           "onnxruntime-genai does):", "",
           "| context | layers | EP step + reorder ms | of which reorder ms | ORT step + gather ms | EP speedup | "
           "EP copied / step | ORT copied / step |", "|---|---|---|---|---|---|---|---|"]
    for r in result["beam"]:
        out.append(f"| {r['context_length']} | {r['num_layers']} | {_ms(r['ep'])} | {_ms(r['ep_reorder'])} | "
                   f"{_ms(r['ort_gather'])} | {r['speedup']:.1f}x | {_mib(r['ep_bytes_copied_per_step'])} | "
                   f"{_mib(r['ort_bytes_copied_per_step'])} |")
    out += ["", "Fork vs a full copy of the same cache (batch 1):", "",
            "| context | layers | cache | fork ms | full copy (export + from_past) ms | memcpy of the bytes ms |",
            "|---|---|---|---|---|---|"]
    for r in result["fork"]:
        out.append(f"| {r['context_length']} | {r['num_layers']} | {_mib(r['cache_bytes'])} | {_ms(r['fork'])} | "
                   f"{_ms(r['full_copy'])} | {_ms(r['memcpy'])} |")
    out += ["", "Speculative decoding: rollback costs (batch 1):", "",
            "| context | layers | checkpoint ms | restore ms | truncate by 8 ms |", "|---|---|---|---|---|"]
    for r in result["speculative"]:
        out.append(f"| {r['context_length']} | {r['num_layers']} | {_ms(r['checkpoint'])} | {_ms(r['restore'])} | "
                   f"{_ms(r['truncate'])} |")
    t = result.get("truncate_churn")
    if t:
        from ..pool import KVPool

        out += ["", f"Truncate churn at a page start (a decode step that starts a page, then truncate back to "
                f"{t['context_length']}; {t['num_layers']} layers, batch 1; pools interleaved):", "",
                "| pool | step + truncate ms | mapped / step |", "|---|---|---|",
                f"| keep_free_bytes=0 (unmap empty slabs at once) | {_ms(t['unmap_at_once'])} | "
                f"{_mib(t['unmap_at_once_mapped_bytes_per_step'])} |",
                f"| default (keep up to {_mib(KVPool.DEFAULT_KEEP_FREE_BYTES)} of empty slabs) | {_ms(t['keep_free'])} | "
                f"{_mib(t['keep_free_mapped_bytes_per_step'])} |",
                "", f"Kept empty slabs: {t['speedup']:.2f}x faster per step."]
    w = result["sliding_window"]
    out += ["", f"Sliding-window layer (W={w['window']}, appended in chunks of {w['chunk']}): committed KV "
            f"bytes per layer (bound W + 2 pages: {_mib(w['bound_bytes'])}):", "",
            "| context | sliding_window=512 | keeps everything |", "|---|---|---|"]
    for r in w["rows"]:
        out.append(f"| {r['context']} | {_mib(r['evicting_committed_bytes'])} | {_mib(r['keeping_committed_bytes'])} |")
    o = result["overhead"]
    out += ["", f"Page-table overhead and fragmentation ({o['num_layers']} layers, batch 1):", "",
            "| context | committed | live | fragmentation | page tables | pages | pool slabs | pool free | "
            "pool overhead |", "|---|---|---|---|---|---|---|---|---|"]
    for r in o["rows"]:
        out.append(f"| {r['context']} | {_mib(r['committed_bytes'])} | {_mib(r['live_bytes'])} | "
                   f"{_mib(r['fragmentation_bytes'])} | {_mib(r['page_table_bytes'])} | {r['num_pages']} | "
                   f"{_mib(r['pool_committed_bytes'])} | {_mib(r['pool_free_bytes'])} | "
                   f"{_mib(r['pool_overhead_bytes'])} |")
    return out
