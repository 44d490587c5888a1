"""EP tensor mode, ONNX Attention beyond the decode-loop shapes: the qk_matmul_output 4th output
in every qk_matmul_output_mode, bfloat16, attn_mask shorter than the keys, and the nodes the EP
leaves to ORT.

Oracle: ``spec_attention`` below, float64 numpy written from the opset-23/24 text of the
installed onnx (``onnx.defs.get_schema("Attention", 24).doc`` and the attribute texts): scores
scale * Q.K^T ("Q*sqrt(scale) . K*sqrt(scale)"); softcap * tanh(x / softcap) before the bias;
bias = attn_mask (bool: 0 / -inf; float: added; "the last dimension can also be shorter than
total_sequence_length and will be padded ... with negative infinity") + causal (-inf where
j > i + offset, offset = past length, nonpad_kv_seqlen - S, or 0) + -inf for keys at or past
nonpad_kv_seqlen; softmax; a fully-masked row is a zero row for Y and mode 3; mode 0 = the raw
matmul, 1 = after softcap, 2 = after softcap and bias, 3 = the softmax. (onnx's reference
op_attention.py returns the soft-capped scores in mode 0; its function body and the text say
raw: ``test_mode0_with_softcap_is_the_raw_matmul`` checks the EP against the function body.)

Inputs are rounded to the dtype first; the oracle sees the rounded values. Tolerances
(tests/reference.py): float32 atol 1e-5 rtol 1e-4; float16/bfloat16 atol 2e-2 rtol 2e-2; -inf
positions of mode 2 must match exactly. Every test asserts from ORT's profile which provider ran
the node. Runs once per ISA level (tests/differential/conftest.py)."""
import json
import zlib

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import onnx_light_ep
from ort_utils import new_session_options, run
from reference import BF16, tol

EP = onnx_light_ep.EP_NAME
CPU = "CPUExecutionProvider"
ONNX_TYPE = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
NP_TYPE = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BF16}


def spec_attention(q, k, v, *, mask=None, past_k=None, past_v=None, nonpad=None, is_causal=0, scale=None,
                   softcap=0.0, mode=0):
    """(Y, present_key, present_value, qk_matmul_output) in float64 for BNSH inputs (see module text)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    if past_k is not None:
        k = np.concatenate([np.asarray(past_k, np.float64), k], axis=2)
        v = np.concatenate([np.asarray(past_v, np.float64), v], axis=2)
    B, Hq, S, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    bias = np.zeros((B, Hq, S, T))
    if mask is not None:
        m = np.asarray(mask)
        m = np.where(m, 0.0, -np.inf) if m.dtype == bool else m.astype(np.float64)
        if m.shape[-1] < T:
            m = np.concatenate([m, np.full(m.shape[:-1] + (T - m.shape[-1],), -np.inf)], axis=-1)
        bias = bias + m
    if past_k is not None:
        offset = np.full(B, past_k.shape[2])
    elif nonpad is not None:
        offset = np.asarray(nonpad) - S
    else:
        offset = np.zeros(B, np.int64)
    i, j = np.arange(S)[:, None], np.arange(T)[None, :]
    if is_causal:
        bias = bias + np.where(j[None] <= i[None] + offset[:, None, None], 0.0, -np.inf)[:, None]
    if nonpad is not None:
        bias = bias + np.where(j[0][None, :] < np.asarray(nonpad)[:, None], 0.0, -np.inf)[:, None, None, :]
    kk = np.repeat(k, Hq // Hkv, axis=1)
    vv = np.repeat(v, Hq // Hkv, axis=1)
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    raw = scale * q @ kk.transpose(0, 1, 3, 2)
    capped = softcap * np.tanh(raw / softcap) if softcap > 0 else raw
    x = capped + bias
    dead = np.isneginf(bias).all(axis=-1, keepdims=True)
    xm = np.where(dead, 0.0, x.max(axis=-1, keepdims=True))
    e = np.exp(x - xm)
    p = np.where(dead, 0.0, e / np.where(dead, 1.0, e.sum(axis=-1, keepdims=True)))
    qk = {0: raw, 1: capped, 2: x, 3: p}[mode]
    return p @ vv, k, v, qk


def attention_model(dtype, *, mask=None, past=False, nonpad=False, qk=True, opset=None, **attrs):
    """One ONNX Attention node: Q, K, V [, attn_mask] [, past_key, past_value] [, nonpad_kv_seqlen];
    Y [, present_key, present_value] [, qk_matmul_output]. `mask`: None, "bool" or a float dtype name."""
    t = ONNX_TYPE[dtype]
    vi = helper.make_tensor_value_info
    names = ["Q", "K", "V", "attn_mask" if mask else "", "past_key" if past else "", "past_value" if past else "",
             "nonpad_kv_seqlen" if nonpad else ""]
    while names[-1] == "":
        names.pop()
    ins = [vi(n, t, None) for n in ("Q", "K", "V")]
    if mask:
        ins.append(vi("attn_mask", TensorProto.BOOL if mask == "bool" else ONNX_TYPE[mask], None))
    if past:
        ins += [vi("past_key", t, None), vi("past_value", t, None)]
    if nonpad:
        ins.append(vi("nonpad_kv_seqlen", TensorProto.INT64, None))
    outs = ["Y", "present_key" if past else "", "present_value" if past else ""] + (["qk_matmul_output"] if qk else [])
    while outs[-1] == "":
        outs.pop()
    node = helper.make_node("Attention", names, outs, **attrs)
    g = helper.make_graph([node], "g", ins, [vi(n, t, None) for n in outs if n])
    version = opset or (24 if nonpad else 23)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", version)], ir_version=10)


def node_providers(sess):
    with open(sess.end_profiling()) as f:
        events = json.load(f)
    return {e["args"]["provider"] for e in events if e.get("cat") == "Node" and "provider" in e.get("args", {})}


def ep_run(model, feeds, tmp_path):
    sess = onnx_light_ep.InferenceSession(model.SerializeToString(), new_session_options(tmp_path))
    out = run(sess, feeds)
    return out, node_providers(sess)


def assert_matches(actual, expected, dtype, what):
    atol, rtol = tol(dtype)
    a = np.asarray(actual).astype(np.float64)
    assert a.shape == expected.shape, f"{what}: shape {a.shape} != {expected.shape}"
    assert np.array_equal(np.isneginf(a), np.isneginf(expected)), f"{what}: -inf positions differ"
    fin = ~np.isneginf(expected)
    np.testing.assert_allclose(a[fin], expected[fin], atol=atol, rtol=rtol, err_msg=what)


def rounded(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(NP_TYPE[dtype])


# (id, B, Hq, Hkv, S, kv, past, D, mask, mask_shape, is_causal, softcap, nonpad)
SCENARIOS = [
    ("mha-causal-past-floatmask", 2, 3, 3, 4, 6, 5, 8, "float", (2, 1, 4, 11), 1, 0.0, None),
    ("gqa-causal-boolmask-softcap", 1, 8, 2, 3, 3, 4, 16, "bool", (3, 7), 1, 2.0, None),
    ("mqa-nocausal-boolmask4d", 2, 4, 1, 2, 5, 0, 8, "bool", (2, 4, 2, 5), 0, 0.0, None),
    ("gqa-nonpad-causal-shortmask", 2, 4, 2, 3, 8, 0, 8, "float", (2, 1, 3, 6), 1, 0.0, [6, 4]),
    ("decode-past-nomask-softcap", 2, 4, 2, 1, 1, 9, 32, None, None, 1, 5.0, None),
]


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("sc", SCENARIOS, ids=lambda s: s[0])
def test_qk_matmul_output_every_mode(sc, dtype, mode, tmp_path):
    """Y, presents and qk_matmul_output on the EP against the spec oracle."""
    _, B, Hq, Hkv, S, kv, P, D, mask, mshape, causal, softcap, nonpad = sc
    rng = np.random.default_rng(zlib.crc32(f"{sc[0]}-{dtype}-{mode}".encode()))
    feeds = {"Q": rounded(rng, (B, Hq, S, D), dtype, 2.0), "K": rounded(rng, (B, Hkv, kv, D), dtype, 2.0),
             "V": rounded(rng, (B, Hkv, kv, D), dtype)}
    if P:
        feeds["past_key"] = rounded(rng, (B, Hkv, P, D), dtype, 2.0)
        feeds["past_value"] = rounded(rng, (B, Hkv, P, D), dtype)
    if mask == "bool":
        feeds["attn_mask"] = rng.random(mshape) > 0.3
    elif mask:
        feeds["attn_mask"] = rounded(rng, mshape, dtype)
    if nonpad is not None:
        feeds["nonpad_kv_seqlen"] = np.array(nonpad, np.int64)
    attrs = {"qk_matmul_output_mode": mode, "is_causal": causal}
    if softcap:
        attrs["softcap"] = softcap
    model = attention_model(dtype, mask=mask and ("bool" if mask == "bool" else dtype), past=bool(P),
                            nonpad=nonpad is not None, **attrs)
    out, providers = ep_run(model, feeds, tmp_path)
    y, pk, pv, qk = spec_attention(feeds["Q"], feeds["K"], feeds["V"], mask=feeds.get("attn_mask"),
                                   past_k=feeds.get("past_key"), past_v=feeds.get("past_value"), nonpad=nonpad,
                                   is_causal=causal, softcap=softcap, mode=mode)
    assert providers == {EP}
    assert_matches(out["Y"], y, dtype, "Y")
    assert_matches(out["qk_matmul_output"], qk, dtype, f"qk_matmul_output mode {mode}")
    assert out["qk_matmul_output"].dtype == NP_TYPE[dtype]
    if P:
        assert np.array_equal(out["present_key"].astype(np.float64), pk)
        assert np.array_equal(out["present_value"].astype(np.float64), pv)
    if mode == 2 and sc[0] != "decode-past-nomask-softcap":
        assert np.isneginf(qk).any()  # masked keys exist: assert_matches compared their -inf


def _function_body_outputs(model, feeds):
    """The model's Attention expanded into its schema function body (as onnx's backend cases do),
    run by onnx's ReferenceEvaluator."""
    import warnings

    from onnx.reference import ReferenceEvaluator
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from onnx.backend.test.case.node import function_testcase_helper
    node = model.graph.node[0]
    types = [i.type for i in model.graph.input]
    (nodes, opsets), = function_testcase_helper(node, types, "qk", opset_imports=model.opset_import)[0]
    g = helper.make_graph(nodes, "g", model.graph.input, model.graph.output)
    expanded = helper.make_model(g, opset_imports=opsets, ir_version=model.ir_version)
    return dict(zip([o.name for o in g.output], ReferenceEvaluator(expanded).run(None, feeds)))


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_mode0_with_softcap_is_the_raw_matmul(mode, tmp_path):
    """softcap with every mode, causal: the EP equals Attention's function body and the spec text
    (mode 0 = "the output of qk matmul", before the softcap)."""
    rng = np.random.default_rng(7 + mode)
    feeds = {"Q": rounded(rng, (1, 2, 3, 8), "float32", 3.0), "K": rounded(rng, (1, 2, 4, 8), "float32", 3.0),
             "V": rounded(rng, (1, 2, 4, 8), "float32")}
    model = attention_model("float32", qk_matmul_output_mode=mode, softcap=2.0, is_causal=1)
    out, providers = ep_run(model, feeds, tmp_path)
    body = _function_body_outputs(model, feeds)
    _, _, _, spec = spec_attention(feeds["Q"], feeds["K"], feeds["V"], softcap=2.0, is_causal=1, mode=mode)
    assert providers == {EP}
    assert_matches(out["qk_matmul_output"], spec, "float32", "EP vs spec")
    assert_matches(body["qk_matmul_output"], spec, "float32", "function body vs spec")
    assert_matches(out["Y"], body["Y"].astype(np.float64), "float32", "Y vs function body")
    if mode == 0:
        assert np.abs(spec).max() > 2.0  # raw scores beyond the cap: mode 0 and 1 really differ


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_short_mask_pads_with_neg_inf(dtype, tmp_path):
    """attn_mask's last dimension shorter than past + new keys (opset 24): the keys past it are
    masked out, Y equals the explicitly padded mask's Y (plain ORT refuses this shape)."""
    rng = np.random.default_rng(3)
    B, H, S, P, D = 2, 2, 3, 4, 8
    feeds = {"Q": rounded(rng, (B, H, S, D), dtype), "K": rounded(rng, (B, H, S, D), dtype),
             "V": rounded(rng, (B, H, S, D), dtype), "past_key": rounded(rng, (B, H, P, D), dtype),
             "past_value": rounded(rng, (B, H, P, D), dtype), "attn_mask": rng.random((B, 1, S, 5)) > 0.2}
    feeds["attn_mask"][..., 0] = True
    model = attention_model(dtype, mask="bool", past=True, qk=False, opset=24)
    out, providers = ep_run(model, feeds, tmp_path)
    padded = dict(feeds, attn_mask=np.concatenate([feeds["attn_mask"], np.zeros((B, 1, S, P + S - 5), bool)], -1))
    out_padded, _ = ep_run(model, padded, tmp_path)
    y, *_ = spec_attention(feeds["Q"], feeds["K"], feeds["V"], mask=feeds["attn_mask"], past_k=feeds["past_key"],
                           past_v=feeds["past_value"])
    assert providers == {EP}
    assert np.array_equal(out["Y"], out_padded["Y"])
    assert_matches(out["Y"], y, dtype, "Y")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("rank", [3, 4])
def test_low_precision_y_and_presents(dtype, rank, tmp_path):
    """float16/bfloat16 Attention with a past, GQA, a float mask of the same type, causal: on the
    EP at every ISA level; presents bit-exact (copies)."""
    rng = np.random.default_rng(11)
    B, Hq, Hkv, S, P, D = 2, 8, 2, 5, 7, 64
    q, k, v = rounded(rng, (B, Hq, S, D), dtype), rounded(rng, (B, Hkv, S, D), dtype), rounded(rng, (B, Hkv, S, D), dtype)
    pk, pv = rounded(rng, (B, Hkv, P, D), dtype), rounded(rng, (B, Hkv, P, D), dtype)
    mask = rounded(rng, (B, 1, S, P + S), dtype)
    bsnh = (lambda x: np.ascontiguousarray(x.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1)))
    feeds = {"Q": q, "K": k, "V": v} if rank == 4 else {"Q": bsnh(q), "K": bsnh(k), "V": bsnh(v)}
    feeds.update(past_key=pk, past_value=pv, attn_mask=mask)
    attrs = {"is_causal": 1} if rank == 4 else {"is_causal": 1, "q_num_heads": Hq, "kv_num_heads": Hkv}
    model = attention_model(dtype, mask=dtype, past=True, qk=False, **attrs)
    out, providers = ep_run(model, feeds, tmp_path)
    y, epk, epv, _ = spec_attention(q, k, v, mask=mask, past_k=pk, past_v=pv, is_causal=1)
    if rank == 3:
        y = y.transpose(0, 2, 1, 3).reshape(B, S, -1)
    assert providers == {EP}
    assert out["Y"].dtype == NP_TYPE[dtype]
    assert_matches(out["Y"], y, dtype, "Y")
    assert np.array_equal(out["present_key"].astype(np.float64), epk)
    assert np.array_equal(out["present_value"].astype(np.float64), epv)


LEFT_TO_ORT = [
    # (id, dtype, attributes, mask type, opset, the reason the EP logs)
    ("softmax_precision float16 of float32", {"softmax_precision": 10}, None, 23, "softmax_precision=10"),
    ("scale 0", {"scale": 0.0}, None, 23, "scale=0.000000 (supported: > 0)"),
    ("int64 mask", {}, TensorProto.INT64, 23, "attn_mask type 7"),
    ("V float16 of float32 Q", {}, None, 23, "input #2 has another type than Q"),
    ("opset 25 window", {"left_window_size": 1, "is_causal": 1}, None, 25, "since_version 25"),
]


@pytest.mark.parametrize("what, attrs, mask, opset, reason", LEFT_TO_ORT, ids=[c[0] for c in LEFT_TO_ORT])
def test_unsupported_nodes_are_left_to_ort(what, attrs, mask, opset, reason, tmp_path, capfd):
    """What the EP does not implement as the spec says is refused in GetCapability (reason logged at
    verbose level) and stays on ORT: plain ORT's outputs, or plain ORT's error."""
    rng = np.random.default_rng(5)
    feeds = {"Q": rounded(rng, (1, 2, 3, 8), "float32"), "K": rounded(rng, (1, 2, 3, 8), "float32"),
             "V": rounded(rng, (1, 2, 3, 8), "float16" if what.startswith("V ") else "float32")}
    vi = helper.make_tensor_value_info
    ins = [vi(n, ONNX_TYPE[str(feeds[n].dtype)], None) for n in ("Q", "K", "V")]
    names = ["Q", "K", "V"]
    if mask is not None:
        feeds["attn_mask"] = np.zeros((3, 3), np.int64)
        ins.append(vi("attn_mask", mask, None))
        names.append("attn_mask")
    node = helper.make_node("Attention", names, ["Y"], **attrs)
    model = helper.make_model(helper.make_graph([node], "g", ins, [vi("Y", TensorProto.FLOAT, None)]),
                              opset_imports=[helper.make_opsetid("", opset)], ir_version=10).SerializeToString()
    so = new_session_options(tmp_path)
    so.log_severity_level = 0
    try:
        expected = ort.InferenceSession(model, providers=[CPU]).run(None, feeds)[0]
    except Exception as e:  # noqa: BLE001 - plain ORT's own verdict is what the EP must reproduce
        with pytest.raises(type(e)):
            onnx_light_ep.InferenceSession(model, so).run(None, feeds)
        assert f"leaving to ORT: Attention: {reason}" in capfd.readouterr().err
        return
    sess = onnx_light_ep.InferenceSession(model, so)
    assert f"leaving to ORT: Attention: {reason}" in capfd.readouterr().err
    out = sess.run(None, feeds)[0]
    assert EP not in node_providers(sess)
    np.testing.assert_array_equal(out, expected)
