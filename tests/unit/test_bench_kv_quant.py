"""tools/bench_kv_quant.py without timing: the ORT quantized-GQA graph it benchmarks computes the
attention of ORT's documented quantized cache (so the comparison measures a correct
configuration), past and present share one buffer, and the C++ drivers' output parses.

The reference follows the GroupQueryAttention schema (com.microsoft, ORT >= 1.23): symmetric
quantization, x = code x scale with the scale broadcast from (1, kv_heads, 1, head_size)
(PER_CHANNEL) or (1,) (PER_TENSOR); 8 bits: int8 codes; 4 bits: uint8 bytes of two codes, the
element at even index in the low nibble, each stored as code + 8 (code in [-8, 7]), as ORT's CPU
and CUDA kernels pack them. The new token's K/V is quantized with round-half-to-even and clamped.
"""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def bkq():
    spec = importlib.util.spec_from_file_location("bench_kv_quant", os.path.join(ROOT, "tools", "bench_kv_quant.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def dequantize(codes: np.ndarray, scale: np.ndarray, bits: int) -> np.ndarray:
    if bits == 8:
        x = codes.astype(np.float32)
    else:
        x = np.empty(codes.shape[:-1] + (2 * codes.shape[-1],), np.float32)
        x[..., 0::2] = (codes & 0x0F).astype(np.float32) - 8
        x[..., 1::2] = (codes >> 4).astype(np.float32) - 8
    return x * scale


def quantize(x: np.ndarray, scale: np.ndarray, bits: int) -> np.ndarray:
    lo, hi = (-128, 127) if bits == 8 else (-8, 7)
    q = np.clip(np.rint(x.astype(np.float32) / scale), lo, hi).astype(np.int32)
    if bits == 8:
        return q.astype(np.int8)
    u = (q + 8).astype(np.uint8)
    return (u[..., 0::2] | (u[..., 1::2] << 4)).astype(np.uint8)


def reference(step, layer, num_heads, kv_heads, head_dim, T):
    """Output of layer `layer` after the step, from the caches as they were before it."""
    bits = step.bits
    kbefore, vbefore = step._before[layer]
    k_new = step.k.reshape(1, kv_heads, 1, head_dim).astype(np.float32)
    v_new = step.v.reshape(1, kv_heads, 1, head_dim).astype(np.float32)
    if bits:
        ks, vs = step.k_scales[layer], step.v_scales[layer]
        K, V = dequantize(kbefore, ks, bits), dequantize(vbefore, vs, bits)
        K[:, :, T - 1:T] = dequantize(quantize(k_new, ks, bits), ks, bits)
        V[:, :, T - 1:T] = dequantize(quantize(v_new, vs, bits), vs, bits)
    else:
        K, V = kbefore.astype(np.float32), vbefore.astype(np.float32)
        K[:, :, T - 1:T], V[:, :, T - 1:T] = k_new, v_new
    q = step.q.reshape(num_heads, head_dim).astype(np.float32)
    group = num_heads // kv_heads
    out = np.empty((num_heads, head_dim), np.float32)
    for h in range(num_heads):
        s = K[0, h // group, :T] @ q[h] / np.sqrt(head_dim)
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ V[0, h // group, :T]
    return out.reshape(1, 1, -1)


CASES = ([(bits, dtype, heads, "PER_CHANNEL") for bits in (8, 4, 0) for dtype in ("float32", "float16")
          for heads in ((4, 2), (2, 2))] +
         [(bits, dtype, (4, 2), "PER_TENSOR") for bits in (8, 4) for dtype in ("float32", "float16")])


@pytest.mark.parametrize("bits,dtype,heads,quant_type", CASES)
def test_ort_gqa_step_matches_documented_dequantization(bkq, bits, dtype, heads, quant_type):
    H, Hk = heads
    D, T, layers = 16, 12, 2
    step = bkq.OrtGqaStep(layers, H, Hk, D, T, dtype, bits, seed=3, quant_type=quant_type)
    assert len(step.session.get_inputs()) == 5 + 2 * layers
    assert step.session.get_providers() == ["CPUExecutionProvider"]
    step._before = [(k.copy(), v.copy()) for k, v in zip(step.past_key, step.past_value)]
    step.run()
    tol = dict(rtol=2e-2, atol=4e-3) if dtype == "float16" else dict(rtol=1e-4, atol=1e-5)
    for layer in range(layers):
        ref = reference(step, layer, H, Hk, D, T)
        np.testing.assert_allclose(step.y[layer].astype(np.float32), ref, **tol)
        # past_present_share_buffer: the new token went into the bound past buffer, in place,
        # quantized as documented; the other rows are untouched
        k_new = step.k.reshape(1, Hk, 1, D)
        expect = quantize(k_new, step.k_scales[layer], bits) if bits else k_new.astype(dtype)
        np.testing.assert_array_equal(step.past_key[layer][:, :, T - 1:T], expect)
        np.testing.assert_array_equal(step.past_key[layer][:, :, :T - 1], step._before[layer][0][:, :, :T - 1])
    # the same step again reads the row it wrote and gives the same output
    y0 = [y.copy() for y in step.y]
    step.run()
    for a, b in zip(y0, step.y):
        np.testing.assert_array_equal(a, b)


def test_gqa_model_attributes(bkq):
    m = bkq.gqa_model(3, 4, 2, 16, 8, "float16", 4, [np.ones((1, 2, 1, 16))] * 3, [np.ones((1, 2, 1, 16))] * 3)
    assert [n.op_type for n in m.graph.node] == ["GroupQueryAttention"] * 3
    attrs = {a.name: a for a in m.graph.node[0].attribute}
    assert attrs["kv_cache_bit_width"].i == 4
    assert attrs["k_quant_type"].s == attrs["v_quant_type"].s == b"PER_CHANNEL"
    assert list(m.graph.node[1].input[-2:]) == ["k_scale_1", "v_scale_1"]
    past = next(i for i in m.graph.input if i.name == "past_key_2")
    assert [d.dim_value for d in past.type.tensor_type.shape.dim] == [1, 2, 8, 8]  # two codes a byte


QUANT_OUT = """f16 isa=avx512_bf16 T=8192 page_tokens=256 heads=8 group=4 head_dim=128 layers=8 rounds=5
  native       median    2.104 ms   min    2.050 ms
  int8         median    2.200 ms   min    2.150 ms
  int4         median    1.900 ms   min    1.850 ms
  read native  median    1.230 ms   min    1.200 ms
  read int8    median    0.650 ms   min    0.640 ms
  read int4    median    0.340 ms   min    0.330 ms
  int8 / native x1.046 (min x1.049); native / its read x1.711; int8 / its read x3.385
  int4 / native x0.903
"""

PEAK_OUT = """fma_peak one core, best of 7 trials of 200 ms; GFMA/s = 1e9 multiply-adds per second
  fp32_avx2                58.6 GFMA/s  vfmadd231ps ymm (256-bit FMA), 12 chains
  fp32_avx512              58.5 GFMA/s  vfmadd231ps zmm (512-bit FMA), 24 chains
  int16_avx2               93.3 GFMA/s  vpmaddwd+vpaddd ymm, 12 chains
  int16_avx512bw                n/a GFMA/s  vpmaddwd+vpaddd zmm
  int16_avx512vnni              n/a GFMA/s  vpdpwssd zmm
"""


def test_parse_quant_attention_every_layout_line(bkq):
    r = bkq.parse_quant_attention(QUANT_OUT)
    assert r["dtype"] == "f16" and r["isa"] == "avx512_bf16"
    assert r["params"] == {"T": 8192, "page_tokens": 256, "heads": 8, "group": 4, "head_dim": 128, "layers": 8,
                           "rounds": 5}
    assert r["layouts"] == {"native": {"median_ms": 2.104, "min_ms": 2.05}, "int8": {"median_ms": 2.2, "min_ms": 2.15},
                            "int4": {"median_ms": 1.9, "min_ms": 1.85}}
    assert set(r["reads"]) == {"native", "int8", "int4"} and r["reads"]["int8"]["median_ms"] == 0.65
    with pytest.raises(ValueError):
        bkq.parse_quant_attention("garbage\n")


def test_parse_fma_peak(bkq):
    p = bkq.parse_fma_peak(PEAK_OUT)
    assert p == {"fp32_avx2": 58.6, "fp32_avx512": 58.5, "int16_avx2": 93.3, "int16_avx512bw": None,
                 "int16_avx512vnni": None}
    assert bkq.fp32_peak_for_isa("avx512_bf16", p) == 58.5 and bkq.fp32_peak_for_isa("avx2", p) == 58.6
    assert bkq.fp32_peak_for_isa("scalar", p) is None


def test_analyse_floors_and_ratios(bkq):
    cfg = {"shape": "GQA 32/8", "num_heads": 32, "kv_heads": 8, "group": 4, "head_dim": 128, "context": 8192,
           "ours": bkq.parse_quant_attention(QUANT_OUT),
           "ort": {"ort_fp16": {"dtype": "float16", "bits": 0, "layers": 8, "median_ms": 20.0, "min_ms": 19.0},
                   "ort_int8": {"dtype": "float16", "bits": 8, "layers": 16, "median_ms": 6.6, "min_ms": 6.0},
                   "ort_int4": {"dtype": "float16", "bits": 4, "layers": 32, "error": "Fail: nope"}}}
    peaks = bkq.parse_fma_peak(PEAK_OUT)
    bkq.analyse(cfg, peaks)
    nat = cfg["ours"]["layouts"]["native"]
    assert nat["bytes_per_layer"] == 8 * 32 * 2 * 256 * 128 * 2 == 32 * 2**20
    bw = cfg["ours"]["read_gb_per_s"]
    # the bandwidth: the best pass (minimum time) of the read lines of layouts with known bytes
    assert bw == pytest.approx(max(32 * 2**20 / 1.2e-3, 8 * 32 * bkq.quant_page_bytes(256, 128, 8) / 0.64e-3) / 1e9)
    assert bkq.read_bandwidth([cfg]) == bw
    assert nat["read_ms"] == pytest.approx(32 * 2**20 / (bw * 1e9) * 1e3)
    macs = 32 * 8192 * 2 * 128
    assert nat["compute_ms"] == pytest.approx(macs / 58.5e9 * 1e3)
    assert nat["floor_ms"] == max(nat["read_ms"], nat["compute_ms"])
    assert nat["x_floor"] == pytest.approx(2.104 / nat["floor_ms"])
    assert cfg["ours"]["layouts"]["int8"]["vs_f16"] == pytest.approx(2.2 / 2.104)
    assert cfg["ours"]["layouts"]["int4"]["bytes_source"] == "its read time x bandwidth"
    o8 = cfg["ort"]["ort_int8"]
    assert o8["bytes_per_layer"] == 2 * 8 * 8192 * 128 + 2 * 8 * 128 * 4
    assert o8["vs_f16"] == pytest.approx(6.6 / 20.0) and o8["vs_ours"] == pytest.approx(6.6 / 2.2)
    assert "read_ms" not in cfg["ort"]["ort_int4"]
    result = {"settings": {"command": "python tools/bench_kv_quant.py", "elapsed_s": 1, "min_working_set_mib": 256,
                           "rounds": 5, "steps": 3, "warmup": 1},
              "machine": {"onnxruntime": "x", "isa": "avx512_bf16"}, "fma_peak": peaks,
              "ort_peak_level": "fp32_avx512", "read_gb_per_s": bw, "configs": [cfg]}
    md = bkq.markdown(result, bkq.load_report())
    assert "| GQA 32/8 | 8K | ours f16 pages |" in md and "ours int4 pages" in md
    assert "ORT int4 (fp16 q) | 32 |  | refused (below)" in md and "`Fail: nope`" in md
