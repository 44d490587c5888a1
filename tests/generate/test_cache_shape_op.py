"""ai.onnx_light.CacheShape(cache) -> int64 [4] through ORT, on OnnxLightExecutionProvider and on plain
ORT's CPU EP with the custom-op library: [batch_size, kv_num_heads, P, head_dim] (value=1: v_head_dim),
P = the longest committed sequence, never counting the rows of the run it is part of."""
import numpy as np
import pytest
from onnx import TensorProto as TP
from onnx import helper as oh

import onnx_light_ep as ole

B, HQ, HKV, D, DV = 2, 4, 2, 8, 4


def _model(shape_layer=0):
    ins = [oh.make_tensor_value_info("q", TP.FLOAT, [B, "S", HQ * D]),
           oh.make_tensor_value_info("k", TP.FLOAT, [B, "S", HKV * D]),
           oh.make_tensor_value_info("v", TP.FLOAT, [B, "S", HKV * DV]),
           oh.make_tensor_value_info("kv_cache", TP.INT64, [1]),
           oh.make_tensor_value_info("seqlens_k", TP.INT32, [B])]
    nodes = [
        oh.make_node("CacheShape", ["kv_cache"], ["key_shape"], domain=ole.DOMAIN, layer=shape_layer),
        oh.make_node("CacheShape", ["kv_cache"], ["value_shape"], domain=ole.DOMAIN, layer=shape_layer, value=1),
        oh.make_node("CacheAttention", ["q", "k", "v", "kv_cache", "", "seqlens_k"], ["y"], domain=ole.DOMAIN,
                     layer=0, q_num_heads=HQ, kv_num_heads=HKV, is_causal=1, commit_node=1),
        oh.make_node("CacheCommit", ["kv_cache", "y", "key_shape", "value_shape"], ["seq_lens"], domain=ole.DOMAIN),
    ]
    outs = [oh.make_tensor_value_info("y", TP.FLOAT, None),
            oh.make_tensor_value_info("key_shape", TP.INT64, [4]),
            oh.make_tensor_value_info("value_shape", TP.INT64, [4]),
            oh.make_tensor_value_info("seq_lens", TP.INT64, [B])]
    g = oh.make_graph(nodes, "cache_shape", ins, outs)
    return oh.make_model(g, ir_version=10, opset_imports=[oh.make_opsetid("", 21), oh.make_opsetid(ole.DOMAIN, 1)])


def _feeds(cache, s, seqlens, seed):
    rng = np.random.default_rng(seed)
    return {"q": rng.standard_normal((B, s, HQ * D), dtype=np.float32),
            "k": rng.standard_normal((B, s, HKV * D), dtype=np.float32),
            "v": rng.standard_normal((B, s, HKV * DV), dtype=np.float32),
            "kv_cache": cache.handle, "seqlens_k": np.asarray(seqlens, np.int32)}


@pytest.mark.parametrize("path", ["ep", "cpu"])
def test_cache_shape_is_the_committed_past(path, ep_session, cpu_session):
    sess = (ep_session if path == "ep" else cpu_session)(_model())
    with ole.KVCache(1, B, HKV, D, v_head_dim=DV, max_sequence_length=32) as cache:
        # prefill, right-padded: 4 and 2 valid tokens of S = 4; the run's own rows do not count
        ks, vs, lens = sess.run(["key_shape", "value_shape", "seq_lens"], _feeds(cache, 4, [3, 1], 0))
        assert ks.dtype == np.int64 and ks.tolist() == [B, HKV, 0, D] and vs.tolist() == [B, HKV, 0, DV]
        assert lens.tolist() == [4, 2]
        # rows of unequal length: P is the longest one
        ks, vs, lens = sess.run(["key_shape", "value_shape", "seq_lens"], _feeds(cache, 1, [4, 2], 1))
        assert ks.tolist() == [B, HKV, 4, D] and vs.tolist() == [B, HKV, 4, DV] and lens.tolist() == [5, 3]
        cache.truncate([2, 3])
        ks, = sess.run(["key_shape"], _feeds(cache, 1, [2, 3], 2))
        assert ks.tolist() == [B, HKV, 3, D]


def test_a_failed_run_leaves_the_shape_as_it_was(ep_session):
    sess = ep_session(_model())
    with ole.KVCache(1, B, HKV, D, v_head_dim=DV, max_sequence_length=32) as cache:
        sess.run(None, _feeds(cache, 3, [2, 2], 0))
        with pytest.raises(Exception, match="seqlens_k"):
            sess.run(None, _feeds(cache, 1, [9, 3], 1))  # 9 + 1 - 3 new rows > S = 1: the run fails
        ks, = sess.run(["key_shape"], _feeds(cache, 1, [3, 3], 2))
        assert ks.tolist() == [B, HKV, 3, D] and cache.seq_lens.tolist() == [4, 4]


def test_the_ep_refuses_a_layer_no_attention_has(ep_session):
    with pytest.raises(Exception, match="CacheShape .* has layer=1 .* but no CacheAttention node has that layer"):
        ep_session(_model(shape_layer=1))


def test_a_layer_beyond_the_cache_fails_the_run_naming_it(cpu_session):
    sess = cpu_session(_model(shape_layer=3))
    with ole.KVCache(1, B, HKV, D, v_head_dim=DV, max_sequence_length=32) as cache:
        with pytest.raises(Exception, match=r"CacheShape: attribute 'layer' \(3\) must be < num_layers"):
            sess.run(None, _feeds(cache, 2, [1, 1], 0))
        assert cache.seq_lens.tolist() == [0, 0]
