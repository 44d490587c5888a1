"""CASES.md entries whose component is "rewrite": C01 (variant), C03, C04(a), C05, C06, C10, C11, C12, C13.

Each builds a graph that reproduces the case, converts it, runs the original on
plain ORT and the conversion on the EP, and checks both against the numpy
oracle ``ref_attn`` (tests/reference.py) with the fp32 tolerances there.
"""
import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper as oh

import rw_graphs as G
import rw_harness as H
from reference import assert_close, ref_attn
from onnx_light_ep.rewrite import ConvertError, read_metadata

F = TP.FLOAT
MS = (("", 21), ("com.microsoft", 1))


def _model(nodes, inputs, outputs, opsets=(("", 23),), inits=()):
    g = oh.make_graph(nodes, "case", inputs, outputs, initializer=list(inits))
    m = oh.make_model(g, opset_imports=[oh.make_opsetid(d, v) for d, v in opsets])
    m.ir_version = 10
    return m


def vi(name, shape, elem=F):
    return oh.make_tensor_value_info(name, elem, shape)


def rng_arrays(seed, *shapes):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


# -- C01 variant: Attention without past, present requested -----------------------------------

def test_c01_attention_without_past_keeps_present_equal_to_k(tmp_path, olep):
    q, k, v = rng_arrays(1, (1, 2, 3, 4), (1, 2, 3, 4), (1, 2, 3, 4))
    m = _model([oh.make_node("Attention", ["Q", "K", "V"], ["Y", "present_key", "present_value"], is_causal=1)],
               [vi("Q", [1, 2, "S", 4]), vi("K", [1, 2, "S", 4]), vi("V", [1, 2, "S", 4])],
               [vi("Y", None), vi("present_key", None), vi("present_value", None)])
    report, src, dst = H.convert_model(m, tmp_path, "c01")
    assert report.patterns == ["Attention (no past)"] and report.layers[0]["exported"]
    assert report.kept_outputs == ["present_key", "present_value"] and not report.removed_inputs
    a, b = H.sessions(src, dst)
    ya = a.run(None, {"Q": q, "K": k, "V": v})
    with olep.KVCache.for_model(dst, 1, 8) as cache:
        y, pk, pv = b.run(["Y", "present_key", "present_value"], {"Q": q, "K": k, "V": v, "kv_cache": cache.handle})
        assert cache.seq_lens.tolist() == [3]
    assert_close(y, ref_attn(q, k, v, np.zeros((1, 2, 0, 4), np.float32), np.zeros((1, 2, 0, 4), np.float32))[0],
                 np.float32)
    assert_close(y, ya[0], np.float32)
    assert pk.shape == (1, 2, 3, 4) and np.array_equal(pk, k) and np.array_equal(pv, v)


# -- C03: seqlens_k is total - 1, synthesised from the mask row sums ---------------------------

def _gqa_graph(b, hq, hkv, d, seqlens_rank=1, **attrs):
    nodes = [oh.make_node("ReduceSum", ["attention_mask", "axes1"], ["rs"], keepdims=0),
             oh.make_node("Sub", ["rs", "one"], ["rs1"]),
             oh.make_node("Cast", ["rs1"], ["seqlens_k"], to=TP.INT32),
             oh.make_node("Shape", ["attention_mask"], ["tot64"], start=1, end=2),
             oh.make_node("Squeeze", ["tot64"], ["tot64s"]),
             oh.make_node("Cast", ["tot64s"], ["total"], to=TP.INT32)]
    sk = "seqlens_k"
    if seqlens_rank == 2:
        nodes.append(oh.make_node("Unsqueeze", ["seqlens_k", "axes1"], ["seqlens_k2"]))
        sk = "seqlens_k2"
    nodes.append(oh.make_node("GroupQueryAttention", ["q", "k", "v", "past_key", "past_value", sk, "total"],
                              ["y", "present_key", "present_value"], domain="com.microsoft", num_heads=hq,
                              kv_num_heads=hkv, **attrs))
    inits = [onnx.numpy_helper.from_array(np.array([1], np.int64), "axes1"),
             onnx.numpy_helper.from_array(np.array(1, np.int64), "one")]
    return _model(nodes, [vi("q", [b, "S", hq * d]), vi("k", [b, "S", hkv * d]), vi("v", [b, "S", hkv * d]),
                          vi("attention_mask", [b, "T"], TP.INT64), vi("past_key", [b, hkv, "P", d]),
                          vi("past_value", [b, hkv, "P", d])],
                  [vi("y", None), vi("present_key", None), vi("present_value", None)], MS, inits)


def _bnsh(x, h):
    return x.reshape(x.shape[0], x.shape[1], h, -1).transpose(0, 2, 1, 3)


@pytest.mark.parametrize("seqlens_rank", [1, 2])
def test_c03_seqlens_from_mask_row_sums(tmp_path, olep, seqlens_rank):
    B, Hq, Hkv, D = 2, 4, 2, 8
    report, src, dst = H.convert_model(_gqa_graph(B, Hq, Hkv, D, seqlens_rank), tmp_path, "c03")
    assert report.metadata["padding_side"] == "right"
    node = next(n for n in onnx.load(dst).graph.node if n.op_type == "CacheAttention")
    assert node.input[5] in ("seqlens_k", "seqlens_k2")  # the graph's own ReduceSum(mask) - 1
    q1, k1, v1 = rng_arrays(3, (B, 4, Hq * D), (B, 4, Hkv * D), (B, 4, Hkv * D))
    q2, k2, v2 = rng_arrays(4, (B, 1, Hq * D), (B, 1, Hkv * D), (B, 1, Hkv * D))
    mask1 = np.array([[1, 1, 1, 1], [1, 1, 0, 0]], np.int64)        # rows of 4 and 2, right-padded
    mask2 = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], np.int64)  # seqlens_k [4, 2]
    b = H.sessions(src, dst)[1]
    with olep.KVCache.for_model(dst, B, 8) as cache:
        y1 = b.run(None, {"q": q1, "k": k1, "v": v1, "attention_mask": mask1, "kv_cache": cache.handle})[0]
        assert cache.seq_lens.tolist() == [4, 2]
        y2 = b.run(None, {"q": q2, "k": k2, "v": v2, "attention_mask": mask2, "kv_cache": cache.handle})[0]
        assert cache.seq_lens.tolist() == [5, 3]
    for row, n in ((0, 4), (1, 2)):
        sl = slice(row, row + 1)
        exp1 = ref_attn(_bnsh(q1[sl, :n], Hq), _bnsh(k1[sl, :n], Hkv), _bnsh(v1[sl, :n], Hkv))[0]
        assert_close(_bnsh(y1[sl, :n], Hq), exp1, np.float32, f"prefill row {row}")
        exp2 = ref_attn(_bnsh(q2[sl], Hq), _bnsh(k2[sl], Hkv), _bnsh(v2[sl], Hkv),
                        _bnsh(k1[sl, :n], Hkv), _bnsh(v1[sl, :n], Hkv))[0]
        assert_close(_bnsh(y2[sl], Hq), exp2, np.float32, f"decode row {row}")
    if seqlens_rank == 1:  # ORT's own GQA agrees on the valid rows
        a = H.sessions(src, dst)[0]
        z = np.zeros((B, Hkv, 0, D), np.float32)
        ya1, pk, pv = a.run(None, {"q": q1, "k": k1, "v": v1, "attention_mask": mask1, "past_key": z,
                                   "past_value": z})
        ya2 = a.run(None, {"q": q2, "k": k2, "v": v2, "attention_mask": mask2, "past_key": pk, "past_value": pv})[0]
        assert_close(y1[1, :2], ya1[1, :2], np.float32)
        assert_close(y2, ya2, np.float32)


# -- C04: is_causal without past is upper-left -----------------------------------------------

def test_c04a_attention_without_past_query_shorter_than_key_is_refused(tmp_path):
    m = _model([oh.make_node("Attention", ["Q", "K", "V"], ["Y", "present_key", "present_value"], is_causal=1)],
               [vi("Q", [1, 1, 1, 4]), vi("K", [1, 1, 3, 4]), vi("V", [1, 1, 3, 4])],
               [vi("Y", None), vi("present_key", None), vi("present_value", None)])
    with pytest.raises(ConvertError, match="upper-left"):
        H.convert_model(m, tmp_path, "c04a")


def _concat_attention_graph(is_causal, with_mask_input=True):
    """Concat(past, new) -> Attention(is_causal) without past: the causal mask is upper-left over all keys.

    ``attention_mask`` [1, P + S] is an input the original does not read (as in exports whose mask is
    implicit); the conversion needs it for the total length of the explicit upper-left mask."""
    nodes = [oh.make_node("Concat", ["past_key", "K"], ["present_key"], axis=2),
             oh.make_node("Concat", ["past_value", "V"], ["present_value"], axis=2),
             oh.make_node("Attention", ["Q", "present_key", "present_value"], ["Y"], is_causal=is_causal)]
    inputs = [vi("Q", [1, 1, "S", 4]), vi("K", [1, 1, "S", 4]), vi("V", [1, 1, "S", 4]),
              vi("past_key", [1, 1, "P", 4]), vi("past_value", [1, 1, "P", 4])]
    if with_mask_input:
        inputs.append(vi("attention_mask", [1, "T"], TP.INT64))
    return _model(nodes, inputs, [vi("Y", None), vi("present_key", None), vi("present_value", None)])


def test_c04a_stateless_causal_attention_on_concat_stays_upper_left(tmp_path):
    """Attention(Q, K[0:3], V[0:3], is_causal=1) without past: the query sees key 0 only (Y == V[0])."""
    report, src, dst = H.convert_model(_concat_attention_graph(1), tmp_path, "c04")
    assert report.patterns == ["Concat+Attention"] and report.layers[0]["attrs"]["is_causal"] == 0
    q, k, v = rng_arrays(5, (1, 1, 1, 4), (1, 1, 3, 4), (1, 1, 3, 4))
    q0 = rng_arrays(6, (1, 1, 2, 4))[0]
    steps = [{"Q": q0, "K": k[:, :, :2], "V": v[:, :, :2], "attention_mask": np.ones((1, 2), np.int64)},
             {"Q": q, "K": k[:, :, 2:], "V": v[:, :, 2:], "attention_mask": np.ones((1, 3), np.int64)}]
    oa, ob, lengths = H.run_pair(src, dst, report, steps, 1)
    assert lengths == [[2], [3]]
    assert_close(oa[1]["Y"], v[:, :, :1], np.float32, "original: upper-left")
    assert_close(ob[1]["Y"], v[:, :, :1], np.float32, "converted keeps upper-left")
    assert_close(ob[0]["Y"], oa[0]["Y"], np.float32)


def test_c04a_upper_left_without_total_length_is_refused(tmp_path):
    with pytest.raises(ConvertError, match="upper-left"):
        H.convert_model(_concat_attention_graph(1, with_mask_input=False), tmp_path, "c04n")


def test_c04b_attention_with_past_is_bottom_right(tmp_path):
    nodes = [oh.make_node("Attention", ["Q", "K", "V", "", "past_key", "past_value"],
                          ["Y", "present_key", "present_value"], is_causal=1)]
    m = _model(nodes, [vi("Q", [1, 1, "S", 4]), vi("K", [1, 1, "S", 4]), vi("V", [1, 1, "S", 4]),
                       vi("past_key", [1, 1, "P", 4]), vi("past_value", [1, 1, "P", 4])],
               [vi("Y", None), vi("present_key", None), vi("present_value", None)])
    report, src, dst = H.convert_model(m, tmp_path, "c04b")
    q, k, v = rng_arrays(7, (1, 1, 1, 4), (1, 1, 3, 4), (1, 1, 3, 4))
    q0 = rng_arrays(8, (1, 1, 2, 4))[0]
    steps = [{"Q": q0, "K": k[:, :, :2], "V": v[:, :, :2]}, {"Q": q, "K": k[:, :, 2:], "V": v[:, :, 2:]}]
    oa, ob, _ = H.run_pair(src, dst, report, steps, 1)
    exp = ref_attn(q, k[:, :, 2:], v[:, :, 2:], k[:, :, :2], v[:, :, :2])[0]
    assert_close(ob[1]["Y"], exp, np.float32)
    assert_close(oa[1]["Y"], exp, np.float32)


# -- C05: GQA expansion is repeat-interleave ---------------------------------------------------

def _decomposed_gqa_graph(hq, hkv, d, tile=False):
    g = G.GB(0)
    q = g.inp("Q", F, [1, hq, "S", d])
    k = g.inp("K", F, [1, hkv, "S", d])
    v = g.inp("V", F, [1, hkv, "S", d])
    pk, pv, prk, prv = g.past_io(0, hkv, d)
    g.node("Concat", [pk, k], axis=2, out=prk)
    g.node("Concat", [pv, v], axis=2, out=prv)
    kx, vx = g.repeat_kv(prk, hkv, hq // hkv, d, tile=tile), g.repeat_kv(prv, hkv, hq // hkv, d, tile=tile)
    s = g.node("Mul", [g.node("MatMul", [q, g.node("Transpose", [kx], perm=[0, 1, 3, 2])]), g.f32(1 / math.sqrt(d))])
    g.node("MatMul", [g.node("Softmax", [s], axis=-1), vx], out="Y")
    g.out("Y", F, None)
    return g.model([("", 18)])


def test_c05_head_expansion_interleave(tmp_path):
    report, src, dst = H.convert_model(_decomposed_gqa_graph(4, 2, 2), tmp_path, "c05")
    q = np.ones((1, 4, 1, 2), np.float32)
    k = np.zeros((1, 2, 1, 2), np.float32)
    v = np.stack([np.zeros((1, 2)), np.ones((1, 2))])[None].astype(np.float32)  # kv head 0: 0, head 1: 1
    oa, ob, _ = H.run_pair(src, dst, report, [{"Q": q, "K": k, "V": v}], 1)
    assert_close(ob[0]["Y"][0, :, 0, 0], np.array([0, 0, 1, 1], np.float32), np.float32)
    assert_close(oa[0]["Y"], ob[0]["Y"], np.float32)


@pytest.mark.parametrize("hq,hkv", [(6, 3), (8, 2)])
def test_c05_random_gqa_shapes(tmp_path, hq, hkv):
    report, src, dst = H.convert_model(_decomposed_gqa_graph(hq, hkv, 4), tmp_path, "c05r")
    steps = []
    for s, seed in ((3, 10), (1, 11), (1, 12)):
        q, k, v = rng_arrays(seed, (1, hq, s, 4), (1, hkv, s, 4), (1, hkv, s, 4))
        steps.append({"Q": q, "K": k, "V": v})
    oa, ob, lengths = H.run_pair(src, dst, report, steps, 1)
    assert lengths == [[3], [4], [5]]
    for a, b in zip(oa, ob):
        assert_close(b["Y"], a["Y"], np.float32)


def test_c05_tile_expansion_is_refused(tmp_path):
    with pytest.raises(ConvertError, match="tiles the kv heads"):
        H.convert_model(_decomposed_gqa_graph(4, 2, 2, tile=True), tmp_path, "c05t")


# -- C06: sliding window recorded ----------------------------------------------------------------

def test_c06_gqa_window_in_op_and_metadata(tmp_path, olep):
    B, H1, D = 1, 1, 8
    report, src, dst = H.convert_model(_gqa_graph(B, H1, H1, D, local_window_size=3), tmp_path, "c06")
    assert report.layers[0]["attrs"]["local_window_size"] == 3
    assert read_metadata(dst)["layers"][0]["local_window_size"] == 3
    q, k, v = rng_arrays(13, (1, 6, D), (1, 6, D), (1, 6, D))
    steps = [{"q": q[:, :5], "k": k[:, :5], "v": v[:, :5], "attention_mask": np.ones((1, 5), np.int64)},
             {"q": q[:, 5:], "k": k[:, 5:], "v": v[:, 5:], "attention_mask": np.ones((1, 6), np.int64)}]
    oa, ob, _ = H.run_pair(src, dst, report, steps, 1)
    q4, k4, v4 = _bnsh(q, 1), _bnsh(k, 1), _bnsh(v, 1)
    assert_close(_bnsh(ob[1]["y"], 1), ref_attn(q4[:, :, 5:], k4[:, :, 5:], v4[:, :, 5:], k4[:, :, :5], v4[:, :, :5],
                                                window=3)[0], np.float32, "decode sees keys 3, 4, 5")
    assert_close(_bnsh(ob[0]["y"], 1), ref_attn(q4[:, :, :5], k4[:, :, :5], v4[:, :, :5], window=3)[0], np.float32)
    assert_close(ob[1]["y"], oa[1]["y"], np.float32)


def test_c06_for_model_turns_on_the_recorded_windows(tmp_path, olep):
    """KVCache.for_model reads each layer's local_window_size from the metadata: a windowed model's
    cache evicts by itself (bounded memory with no option passed); an explicit sliding_window wins."""
    model = G.decoder(G.gqa_block, layers=2, window=40)
    report, src, dst = H.convert_model(model, tmp_path, "c06fm")
    assert [x["local_window_size"] for x in read_metadata(dst)["layers"]] == [40, 40]
    with olep.KVCache.for_model(dst, 1, 512, page_tokens=32) as c:
        assert c.sliding_window == [40, 40]
    with olep.KVCache.for_model(dst, 1, 512, sliding_window=None) as c:
        assert c.sliding_window is None
    _, _, dst2 = H.convert_model(G.decoder(G.gqa_block, layers=2), tmp_path, "c06fm2")
    with olep.KVCache.for_model(dst2, 1, 64) as c:
        assert c.sliding_window is None


def test_c06_window_for_decomposed_export_recorded_from_option(tmp_path):
    model = G.decoder(G.decomposed_block, opsets=(("", 18),))
    report, src, dst = H.convert_model(model, tmp_path, "c06d", sliding_window=3)
    assert all(x["attrs"]["local_window_size"] == 3 for x in report.layers)
    assert [x["local_window_size"] for x in read_metadata(dst)["layers"]] == [3]


# -- C10: scale resolution ----------------------------------------------------------------------

def test_c10a_packed_qkv_default_scale_uses_head_size(tmp_path, olep):
    hq, hkv, d = 4, 2, 8
    nodes = [oh.make_node("GroupQueryAttention", ["qkv", "", "", "past_key", "past_value", "seqlens_k", "total"],
                          ["y", "present_key", "present_value"], domain="com.microsoft", num_heads=hq,
                          kv_num_heads=hkv)]
    m = _model(nodes, [vi("qkv", [1, "S", (hq + 2 * hkv) * d]), vi("past_key", [1, hkv, "P", d]),
                       vi("past_value", [1, hkv, "P", d]), vi("seqlens_k", [1], TP.INT32),
                       vi("total", [], TP.INT32)],
               [vi("y", None), vi("present_key", None), vi("present_value", None)], MS)
    report, src, dst = H.convert_model(m, tmp_path, "c10a")
    assert report.layers[0]["attrs"]["scale"] == pytest.approx(1 / math.sqrt(8))  # not 1/sqrt(16)
    qkv = rng_arrays(14, (1, 3, 64))[0]
    feeds = {"qkv": qkv, "seqlens_k": np.array([2], np.int32), "total": np.array(3, np.int32)}
    oa, ob, _ = H.run_pair(src, dst, report, [feeds], 1)
    q, k, v = _bnsh(qkv[..., :32], hq), _bnsh(qkv[..., 32:48], hkv), _bnsh(qkv[..., 48:], hkv)
    assert_close(_bnsh(ob[0]["y"], hq), ref_attn(q, k, v)[0], np.float32)
    assert_close(ob[0]["y"], oa[0]["y"], np.float32)


def test_c10b_scale_is_the_product_on_the_qk_path(tmp_path):
    model = G.decoder(G.decomposed_block, style="c10b", opsets=(("", 18),))
    report, src, dst = H.convert_model(model, tmp_path, "c10b")
    assert report.layers[0]["attrs"]["scale"] == 0.5
    H.greedy_steps(src, dst, report, [[3, 4, 5, 6, 7]], 4)


# -- C11: 3-D inputs with present ---------------------------------------------------------------

def test_c11_three_d_inputs_layout(tmp_path, olep):
    Q = (np.arange(8, dtype=np.float32) / 4).reshape(1, 2, 4)
    K = (np.arange(8, dtype=np.float32)[::-1] / 4).reshape(1, 2, 4).copy()
    V = np.arange(8, dtype=np.float32).reshape(1, 2, 4)
    m = _model([oh.make_node("Attention", ["Q", "K", "V"], ["Y", "present_key", "present_value"], is_causal=0,
                             q_num_heads=2, kv_num_heads=2)],
               [vi("Q", [1, "S", 4]), vi("K", [1, "S", 4]), vi("V", [1, "S", 4])],
               [vi("Y", None), vi("present_key", None), vi("present_value", None)])
    report, src, dst = H.convert_model(m, tmp_path, "c11")
    t = lambda x: x.reshape(1, 2, 2, 2).transpose(0, 2, 1, 3)  # noqa: E731
    expected = ref_attn(t(Q), t(K), t(V), causal=False)[0].transpose(0, 2, 1, 3).reshape(1, 2, 4)
    oa, ob, _ = H.run_pair(src, dst, report, [{"Q": Q, "K": K, "V": V}], 1)
    assert_close(ob[0]["Y"], expected, np.float32)
    assert_close(oa[0]["Y"], expected, np.float32)
    assert ob[0]["present_key"].shape == (1, 2, 2, 2)
    assert np.array_equal(ob[0]["present_key"], t(K))


# -- C12: rank-3 mask broadcast ------------------------------------------------------------------

def test_c12_rank3_mask_broadcasts_over_batch(tmp_path):
    nodes = [oh.make_node("Attention", ["Q", "K", "V", "mask", "past_key", "past_value"],
                          ["Y", "present_key", "present_value"], is_causal=0)]
    m = _model(nodes, [vi("Q", [2, 2, "S", 4]), vi("K", [2, 2, "S", 4]), vi("V", [2, 2, "S", 4]),
                       vi("mask", ["mh", "S", "T"]), vi("past_key", [2, 2, "P", 4]), vi("past_value", [2, 2, "P", 4])],
               [vi("Y", None), vi("present_key", None), vi("present_value", None)])
    report, src, dst = H.convert_model(m, tmp_path, "c12")
    q0, k0, v0 = rng_arrays(15, (2, 2, 2, 4), (2, 2, 2, 4), (2, 2, 2, 4))
    q, k, v = rng_arrays(16, (2, 2, 1, 4), (2, 2, 1, 4), (2, 2, 1, 4))
    mask = np.array([[[0, 0, -np.inf]], [[0, -np.inf, 0]]], np.float32)  # (2, 1, 3): per head
    steps = [{"Q": q0, "K": k0, "V": v0, "mask": np.zeros((2, 2, 2), np.float32)},
             {"Q": q, "K": k, "V": v, "mask": mask}]
    oa, ob, _ = H.run_pair(src, dst, report, steps, 2)
    exp = ref_attn(q, k, v, k0, v0, causal=False, add_mask=mask[None])[0]
    assert_close(ob[1]["Y"], exp, np.float32)
    assert_close(oa[1]["Y"], exp, np.float32)


# -- C13: dim names are not trusted -----------------------------------------------------------------

def test_c13_misleading_dim_names(tmp_path):
    model = G.decoder(G.decomposed_block, hq=2, hkv=2, d=4, opsets=(("", 18),),
                      mask_dims=("batch_size", "past_sequence_length + 1"),
                      seq_dims=("past_sequence_length", "past_sequence_length + 1"))
    report, src, dst = H.convert_model(model, tmp_path, "c13")
    ids = np.array([[3, 4, 5, 6, 7]], np.int64)
    steps = [{"input_ids": ids, "attention_mask": np.ones((1, 5), np.int64)},
             {"input_ids": np.array([[8]]), "attention_mask": np.ones((1, 6), np.int64)}]
    oa, ob, lengths = H.run_pair(src, dst, report, steps, 1)
    assert lengths == [[5], [6]]
    assert oa[0]["present_key_0"].shape[2] == 5 and oa[1]["present_key_0"].shape[2] == 6
    for a, b in zip(oa, ob):
        assert_close(b["logits"], a["logits"], np.float32)
