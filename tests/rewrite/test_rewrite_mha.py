"""ONNX Runtime's contrib attentions with a cache: ``com.microsoft.MultiHeadAttention`` (past_key/past_value)
and ``com.microsoft.Attention`` (QKV projection inside, stacked past [2, B, N, P, D]).

Every variant that converts: the original on plain ORT (CPUExecutionProvider, presents fed back) against
the conversion on the EP with a KVCache, prefill of 9 tokens + 24 greedy steps, batch 1 and a left-padded
batch 2 (the masks carry the padding), fp32 logits within 1e-4 at every real position, same argmax
(rw_harness.greedy_steps). Every variant that does not: convert names the reason.
"""
import functools

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper as oh

import rw_graphs as G
import rw_harness as H
import rw_mha_graphs as M
import onnx_light_ep as ole
from onnx_light_ep.rewrite import ConvertError

MS_OPSETS = (("", 17), ("com.microsoft", 1))
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13]
STEPS = 24


def mha(**kw):
    return functools.partial(G.decoder, M.mha_block, hq=4, hkv=4, d=8, opsets=MS_OPSETS, **kw)


def attention(**kw):
    return functools.partial(M.ms_attention_decoder, **kw)


CONVERTS = {
    # what ORT's rotary attention fusion writes: attention_bias from the transformers mask, no unidirectional
    "mha_attention_bias": mha(mask="bias"),
    "mha_kpm2d_causal": mha(mask="kpm2d", unidirectional=1),
    "mha_kpm2d_bias_scale_mfv": mha(mask="kpm2d", unidirectional=1, bias=True, scale=0.2, mask_filter_value=-2.0),
    "mha_kpm3d_causal": mha(mask="kpm3d", unidirectional=1),
    "mha_bias_and_attention_bias": mha(mask="bias", bias=True),
    # what ORT's GPT-2 tool writes: raw [B, T] mask, unidirectional, mask_filter_value = finfo.min
    "attention_2d_fmin": attention(mask="2d", mask_filter_value=M.FMIN),
    "attention_2d_default_mfv": attention(mask="2d"),
    "attention_2d_small_mfv": attention(mask="2d", mask_filter_value=-2.0),
    "attention_3d": attention(mask="3d"),
    "attention_nomask_nobias_scale": attention(mask="", bias=False, scale=0.25),
    "attention_qkv_hidden_sizes": attention(qkv_hidden_sizes=[32, 32, 32]),
    "attention_bidirectional": attention(mask="2d", unidirectional=0),
}
PATTERN = {"mha": "MultiHeadAttention", "attention": "com.microsoft.Attention"}


@pytest.mark.parametrize("name", sorted(CONVERTS))
@pytest.mark.parametrize("batch", [1, 2])
def test_variant_matches_plain_ort(name, batch, tmp_path):
    report, src, dst = H.convert_model(CONVERTS[name](layers=2), tmp_path, name)
    assert report.patterns == [PATTERN[name.split("_")[0]]] and not report.refused
    assert report.num_layers == 2 and report.metadata["padding_side"] == "left"
    if name.startswith("attention"):  # one stacked [2, B, N, P, D] tensor per layer
        assert report.removed_inputs == ["past_0", "past_1"] and report.removed_outputs == ["present_0", "present_1"]
        assert [(x["past_key"], x["past_value"]) for x in report.layers] == [("past_0", "past_0"), ("past_1", "past_1")]
    else:
        assert len(report.removed_inputs) == len(report.removed_outputs) == 4
    rows = [PROMPT] if batch == 1 else [PROMPT, PROMPT[4:]]
    worst, gen = H.greedy_steps(src, dst, report, rows, STEPS, padding="left", atol=1e-4)
    assert len(gen[0]) == STEPS + 1
    ops = [n.op_type for n in onnx.load(dst).graph.node]
    assert ops.count("CacheAttention") == 2
    assert not {"Attention", "MultiHeadAttention"} & set(ops)


def test_mha_1d_end_positions_equal_rows(tmp_path):
    """key_padding_mask [B] (end positions = valid lengths): rows of equal length."""
    report, src, dst = H.convert_model(mha(mask="kpm1d", unidirectional=1)(layers=2), tmp_path, "kpm1d")
    assert report.patterns == ["MultiHeadAttention"]
    H.greedy_steps(src, dst, report, [PROMPT, PROMPT[::-1]], 16, padding="left", atol=1e-4)


def test_stacked_present_kept_through_cache_export(tmp_path):
    """keep_present on a stacked present: CacheExport's key and value stacked back into [2, B, N, T, D],
    over a prefill and a decode step (the present then holds the cached rows too)."""
    report, src, dst = H.convert_model(attention()(layers=2), tmp_path, "keep", keep_present=["present_1"])
    assert report.kept_outputs == ["present_1"] and report.layers[1]["exported"]
    assert report.removed_outputs == ["present_0"]
    a, b = H.sessions(src, dst)
    names_a, names_b = [o.name for o in a.get_outputs()], [o.name for o in b.get_outputs()]
    pasts = {f"past_{l}": np.zeros((2, 1, 4, 0, 8), np.float32) for l in range(2)}
    with ole.KVCache.for_model(dst, 1, 32) as cache:
        for ids in (np.array([PROMPT], np.int64), np.array([[3]], np.int64)):
            total = sum(p.shape[3] for p in pasts.values()) // 2 + ids.shape[1]
            feeds = {"input_ids": ids, "attention_mask": np.ones((1, total), np.int64)}
            ra = dict(zip(names_a, a.run(None, dict(feeds, **pasts))))
            rb = dict(zip(names_b, b.run(None, dict(feeds, kv_cache=cache.handle))))
            pasts = {f"past_{l}": ra[f"present_{l}"] for l in range(2)}
            assert rb["present_1"].shape == ra["present_1"].shape == (2, 1, 4, total, 8)
            assert np.abs(rb["present_1"] - ra["present_1"]).max() <= 1e-5
            assert np.abs(rb["logits"] - ra["logits"]).max() <= 1e-4


# -- refusals -------------------------------------------------------------------------------------

def _refused(model, tmp_path, *words):
    with pytest.raises(ConvertError) as e:
        H.convert_model(model, tmp_path, "refused")
    for w in words:
        assert w in str(e.value), str(e.value)
    return str(e.value)


def _with_node_change(model, op, fn):
    for n in model.graph.node:
        if n.op_type == op:
            fn(n)
    return model


@pytest.mark.parametrize("case, make, words", [
    ("share_buffer", lambda: attention(past_present_share_buffer=1)(layers=1), ["past_present_share_buffer"]),
    ("do_rotary", lambda: attention(do_rotary=1)(layers=1), ["do_rotary=1", "CPU"]),
    ("megatron_mask", lambda: attention(mask="4d", unidirectional=0)(layers=1), ["Megatron", "rank 4"]),
    ("unequal_hidden", lambda: attention(qkv_hidden_sizes=[32, 32, 64])(layers=1), ["qkv_hidden_sizes", "equal"]),
])
def test_attention_refusals(case, make, words, tmp_path):
    _refused(make(), tmp_path, "com.microsoft.Attention", *words)


def test_attention_bias_with_past_refused(tmp_path):
    m = attention()(layers=1)
    m.graph.initializer.append(onnx.numpy_helper.from_array(np.zeros((1, 4, 1, 1), np.float32), "ab"))
    _with_node_change(m, "Attention", lambda n: n.input.append("ab"))
    _refused(m, tmp_path, "attention_bias together with past")


def test_attention_1d_mask_of_unknown_length_refused(tmp_path):
    m = attention(mask="1d")(layers=1)
    ab = oh.make_tensor_value_info("end_positions", TP.INT32, ["n_positions"])  # [B], [2B] or [3B+2]?
    m.graph.input.append(ab)
    _with_node_change(m, "Attention", lambda n: n.input.__setitem__(3, "end_positions"))
    _refused(m, tmp_path, "not provably [batch]")


def test_attention_1d_mask_of_batch_length_converts(tmp_path):
    report, src, dst = H.convert_model(attention(mask="1d")(layers=2), tmp_path, "a1d")
    assert report.patterns == ["com.microsoft.Attention"]
    H.greedy_steps(src, dst, report, [PROMPT, PROMPT[::-1]], 16, padding="left", atol=1e-4)


def _mha_model(**kw):
    return mha(**kw)(layers=1)


def test_mha_past_sequence_length_refused(tmp_path):
    m = _mha_model(mask="", extra_inputs=["psl"])
    m.graph.input.append(oh.make_tensor_value_info("psl", TP.INT32, [1]))
    _refused(m, tmp_path, "MultiHeadAttention", "past_sequence_length")


def test_mha_cache_indirection_refused(tmp_path):
    m = _mha_model(mask="", extra_inputs=["", "cache_indirection"])
    m.graph.input.append(oh.make_tensor_value_info("cache_indirection", TP.INT32, ["batch", 1, 64]))
    _refused(m, tmp_path, "cache_indirection")


def test_mha_qk_output_refused(tmp_path):
    _refused(_mha_model(mask="", qk_output=True), tmp_path, "output qk is used")


def test_mha_packed_qkv_and_bnsh_key_refused(tmp_path):
    m = _mha_model(mask="")
    g = m.graph
    node = next(n for n in g.node if n.op_type == "MultiHeadAttention")
    # packed QKV [B, S, N, 3, H]: Reshape the query to 5-D and drop key/value
    g.initializer.append(onnx.numpy_helper.from_array(np.array([0, 0, 4, 3, 8], np.int64), "packed_shape"))
    cat = oh.make_node("Concat", [node.input[0], node.input[1], node.input[2]], ["qkv3"], axis=-1)
    g.node.insert(list(g.node).index(node), cat)
    g.node.insert(list(g.node).index(node), oh.make_node("Reshape", ["qkv3", "packed_shape"], ["qkv5"]))
    node.input[0], node.input[1], node.input[2] = "qkv5", "", ""
    _refused(m, tmp_path, "packed QKV")
    m2 = _mha_model(mask="")
    node = next(n for n in m2.graph.node if n.op_type == "MultiHeadAttention")
    m2.graph.initializer.append(onnx.numpy_helper.from_array(np.array([0, 0, 4, 8], np.int64), "bsnh"))
    for i, t in ((1, "kb"), (2, "vb")):
        r = oh.make_node("Reshape", [node.input[i], "bsnh"], [t + "_r"])
        tr = oh.make_node("Transpose", [t + "_r"], [t], perm=[0, 2, 1, 3])
        m2.graph.node.insert(list(m2.graph.node).index(node), r)
        m2.graph.node.insert(list(m2.graph.node).index(node), tr)
        node.input[i] = t
    _refused(m2, tmp_path, "BNSH", "cross-attention")


def test_mha_present_without_past_refused_and_stateless_ignored(tmp_path):
    m = _mha_model(mask="")
    node = next(n for n in m.graph.node if n.op_type == "MultiHeadAttention")
    del node.input[6:]
    del m.graph.input[2:]
    _refused(m, tmp_path, "without past_key/past_value")
    del node.output[1:]
    del m.graph.output[1:]
    msg = _refused(m, tmp_path, "no attention with a loop-carried KV cache")
    assert "MultiHeadAttention" in msg  # the list of patterns looked for names it


def test_mha_one_past_refused(tmp_path):
    m = _mha_model(mask="")
    node = next(n for n in m.graph.node if n.op_type == "MultiHeadAttention")
    node.input[7] = ""
    _refused(m, tmp_path, "only one of past_key/past_value")


def _ort_cpu_error(attrs, extra):
    """Run one ``com.microsoft.Attention`` (past of length 1) on plain ORT CPU; the run must fail: its message."""
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((1, 2, 8)).astype(np.float32),
             "w": rng.standard_normal((8, 24)).astype(np.float32), "past": np.zeros((2, 1, 2, 1, 4), np.float32)}
    ins = ["x", "w", "", "", "past", "", ""]
    for pos, (name, value) in extra.items():
        ins[pos] = name
        feeds[name] = value
    elem = {np.dtype(np.float32): TP.FLOAT, np.dtype(np.int32): TP.INT32}
    node = oh.make_node("Attention", ins, ["y", "present"], domain="com.microsoft", num_heads=2, **attrs)
    g = oh.make_graph([node], "g", [oh.make_tensor_value_info(k, elem[v.dtype], v.shape) for k, v in feeds.items()],
                      [oh.make_tensor_value_info(n, TP.FLOAT, None) for n in ("y", "present")])
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("com.microsoft", 1)])
    s = ort.InferenceSession(m.SerializeToString(), H.so(), providers=["CPUExecutionProvider"])
    with pytest.raises(Exception) as e:
        s.run(None, feeds)
    return str(e.value)


@pytest.mark.parametrize("attrs, extra, words", [
    ({"do_rotary": 1, "unidirectional": 1}, {}, "Rotary embedding is not supported"),
    ({"unidirectional": 1}, {5: ("ab", np.zeros((1, 2, 2, 3), np.float32))},
     "cannot have both past and attention_bias"),
    ({"unidirectional": 0}, {3: ("m4", np.ones((1, 1, 8, 8), np.int32))}, "4D mask in attention cpu kernel"),
    ({"unidirectional": 1, "past_present_share_buffer": 1},
     {3: ("m", np.ones((1, 8), np.int32)), 6: ("psl", np.array([1], np.int32))}, "past_present_share_buffer"),
])
def test_refusals_citing_the_cpu_kernel_are_what_it_rejects(attrs, extra, words):
    """The refusals that say ORT's CPU kernel does not run a variant: it really does not (ORT 1.32)."""
    assert words in _ort_cpu_error(attrs, extra)
