"""EP tensor compatibility mode: standard ONNX Attention (opset 23/24) in models that
were NOT converted runs on OnnxLightExecutionProvider with the same Y and
present_key/present_value as plain ORT (presents bit-exact: they are copies).

Every test asserts from ORT's profile which provider ran the attention node.
Tolerances: fp32 atol 1e-5 rtol 1e-4; fp16 atol/rtol 2e-2 (tests/reference.py).
Runs once per ISA level (tests/differential/conftest.py)."""
import json

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import onnx_light_ep
from models import onnx_attention_model
from reference import FP32_ATOL, FP32_RTOL, LOWP_ATOL, LOWP_RTOL, ref_attn

EP = onnx_light_ep.EP_NAME


def _sessions(model, tmp_path, provider_options=None):
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "prof")
    ep = onnx_light_ep.InferenceSession(model.SerializeToString(), so, provider_options=provider_options)
    cpu = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return ep, cpu


def _attention_providers(sess):
    events = json.load(open(sess.end_profiling()))
    out = set()
    for e in events:
        if e.get("cat") != "Node":
            continue
        op = e["args"].get("op_name", "")
        if op == "Attention" or op.startswith(EP + "_"):
            out.add(e["args"].get("provider"))
    return out


def _tol(dt):
    return (FP32_ATOL, FP32_RTOL) if dt == np.float32 else (LOWP_ATOL, LOWP_RTOL)


def _bnsh_or_3d(x, rank):
    b, h, s, d = x.shape
    return x if rank == 4 else np.ascontiguousarray(x.transpose(0, 2, 1, 3).reshape(b, s, h * d))


CONFIGS = [
    # (hq, hkv, rank, dtype, mask, causal, softcap)
    (4, 4, 4, np.float32, None, 1, 0.0),
    (8, 2, 4, np.float32, "bool", 1, 0.0),
    (8, 2, 3, np.float32, "float", 1, 0.0),
    (4, 1, 4, np.float32, None, 0, 0.0),
    (8, 2, 4, np.float32, None, 1, 30.0),
    (8, 2, 4, np.float16, "bool", 1, 0.0),
    (4, 1, 3, np.float16, None, 1, 0.0),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"hq{c[0]}-hkv{c[1]}-r{c[2]}-{c[3].__name__}-m{c[4]}-c{c[5]}-cap{c[6]}")
def test_decode_loop_matches_plain_ort(cfg, tmp_path):
    """Prefill 5 tokens, then 12 decode steps feeding present back as past, on both sides."""
    hq, hkv, rank, dt, mask, causal, softcap = cfg
    D, B = 16, 2
    model = onnx_attention_model(q_num_heads=hq, kv_num_heads=hkv, head_dim=D, rank=rank,
                                 dtype="float32" if dt == np.float32 else "float16",
                                 with_mask=mask, is_causal=causal, softcap=softcap)
    ep, cpu = _sessions(model, tmp_path)
    rng = np.random.default_rng(1)
    past_ep = past_cpu = (np.zeros((B, hkv, 0, D), dt), np.zeros((B, hkv, 0, D), dt))
    atol, rtol = _tol(dt)
    for step, S in enumerate([5] + [1] * 12):
        q = rng.standard_normal((B, hq, S, D)).astype(dt)
        k = rng.standard_normal((B, hkv, S, D)).astype(dt)
        v = rng.standard_normal((B, hkv, S, D)).astype(dt)
        feeds = {"query_0": _bnsh_or_3d(q, rank), "key_0": _bnsh_or_3d(k, rank), "value_0": _bnsh_or_3d(v, rank)}
        T = past_ep[0].shape[2] + S
        if mask == "bool":
            m = rng.random((B, 1, S, T)) > 0.2
            m[..., 0] = True
            feeds["attn_mask"] = m
        elif mask == "float":
            feeds["attn_mask"] = np.where(rng.random((B, 1, S, T)) > 0.2, 0.0, -np.inf).astype(dt)
            feeds["attn_mask"][..., 0] = 0
        y_ep, pk_ep, pv_ep = ep.run(None, dict(feeds, past_key_0=past_ep[0], past_value_0=past_ep[1]))
        y_cpu, pk_cpu, pv_cpu = cpu.run(None, dict(feeds, past_key_0=past_cpu[0], past_value_0=past_cpu[1]))
        assert np.array_equal(pk_ep, pk_cpu) and np.array_equal(pv_ep, pv_cpu), f"step {step}: present differs"
        np.testing.assert_allclose(y_ep.astype(np.float32), y_cpu.astype(np.float32), atol=atol, rtol=rtol,
                                   err_msg=f"step {step}")
        past_ep, past_cpu = (pk_ep, pv_ep), (pk_cpu, pv_cpu)
    assert _attention_providers(ep) == {EP}


def test_no_past_presents_and_top_left_causal(tmp_path):
    """C01 variant + C04(a): Attention with Q, K, V only and present outputs. present == K/V
    bit-exactly; with is_causal and no past the offset is 0 (top-left): one query over 3 keys
    sees only key 0, so Y == V[0]."""
    D = 4
    t = TensorProto.FLOAT
    node = helper.make_node("Attention", ["Q", "K", "V"], ["Y", "present_key", "present_value"], is_causal=1)
    g = helper.make_graph([node], "g",
                          [helper.make_tensor_value_info("Q", t, [1, 1, "s", D]),
                           helper.make_tensor_value_info("K", t, [1, 1, "t", D]),
                           helper.make_tensor_value_info("V", t, [1, 1, "t", D])],
                          [helper.make_tensor_value_info(n, t, None) for n in ("Y", "present_key", "present_value")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)
    ep, cpu = _sessions(model, tmp_path)
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 1, 1, D), dtype=np.float32)
    k = rng.standard_normal((1, 1, 3, D), dtype=np.float32)
    v = rng.standard_normal((1, 1, 3, D), dtype=np.float32)
    y, pk, pv = ep.run(None, {"Q": q, "K": k, "V": v})
    assert np.array_equal(pk, k) and np.array_equal(pv, v)
    np.testing.assert_allclose(y[0, 0, 0], v[0, 0, 0], atol=FP32_ATOL, rtol=FP32_RTOL)
    np.testing.assert_allclose(y, cpu.run(None, {"Q": q, "K": k, "V": v})[0], atol=FP32_ATOL, rtol=FP32_RTOL)
    # Prefill S == T: plain causal over the new tokens.
    q3 = rng.standard_normal((1, 1, 3, D), dtype=np.float32)
    y3, _, _ = ep.run(None, {"Q": q3, "K": k, "V": v})
    np.testing.assert_allclose(y3, ref_attn(q3, k, v)[0], atol=FP32_ATOL, rtol=FP32_RTOL)
    assert _attention_providers(ep) == {EP}


def test_opset24_nonpad_kv_seqlen_static_cache(tmp_path):
    """Opset-24 in-place idiom: K/V are a static max-length buffer, nonpad_kv_seqlen gives the
    valid length per row; slots past it are poisoned (1e4) and must not change the result."""
    B, H, D, M = 2, 2, 8, 10
    t = TensorProto.FLOAT
    node = helper.make_node("Attention", ["Q", "K", "V", "", "", "", "nonpad"], ["Y"], is_causal=1)
    g = helper.make_graph([node], "g",
                          [helper.make_tensor_value_info("Q", t, [B, H, 1, D]),
                           helper.make_tensor_value_info("K", t, [B, H, M, D]),
                           helper.make_tensor_value_info("V", t, [B, H, M, D]),
                           helper.make_tensor_value_info("nonpad", TensorProto.INT64, [B])],
                          [helper.make_tensor_value_info("Y", t, None)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 24)], ir_version=10)
    ep, cpu = _sessions(model, tmp_path)
    rng = np.random.default_rng(3)
    lens = np.array([6, 3], np.int64)
    q = rng.standard_normal((B, H, 1, D), dtype=np.float32)
    k = np.full((B, H, M, D), 1e4, np.float32)
    v = np.full((B, H, M, D), 1e4, np.float32)
    for b, n in enumerate(lens):
        k[b, :, :n] = rng.standard_normal((H, n, D))
        v[b, :, :n] = rng.standard_normal((H, n, D))
    (y,) = ep.run(None, {"Q": q, "K": k, "V": v, "nonpad": lens})
    for b, n in enumerate(lens):
        want = ref_attn(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], q_offset=n - 1)[0]
        np.testing.assert_allclose(y[b:b + 1], want, atol=FP32_ATOL, rtol=FP32_RTOL)
    (y_cpu,) = cpu.run(None, {"Q": q, "K": k, "V": v, "nonpad": lens})
    np.testing.assert_allclose(y, y_cpu, atol=FP32_ATOL, rtol=FP32_RTOL)
    assert _attention_providers(ep) == {EP}


def test_tensor_mode_off_leaves_attention_to_ort(tmp_path):
    model = onnx_attention_model(q_num_heads=4, kv_num_heads=2, head_dim=8, is_causal=1)
    ep, _ = _sessions(model, tmp_path, provider_options={"tensor_mode": "0"})
    rng = np.random.default_rng(4)
    feeds = {"query_0": rng.standard_normal((1, 4, 1, 8), dtype=np.float32),
             "key_0": rng.standard_normal((1, 2, 1, 8), dtype=np.float32),
             "value_0": rng.standard_normal((1, 2, 1, 8), dtype=np.float32),
             "past_key_0": rng.standard_normal((1, 2, 3, 8), dtype=np.float32),
             "past_value_0": rng.standard_normal((1, 2, 3, 8), dtype=np.float32)}
    ep.run(None, feeds)
    assert _attention_providers(ep) == {"CPUExecutionProvider"}


def test_bad_tensor_mode_option_is_an_error():
    model = onnx_attention_model(q_num_heads=4, kv_num_heads=2, head_dim=8)
    with pytest.raises(Exception, match="tensor_mode"):
        onnx_light_ep.InferenceSession(model.SerializeToString(), provider_options={"tensor_mode": "yes"})
