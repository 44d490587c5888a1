"""Regressions for faults an adversarial review found, each run through the EP and the
plain CPU EP:

- CacheExport whose output type differs from the cache dtype: a clear error, never a
  heap overflow or reinterpreted bits;
- CacheExport of an empty layer returns [B, Hkv, 0, D];
- CacheAttention with unranked query/key/value keeps Y typed as the query;
- NaN in a visible key propagates to the row (as ONNX Attention), NaN only in padding
  or future slots does not;
- a cache with more layers than the model is reported instead of silently never
  advancing;
- a KVCache method racing a run makes the run fail naming the real cause.
"""
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper

import onnx_light_ep
from onnx_light_ep import KVCache
from models import cache_attention_model
from reference import FP32_ATOL, FP32_RTOL, ref_attn

DOMAIN = onnx_light_ep.DOMAIN
MODES = ["ep", "cpu"]


def _session(model, mode):
    data = model if isinstance(model, bytes) else model.SerializeToString()
    if mode == "ep":
        return onnx_light_ep.InferenceSession(data)
    so = ort.SessionOptions()
    so.register_custom_ops_library(onnx_light_ep.get_library_path())
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])


def _export_model(out_type, dtype_attr):
    node = helper.make_node("CacheExport", ["kv_cache"], ["pk", "pv"], domain=DOMAIN, layer=0, dtype=dtype_attr)
    g = helper.make_graph([node], "e", [helper.make_tensor_value_info("kv_cache", TP.INT64, [1])],
                          [helper.make_tensor_value_info("pk", out_type, None),
                           helper.make_tensor_value_info("pv", out_type, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1)],
                             ir_version=10)


@pytest.mark.parametrize("mode", MODES)
def test_export_type_mismatch_is_an_error_not_an_overflow(mode):
    k = np.full((2, 2, 64, 16), 7.0, np.float32)
    with KVCache.from_past([k], [k]) as cache:
        sess = _session(_export_model(TP.FLOAT16, 10), mode)
        with pytest.raises(Exception, match="cache's type float"):
            sess.run(None, {"kv_cache": cache.handle})
        pk, _ = cache.export(0)
        assert np.array_equal(pk, k)  # nothing changed
    h = np.full((1, 1, 3, 8), 1.0, np.float16)
    with KVCache.from_past([h], [h]) as cache:
        sess = _session(_export_model(TP.FLOAT, 1), mode)
        with pytest.raises(Exception, match="cache's type float16"):
            sess.run(None, {"kv_cache": cache.handle})


@pytest.mark.parametrize("mode", MODES)
def test_export_of_empty_layer(mode):
    with KVCache(1, 2, 3, 8, max_sequence_length=16) as cache:
        pk, pv = _session(_export_model(TP.FLOAT, 1), mode).run(None, {"kv_cache": cache.handle})
        assert pk.shape == (2, 3, 0, 8) and pv.shape == (2, 3, 0, 8)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mask_type", [TP.BOOL, TP.FLOAT16])
def test_unranked_inputs_keep_output_type(mode, mask_type):
    ins = [helper.make_tensor_value_info("kv_cache", TP.INT64, [1])]
    ins += [helper.make_tensor_value_info(n, TP.FLOAT, None) for n in ("q", "k", "v")]
    ins.append(helper.make_tensor_value_info("mask", mask_type, None))
    node = helper.make_node("CacheAttention", ["q", "k", "v", "kv_cache", "mask"], ["Y"], domain=DOMAIN, layer=0)
    g = helper.make_graph([node], "m", ins, [helper.make_tensor_value_info("Y", TP.FLOAT, None)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(DOMAIN, 1)],
                              ir_version=10)
    sess = _session(model, mode)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 1, 4), dtype=np.float32)
    k = rng.standard_normal((1, 2, 1, 4), dtype=np.float32)
    mask = np.ones((1, 1, 1, 1), bool) if mask_type == TP.BOOL else np.zeros((1, 1, 1, 1), np.float16)
    with KVCache(1, 1, 2, 4, max_sequence_length=4) as cache:
        (y,) = sess.run(None, {"q": q, "k": k, "v": k, "kv_cache": cache.handle, "mask": mask})
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, ref_attn(q, k, k)[0], atol=FP32_ATOL, rtol=FP32_RTOL)


@pytest.mark.parametrize("mode", MODES)
def test_nan_in_visible_key_propagates(mode):
    rng = np.random.default_rng(1)
    D = 16
    sess = _session(cache_attention_model(q_num_heads=2, kv_num_heads=1, head_dim=D, is_causal=1), mode)
    past = rng.standard_normal((1, 1, 20, D)).astype(np.float32)
    past[0, 0, 7, 3] = np.nan
    q = rng.standard_normal((1, 2, 1, D), dtype=np.float32)
    k = rng.standard_normal((1, 1, 1, D), dtype=np.float32)
    with KVCache.from_past([past], [past], max_sequence_length=32) as cache:
        (y,) = sess.run(None, {"query_0": q, "key_0": k, "value_0": k, "kv_cache": cache.handle})
    assert np.isnan(y).all()
    past[0, 0, 7, 3] = 0.0
    with KVCache.from_past([past], [past], max_sequence_length=32) as cache:
        (y,) = sess.run(None, {"query_0": q, "key_0": k, "value_0": k, "kv_cache": cache.handle})
    np.testing.assert_allclose(y, ref_attn(q, k, k, past, past)[0], atol=FP32_ATOL, rtol=FP32_RTOL)


@pytest.mark.parametrize("mode,with_commit", [("ep", False), ("ep", True), ("cpu", True)])
def test_cache_with_more_layers_than_model_is_reported(mode, with_commit):
    """Certain, so reported at the first run: onnx_light_ep.InferenceSession knows the run
    succeeded with layers missing; a CacheCommit node runs after every output and sees them."""
    rng = np.random.default_rng(2)
    sess = _session(cache_attention_model(q_num_heads=2, kv_num_heads=1, head_dim=8, is_causal=1,
                                          with_commit=with_commit), mode)
    feeds = {n: rng.standard_normal((1, h, 1, 8), dtype=np.float32)
             for n, h in (("query_0", 2), ("key_0", 1), ("value_0", 1))}
    with KVCache(2, 1, 1, 8, max_sequence_length=16) as cache:  # 2 layers, model has 1
        for _ in range(3):
            with pytest.raises(Exception, match="fewer attention layers than the cache"):
                sess.run(None, dict(feeds, kv_cache=cache.handle))
            assert cache.seq_lens.tolist() == [0]
            assert cache.stats()["reserved_bytes"] == 0


def test_cache_with_more_layers_than_model_on_plain_cpu_without_commit_node():
    """A plain ORT CPU session of a graph without CacheCommit gives no run boundary: the step
    never completes, so nothing is appended (never a wrong length), and no error can be certain."""
    rng = np.random.default_rng(2)
    sess = _session(cache_attention_model(q_num_heads=2, kv_num_heads=1, head_dim=8, is_causal=1), "cpu")
    feeds = {n: rng.standard_normal((1, h, 1, 8), dtype=np.float32)
             for n, h in (("query_0", 2), ("key_0", 1), ("value_0", 1))}
    with KVCache(2, 1, 1, 8, max_sequence_length=16) as cache:
        for _ in range(4):
            sess.run(None, dict(feeds, kv_cache=cache.handle))
            assert cache.seq_lens.tolist() == [0]
