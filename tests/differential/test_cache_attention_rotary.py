"""CacheAttention taking GroupQueryAttention's packed QKV and rotary itself (the fused form
``convert`` writes for onnxruntime-genai models) against

- the unfused graph (``convert(..., fuse_gqa=False)``: QKV Split + com.microsoft.RotaryEmbedding
  in front of CacheAttention on separate Q/K/V): the same arithmetic, so outputs and cached
  rows are bit-identical, every dtype;
- plain ORT's com.microsoft.GroupQueryAttention (do_rotary=1) on the same inputs, present fed
  back as past: the cached K (rotated) and V rows equal ORT's present rows bit for bit (fp32
  and fp16: ORT's CPU rotary rounding, kernels/rotary.h); outputs of the valid rows within
  fp32 atol 1e-5 / rtol 1e-4, fp16 2e-2 / 2e-2 (tests/reference.py);
- for bfloat16 (ORT's CPU GQA has none), the numpy rotary in float32 rounded once (cached K
  bit-exact) and the fp64 oracle ``ref_rows`` (outputs within 2e-2 / 2e-2).

Batch 2 with a right-padded prompt (rows of 7 and 4 tokens), then decode steps, so the rows
have different past lengths at every step; halves and interleaved pairs; partial rotary_dim.
Runs once per ISA level (tests/differential/conftest.py).
"""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_light_ep
import ort_utils
from onnx_light_ep.rewrite import convert
from reference import BF16, assert_close, from_bnsh, ref_rows, to_bnsh
from test_tensor_mode_gqa import _new_tokens as _feeds, _rotary_caches, gqa_model

PROMPT_LENS = np.array([7, 4])
DECODE_STEPS = 6
MAX_LEN = 64

CONFIGS = [
    # (hq, hkv, d, dtype, packed, rotary, rotary_dim)
    (8, 2, 32, np.float32, True, "half", None),          # genai's form
    (8, 2, 32, np.float32, True, "interleaved", None),
    (8, 2, 32, np.float32, True, "half", 16),            # partial rotary_dim
    (8, 2, 32, np.float32, True, "interleaved", 16),
    (4, 1, 16, np.float32, False, "half", None),         # separate Q/K/V with rotary
    (8, 2, 32, np.float32, True, None, None),            # packed QKV without rotary
    (8, 2, 32, np.float16, True, "half", 16),
    (8, 2, 32, np.float16, True, "interleaved", None),
]


def _cfg_id(c):
    hq, hkv, d, dt, packed, rot, rdim = c
    return f"hq{hq}-hkv{hkv}-d{d}-{np.dtype(dt).name}-{'packed' if packed else 'qkv'}-rot{rot}{rdim or ''}"


def _converted(model, tmp_path, fuse):
    src = tmp_path / "gqa.onnx"
    onnx.save(model, str(src))
    dst = str(tmp_path / f"gqa.{'fused' if fuse else 'unfused'}.onnx")
    report = convert(str(src), dst, fuse_gqa=fuse)
    return report, dst


@pytest.mark.parametrize("cfg", CONFIGS, ids=_cfg_id)
def test_fused_equals_unfused_and_ort_gqa(cfg, tmp_path):
    hq, hkv, d, dt, packed, rotary, rdim = cfg
    model = gqa_model(hq=hq, hkv=hkv, d=d, dt=dt, packed=packed, rotary=rotary, rotary_dim=rdim, max_len=MAX_LEN)
    rep_f, fused = _converted(model, tmp_path, True)
    rep_u, unfused = _converted(model, tmp_path, False)
    ops_f = [n.op_type for n in onnx.load(fused).graph.node]
    ops_u = [n.op_type for n in onnx.load(unfused).graph.node]
    assert ops_f.count("CacheAttention") == 1 and not {"Split", "RotaryEmbedding"} & set(ops_f), ops_f
    if rotary:
        assert ops_u.count("RotaryEmbedding") == 2, ops_u
    if packed:
        assert "Split" in ops_u, ops_u
    ca = [n for n in onnx.load(fused).graph.node if n.op_type == "CacheAttention"][0]
    assert list(ca.input[1:3]) == (["", ""] if packed else ["key", "value"])
    assert list(ca.input[6:]) == (["cos_cache", "sin_cache"] if rotary else [])

    so = ort_utils.new_session_options()
    cpu = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    (tmp_path / "f").mkdir()
    (tmp_path / "u").mkdir()
    s_f = onnx_light_ep.InferenceSession(fused, ort_utils.new_session_options(tmp_path / "f"))
    s_u = onnx_light_ep.InferenceSession(unfused, ort_utils.new_session_options(tmp_path / "u"))
    B, S = len(PROMPT_LENS), int(PROMPT_LENS.max())
    c_f = onnx_light_ep.KVCache.for_model(fused, B, MAX_LEN)
    c_u = onnx_light_ep.KVCache.for_model(unfused, B, MAX_LEN)
    rng = np.random.default_rng(21)
    past = (np.zeros((B, hkv, 0, d), dt), np.zeros((B, hkv, 0, d), dt))
    try:
        for step in range(DECODE_STEPS + 1):
            n = S if step == 0 else 1
            feeds = _feeds(rng, B, n, hq, hkv, d, dt, packed)
            lens = PROMPT_LENS + step                       # valid tokens after the step
            feeds["seqlens_k"] = (lens - 1).astype(np.int32)
            feeds["total_sequence_length"] = np.array(S + step, np.int32)
            y_f = s_f.run(["output"], dict(feeds, kv_cache=c_f.handle))[0]
            y_u = s_u.run(["output"], dict(feeds, kv_cache=c_u.handle))[0]
            y_o, pk, pv = cpu.run(None, dict(feeds, past_key=past[0], past_value=past[1]))
            past = (pk, pv)
            msg = f"step {step}"
            assert y_f.dtype == dt and np.array_equal(y_f, y_u), f"{msg}: fused and unfused outputs differ"
            kf, vf = c_f.export(0)
            ku, vu = c_u.export(0)
            assert np.array_equal(kf, ku) and np.array_equal(vf, vu), f"{msg}: fused and unfused caches differ"
            assert list(c_f.seq_lens) == list(lens)
            if rotary and step == 0:  # K is cached rotated: position >= 1 differs from the raw key
                raw = to_bnsh(feeds["query"][..., hq * d:(hq + hkv) * d] if packed else feeds["key"], hkv)
                assert not np.array_equal(kf[0, :, 1:S], raw[0, :, 1:S])
            for b in range(B):
                L = int(lens[b])
                assert np.array_equal(kf[b, :, :L], pk[b, :, :L]), f"{msg}: cached K of row {b} != ORT present_key"
                assert np.array_equal(vf[b, :, :L], pv[b, :, :L]), f"{msg}: cached V of row {b} != ORT present_value"
                valid = n if step else int(PROMPT_LENS[b])  # the rows ORT's output means something for
                assert_close(y_f[b, :valid], y_o[b, :valid], dt, f"{msg} row {b}: output vs ORT GroupQueryAttention")
                assert not y_f[b, valid:].any(), f"{msg} row {b}: padding rows must be zeros"
    finally:
        c_f.close()
        c_u.close()
    for s in (s_f, s_u):  # the fused (and the unfused) CacheAttention ran on the EP
        assert ort_utils.end_profile_providers(s, "CacheAttention") == {ort_utils.EP_NAME}


# -- a hand-made fused node: bf16, and bad inputs -------------------------------------------------

def fused_model(*, hq, hkv, d, elem=TensorProto.FLOAT, cos_elem=None, packed=True, rotary=True,
                interleaved=0, with_sin=True, key_only=False):
    """CacheAttention(query, [key], [value], kv_cache, "", seqlens_k, [cos_cache], [sin_cache]) with
    every tensor a graph input of free shape (so bad shapes reach the op)."""
    vi = helper.make_tensor_value_info
    inputs = [vi("query", elem, None), vi("kv_cache", TensorProto.INT64, [1]),
              vi("seqlens_k", TensorProto.INT32, ["B"])]
    ins = ["query", "", "", "kv_cache", "", "seqlens_k"]
    if not packed or key_only:
        ins[1] = "key"
        inputs.append(vi("key", elem, None))
        if not key_only:
            ins[2] = "value"
            inputs.append(vi("value", elem, None))
    if rotary:
        ins += ["cos_cache", "sin_cache" if with_sin else ""]
        inputs.append(vi("cos_cache", cos_elem or elem, None))
        if with_sin:
            inputs.append(vi("sin_cache", cos_elem or elem, None))
    node = helper.make_node("CacheAttention", ins, ["Y"], domain="ai.onnx_light", layer=0, q_num_heads=hq,
                            kv_num_heads=hkv, is_causal=1, rotary_interleaved=interleaved)
    g = helper.make_graph([node], "fused", inputs, [vi("Y", elem, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("ai.onnx_light", 1)],
                             ir_version=10)


def _np_rotary(x, cos, sin, pos, interleaved):
    """[..., D] rows rotated at positions ``pos`` (broadcast over the leading dims) in float32,
    separate products, as kernels/rotary.h specifies for 16-bit types."""
    x = x.astype(np.float32)
    half = cos.shape[1]
    c, s = cos[pos].astype(np.float32), sin[pos].astype(np.float32)
    y = x.copy()
    ia = np.arange(half) * 2 if interleaved else np.arange(half)
    ib = ia + 1 if interleaved else ia + half
    a, b = x[..., ia], x[..., ib]
    y[..., ia] = (a * c).astype(np.float32) - (b * s).astype(np.float32)
    y[..., ib] = (b * c).astype(np.float32) + (a * s).astype(np.float32)
    return y


@pytest.mark.parametrize("interleaved", [0, 1])
def test_bf16_fused_against_numpy(interleaved, tmp_path):
    hq, hkv, d, rdim = 4, 2, 32, 16
    model = fused_model(hq=hq, hkv=hkv, d=d, elem=TensorProto.BFLOAT16, interleaved=interleaved)
    sess = ort_utils.make_ep_session(onnx_light_ep, model)
    cos, sin = (t.astype(BF16) for t in _rotary_caches(MAX_LEN, rdim, np.float32))
    B, S = len(PROMPT_LENS), int(PROMPT_LENS.max())
    cache = onnx_light_ep.KVCache(num_layers=1, batch_size=B, kv_num_heads=hkv, head_dim=d,
                                  max_sequence_length=MAX_LEN, dtype="bfloat16")
    rng = np.random.default_rng(5)
    k_all = np.zeros((B, hkv, 0, d), np.float64)
    v_all = np.zeros((B, hkv, 0, d), np.float64)
    try:
        for step in range(DECODE_STEPS + 1):
            n = S if step == 0 else 1
            past = PROMPT_LENS - PROMPT_LENS if step == 0 else PROMPT_LENS + step - 1
            lens = PROMPT_LENS + step
            n_new = lens - past
            x = rng.standard_normal((B, n, (hq + 2 * hkv) * d)).astype(BF16)
            y = ort_utils.run(sess, {"query": x, "kv_cache": cache.handle, "seqlens_k": (lens - 1).astype(np.int32),
                                     "cos_cache": cos, "sin_cache": sin})["Y"]
            q = to_bnsh(x[..., :hq * d].astype(np.float32), hq)
            k = to_bnsh(x[..., hq * d:(hq + hkv) * d].astype(np.float32), hkv)
            v = to_bnsh(x[..., (hq + hkv) * d:].astype(np.float32), hkv)
            pos = past[:, None, None] + np.arange(n)[None, None, :]   # [B, 1, S]
            rot = lambda t: np.concatenate([_np_rotary(t[..., :rdim], cos, sin, pos, interleaved), t[..., rdim:]], -1)
            qr = rot(q).astype(BF16).astype(np.float64)
            kr = rot(k).astype(BF16)
            kc, vc = cache.export(0)
            for b in range(B):
                assert np.array_equal(kc[b, :, past[b]:lens[b]].view(np.uint16),
                                      kr[b, :, :n_new[b]].view(np.uint16)), f"step {step}: cached K of row {b}"
            expect = ref_rows(qr, kr.astype(np.float64), v.astype(np.float64), k_all, v_all, n_new, past)
            assert_close(y.astype(np.float64), from_bnsh(expect), "bfloat16", f"step {step}")
            k_all, v_all = kc.astype(np.float64), vc.astype(np.float64)
    finally:
        cache.close()


HQ, HKV, D = 4, 2, 16


def _bad_run(kind, model, feeds, tmp_path):
    """Runs on the EP or on plain ORT with the custom-op library; returns (error text, cache)."""
    sess = (ort_utils.make_ep_session(onnx_light_ep, model) if kind == "ep"
            else ort_utils.make_cpu_session(onnx_light_ep, model))
    cache = onnx_light_ep.KVCache(num_layers=1, batch_size=1, kv_num_heads=HKV, head_dim=D, max_sequence_length=32)
    with pytest.raises(Exception) as e:
        sess.run(None, dict(feeds, kv_cache=cache.handle))
    return str(e.value), cache


def _good(s=3, table=16, half=4):
    cos, sin = _rotary_caches(table, 2 * half, np.float32)
    return {"query": np.ones((1, s, (HQ + 2 * HKV) * D), np.float32), "seqlens_k": np.array([s - 1], np.int32),
            "cos_cache": cos, "sin_cache": sin}


BAD = {
    "cos_rank_1": (dict(), dict(cos_cache=np.ones(8, np.float32)),
                   "input 'cos_cache' shape; expected [max_position >= 1, rotary_dim/2] with 1 <= rotary_dim/2 <= "
                   "head_dim/2 = 8, got float [8]"),
    "rotary_dim_beyond_head_dim": (dict(), dict(cos_cache=np.ones((16, 9), np.float32),
                                                sin_cache=np.ones((16, 9), np.float32)),
                                   "input 'cos_cache' shape; expected [max_position >= 1, rotary_dim/2]"),
    "sin_shape_differs": (dict(), dict(sin_cache=np.ones((15, 4), np.float32)),
                          "input 'sin_cache' shape; expected [16, 4] (the shape of 'cos_cache'), got [15, 4]"),
    "cos_dtype": (dict(cos_elem=TensorProto.FLOAT16), dict(cos_cache=np.ones((16, 4), np.float16),
                                                           sin_cache=np.ones((16, 4), np.float16)),
                  "input 'cos_cache' type; expected float (the type of 'query'), got float16"),
    "sin_absent": (dict(with_sin=False), dict(sin_cache=None),
                   "inputs 'cos_cache' and 'sin_cache'; expected both present or both absent, got 'sin_cache' absent"),
    "packed_width": (dict(), dict(query=np.ones((1, 3, 100), np.float32)),
                     "input 'query' (packed QKV) shape; expected [B >= 1, S >= 1, a positive multiple of "
                     "q_num_heads + 2*kv_num_heads = 8], got float [1, 3, 100]"),
    "key_without_value": (dict(key_only=True), dict(key=np.ones((1, 3, HKV * D), np.float32)),
                          "inputs 'key' and 'value'; expected both present or both absent (packed QKV in 'query'), "
                          "got 'value' absent"),
    "position_beyond_table": (dict(), dict(query=np.ones((1, 20, (HQ + 2 * HKV) * D), np.float32),
                                           seqlens_k=np.array([19], np.int32)),
                              "rotary position 19 of sequence 0 (past length 0 + 20 new rows - 1); expected < "
                              "max_position = 16 (input 'cos_cache' dim 0), got 19; nothing was appended"),
}


@pytest.mark.parametrize("kind", ["ep", "cpu"])
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_rotary_inputs_fail_naming_the_input(case, kind, tmp_path):
    model_kw, feed_kw, text = BAD[case]
    model = fused_model(hq=HQ, hkv=HKV, d=D, **model_kw)
    feeds = {k: v for k, v in dict(_good(), **feed_kw).items() if v is not None}
    err, cache = _bad_run(kind, model, feeds, tmp_path)
    try:
        assert "CacheAttention: " + text in err, err
        assert list(cache.seq_lens) == [0], "a failed run must leave the cache as it was"
    finally:
        cache.close()


def test_position_error_leaves_earlier_steps(tmp_path):
    """A decode step whose position is past the table fails; the rows of earlier steps stay."""
    model = fused_model(hq=HQ, hkv=HKV, d=D)
    sess = ort_utils.make_ep_session(onnx_light_ep, model)
    cache = onnx_light_ep.KVCache(num_layers=1, batch_size=1, kv_num_heads=HKV, head_dim=D, max_sequence_length=32)
    try:
        sess.run(None, dict(_good(s=8, table=8), kv_cache=cache.handle))
        before = cache.export(0)
        with pytest.raises(Exception, match=r"rotary position 8 of sequence 0 \(past length 8 \+ 1 new rows - 1\); "
                                            r"expected < max_position = 8"):
            sess.run(None, dict(_good(s=1, table=8), seqlens_k=np.array([8], np.int32), kv_cache=cache.handle))
        assert list(cache.seq_lens) == [8]
        after = cache.export(0)
        assert all(np.array_equal(a, b) for a, b in zip(before, after))
    finally:
        cache.close()


def test_bad_rotary_interleaved_fails_at_session_creation():
    model = fused_model(hq=HQ, hkv=HKV, d=D, interleaved=2)
    with pytest.raises(Exception, match=r"CacheAttention: attribute 'rotary_interleaved'; expected 0 or 1, got 2"):
        ort_utils.make_ep_session(onnx_light_ep, model)
