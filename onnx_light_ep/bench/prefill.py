"""Prefill attention: ``S`` new tokens attending causally over themselves, one layer, against
its compute floor (``onnx-light bench --prefill-only``).

Shapes: S in {512, 2048} x (GQA 32/8, MHA 32/32), head_dim 128, fp32, batch 1 (``PREFILL_SHAPES``).
Candidates, interleaved round-robin in one process (order rotated every round, warm-up rounds
discarded, median and p25/p75 of the rest):

- ``ep_kvcache``: ``ai.onnx_light.CacheAttention`` (``is_causal=1``) on the EP appending the
  ``S`` rows into an empty ``KVCache`` and attending over the cache (its query-blocked prefill
  path); the cache is emptied (``truncate(0)``, no copy) before every run, outside the timing.
  Its pages come from a ``KVPool`` that keeps the slabs the truncate empties (the default
  ``keep_free_bytes``, 64 MiB, holds MHA S=2048's), as ORT's arena keeps the memory of the
  other candidates' outputs between runs: both time the steady state, not first-touch faults;
- ``ort_attention``: ONNX ``Attention`` (opset 23), 3-D Q/K/V, ``is_causal=1``, no past;
- ``ort_gqa``: ``com.microsoft.GroupQueryAttention`` with an empty past (``[B, Hkv, 0, D]``,
  ``seqlens_k = S - 1``, ``total_sequence_length = S``): ORT's first-prompt path, as the genai
  builder's models prefill.

Compute floor: the causal half of the score and P.V multiply-adds, ``Hq x S(S+1)/2 x (D + Dv)``,
at the measured one-core fp32 FMA peak of the ISA level in use (``_core.fma_peak``), split over
the threads. The K/V read is small beside it (S x Hkv x D x 8 bytes). Outputs
``bench_prefill.json`` / ``bench_prefill.md``; ``update_benchmarks_md`` writes the block
``bench_prefill[<machine kind>]``.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Callable, Dict, Optional, Sequence

import numpy as np
from onnx import TensorProto, helper

from .._registration import DOMAIN
from .candidates import _make_session, ortvalue
from .machine import FP32_PEAK_LEVEL, machine_info

#: (S, q_num_heads, kv_num_heads): the default shapes, head_dim 128, fp32
PREFILL_SHAPES = ((512, 32, 8), (512, 32, 32), (2048, 32, 8), (2048, 32, 32))
CANDIDATES = ("ep_kvcache", "ort_attention", "ort_gqa")
NAMES = {"ep_kvcache": "EP CacheAttention", "ort_attention": "ORT Attention (opset 23)",
         "ort_gqa": "ORT GroupQueryAttention"}
F = TensorProto.FLOAT


def causal_macs(seq: int, q_num_heads: int, head_dim: int, v_head_dim: Optional[int] = None,
                batch_size: int = 1) -> int:
    """Multiply-adds of causal attention of ``seq`` tokens over themselves: every query row ``i``
    sees ``i + 1`` keys, each costing ``head_dim`` (q.k) + ``v_head_dim`` (P.V)."""
    dv = head_dim if v_head_dim is None else v_head_dim
    return batch_size * q_num_heads * seq * (seq + 1) // 2 * (head_dim + dv)


def compute_floor_ms(macs: int, machine: Dict, threads: int = 1) -> Optional[float]:
    """``macs`` at the fp32 FMA peak of the ISA level in use, over ``threads`` cores; None if unknown."""
    peak = (machine.get("fma_peak_gfma_per_s") or {}).get(FP32_PEAK_LEVEL.get(machine.get("isa") or "", ""))
    return macs / (peak * 1e9) * 1e3 / max(1, int(threads)) if peak else None


def _vi(name, shape, t=F):
    return helper.make_tensor_value_info(name, t, shape)


def _model(nodes, inputs, outputs, opsets):
    m = helper.make_model(helper.make_graph(nodes, "bench_prefill", inputs, outputs),
                          opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    m.ir_version = 10
    return m


def _qkv(hq, hkv, d):
    return [_vi("query", [1, "S", hq * d]), _vi("key", [1, "S", hkv * d]), _vi("value", [1, "S", hkv * d])]


def cache_attention_prefill_model(hq: int, hkv: int, d: int):
    """One causal ``CacheAttention`` layer: ``query`` [1, S, Hq*D], ``key``/``value`` [1, S, Hkv*D],
    ``kv_cache`` int64 [1] -> ``Y`` [1, S, Hq*D]."""
    node = helper.make_node("CacheAttention", ["query", "key", "value", "kv_cache"], ["Y"], domain=DOMAIN,
                            layer=0, q_num_heads=hq, kv_num_heads=hkv, is_causal=1)
    return _model([node], _qkv(hq, hkv, d) + [_vi("kv_cache", [1], TensorProto.INT64)],
                  [_vi("Y", [1, "S", hq * d])], [("", 23), (DOMAIN, 1)])


def attention_prefill_model(hq: int, hkv: int, d: int):
    """ONNX ``Attention`` (opset 23), 3-D, ``is_causal=1``, no past -> ``Y`` [1, S, Hq*D]."""
    node = helper.make_node("Attention", ["query", "key", "value"], ["Y"], q_num_heads=hq, kv_num_heads=hkv,
                            is_causal=1)
    return _model([node], _qkv(hq, hkv, d), [_vi("Y", [1, "S", hq * d])], [("", 23)])


def gqa_prefill_model(hq: int, hkv: int, d: int):
    """``com.microsoft.GroupQueryAttention`` with an empty past (its first-prompt path, causal)."""
    node = helper.make_node("GroupQueryAttention", ["query", "key", "value", "past_key", "past_value",
                                                    "seqlens_k", "total_sequence_length"],
                            ["Y", "present_key", "present_value"], domain="com.microsoft", num_heads=hq,
                            kv_num_heads=hkv)
    inputs = _qkv(hq, hkv, d) + [_vi("past_key", [1, hkv, "P", d]), _vi("past_value", [1, hkv, "P", d]),
                                 _vi("seqlens_k", [1], TensorProto.INT32),
                                 _vi("total_sequence_length", [], TensorProto.INT32)]
    outputs = [_vi("Y", [1, "S", hq * d]), _vi("present_key", [1, hkv, "T", d]),
               _vi("present_value", [1, hkv, "T", d])]
    return _model([node], inputs, outputs, [("", 23), ("com.microsoft", 1)])


class _Runner:
    """One candidate of one shape: ``run(threads)`` is the timed call; ``before()`` untimed."""

    def __init__(self, key, model, feeds, threads, on_ep, cache=None):
        self.key, self.cache = key, cache
        self.feeds = {k: ortvalue(v) for k, v in feeds.items()}
        self.sessions = {t: _make_session(model, t, on_ep) for t in threads}
        self.y = None

    def before(self):
        if self.cache is not None:
            self.cache.truncate(0)  # an empty cache again: O(1), pages released

    def run(self, threads):
        self.y = self.sessions[threads].run_with_ort_values(["Y"], self.feeds)[0]

    def output(self):
        return np.array(self.y.numpy(), dtype=np.float32, copy=True)

    def close(self):
        self.sessions = self.feeds = None
        if self.cache is not None:
            pool = self.cache.pool
            self.cache.close()
            if pool is not None:
                pool.close()


def _build(key, seq, hq, hkv, d, q, k, v, threads):
    if key == "ep_kvcache":
        from ..cache import KVCache

        from ..pool import KVPool

        # A pool, not the cache's private one: it keeps the slabs truncate(0) empties (see above).
        cache = KVCache(1, 1, hkv, d, dtype="float32", max_sequence_length=seq, pool=KVPool())
        return _Runner(key, cache_attention_prefill_model(hq, hkv, d),
                       {"query": q, "key": k, "value": v, "kv_cache": cache.handle},
                       threads, True, cache)
    if key == "ort_attention":
        return _Runner(key, attention_prefill_model(hq, hkv, d), {"query": q, "key": k, "value": v}, threads, False)
    if key == "ort_gqa":
        empty = np.zeros((1, hkv, 0, d), np.float32)
        return _Runner(key, gqa_prefill_model(hq, hkv, d),
                       {"query": q, "key": k, "value": v, "past_key": empty, "past_value": empty,
                        "seqlens_k": np.array([seq - 1], np.int32),
                        "total_sequence_length": np.array(seq, np.int32)}, threads, False)
    raise ValueError(f"run_prefill: candidate; expected one of {CANDIDATES}, got {key!r}")


def run_shape(seq: int, hq: int, hkv: int, d: int = 128, *, threads: Sequence[int] = (1,), warmup: int = 2,
              reps: int = 7, candidates: Sequence[str] = CANDIDATES, machine: Optional[Dict] = None,
              seed: int = 0) -> Dict:
    """One shape: every candidate x thread count interleaved; JSON-able record with medians,
    the compute floor and ``x_floor``; a candidate that fails to build or run is reported."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, seq, hq * d), np.float32)
    k = rng.standard_normal((1, seq, hkv * d), np.float32)
    v = rng.standard_normal((1, seq, hkv * d), np.float32)
    macs = causal_macs(seq, hq, d)
    kind = "MHA" if hq == hkv else "MQA" if hkv == 1 else "GQA"
    rec = {"name": f"{kind} {hq}/{hkv} S={seq} D={d} fp32", "seq": seq, "q_num_heads": hq, "kv_num_heads": hkv,
           "head_dim": d, "macs": macs, "runs": [], "candidates": {}}
    runners = {}
    for key in candidates:
        try:
            runners[key] = _build(key, seq, hq, hkv, d, q, k, v, threads)
            rec["candidates"][key] = {"status": "ok"}
        except Exception as e:  # reported, the others go on
            rec["candidates"][key] = {"status": f"error: {type(e).__name__}: {str(e)[:300]}"}
    samples = {(key, t): [] for key in runners for t in threads}
    units = list(samples)
    try:
        for r in range(warmup + reps):
            order = units[r % len(units):] + units[:r % len(units)] if units else []
            for key, t in order:
                if key not in runners:
                    continue
                c = runners[key]
                try:
                    c.before()
                    t0 = time.perf_counter_ns()
                    c.run(t)
                    ms = (time.perf_counter_ns() - t0) / 1e6
                except Exception as e:  # this candidate is out; the others go on
                    rec["candidates"][key] = {"status": f"error at round {r}: {type(e).__name__}: {str(e)[:300]}"}
                    runners.pop(key).close()
                    continue
                if r >= warmup:
                    samples[(key, t)].append(ms)
        outs = {key: c.output() for key, c in runners.items()}
        ref = outs.get("ort_attention", outs.get("ort_gqa"))
        rec["output_max_abs_diff_vs_ort_attention"] = {key: float(np.max(np.abs(o - ref))) for key, o in outs.items()
                                                       if ref is not None and o is not ref}
    finally:
        for c in runners.values():
            c.close()
    for t in threads:
        floor = compute_floor_ms(macs, machine or {}, t)
        run = {"threads": t, "compute_floor_ms": floor, "candidates": {}}
        for key in candidates:
            xs = samples.get((key, t)) or []
            e = dict(rec["candidates"][key])
            if xs and e["status"] == "ok":
                med = statistics.median(xs)
                e.update({"median_ms": med, "p25_ms": float(np.quantile(xs, 0.25)),
                          "p75_ms": float(np.quantile(xs, 0.75)), "samples_ms": xs,
                          "x_floor": med / floor if floor else None})
            run["candidates"][key] = e
        ep, best = run["candidates"].get("ep_kvcache", {}), [run["candidates"].get(k, {}).get("median_ms")
                                                              for k in ("ort_attention", "ort_gqa")]
        best = [b for b in best if b]
        if ep.get("median_ms") and best:
            run["ep_speedup_vs_ort_best"] = min(best) / ep["median_ms"]
        rec["runs"].append(run)
    return rec


def run_prefill(out_dir: str = "bench_out", *, shapes: Sequence[tuple] = PREFILL_SHAPES,
                threads: Sequence[int] = (1,), warmup: int = 2, reps: int = 7, quick: bool = False,
                command: Optional[str] = None, progress: Callable[[str], None] = print) -> Dict:
    """Every shape of ``shapes`` ((S, Hq, Hkv)); writes ``bench_prefill.{json,md}`` into ``out_dir``
    after every shape. ``quick``: S = 64 and 128, 1 warm-up + 2 measured rounds (a smoke test)."""
    if quick:
        shapes, warmup, reps = ((64, 4, 2), (128, 4, 4)), 1, 2
    os.makedirs(out_dir, exist_ok=True)
    res = {"machine": machine_info(measure_bandwidth=False, fma_ms=10.0 if quick else 50.0,
                                   fma_trials=2 if quick else 5),
           "settings": {"threads": list(threads), "warmup": warmup, "reps": reps, "quick": quick,
                        "command": command}, "results": []}
    t0 = time.perf_counter()
    res["settings"]["loadavg_before"] = _loadavg()
    try:
        for seq, hq, hkv in shapes:
            progress(f"[prefill] S={seq} Hq={hq} Hkv={hkv}")
            try:
                rec = run_shape(seq, hq, hkv, 16 if quick else 128, threads=threads, warmup=warmup, reps=reps,
                                machine=res["machine"])
            except Exception as e:  # noqa: BLE001 - reported; the other shapes go on
                rec = {"name": f"S={seq} {hq}/{hkv}", "failed": f"{type(e).__name__}: {str(e)[:300]}", "runs": []}
            res["results"].append(rec)
            for run in rec["runs"]:
                progress(f"  t={run['threads']}: floor {run['compute_floor_ms'] or 0:.2f} ms; " + " ".join(
                    f"{k}={v['median_ms']:.2f}" for k, v in run["candidates"].items() if "median_ms" in v))
            _write(res, out_dir)
    finally:
        res["settings"]["elapsed_s"] = time.perf_counter() - t0
        res["settings"]["loadavg_after"] = _loadavg()
        _write(res, out_dir)
    return res


def _loadavg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _write(res: Dict, out_dir: str) -> None:
    path = os.path.join(out_dir, "bench_prefill.json")
    with open(path + ".tmp", "w") as f:
        json.dump(res, f, indent=1)
    os.replace(path + ".tmp", path)
    with open(os.path.join(out_dir, "bench_prefill.md"), "w") as f:
        f.write(markdown(res))


def _cell(e: Dict) -> str:
    if "median_ms" not in e:
        return e.get("status", "")[:160]
    return f"{e['median_ms']:.3g} [{e['p25_ms']:.3g}–{e['p75_ms']:.3g}]" + (
        f" ({e['x_floor']:.2f})" if e.get("x_floor") else "")


def markdown(res: Dict) -> str:
    from .report import machine_lines

    s = res["settings"]
    lines = ["## Prefill attention: causal, one layer, fp32, against the compute floor", ""]
    lines += machine_lines(res["machine"])
    lines += ["", f"Command: `{s.get('command') or 'onnx-light bench --prefill-only'}` (source "
              f"{res['machine'].get('source_revision', '?')}); {s['warmup']} warm-up + {s['reps']} measured runs "
              f"per candidate and thread count, interleaved; run took {s.get('elapsed_s', 0) / 60:.1f} min; load average "
              f"(1 min) {(s.get('loadavg_before') or ['?'])[0]} before, {(s.get('loadavg_after') or ['?'])[0]} after.", "",
              "Median [p25–p75] ms per prefill of one layer (÷ floor in brackets). Floor = the causal half of the "
              "q.k and P.V multiply-adds, Hq x S(S+1)/2 x (D + Dv), at the one-core fp32 FMA peak of the ISA "
              "level in use, over the threads. EP: `CacheAttention(is_causal=1)` appending S rows into an empty "
              "KVCache; ORT: `Attention` (opset 23, `is_causal=1`) and `GroupQueryAttention` with an empty past.",
              "", "| shape | threads | G multiply-adds | floor ms | " + " | ".join(NAMES[k] for k in CANDIDATES)
              + " | EP speedup vs ORT best | max abs ΔY vs ORT Attention |",
              "|---|---|---|---|---|---|---|---|---|"]
    for rec in res["results"]:
        if rec.get("failed"):
            lines.append(f"| {rec['name']} | | | | FAILED: {rec['failed']} | | | | |")
            continue
        diff = ", ".join(f"{NAMES[k].split(' ')[0]} {NAMES[k].split(' ')[1]}: {v:.1e}"
                         for k, v in rec.get("output_max_abs_diff_vs_ort_attention", {}).items())
        for run in rec["runs"]:
            sp = run.get("ep_speedup_vs_ort_best")
            fl = run["compute_floor_ms"]
            lines.append(f"| {rec['name']} | {run['threads']} | {rec['macs'] / 1e9:.2f} | "
                         f"{'' if fl is None else f'{fl:.3g}'} | "
                         + " | ".join(_cell(run["candidates"].get(k, {})) for k in CANDIDATES)
                         + f" | {'' if sp is None else f'{sp:.2f}x'} | {diff} |")
    return "\n".join(lines) + "\n"


def update_benchmarks_md(path: str, res: Dict) -> None:
    """Replace this machine kind's ``bench_prefill`` block of ``path`` with ``res``'s report."""
    from .report import update_block

    update_block(path, "bench_prefill", markdown(res).rstrip("\n"), machine=res["machine"])
