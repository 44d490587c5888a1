#!/usr/bin/env python3
"""Quantized KV: our int8 (int4) pages vs ONNX Runtime's quantized-KV GroupQueryAttention, and the floor.

    python tools/bench_kv_quant.py --build-dir build-dev --out-dir bench_out [--benchmarks-md BENCHMARKS.md]

One decode step (one new token: one query row per query head at position T - 1 over the T keys
[0, T)), head_dim 128, one thread, for GQA 32/8 (8 kv heads, 4 query heads each) and MHA 32/32
at contexts 8K and 32K. Every time is milliseconds per layer-step: a step over `layers` layers,
enough for the K/V bytes to reach 256 MiB (so they come from DRAM, not the caches; each
implementation and variant its own count), divided by `layers`. What is measured, per
configuration:

1. Ours, the attention kernel alone (``build-dev/bench_quant_attention f16 T 256 kv_heads group
   128 rounds 1 layers``): the same K/V values as float16 pages (``native``) and as int8 pages
   (per-channel K scales, per-row V scales, codes then scales in each page), 256-token pages in
   decode order, interleaved round by round in one process; every layout line of its output is
   parsed (an ``int4`` line, when the driver has one, is taken like the ``int8`` line), with its
   median and minimum over the rounds, and the ``read <layout>`` lines: one sequential pass over
   the same bytes with no arithmetic (``stream_read``). No append, no ORT.
2. ONNX Runtime's CPU ``com.microsoft.GroupQueryAttention`` (the installed onnxruntime): a graph
   of one GQA node per layer, each with its own past/present K and V bound through IOBinding to
   one OrtValue each (past_present_share_buffer: the op appends the new token's K/V in place at
   row T - 1 of a buffer of T rows, then attends over the T rows), no rotary, ``seqlens_k`` T - 1,
   ``total_sequence_length`` T. Variants: the float16 cache (ORT's own baseline) and the float32
   cache; the quantized cache with ``k_quant_type = v_quant_type = PER_CHANNEL`` and static
   float32 scales of shape (1, kv_heads, 1, head_dim) as initializers, ``kv_cache_bit_width`` 8
   (int8 cache) and 4 (uint8 cache, two codes a byte), with float16 and with float32 query/output.
   Each variant gets its own layer count (its own bytes >= 256 MiB); all of a configuration's
   sessions exist at once and run interleaved round by round, after warm-up steps; median, min,
   p25, p75 over the rounds. A variant ORT refuses (session creation or run) is recorded with the
   exact error text instead of a time.
3. ``build-dev/bench_fma_peak 50 30``: the measured multiply-add peak of one core per ISA level,
   the best of 30 trials of 50 ms of the thread's CPU time (so another process taking the core
   does not count).

Derived, per row: bytes per layer-step (K, V and scales: for ours the pages as the driver lays
them out; for ORT the T rows of both caches plus the scales); the read limit = bytes / the
single-core read bandwidth measured by the C++ read lines (the best pass of the whole run: bytes /
the minimum time of a read line, the highest over configurations and layouts, so that the limit
stays a lower bound when other work on the machine slows some passes); the compute floor = multiply-adds / the fp32 FMA peak of the ISA level
used (multiply-adds per layer-step = query heads x T x 2 x head_dim: q.k and p.v; ours: the level
the driver reports, ORT: the widest level the CPU has, which is what its MLAS kernels dispatch to);
the floor = the larger of the two; time / floor; each quantized row against its own float16
baseline (ours native, ORT float16); ORT against ours at the same bit width.

Writes ``<out-dir>/bench_kv_quant.json`` (every raw C++ output, every ORT sample, machine) and
prints the table; ``--benchmarks-md`` replaces the block ``bench_kv_quant`` of that file. ``--quick``
is a smoke run (context 1024, 32 MiB working sets, 3 rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this tree's onnx_light_ep (as tools/eval_kv_quant.py)
SHAPES = (("GQA 32/8", 32, 8), ("MHA 32/32", 32, 32))  # (name, query heads, kv heads)
HEAD_DIM = 128
PAGE_TOKENS = 256
MIB = 1 << 20
# (key, query/output and unquantized cache dtype, cache bit width; 0 = not quantized)
ORT_VARIANTS = (("ort_fp16", "float16", 0), ("ort_fp32", "float32", 0),
                ("ort_int8", "float16", 8), ("ort_int4", "float16", 4),
                ("ort_int8_f32q", "float32", 8), ("ort_int4_f32q", "float32", 4))
ORT_LABEL = {"ort_fp16": "ORT fp16 cache", "ort_fp32": "ORT fp32 cache", "ort_int8": "ORT int8 (fp16 q)",
             "ort_int4": "ORT int4 (fp16 q)", "ort_int8_f32q": "ORT int8 (fp32 q)",
             "ort_int4_f32q": "ORT int4 (fp32 q)"}
QUANT_TYPE = "PER_CHANNEL"
K_SCALE, V_SCALE = {8: 0.01, 4: 0.15}, {8: 0.01, 4: 0.15}  # codes x scale ~ U(-1.3, 1.3)


# ---------------------------------------------------------------- parsing the C++ drivers

_HEADER = re.compile(r"^(\w+) isa=(\S+)((?: \w+=\S+)*)\s*$")
_TIMING = re.compile(r"^\s+(\w+(?: \w+)?)\s+median\s+([\d.]+) ms\s+min\s+([\d.]+) ms\s*$")
_PEAK = re.compile(r"^\s+(\w+)\s+(n/a|[\d.]+) GFMA/s")


def parse_quant_attention(text: str) -> Dict:
    """``bench_quant_attention`` output -> {dtype, isa, params, layouts, reads}.

    ``layouts`` holds every ``<name> median X ms min Y ms`` line whose name does not start with
    ``read`` (native, int8, and any other such as int4), ``reads`` the ``read <name>`` lines
    keyed by ``<name>``; each {median_ms, min_ms} (ms per layer-step).
    """
    out: Dict = {"dtype": None, "isa": None, "params": {}, "layouts": {}, "reads": {}}
    for line in text.splitlines():
        m = _HEADER.match(line)
        if m and out["isa"] is None:
            out["dtype"], out["isa"] = m.group(1), m.group(2)
            out["params"] = {k: int(v) if v.lstrip("-").isdigit() else v
                             for k, v in (kv.split("=", 1) for kv in m.group(3).split())}
            continue
        m = _TIMING.match(line)
        if m:
            name, entry = m.group(1), {"median_ms": float(m.group(2)), "min_ms": float(m.group(3))}
            if name.startswith("read "):
                out["reads"][name[5:]] = entry
            else:
                out["layouts"][name] = entry
    if out["isa"] is None or "native" not in out["layouts"]:
        raise ValueError("not bench_quant_attention output:\n" + text)
    return out


def parse_fma_peak(text: str) -> Dict[str, Optional[float]]:
    """``bench_fma_peak`` output -> {level: GFMA/s or None where the CPU lacks it}."""
    peaks = {m.group(1): None if m.group(2) == "n/a" else float(m.group(2))
             for m in map(_PEAK.match, text.splitlines()) if m}
    if not peaks:
        raise ValueError("not bench_fma_peak output:\n" + text)
    return peaks


# ---------------------------------------------------------------- bytes, floors

def native_layer_bytes(kv_heads: int, context: int, page_tokens: int, head_dim: int, elem: int = 2) -> int:
    """K+V bytes of one layer of native pages, as bench_quant_attention lays them out."""
    blocks = -(-context // page_tokens)
    return kv_heads * blocks * 2 * page_tokens * head_dim * elem


def quant_page_bytes(page_tokens: int, head_dim: int, bits: int) -> int:
    """One int8 page of bench_quant_attention (K and V codes, fp32 K scales per channel and V
    scales per row, rounded up to 64 bytes); other bit widths: the same with packed codes."""
    codes = 2 * page_tokens * head_dim * bits // 8
    return (codes + 4 * (head_dim + page_tokens) + 63) // 64 * 64


def layers_for(layer_bytes: int, min_bytes: int) -> int:
    """Enough layers for at least `min_bytes` (the rule of bench_quant_attention where
    `layer_bytes` divides `min_bytes`, as its native pages do here; it rounds down)."""
    return max(1, -(-min_bytes // layer_bytes))


def ort_layer_bytes(kv_heads: int, context: int, head_dim: int, dtype: str, bits: int) -> int:
    """K and V caches of one GQA node (T rows each) plus the per-channel scales."""
    if bits == 0:
        return 2 * kv_heads * context * head_dim * np.dtype(dtype).itemsize
    return 2 * kv_heads * context * head_dim * bits // 8 + 2 * kv_heads * head_dim * 4


def fp32_peak_for_isa(isa: str, peaks: Dict[str, Optional[float]]) -> Optional[float]:
    """fp32 FMA GFMA/s of the level named by an ISA string (avx512*, avx2; None for scalar)."""
    if isa.startswith("avx512"):
        return peaks.get("fp32_avx512")
    if isa.startswith("avx2"):
        return peaks.get("fp32_avx2")
    return None


def widest_fp32_peak(peaks: Dict[str, Optional[float]]) -> tuple:
    for level in ("fp32_avx512", "fp32_avx2"):
        if peaks.get(level):
            return level, peaks[level]
    return None, None


def add_floor(entry: Dict, nbytes: int, macs: int, bw_gb_s: Optional[float], peak: Optional[float]) -> None:
    """Fill read_ms, compute_ms, floor_ms and x_floor (and x_floor_min) of a timed entry."""
    entry["bytes_per_layer"] = nbytes
    entry["macs_per_layer"] = macs
    entry["read_ms"] = nbytes / (bw_gb_s * 1e9) * 1e3 if bw_gb_s else None
    entry["compute_ms"] = macs / (peak * 1e9) * 1e3 if peak else None
    parts = [x for x in (entry["read_ms"], entry["compute_ms"]) if x]
    entry["floor_ms"] = max(parts) if parts else None
    entry["bound"] = (None if not parts else "read" if entry["floor_ms"] == entry["read_ms"] else "compute")
    for key, src in (("x_floor", "median_ms"), ("x_floor_min", "min_ms")):
        entry[key] = entry[src] / entry["floor_ms"] if entry.get(src) and entry["floor_ms"] else None


# ---------------------------------------------------------------- ORT's GroupQueryAttention

def gqa_model(layers: int, num_heads: int, kv_heads: int, head_dim: int, capacity: int, dtype: str,
              bits: int, k_scales: Optional[List[np.ndarray]] = None, v_scales: Optional[List[np.ndarray]] = None,
              quant_type: str = QUANT_TYPE):
    """A model of `layers` com.microsoft.GroupQueryAttention nodes sharing the inputs q, k, v
    (1, 1, heads x head_dim), seqlens_k (1,) and total_sequence_length (), each with its own
    past_key_<l>/past_value_<l> inputs (1, kv_heads, capacity, head_dim or head_dim / 2 at 4 bits)
    and outputs y_<l>, present_key_<l>, present_value_<l>. `bits` 0: caches of `dtype`; 8: int8
    caches; 4: uint8 caches of two codes a byte; quantized nodes take k_scale_<l>/v_scale_<l>
    (float32 initializers, (1, kv_heads, 1, head_dim) per channel or (1,) per tensor)."""
    from onnx import TensorProto, helper, numpy_helper

    et = {"float16": TensorProto.FLOAT16, "float32": TensorProto.FLOAT}[dtype]
    cache_t = {0: et, 8: TensorProto.INT8, 4: TensorProto.UINT8}[bits]
    cache_d = head_dim // 2 if bits == 4 else head_dim
    cache_shape = [1, kv_heads, capacity, cache_d]
    vi = helper.make_tensor_value_info
    inputs = [vi("q", et, [1, 1, num_heads * head_dim]), vi("k", et, [1, 1, kv_heads * head_dim]),
              vi("v", et, [1, 1, kv_heads * head_dim]), vi("seqlens_k", TensorProto.INT32, [1]),
              vi("total_sequence_length", TensorProto.INT32, [])]
    outputs, nodes, inits = [], [], []
    for l in range(layers):
        inputs += [vi(f"past_key_{l}", cache_t, cache_shape), vi(f"past_value_{l}", cache_t, cache_shape)]
        outputs += [vi(f"y_{l}", et, [1, 1, num_heads * head_dim]), vi(f"present_key_{l}", cache_t, cache_shape),
                    vi(f"present_value_{l}", cache_t, cache_shape)]
        names = ["q", "k", "v", f"past_key_{l}", f"past_value_{l}", "seqlens_k", "total_sequence_length"]
        attrs = dict(num_heads=num_heads, kv_num_heads=kv_heads)
        if bits:
            attrs.update(k_quant_type=quant_type, v_quant_type=quant_type, kv_cache_bit_width=bits)
            # cos_cache, sin_cache, position_ids, attention_bias, head_sink omitted
            names += ["", "", "", "", "", f"k_scale_{l}", f"v_scale_{l}"]
            inits += [numpy_helper.from_array(np.asarray(k_scales[l], np.float32), f"k_scale_{l}"),
                      numpy_helper.from_array(np.asarray(v_scales[l], np.float32), f"v_scale_{l}")]
        nodes.append(helper.make_node("GroupQueryAttention", names,
                                      [f"y_{l}", f"present_key_{l}", f"present_value_{l}"],
                                      name=f"gqa_{l}", domain="com.microsoft", **attrs))
    graph = helper.make_graph(nodes, "gqa_decode", inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model


class OrtGqaStep:
    """One decode step of `layers` GQA nodes over caches of `context` rows (position context - 1),
    every past/present pair bound to one OrtValue (the op writes the new token in place).

    Attributes for checking: ``q``, ``k``, ``v`` (the step's inputs), ``past_key``/``past_value``
    (numpy arrays the caches live in, one per layer), ``k_scales``/``v_scales``, ``y`` (outputs).
    """

    def __init__(self, layers: int, num_heads: int, kv_heads: int, head_dim: int, context: int, dtype: str,
                 bits: int, threads: int = 1, seed: int = 0, quant_type: str = QUANT_TYPE):
        import onnxruntime as ort

        rng = np.random.default_rng(seed)
        self.layers, self.bits, self.dtype, self.context = layers, bits, dtype, context
        sshape = (1, kv_heads, 1, head_dim) if quant_type == "PER_CHANNEL" else (1,)
        ramp = 1.0 + 0.25 * np.sin(np.arange(int(np.prod(sshape)), dtype=np.float32)).reshape(sshape)
        self.k_scales = [np.float32(K_SCALE.get(bits, 1)) * ramp for _ in range(layers)]
        self.v_scales = [np.float32(V_SCALE.get(bits, 1)) * ramp[..., ::-1].copy() for _ in range(layers)]
        model = gqa_model(layers, num_heads, kv_heads, head_dim, context, dtype, bits,
                          self.k_scales if bits else None, self.v_scales if bits else None, quant_type)
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.log_severity_level = 3
        self.session = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        self.binding = self.session.io_binding()
        self._keep = []

        def bind_in(name, arr):
            val = ort.OrtValue.ortvalue_from_numpy(arr)
            self._keep.append((arr, val))
            self.binding.bind_ortvalue_input(name, val)
            return val

        self.q = rng.standard_normal((1, 1, num_heads * head_dim)).astype(dtype)
        self.k = rng.standard_normal((1, 1, kv_heads * head_dim)).astype(dtype)
        self.v = rng.standard_normal((1, 1, kv_heads * head_dim)).astype(dtype)
        for name in ("q", "k", "v"):
            bind_in(name, getattr(self, name))
        bind_in("seqlens_k", np.array([context - 1], np.int32))
        bind_in("total_sequence_length", np.array(context, np.int32))
        shape = (1, kv_heads, context, head_dim // 2 if bits == 4 else head_dim)

        def fill():
            if bits == 8:
                return rng.integers(-127, 128, size=shape, dtype=np.int8)
            if bits == 4:
                return rng.integers(0, 256, size=shape, dtype=np.uint8)
            return (rng.standard_normal(shape, dtype=np.float32) * 0.5).astype(dtype)

        first = {"key": fill(), "value": fill()}  # one random layer, copied (the values do not matter to speed)
        self.past_key, self.past_value, self.y = [], [], []
        for l in range(layers):
            for kind, store in (("key", self.past_key), ("value", self.past_value)):
                arr = first[kind] if l == 0 else first[kind].copy()
                store.append(arr)
                self.binding.bind_ortvalue_output(f"present_{kind}_{l}", bind_in(f"past_{kind}_{l}", arr))
            y = np.zeros((1, 1, num_heads * head_dim), dtype)
            yv = ort.OrtValue.ortvalue_from_numpy(y)
            self._keep.append((y, yv))
            self.y.append(y)
            self.binding.bind_ortvalue_output(f"y_{l}", yv)

    def run(self) -> None:
        self.session.run_with_iobinding(self.binding)


# ---------------------------------------------------------------- running

def ensure_built(build_dir: str) -> Dict[str, str]:
    """Build the two drivers (configuring a C++-only tree if `build_dir` has none)."""
    if not os.path.isfile(os.path.join(build_dir, "CMakeCache.txt")):
        subprocess.run(["cmake", "-S", ROOT, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release",
                        "-DONNX_LIGHT_BUILD_TESTS=ON", "-DONNX_LIGHT_BUILD_PYTHON=OFF"],
                       check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", build_dir, "-j2", "--target", "bench_quant_attention", "bench_fma_peak"],
                   check=True, stdout=subprocess.DEVNULL)
    return {n: os.path.join(build_dir, n) for n in ("bench_quant_attention", "bench_fma_peak")}


def run_ours(exe: str, num_heads: int, kv_heads: int, context: int, rounds: int, min_bytes: int,
             env: Dict[str, str]) -> Dict:
    layers = layers_for(native_layer_bytes(kv_heads, context, PAGE_TOKENS, HEAD_DIM), min_bytes)
    cmd = [exe, "f16", str(context), str(PAGE_TOKENS), str(kv_heads), str(num_heads // kv_heads), str(HEAD_DIM),
           str(rounds), "1", str(layers)]
    text = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    res = parse_quant_attention(text)
    res["command"] = " ".join(os.path.relpath(c) if i == 0 else c for i, c in enumerate(cmd))
    res["raw"] = text
    return res


def run_ort(num_heads: int, kv_heads: int, context: int, steps: int, warmup: int, min_bytes: int,
            progress) -> Dict[str, Dict]:
    """Every ORT variant of one configuration, interleaved round by round."""
    out: Dict[str, Dict] = {}
    live = {}
    for key, dtype, bits in ORT_VARIANTS:
        nbytes = ort_layer_bytes(kv_heads, context, HEAD_DIM, dtype, bits)
        layers = layers_for(nbytes, min_bytes)
        entry = out[key] = {"dtype": dtype, "bits": bits, "layers": layers, "quant_type": QUANT_TYPE if bits else None}
        try:
            step = OrtGqaStep(layers, num_heads, kv_heads, HEAD_DIM, context, dtype, bits)
            for _ in range(max(1, warmup)):
                step.run()
            if not all(np.isfinite(y.astype(np.float32)).all() for y in step.y):
                raise RuntimeError("non-finite output")
            live[key] = step
        except Exception as e:  # ORT refuses this configuration: its exact words
            entry["error"] = f"{type(e).__name__}: {e}".strip()
            progress(f"    {key}: refused: {entry['error'].splitlines()[0]}")
    samples = {k: [] for k in live}
    keys = list(live)
    for r in range(steps):
        for i in range(len(keys)):
            key = keys[(i + r) % len(keys)]
            t0 = time.perf_counter()
            live[key].run()
            samples[key].append((time.perf_counter() - t0) * 1e3 / live[key].layers)
    for key, xs in samples.items():
        q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
        out[key].update(samples_ms=xs, median_ms=statistics.median(xs), min_ms=min(xs), p25_ms=q[0], p75_ms=q[2])
    live.clear()
    return out


def _known_bytes(cfg: Dict) -> Dict[str, int]:
    """Bytes per layer of the layouts whose page format this script knows (native, int8)."""
    Hk, T, D = cfg["kv_heads"], cfg["context"], cfg["head_dim"]
    P = cfg["ours"]["params"].get("page_tokens", PAGE_TOKENS)
    return {"native": native_layer_bytes(Hk, T, P, D), "int8": Hk * -(-T // P) * quant_page_bytes(P, D, 8)}


def read_bandwidth(cfgs: List[Dict]) -> Optional[float]:
    """The highest one-core read bandwidth (GB/s) of the C++ read lines of `cfgs`: bytes / the
    minimum time of a read line, over the layouts of known bytes. One figure for the whole run:
    the least disturbed pass, so that the read limit stays a lower bound on a shared machine."""
    bws = [b[n] / (r["min_ms"] * 1e-3) / 1e9 for c in cfgs for b in [_known_bytes(c)]
           for n, r in c["ours"]["reads"].items() if n in b]
    return max(bws) if bws else None


def analyse(cfg: Dict, peaks: Dict[str, Optional[float]], bw: Optional[float] = None) -> None:
    """Bytes, read limit, compute floor and ratios of one configuration's ours and ort (in place);
    `bw`: the read bandwidth for the read limit (default: :func:`read_bandwidth` of `cfg`)."""
    H, Hk, T, D = cfg["num_heads"], cfg["kv_heads"], cfg["context"], cfg["head_dim"]
    macs = H * T * 2 * D
    ours = cfg["ours"]
    P = ours["params"].get("page_tokens", PAGE_TOKENS)
    blocks = -(-T // P)
    known = _known_bytes(cfg)
    ours["read_gb_per_s_median"] = max([known[n] / (r["median_ms"] * 1e-3) / 1e9 for n, r in ours["reads"].items()
                                        if n in known] or [None])
    bw = bw if bw is not None else read_bandwidth([cfg])
    ours["read_gb_per_s"] = bw
    peak = fp32_peak_for_isa(ours["isa"], peaks)
    nat = ours["layouts"]["native"]
    for name, e in ours["layouts"].items():
        if name in known:
            nbytes, src = known[name], "layout"
        elif name in ours["reads"] and bw:
            nbytes, src = int(ours["reads"][name]["median_ms"] * 1e-3 * bw * 1e9), "its read time x bandwidth"
        else:
            m = re.match(r"int(\d+)$", name)
            nbytes, src = (Hk * blocks * quant_page_bytes(P, D, int(m.group(1))), "nominal") if m else (0, "unknown")
        e["bytes_source"] = src
        add_floor(e, nbytes, macs, bw, peak)
        e["vs_f16"] = e["median_ms"] / nat["median_ms"]
        e["vs_f16_min"] = e["min_ms"] / nat["min_ms"]
    level, ort_peak = widest_fp32_peak(peaks)
    cfg["ort_peak_level"] = level
    base = cfg["ort"].get("ort_fp16", {}).get("median_ms")
    for key, e in cfg["ort"].items():
        if "median_ms" not in e:
            continue
        add_floor(e, ort_layer_bytes(Hk, T, D, e["dtype"], e["bits"]), macs, bw, ort_peak)
        e["vs_f16"] = e["median_ms"] / base if base else None
        mine = ours["layouts"].get({0: "native", 8: "int8", 4: "int4"}[e["bits"]])
        e["vs_ours"] = e["median_ms"] / mine["median_ms"] if mine and e["dtype"] == "float16" else None


def machine_info(isa: Optional[str]) -> Dict:
    """onnx_light_ep.bench.machine.machine_info (the read bandwidth is measured by the C++ bench) and
    the kernel's ISA level."""
    from onnx_light_ep.bench import machine

    info = machine.machine_info(measure_bandwidth=False)
    if isa:
        info["isa"] = isa
    return info


# ---------------------------------------------------------------- report

def _f(x, spec=".3g"):
    return "" if x is None else format(x, spec)


def table_lines(result: Dict) -> List[str]:
    head = ["shape", "T", "implementation", "layers", "MiB / layer", "median ms", "min ms", "÷ own f16",
            "read limit ms", "compute floor ms", "÷ floor (min)", "ORT ÷ ours"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cfg in result["configs"]:
        first = True
        ctx = f"{cfg['context'] // 1024}K" if cfg["context"] % 1024 == 0 else str(cfg["context"])
        rows = [("ours f16 pages" if n == "native" else f"ours {n} pages", e)
                for n, e in cfg["ours"]["layouts"].items()]
        rows += [(ORT_LABEL.get(k, k), e) for k, e in cfg["ort"].items()]
        for label, e in rows:
            lead = [cfg["shape"], ctx] if first else ["", ""]
            first = False
            layers = e.get("layers", cfg["ours"]["params"].get("layers"))
            if "error" in e:
                lines.append("| " + " | ".join(lead + [label, str(layers), "", "refused (below)"] + [""] * 6) + " |")
                continue
            bound = {"read": "R", "compute": "C"}.get(e.get("bound"), "")
            xf = f"{_f(e['x_floor'], '.2f')} ({_f(e['x_floor_min'], '.2f')}) {bound}".strip()
            lines.append("| " + " | ".join(lead + [
                label, str(layers), _f(e["bytes_per_layer"] / MIB, ".1f"), _f(e["median_ms"]), _f(e["min_ms"]),
                _f(e.get("vs_f16"), ".2f"), _f(e["read_ms"]), _f(e["compute_ms"]), xf,
                _f(e.get("vs_ours"), ".2f")]) + " |")
    return lines


def peaks_line(peaks: Dict[str, Optional[float]]) -> str:
    names = {"fp32_avx2": "fp32 FMA AVX2", "fp32_avx512": "fp32 FMA AVX-512",
             "int16_avx2": "int16 vpmaddwd+vpaddd AVX2", "int16_avx512bw": "int16 vpmaddwd+vpaddd AVX-512BW",
             "int16_avx512vnni": "int16 vpdpwssd AVX512-VNNI"}
    return "; ".join(f"{names.get(k, k)} {'n/a' if v is None else f'{v:.1f}'}" for k, v in peaks.items())


def markdown(result: Dict, report) -> str:
    s = result["settings"]
    lines = ["## Quantized KV: our pages vs ORT's quantized-KV GroupQueryAttention, against the floor", ""]
    lines += report.machine_lines(result["machine"])
    isa = result["machine"].get("isa")
    bw = result.get("read_gb_per_s")
    meds = [c["ours"]["read_gb_per_s_median"] for c in result["configs"] if c["ours"].get("read_gb_per_s_median")]
    if bw:
        lines.append(f"- one-core read bandwidth (`stream_read`, the C++ read lines): {bw:.1f} GB/s, the best pass "
                     f"of the run (used for every read limit); medians per configuration "
                     f"{min(meds):.1f}-{max(meds):.1f} GB/s")
    lines += [f"- ISA: our kernel `{isa}`; ORT's floor at `{result.get('ort_peak_level')}`. One-core peaks "
              f"(`bench_fma_peak`, GFMA/s = 1e9 multiply-adds/s): {peaks_line(result['fma_peak'])}", "",
              f"Command: `{s['command']}`; run took {s['elapsed_s'] / 60:.1f} min. One decode step, head_dim "
              f"{HEAD_DIM}, 1 thread, ms per layer-step over enough layers for >= {s['min_working_set_mib']} MiB "
              f"of K/V (each implementation its own count). Ours: `bench_quant_attention` (kernel alone, "
              f"{PAGE_TOKENS}-token pages, {s['rounds']} interleaved rounds; int8 = per-channel K and per-row V "
              f"scales). ORT {result['machine'].get('onnxruntime')}: CPU `com.microsoft.GroupQueryAttention`, one "
              f"node per layer, past/present bound to one OrtValue (shared buffer, the new token appended in "
              f"place), static {QUANT_TYPE} scales, {s['steps']} interleaved steps after {s['warmup']} warm-up. "
              f"Read limit = K+V+scale bytes / the one-core read bandwidth above; compute floor "
              f"= query heads x T x 2 x head_dim multiply-adds / the fp32 FMA peak; ÷ floor: R/C = read/compute "
              f"bound. `÷ own f16`: against ours f16 pages, ORT against its fp16 cache; `ORT ÷ ours`: fp16-query "
              f"ORT against ours at the same bit width. Medians of the rounds (min in brackets); the machine's "
              f"2 cores are shared with other work, so figures are indicative.", ""]
    lines += table_lines(result)
    refused = [(c, k, e["error"]) for c in result["configs"] for k, e in c["ort"].items() if "error" in e]
    lines += ["", "ORT refused: " + ("nothing" if not refused else "")]
    for c, k, err in refused:
        lines.append(f"- {c['shape']} T={c['context']} {ORT_LABEL.get(k, k)}: `{' '.join(err.split())}`")
    return "\n".join(lines) + "\n"


def load_report():
    from onnx_light_ep.bench import report

    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build-dev"))
    ap.add_argument("--out-dir", default="bench_out")
    ap.add_argument("--benchmarks-md", default=None)
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--rounds", type=int, default=15, help="bench_quant_attention rounds")
    ap.add_argument("--steps", type=int, default=20, help="ORT measured steps per variant")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--min-working-set-mib", type=int, default=256)
    ap.add_argument("--isa", default="", help="ONNX_LIGHT_ISA for our kernel (default: detected)")
    ap.add_argument("--quick", action="store_true", help="smoke run: context 1024, 32 MiB, 3 rounds")
    args = ap.parse_args(argv)
    if args.quick:
        args.contexts, args.rounds, args.steps, args.warmup, args.min_working_set_mib = "1024", 3, 3, 1, 32
    t0 = time.time()
    say = lambda line: print(line, flush=True)  # noqa: E731
    exe = ensure_built(args.build_dir)
    env = dict(os.environ, **({"ONNX_LIGHT_ISA": args.isa} if args.isa else {}))
    peak_text = subprocess.run([exe["bench_fma_peak"]] + (["20", "3"] if args.quick else ["50", "30"]),
                               check=True, capture_output=True, text=True).stdout
    peaks = parse_fma_peak(peak_text)
    say("fma peaks (GFMA/s): " + peaks_line(peaks))
    min_bytes = args.min_working_set_mib * MIB
    configs = []
    for context in (int(c) for c in args.contexts.split(",") if c):
        for shape, H, Hk in SHAPES:
            cfg = {"shape": shape, "num_heads": H, "kv_heads": Hk, "group": H // Hk, "head_dim": HEAD_DIM,
                   "context": context}
            say(f"{shape} T={context}: ours ...")
            cfg["ours"] = run_ours(exe["bench_quant_attention"], H, Hk, context, args.rounds, min_bytes, env)
            say("  " + ", ".join(f"{n} {e['median_ms']:.3f} ms" for n, e in cfg["ours"]["layouts"].items()))
            say(f"{shape} T={context}: ORT ...")
            cfg["ort"] = run_ort(H, Hk, context, args.steps, args.warmup, min_bytes, say)
            say("  " + ", ".join(f"{k} {e['median_ms']:.3f} ms" for k, e in cfg["ort"].items() if "median_ms" in e))
            configs.append(cfg)
    bw = read_bandwidth(configs)
    for cfg in configs:
        analyse(cfg, peaks, bw)
    cmd = "python tools/bench_kv_quant.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None
                                                                                  else sys.argv[1:]))
    from onnx_light_ep.bench.command import reproducible_command

    result = {"settings": {**vars(args), "command": reproducible_command(cmd.strip()), "elapsed_s": time.time() - t0,
                           "head_dim": HEAD_DIM, "page_tokens": PAGE_TOKENS},
              "machine": machine_info(configs[0]["ours"]["isa"] if configs else None),
              "fma_peak": peaks, "fma_peak_raw": peak_text, "ort_peak_level": widest_fp32_peak(peaks)[0],
              "read_gb_per_s": bw,
              "configs": configs}
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, "bench_kv_quant.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    report = load_report()
    md = markdown(result, report)
    print("\n" + md)
    print(f"wrote {path}")
    if args.benchmarks_md:
        report.update_block(args.benchmarks_md, "bench_kv_quant", md.rstrip("\n"), machine=result["machine"])
        print(f"updated block bench_kv_quant of {args.benchmarks_md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
