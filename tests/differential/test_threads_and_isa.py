"""Parallel work split (batch x kv head x query block x KV split) is fixed by the
problem shape, never by the thread count: 1 and 2 intra-op threads give
bit-identical outputs, on the EP, including a case long enough to split the
KV range (B * Hkv < 8 items, >= 1024 keys). Also: every ISA level agrees with
the scalar oracle on that case within the fp32 tolerance."""
import numpy as np
import onnxruntime as ort

import onnx_light_ep
from onnx_light_ep import KVCache, _core
from models import cache_attention_model
from reference import FP32_ATOL, FP32_RTOL, ref_attn


def _run(threads, q, k, v, past_k, past_v, model, **cache_options):
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    sess = onnx_light_ep.InferenceSession(model.SerializeToString(), so)
    cache = KVCache.from_past([past_k], [past_v], max_sequence_length=past_k.shape[2] + 4, **cache_options)
    try:
        (y,) = sess.run(None, {"query_0": q, "key_0": k, "value_0": v, "kv_cache": cache.handle})
    finally:
        cache.close()
    return y


def _case(seed, HKV=2, P=1500):
    """A decode step with P cached positions, B * Hkv work items (default 1500 positions, 2
    items: the KV range splits in 2)."""
    rng = np.random.default_rng(seed)
    B, HQ, D = 1, 8, 64
    model = cache_attention_model(q_num_heads=HQ, kv_num_heads=HKV, head_dim=D, is_causal=1)
    q = rng.standard_normal((B, HQ, 1, D), dtype=np.float32)
    k = rng.standard_normal((B, HKV, 1, D), dtype=np.float32)
    v = rng.standard_normal((B, HKV, 1, D), dtype=np.float32)
    pk = rng.standard_normal((B, HKV, P, D), dtype=np.float32)
    pv = rng.standard_normal((B, HKV, P, D), dtype=np.float32)
    return q, k, v, pk, pv, model


def test_one_and_two_threads_bit_identical(isa):
    q, k, v, pk, pv, model = _case(0)
    y1 = _run(1, q, k, v, pk, pv, model)
    y2 = _run(2, q, k, v, pk, pv, model)
    assert np.array_equal(y1, y2), f"{isa}: 1 vs 2 threads differ"
    want = ref_attn(q, k, v, pk, pv)[0]
    np.testing.assert_allclose(y1, want, atol=FP32_ATOL, rtol=FP32_RTOL)
    assert _core.isa() == isa


def test_int8_pages_one_and_two_threads_bit_identical(isa):
    """The KV split crosses native and int8 runs (sinks, cold int8 pages, the recent window)."""
    q, k, v, pk, pv, model = _case(1)
    opts = dict(kv_quant="int8", page_tokens=128, recent_tokens=200, sink_tokens=4)
    y1 = _run(1, q, k, v, pk, pv, model, **opts)
    y2 = _run(2, q, k, v, pk, pv, model, **opts)
    assert np.array_equal(y1, y2), f"{isa}: 1 vs 2 threads differ on int8 pages"


def test_one_kv_head_long_context_one_and_two_threads_bit_identical(isa):
    """One kv head (MQA-like) over 4500 and 9000 positions: splits past the second are 2048
    keys (ops/attention_core.cc), here 2 and 4 splits of ~2250 keys; 1 and 2 threads agree bit
    for bit and with the oracle."""
    for seed, P in ((2, 4500), (3, 9000)):
        q, k, v, pk, pv, model = _case(seed, HKV=1, P=P)
        y1 = _run(1, q, k, v, pk, pv, model)
        y2 = _run(2, q, k, v, pk, pv, model)
        assert np.array_equal(y1, y2), f"{isa}: 1 vs 2 threads differ at {P} positions"
        np.testing.assert_allclose(y1, ref_attn(q, k, v, pk, pv)[0], atol=FP32_ATOL, rtol=FP32_RTOL)
