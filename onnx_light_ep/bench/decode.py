"""Decode benchmark: one decode step, interleaved candidates, one process.

``run_bench(configs, threads, quick, out_dir, ...) -> dict`` is the whole
benchmark; ``onnx-light bench`` and ``tools/bench_decode.py`` only parse
arguments and call it.

What it measures. A *configuration* is (``q_num_heads``, ``kv_num_heads``,
``head_dim``, ``batch_size``, context ``L``, dtype, ``num_layers``). A *step*
is one new token through all ``num_layers`` attention layers (layer ``l``
reads layer ``l-1``'s output as its query). For each configuration and each
thread count (``SessionOptions.intra_op_num_threads``) the candidates of
``candidates`` are built from the same inputs, then run round-robin:
round ``r`` steps every candidate once (the order rotates every round), the
first ``warmup`` rounds are discarded, the next ``reps`` are kept as raw
samples (ms). Every candidate starts at context ``L`` and appends one token per
step, so all candidates see the same lengths in the same round.

Reported per candidate: median, p25/p75, min/max (ms per step and per layer),
effective read bandwidth (K+V bytes at ``L`` / median), ratio to ``limit``
(same run, same bytes), speedup of the EP over ``ort_gqa_shared`` and over
ORT's best equivalent-contract path (the faster of ``ort_gqa_shared`` and
``ort_tensor_scatter``), bytes appended/copied per step (from
``KVCache.stats()``), and peak temporary memory: the growth of the process's
peak RSS (VmHWM, reset through ``/proc/self/clear_refs``) over one extra step,
i.e. memory newly taken from the OS during a step (memory an allocator reuses
is not counted; the tensor-past candidates also report the present bytes they
allocate per step).

Working sets: multi-layer configurations cycle through enough layers that the
K+V bytes read per step are >= 3x the last-level cache (capped at 32 layers);
the same configuration with one layer is run separately ("single-layer"),
and both report ``working_set_bytes`` against ``llc_bytes``. Configurations or
candidates whose estimated memory exceeds ``memory_budget_bytes`` are skipped
and listed with the reason. Outputs: ``bench_decode.json``, ``bench_decode.md``
and ``bench_decode.png`` (if matplotlib is installed) in ``out_dir``.
"""

from __future__ import annotations

import gc
import itertools
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import numpy as np

from . import candidates as cands
from .machine import machine_info, read_status_kib, reset_peak_rss

__all__ = ["BenchConfig", "default_configs", "run_bench", "CANDIDATES"]

CANDIDATES = ("limit", "ort_attention_past", "ort_gqa_shared", "ort_tensor_scatter",
              "ep_attention_past", "ep_kvcache", "ep_kvcache_block", "ep_kvcache_4k")
ORT_EQUIVALENT = ("ort_gqa_shared", "ort_tensor_scatter")
ORT_ONLY = ("ort_attention_past", "ort_gqa_shared", "ort_tensor_scatter", "ep_attention_past")
BF16_NOTE = ("onnxruntime CPU has no bfloat16 kernel for Attention (falls back to its function "
             "body, which needs Expand(bfloat16): NOT_IMPLEMENTED) nor for "
             "com.microsoft.GroupQueryAttention (NOT_IMPLEMENTED)")
MAX_LAYERS = 32
LLC_MULTIPLE = 3


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark configuration. ``num_layers`` 0 means "plan it" (>= 3x LLC, <= 32)."""

    q_num_heads: int
    kv_num_heads: int
    batch_size: int
    context_length: int
    dtype: str = "float32"
    head_dim: int = 128
    num_layers: int = 0
    tag: str = ""

    @property
    def kind(self) -> str:
        return {1: "MQA"}.get(self.kv_num_heads, "MHA" if self.kv_num_heads == self.q_num_heads
                              else "GQA")

    def layer_bytes(self) -> int:
        """K+V bytes of one layer at context ``L``."""
        es = 4 if self.dtype == "float32" else 2
        return 2 * self.batch_size * self.kv_num_heads * self.context_length * self.head_dim * es

    def name(self) -> str:
        return (f"{self.kind} {self.q_num_heads}/{self.kv_num_heads} B={self.batch_size} "
                f"L={self.context_length} {self.dtype} x{self.num_layers}")


def plan_layers(cfg: BenchConfig, llc_bytes: int) -> int:
    """Layers so that the step's K+V bytes are >= LLC_MULTIPLE x LLC (1..MAX_LAYERS)."""
    return max(1, min(MAX_LAYERS, math.ceil(LLC_MULTIPLE * llc_bytes / cfg.layer_bytes())))


def default_configs(quick: bool = False, llc_bytes: int = 32 << 20) -> List[BenchConfig]:
    """The full grid (or the ``--quick`` subset) with layers planned for ``llc_bytes``.

    Full: (Hq, Hkv) in {(32,32), (32,8), (32,1)} x B in {1, 4} x L in {1K, 4K,
    16K, 32K} x {fp32, fp16, bf16}, D = 128, multi-layer; plus the single-layer
    variant of every configuration whose multi-layer plan has more than one
    layer; plus one repeated configuration (tag "rerun") to show run-to-run noise.
    Quick: GQA 32/8, B=1, L=1024, fp32/fp16/bf16, 2 layers.
    """
    if quick:
        return [BenchConfig(32, 8, 1, 1024, dt, num_layers=2) for dt in ("float32", "float16", "bfloat16")]
    out: List[BenchConfig] = []
    single: List[BenchConfig] = []
    for (hq, hkv), b, L, dt in itertools.product(((32, 32), (32, 8), (32, 1)), (1, 4),
                                                 (1024, 4096, 16384, 32768),
                                                 ("float32", "float16", "bfloat16")):
        cfg = BenchConfig(hq, hkv, b, L, dt)
        n = plan_layers(cfg, llc_bytes)
        out.append(replace(cfg, num_layers=n))
        if n > 1:
            single.append(replace(cfg, num_layers=1, tag="single-layer"))
    out.append(BenchConfig(32, 8, 1, 4096, "float32", num_layers=plan_layers(
        BenchConfig(32, 8, 1, 4096), llc_bytes), tag="rerun"))
    return out + single


def _coerce(cfg) -> BenchConfig:
    return cfg if isinstance(cfg, BenchConfig) else BenchConfig(**dict(cfg))


# -- statistics -----------------------------------------------------------------

def _quantile(xs: Sequence[float], q: float) -> float:
    return float(np.quantile(np.asarray(xs, dtype=np.float64), q))


def summarize_samples(samples_ms: Sequence[float], num_layers: int) -> Dict[str, float]:
    """Median, p25, p75, min, max (ms per step) and the per-layer median."""
    med = statistics.median(samples_ms)
    return {"median_ms": med, "p25_ms": _quantile(samples_ms, 0.25),
            "p75_ms": _quantile(samples_ms, 0.75), "min_ms": min(samples_ms),
            "max_ms": max(samples_ms), "per_layer_median_ms": med / num_layers,
            "num_samples": len(samples_ms)}


def add_ratios(result: Dict) -> None:
    """Fill ``x_limit``, ``speedup_vs_ort_gqa``, ``speedup_vs_ort_best`` and ``ort_best``."""
    c = result["candidates"]
    med = {k: v["median_ms"] for k, v in c.items() if v.get("median_ms") is not None}
    best = min((k for k in ORT_EQUIVALENT if k in med), key=lambda k: med[k], default=None)
    result["ort_best"] = best
    for k, v in c.items():
        if k not in med:
            continue
        v["x_limit"] = med[k] / med["limit"] if "limit" in med else None
        v["gb_per_s"] = result["read_bytes"] / (med[k] * 1e-3) / 1e9
        v["speedup_vs_ort_gqa"] = med["ort_gqa_shared"] / med[k] if "ort_gqa_shared" in med else None
        v["speedup_vs_ort_best"] = med[best] / med[k] if best else None
    if "ep_kvcache" in med and "ep_kvcache_block" in med:
        # paged storage (default page size) vs the same bytes in one block, same run
        result["paged_vs_block"] = med["ep_kvcache"] / med["ep_kvcache_block"]
    if "ep_kvcache" in med and "ep_kvcache_4k" in med:
        result["small_vs_huge_pages"] = med["ep_kvcache_4k"] / med["ep_kvcache"]


def step_macs(cfg: BenchConfig) -> Dict[str, int]:
    """Multiply-adds of one decode step over all layers: per key, every query row does
    ``head_dim`` for q.k and ``head_dim`` (= v_head_dim here) for P.V; one new token per sequence."""
    rows = cfg.batch_size * cfg.q_num_heads * cfg.num_layers
    return {"qk": rows * cfg.context_length * cfg.head_dim, "pv": rows * cfg.context_length * cfg.head_dim}


def compute_ms(cfg: BenchConfig, machine: Dict, threads: int) -> Optional[float]:
    """The step's multiply-adds at the measured one-core peak of the ISA level in use, split ideally
    over ``threads`` cores; None when there is no peak for the level (scalar, or not measured).

    q.k at the bf16 pair-dot peak (``bf16_avx512bf16``) where the avx512_bf16 level runs bf16 K
    through VDPBF16PS (at least 3 query rows per KV head: GQA, MQA), else at the fp32 FMA peak
    of the level's vector width; P.V always at the fp32 FMA
    peak (scores, softmax and P.V accumulate in fp32; fp16/bf16 conversion is not counted)."""
    from .machine import FP32_PEAK_LEVEL

    peaks = machine.get("fma_peak_gfma_per_s") or {}
    isa = machine.get("isa") or ""
    fp32 = peaks.get(FP32_PEAK_LEVEL.get(isa, ""))
    if not fp32:
        return None
    # the level's VDPBF16PS path: bf16 K, >= 3 query rows per KV head (docs/API.md, ISA levels)
    bf16_dot = (isa == "avx512_bf16" and cfg.dtype == "bfloat16" and cfg.head_dim % 2 == 0
                and cfg.q_num_heads // cfg.kv_num_heads >= 3)
    qk = peaks.get("bf16_avx512bf16") if bf16_dot else fp32
    if not qk:
        return None
    m = step_macs(cfg)
    return (m["qk"] / (qk * 1e9) + m["pv"] / (fp32 * 1e9)) * 1e3 / max(1, int(threads))


def add_floors(rec: Dict, machine: Dict) -> None:
    """Per run: ``compute_ms``, ``floor_ms`` = max(limit median, compute_ms), ``bound`` (read or
    compute) and every candidate's ``x_floor`` (its median / floor_ms)."""
    if rec.get("skipped") or rec.get("failed") or not rec.get("runs"):
        return
    cfg = _coerce(rec["config"])
    rec["macs_per_step"] = step_macs(cfg)
    for run in rec["runs"]:
        comp = compute_ms(cfg, machine, run["threads"])
        read = (run["candidates"].get("limit") or {}).get("median_ms")
        run["compute_ms"] = comp
        floor = max(x for x in (read, comp) if x is not None) if (read or comp) else None
        run["floor_ms"] = floor
        run["bound"] = None if floor is None else ("compute" if comp is not None and floor == comp else "read")
        for v in run["candidates"].values():
            if v.get("median_ms") is not None and floor:
                v["x_floor"] = v["median_ms"] / floor


# -- one configuration ----------------------------------------------------------

def _build(key: str, data, threads: Sequence[int]):
    if key == "limit":
        return cands.StreamLimit(data, threads)
    if key == "ort_attention_past":
        return cands.TensorPast(key, data, threads, on_ep=False)
    if key == "ep_attention_past":
        return cands.TensorPast(key, data, threads, on_ep=True)
    if key in ORT_EQUIVALENT:
        return cands.StaticBuffer(key, data, threads)
    if key == "ep_kvcache":
        return cands.EpKVCache(data, threads)
    if key == "ep_kvcache_block":
        return cands.EpKVCacheBlock(data, threads)
    if key == "ep_kvcache_4k":
        return cands.EpKVCacheSmallPages(data, threads)
    raise ValueError(f"run_bench: candidate; expected one of {CANDIDATES}, got {key!r}")


def _memory_estimate(key: str, cfg: BenchConfig, capacity: int, num_threads: int) -> int:
    """Bytes a candidate holds (beyond the shared past arrays) at steady state.

    Tensor past/present: the previous and the new ``present`` are live, and each
    session (one per thread count) keeps its own ORT arena holding them."""
    w = cfg.layer_bytes() * cfg.num_layers
    w_cap = w * capacity // cfg.context_length
    tensor = 3 * w_cap * num_threads
    return {"limit": 0, "ort_attention_past": tensor, "ep_attention_past": tensor,
            "ort_gqa_shared": w_cap, "ort_tensor_scatter": w_cap, "ep_kvcache": w_cap,
            "ep_kvcache_block": w_cap, "ep_kvcache_4k": w_cap}[key]


def _plan_candidates(cfg, candidates, capacity, budget, num_threads):
    """(kept, skipped{key: reason}, estimate_bytes); drops tensor-past first when over budget."""
    skipped: Dict[str, str] = {}
    kept = list(candidates)
    if cfg.dtype == "bfloat16":
        for k in ORT_ONLY:
            if k in kept and k != "ep_attention_past":
                kept.remove(k)
                skipped[k] = "unsupported: " + BF16_NOTE
    shared = cfg.layer_bytes() * cfg.num_layers

    def total():
        return shared + sum(_memory_estimate(k, cfg, capacity, num_threads) for k in kept)

    for k in ("ep_attention_past", "ort_attention_past"):
        if total() > budget and k in kept:
            kept.remove(k)
            skipped[k] = (f"skipped: memory (tensor past/present keeps ~2x the K+V bytes per "
                          f"session, one session per thread count); estimate over the "
                          f"{budget / 1e9:.1f} GB budget")
    return kept, skipped, total()


def _run_rounds(active: Dict[str, cands.Candidate], threads: Sequence[int], warmup: int, reps: int,
                gap_s: float, slow_step_s: float) -> Dict:
    """Round-robin steps over units (candidate, threads); returns per-unit and per-candidate records.

    Round ``r`` steps every unit once, in an order rotated by ``r``; rounds
    ``< warmup`` are discarded. The K/V state belongs to the candidate, so after
    each round every candidate has advanced by ``len(threads)`` tokens.
    """
    units = [(k, t) for k in active for t in threads]
    per_unit = {u: {"samples_ms": [], "warmup_ms": []} for u in units}
    per_key = {k: {"check_output": None, "check_output_last": None, "measured_steps": 0} for k in active}
    unit_warmup = {u: warmup for u in units}
    rounds = {u: warmup + reps for u in units}
    stats_before: Dict[str, Dict] = {}
    last = warmup + reps - 1
    for r in range(warmup + reps):
        if r == warmup:
            stats_before = {k: s for k, c in active.items() if (s := c.cache_stats()) is not None}
        order = units[r % len(units):] + units[:r % len(units)]
        for u in order:
            if r >= rounds[u]:
                continue
            k, t = u
            c = active[k]
            t0 = time.perf_counter_ns()
            try:
                c.step(t)
            except Exception as e:  # this candidate is out of the run; the others go on
                per_key[k]["error"] = f"error at round {r} ({t} threads): {type(e).__name__}: {str(e)[:300]}"
                for uu in units:
                    if uu[0] == k:
                        rounds[uu] = -1
                continue
            dt_ms = (time.perf_counter_ns() - t0) / 1e6
            per_unit[u]["samples_ms" if r >= unit_warmup[u] else "warmup_ms"].append(dt_ms)
            per_key[k]["measured_steps"] += r >= warmup  # steps between the stats snapshots
            if per_key[k]["check_output"] is None:  # first step: every candidate at context L
                per_key[k]["check_output"] = c.output()
            if r == last:
                per_key[k]["check_output_last"] = c.output()
            if r == 1 and dt_ms > slow_step_s * 1e3 and warmup + reps > 7:
                # very slow even after its first (page-faulting) step: 2 warm-up + 5 measured
                unit_warmup[u], rounds[u] = 2, 7
                per_unit[u]["note"] = (f"slow (second step {dt_ms / 1e3:.1f} s > {slow_step_s} s): "
                                       f"2 warm-up + 5 measured steps")
            if gap_s:
                time.sleep(gap_s)
    for k, before in stats_before.items():
        if "error" in per_key[k]:
            continue
        after = active[k].cache_stats()
        n = max(1, per_key[k]["measured_steps"])
        per_key[k]["bytes_appended_per_step"] = (after["bytes_appended"] - before["bytes_appended"]) / n
        per_key[k]["bytes_copied_per_step"] = (after["bytes_copied"] - before["bytes_copied"]) / n
        per_key[k]["cache_stats"] = after
    if len(set(rounds.values())) > 1:  # unequal step counts: states differ
        for k in per_key:
            per_key[k]["check_output_last"] = None
    return {"units": per_unit, "keys": per_key}


def _peak_memory_step(c: cands.Candidate, threads: int) -> Optional[int]:
    """VmHWM growth (bytes) over one step, after resetting the peak; None if unsupported."""
    if not reset_peak_rss():
        return None
    rss = read_status_kib("VmRSS")
    c.step(threads)
    return max(0, read_status_kib("VmHWM") - rss) * 1024


def _check_outputs(per_key, which="check_output") -> Dict[str, float]:
    """Max |Y - Y_ref| against ort_gqa_shared (or ep_kvcache) at the first (or last) step.

    A harness sanity check (same inputs, same state), recorded, not asserted."""
    ref_key = next((k for k in ("ort_gqa_shared", "ep_kvcache") if per_key.get(k, {}).get(which)
                    is not None), None)
    if ref_key is None:
        return {}
    ref = per_key[ref_key][which]
    out = {k: float(np.max(np.abs(v[which] - ref))) for k, v in per_key.items()
           if v.get(which) is not None and k != ref_key}
    out["reference"] = ref_key
    return out


def run_config(cfg: BenchConfig, threads: Sequence[int], *, candidates=CANDIDATES, warmup=5,
               reps=15, memory_budget_bytes=12e9, llc_bytes=32 << 20, gap_s=0.001,
               slow_step_s=3.0, progress: Callable[[str], None] = print) -> Dict:
    """Benchmark one configuration; every thread count is interleaved in the same rounds.

    Returns the JSON record: ``config``, ``working_set_bytes`` (K+V read per step),
    ``runs`` (one per thread count, with ``candidates`` {key: stats}), and
    ``skipped`` when the configuration is over the memory budget.
    """
    threads = [int(t) for t in threads]
    capacity = cfg.context_length + len(threads) * (warmup + reps + 1) + 2
    kept, skipped, estimate = _plan_candidates(cfg, candidates, capacity, memory_budget_bytes,
                                               len(threads))
    ws = cfg.layer_bytes() * cfg.num_layers
    out = {"config": asdict(cfg), "name": cfg.name(), "working_set_bytes": ws, "llc_bytes": llc_bytes,
           "working_set_x_llc": ws / llc_bytes, "memory_estimate_bytes": estimate, "runs": []}
    if estimate > memory_budget_bytes:
        out["skipped"] = f"memory estimate {estimate / 1e9:.1f} GB > budget {memory_budget_bytes / 1e9:.1f} GB"
        progress(f"  skip {cfg.name()}: {out['skipped']}")
        return out
    t0 = time.perf_counter()
    out["loadavg_before"] = _loadavg()
    data = cands.make_step_data(q_num_heads=cfg.q_num_heads, kv_num_heads=cfg.kv_num_heads,
                                head_dim=cfg.head_dim, batch_size=cfg.batch_size,
                                context_length=cfg.context_length, dtype=cfg.dtype,
                                num_layers=cfg.num_layers, capacity=capacity)
    status = {k: {"status": v} for k, v in skipped.items()}
    active: Dict[str, cands.Candidate] = {}
    try:
        for k in kept:
            try:
                c = _build(k, data, threads)
            except Exception as e:  # record and go on: one failing path must not stop the run
                msg = f"{type(e).__name__}: {str(e)[:300]}"
                status[k] = {"status": ("unsupported: " if "NOT_IMPLEMENTED" in msg else "error: ") + msg}
                continue
            status[k] = {"status": "ok"}
            if c.providers:
                status[k]["providers"] = c.providers
            if k == "ep_attention_past" and not cands.claimed_by_ep(c.providers, ("Attention",)):
                status[k]["status"] = "not claimed by EP (Attention ran on CPUExecutionProvider)"
                c.close()
                continue
            active[k] = c
        out["setup_s"] = time.perf_counter() - t0
        rec = _run_rounds(active, threads, warmup, reps, gap_s, slow_step_s)
        for k, v in rec["keys"].items():
            if "error" in v:
                status[k] = {"status": v.pop("error")}
                v["check_output"] = v["check_output_last"] = None
        for (k, t), u in rec["units"].items():
            if status[k]["status"] != "ok":
                continue
            try:
                u["peak_rss_delta_bytes"] = _peak_memory_step(active[k], t)
            except Exception as e:  # noqa: BLE001 - recorded, the measured samples stand
                u["peak_rss_delta_bytes"] = None
                u["note"] = f"peak-memory step failed: {type(e).__name__}: {str(e)[:200]}"
    finally:
        for c in active.values():
            c.close()
        active.clear()
        gc.collect()
    out["output_max_abs_diff_first_step"] = _check_outputs(rec["keys"])
    out["output_max_abs_diff_last_step"] = _check_outputs(rec["keys"], "check_output_last")
    for t in threads:
        run = {"threads": t, "read_bytes": data.read_bytes, "append_bytes": data.append_bytes,
               "candidates": {k: dict(v) for k, v in status.items()}}
        for (k, ut), u in rec["units"].items():
            if ut != t:
                continue
            entry = run["candidates"][k]
            if entry["status"] != "ok" or not u["samples_ms"]:
                continue
            entry.update(summarize_samples(u["samples_ms"], cfg.num_layers))
            entry.update(u)
            entry.update({x: y for x, y in rec["keys"][k].items() if not x.startswith("check_output")})
            if k in ("ort_attention_past", "ep_attention_past"):
                entry["present_bytes_allocated_per_step"] = data.read_bytes + data.append_bytes
        add_ratios(run)
        out["runs"].append(run)
        progress(_progress_line(cfg, run))
    out["elapsed_s"] = time.perf_counter() - t0
    out["loadavg_after"] = _loadavg()
    del data
    gc.collect()
    return out


def _loadavg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _progress_line(cfg, run) -> str:
    parts = []
    for k in CANDIDATES:
        v = run["candidates"].get(k)
        if v and v.get("median_ms") is not None:
            parts.append(f"{k}={v['median_ms']:.3f}")
    return f"  t={run['threads']}, median ms per step: " + " ".join(parts)


# -- whole run --------------------------------------------------------------------

def run_bench(configs: Optional[Iterable] = None, threads: Sequence[int] = (1, 2), quick: bool = False,
              out_dir: str = "bench_out", *, warmup: Optional[int] = None, reps: Optional[int] = None,
              candidates: Sequence[str] = CANDIDATES, memory_budget_bytes: float = 12e9,
              slow_step_s: float = 3.0, allow_spinning: bool = False, plot: bool = True,
              grid: bool = True, e2e: bool = False, e2e_contexts: Sequence[int] = (256, 4096, 8192),
              e2e_threads: Sequence[int] = (1, 2), e2e_models: Sequence[str] = ("fp32", "int4"),
              command: Optional[str] = None,
              metadata: Optional[Dict] = None, progress: Callable[[str], None] = print,
              page_tokens: Optional[int] = None) -> Dict:
    """Run the decode benchmark and write ``bench_decode.{json,md,png}`` into ``out_dir``.

    Args:
        configs: ``BenchConfig`` objects or dicts of its fields; ``None`` means
            :func:`default_configs` (``quick`` selects the small subset). A
            ``num_layers`` of 0 is planned from the machine's LLC.
        threads: ``intra_op_num_threads`` values; each configuration runs once per value.
        quick: few repetitions (2 warm-up + 3 measured) and the quick subset; a
            smoke test, nothing is asserted about speed.
        out_dir: created if missing.
        warmup, reps: rounds discarded / kept (defaults 5 / 15, quick 2 / 3).
        candidates: subset of :data:`CANDIDATES`.
        memory_budget_bytes: skip candidates/configurations estimated above it.
        slow_step_s: a candidate whose second step (the first after its page-faulting
            first one) is slower runs 2 warm-up + 5 measured steps only.
        allow_spinning: ORT ``session.intra_op.allow_spinning`` for every session
            (default off, so an idle session's spinning workers do not steal the
            cores of the candidate that runs next).
        plot: write the PNG if matplotlib is importable.
        grid: run the attention-step configurations (``False``: only ``e2e``).
        e2e: also run the end-to-end SmolLM2-135M comparison (``e2e``:
            EP KVCache vs plain ORT vs onnxruntime-genai: decode tokens/s beside the
            physical limit, time to first token, a profiled prefill at 4K) at
            ``e2e_contexts`` (clamped to the model's positions minus the measured steps,
            with a note) with ``e2e_threads``, for the exports ``e2e_models``
            (``fp32``, ``int4``); needs ``onnx_light_ep.convert`` and
            ``onnx_light_ep.models.smollm2`` (builds the models once).
        command: the command line recorded in the outputs.
        metadata: extra JSON-able facts recorded under ``settings["metadata"]``
            (e.g. the source revision).
        progress: called with one line of text per configuration / run.
        page_tokens: page size of the ``ep_kvcache`` candidate (None = the library default);
            ``ep_kvcache_block`` always holds each (layer, sequence, head) in one page.

    Returns:
        The JSON-able dict also written to ``bench_decode.json``: ``machine``,
        ``settings``, ``results`` (one record per configuration with its runs).
    """
    from . import report

    for k in candidates:
        if k not in CANDIDATES:
            raise ValueError(f"run_bench: candidates; expected names from {CANDIDATES}, got {k!r}")
    warmup = (2 if quick else 5) if warmup is None else int(warmup)
    reps = (3 if quick else 15) if reps is None else int(reps)
    if warmup < 1 or reps < 1:
        raise ValueError(f"run_bench: warmup and reps; expected >= 1, got {warmup}, {reps}")
    cands.configure_sessions(allow_spinning)
    machine = machine_info(measure_bandwidth=not quick, fma_ms=10.0 if quick else 50.0,
                           fma_trials=2 if quick else 5)
    llc = machine.get("llc_bytes") or (32 << 20)
    cfgs = default_configs(quick, llc) if configs is None else [_coerce(c) for c in configs]
    cfgs = cfgs if grid else []
    cfgs = [c if c.num_layers else replace(c, num_layers=plan_layers(c, llc)) for c in cfgs]
    os.makedirs(out_dir, exist_ok=True)
    cands.EP_PAGE_TOKENS = page_tokens
    settings = {"page_tokens": page_tokens, "threads": list(threads), "warmup": warmup, "reps": reps, "quick": quick,
                "candidates": list(candidates), "memory_budget_bytes": memory_budget_bytes,
                "slow_step_s": slow_step_s, "llc_multiple": LLC_MULTIPLE, "max_layers": MAX_LAYERS,
                "allow_spinning": bool(allow_spinning), "command": command,
                "metadata": dict(metadata or {}), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    result = {"machine": machine, "settings": settings, "results": []}
    t0 = time.perf_counter()
    try:
        for i, cfg in enumerate(cfgs):
            progress(f"[{i + 1}/{len(cfgs)}] {cfg.name()}{' (' + cfg.tag + ')' if cfg.tag else ''}")
            try:
                rec = run_config(cfg, threads, candidates=candidates, warmup=warmup, reps=reps,
                                 memory_budget_bytes=memory_budget_bytes, llc_bytes=llc,
                                 slow_step_s=slow_step_s, progress=progress)
            except Exception as e:  # this configuration failed; it is reported and the run goes on
                rec = failed_record(cfg, llc, e)
                progress(f"  FAILED {cfg.name()}: {rec['failed']}")
            add_floors(rec, machine)
            result["results"].append(rec)
            if "elapsed_s" in rec:
                progress(f"  ({rec['elapsed_s']:.1f} s, total {time.perf_counter() - t0:.0f} s)")
            _write_json(result, out_dir)  # partial results survive an interrupted run
        if e2e:
            from .e2e import run_e2e

            progress("[e2e] SmolLM2-135M end to end")
            settings["e2e"] = {"contexts": list(e2e_contexts), "threads": list(e2e_threads),
                               "models": list(e2e_models)}

            def keep(partial):  # every finished point is in the JSON at once
                result["end_to_end"] = partial
                _write_json(result, out_dir)

            try:
                result["end_to_end"] = run_e2e(e2e_contexts, e2e_threads, warmup=3 if not quick else 1,
                                               reps=16 if not quick else 3, work_dir=out_dir,
                                               progress=progress, on_point=keep, machine=machine,
                                               quick=quick, precisions=e2e_models)
            except Exception as e:  # e.g. the model could not be built: the grid's results stand
                result.setdefault("end_to_end", {"models": []})["failed"] = f"{type(e).__name__}: {str(e)[:500]}"
                progress(f"  e2e FAILED: {result['end_to_end']['failed']}")
    finally:  # also on KeyboardInterrupt: what was measured is written
        settings["elapsed_s"] = time.perf_counter() - t0
        try:
            result["summary"] = report.summary(result)
        except Exception as e:  # noqa: BLE001 - the raw results matter more than the summary
            result["summary_error"] = f"{type(e).__name__}: {e}"
        _write_json(result, out_dir)
    with open(os.path.join(out_dir, "bench_decode.md"), "w") as f:
        f.write(report.markdown(result))
    if plot and result["results"]:
        png = report.plot(result, os.path.join(out_dir, "bench_decode.png"))
        if png is None:
            progress("note: no PNG written (matplotlib not installed: pip install matplotlib; "
                     "or no 1-thread multi-layer B=1 results to plot)")
    return result


def failed_record(cfg: BenchConfig, llc_bytes: int, exc: BaseException) -> Dict:
    """The JSON record of a configuration whose run raised: its config and the reason, no runs."""
    ws = cfg.layer_bytes() * cfg.num_layers
    return {"config": asdict(cfg), "name": cfg.name(), "working_set_bytes": ws, "llc_bytes": llc_bytes,
            "working_set_x_llc": ws / llc_bytes, "runs": [],
            "failed": f"{type(exc).__name__}: {str(exc)[:500]}"}


def _write_json(result: Dict, out_dir: str) -> None:
    path = os.path.join(out_dir, "bench_decode.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1, default=_json_default)
    os.replace(path + ".tmp", path)


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")
