"""EP tensor compatibility mode for com.microsoft GroupQueryAttention (GQA), as
onnxruntime-genai models use it: an UNconverted model with the EP selected runs its
GQA nodes on OnnxLightExecutionProvider with the same output, present_key and
present_value as plain ORT CPU.

Both KV contracts are exercised over a right-padded batch-2 prompt and >= 10 decode
steps: separate past/present tensors fed back, and one buffer of capacity
max_sequence_length bound (IOBinding) to both past_key and present_key.
Presents are compared bit-exactly (copies; with rotary the rotated K follows ORT's
rounding on this CPU, see custom_ops/kernels/rotary.h); outputs within fp32 atol 1e-5 /
rtol 1e-4, fp16 2e-2 (tests/reference.py), every row including prompt padding rows.
Every test asserts from ORT's profile which provider ran the GQA node.
Runs once per ISA level (tests/differential/conftest.py)."""
import json

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_light_ep
from reference import FP32_ATOL, FP32_RTOL, LOWP_ATOL, LOWP_RTOL

EP = onnx_light_ep.EP_NAME
CPU = "CPUExecutionProvider"
MS = "com.microsoft"


def _tol(dt):
    return (FP32_ATOL, FP32_RTOL) if dt == np.float32 else (LOWP_ATOL, LOWP_RTOL)


def _onnx_t(dt):
    return TensorProto.FLOAT if dt == np.float32 else TensorProto.FLOAT16


def _rotary_caches(max_len, rotary_dim, dt, base=10000.0):
    inv = 1.0 / base ** (np.arange(0, rotary_dim, 2) / rotary_dim)
    ang = np.outer(np.arange(max_len), inv)
    return np.cos(ang).astype(dt), np.sin(ang).astype(dt)


def gqa_model(*, hq, hkv, d, dt=np.float32, packed=False, rotary=None, rotary_dim=None, window=-1,
              softcap=0.0, max_len=64, extra_attrs=None, extra_inputs=()):
    """One GQA node. Graph inputs: query[, key, value], past_key, past_value, seqlens_k,
    total_sequence_length (+ ``extra_inputs`` (name, TensorProto type, shape)); cos/sin caches
    are initializers (as genai writes them). rotary: None, "half" or "interleaved"."""
    t = _onnx_t(dt)
    vi = helper.make_tensor_value_info
    ins = ["query", "" if packed else "key", "" if packed else "value", "past_key", "past_value",
           "seqlens_k", "total_sequence_length"]
    inputs = [vi("query", t, ["B", "S", (hq + 2 * hkv) * d if packed else hq * d])]
    if not packed:
        inputs += [vi("key", t, ["B", "S", hkv * d]), vi("value", t, ["B", "S", hkv * d])]
    inputs += [vi("past_key", t, ["B", hkv, "P", d]), vi("past_value", t, ["B", hkv, "P", d]),
               vi("seqlens_k", TensorProto.INT32, ["B"]), vi("total_sequence_length", TensorProto.INT32, [])]
    attrs = dict(num_heads=hq, kv_num_heads=hkv)
    if window != -1:
        attrs["local_window_size"] = window
    if softcap:
        attrs["softcap"] = softcap
    inits = []
    if rotary:
        cos, sin = _rotary_caches(max_len, rotary_dim or d, dt)
        inits = [numpy_helper.from_array(cos, "cos_cache"), numpy_helper.from_array(sin, "sin_cache")]
        ins += ["cos_cache", "sin_cache"]
        attrs.update(do_rotary=1, rotary_interleaved=int(rotary == "interleaved"))
    if extra_inputs:
        ins += [""] * (9 - len(ins))
        names = {"position_ids": 9, "attention_bias": 10, "head_sink": 11}
        for name, et, shape in extra_inputs:
            ins += [""] * (names[name] + 1 - len(ins))
            ins[names[name]] = name
            inputs.append(vi(name, et, shape))
    attrs.update(extra_attrs or {})
    node = helper.make_node("GroupQueryAttention", ins, ["output", "present_key", "present_value"], domain=MS,
                            **attrs)
    outs = [vi(n, t, None) for n in ("output", "present_key", "present_value")]
    g = helper.make_graph([node], "gqa", inputs, outs, initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)],
                             ir_version=10)


def _sessions(model, tmp_path, verbose=False):
    so = ort.SessionOptions()
    so.enable_profiling = True
    if verbose:
        so.log_severity_level = 0
    so.profile_file_prefix = str(tmp_path / "prof")
    ep = onnx_light_ep.InferenceSession(model.SerializeToString(), so)
    cpu = ort.InferenceSession(model.SerializeToString(), providers=[CPU])
    return ep, cpu


def _gqa_providers(sess):
    """Providers of the GQA node events (CPU: op_name GroupQueryAttention; EP: fused node)."""
    out = []
    for e in json.load(open(sess.end_profiling())):
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        op = e["args"].get("op_name", "")
        if op == "GroupQueryAttention" or op.startswith(EP + "_"):
            out.append(e["args"].get("provider"))
    return out


def _assert_ran_on(sess, provider):
    got = _gqa_providers(sess)
    assert got and set(got) == {provider}, got


def _new_tokens(rng, b, s, hq, hkv, d, dt, packed):
    q = rng.standard_normal((b, s, hq * d))
    k = rng.standard_normal((b, s, hkv * d))
    v = rng.standard_normal((b, s, hkv * d))
    if packed:
        return {"query": np.concatenate([q, k, v], axis=2).astype(dt)}
    return {"query": q.astype(dt), "key": k.astype(dt), "value": v.astype(dt)}


def _compare(y_ep, y_cpu, dt, msg):
    atol, rtol = _tol(dt)
    np.testing.assert_allclose(y_ep.astype(np.float64), y_cpu.astype(np.float64), atol=atol, rtol=rtol, err_msg=msg)


CONFIGS = [
    # (hq, hkv, d, dtype, packed, rotary, rotary_dim, window, softcap)
    (4, 4, 16, np.float32, False, None, None, -1, 0.0),           # MHA
    (8, 2, 32, np.float32, True, "half", None, -1, 0.0),          # GQA, genai's packed QKV + rotary
    (8, 2, 32, np.float32, False, "interleaved", 16, -1, 0.0),    # partial rotary_dim
    (4, 1, 16, np.float32, False, None, None, 3, 0.0),            # MQA, local window (ORT's fused kernel)
    (8, 2, 16, np.float32, True, "half", None, 4, 2.0),           # window + softcap (ORT's unfused kernel)
    (8, 2, 32, np.float16, True, "interleaved", None, 5, 0.0),    # fp16 packed rotary window
    (4, 1, 16, np.float16, False, None, None, -1, 2.0),           # fp16 MQA softcap
    (4, 4, 32, np.float16, False, "half", None, -1, 0.0),         # fp16 MHA rotary
]


def _cfg_id(c):
    hq, hkv, d, dt, packed, rot, rdim, win, cap = c
    return (f"hq{hq}-hkv{hkv}-d{d}-{np.dtype(dt).name}-{'packed' if packed else 'qkv'}-rot{rot}{rdim or ''}"
            f"-w{win}-cap{cap}")


PROMPT_LENS = np.array([7, 4])  # batch 2, right-padded prompt of S = 7
DECODE_STEPS = 10


@pytest.mark.parametrize("cfg", CONFIGS, ids=_cfg_id)
def test_separate_buffers_prefill_and_decode(cfg, tmp_path):
    """Prompt (row 1 right-padded), then 10 decode steps feeding present back as past.
    total_sequence_length = attention-mask width (as genai computes it)."""
    hq, hkv, d, dt, packed, rotary, rdim, window, softcap = cfg
    model = gqa_model(hq=hq, hkv=hkv, d=d, dt=dt, packed=packed, rotary=rotary, rotary_dim=rdim, window=window,
                      softcap=softcap)
    ep, cpu = _sessions(model, tmp_path)
    rng = np.random.default_rng(10)
    B, S = len(PROMPT_LENS), int(PROMPT_LENS.max())
    past_ep = past_cpu = (np.zeros((B, hkv, 0, d), dt), np.zeros((B, hkv, 0, d), dt))
    for step in range(DECODE_STEPS + 1):
        n = S if step == 0 else 1
        feeds = _new_tokens(rng, B, n, hq, hkv, d, dt, packed)
        feeds["seqlens_k"] = (PROMPT_LENS - 1 + step).astype(np.int32)
        feeds["total_sequence_length"] = np.array(S + step, np.int32)
        y_ep, pk_ep, pv_ep = ep.run(None, dict(feeds, past_key=past_ep[0], past_value=past_ep[1]))
        y_cpu, pk_cpu, pv_cpu = cpu.run(None, dict(feeds, past_key=past_cpu[0], past_value=past_cpu[1]))
        assert pk_ep.shape == pk_cpu.shape == (B, hkv, S + step, d)
        assert np.array_equal(pk_ep, pk_cpu), f"step {step}: present_key differs"
        assert np.array_equal(pv_ep, pv_cpu), f"step {step}: present_value differs"
        _compare(y_ep, y_cpu, dt, f"step {step}")
        past_ep, past_cpu = (pk_ep, pv_ep), (pk_cpu, pv_cpu)
    _assert_ran_on(ep, EP)


def _bound_run(sess, feeds, kbuf, vbuf):
    io = sess.io_binding()
    for name, arr in feeds.items():
        io.bind_cpu_input(name, np.ascontiguousarray(arr))
    io.bind_ortvalue_input("past_key", kbuf)
    io.bind_ortvalue_input("past_value", vbuf)
    io.bind_output("output")
    io.bind_ortvalue_output("present_key", kbuf)
    io.bind_ortvalue_output("present_value", vbuf)
    sess.run_with_iobinding(io)
    return io.get_outputs()[0].numpy()


@pytest.mark.parametrize("cfg", CONFIGS, ids=_cfg_id)
def test_shared_buffer_prefill_and_decode(cfg, tmp_path):
    """past_key/present_key (and values) are one OrtValue of capacity max_sequence_length:
    new K/V are written at each row's own position and every other row stays as it was
    (the buffers start as random garbage, identical on both sides)."""
    hq, hkv, d, dt, packed, rotary, rdim, window, softcap = cfg
    M = 24
    model = gqa_model(hq=hq, hkv=hkv, d=d, dt=dt, packed=packed, rotary=rotary, rotary_dim=rdim, window=window,
                      softcap=softcap)
    ep, cpu = _sessions(model, tmp_path)
    rng = np.random.default_rng(11)
    B, S = len(PROMPT_LENS), int(PROMPT_LENS.max())
    garbage = rng.standard_normal((2, B, hkv, M, d)).astype(dt)
    bufs = {side: [ort.OrtValue.ortvalue_from_numpy(garbage[i].copy()) for i in range(2)] for side in ("ep", "cpu")}
    for step in range(DECODE_STEPS + 1):
        n = S if step == 0 else 1
        feeds = _new_tokens(rng, B, n, hq, hkv, d, dt, packed)
        feeds["seqlens_k"] = (PROMPT_LENS - 1 + step).astype(np.int32)
        feeds["total_sequence_length"] = np.array(S + step, np.int32)
        y_ep = _bound_run(ep, feeds, *bufs["ep"])
        y_cpu = _bound_run(cpu, feeds, *bufs["cpu"])
        for i, name in enumerate(("key", "value")):
            got, want = bufs["ep"][i].numpy(), bufs["cpu"][i].numpy()
            assert got.shape == (B, hkv, M, d)
            assert np.array_equal(got, want), f"step {step}: shared {name} buffer differs"
        _compare(y_ep, y_cpu, dt, f"step {step}")
    # Rows past each sequence's end were never written (still the garbage they started as).
    end = PROMPT_LENS + DECODE_STEPS
    for b in range(B):
        assert np.array_equal(bufs["ep"][0].numpy()[b, :, max(end[b], S):], garbage[0][b, :, max(end[b], S):])
    _assert_ran_on(ep, EP)


def test_subsequent_prompt_chunks(tmp_path):
    """Batch 1, prompt in chunks (S > 1 and S != total_sequence_length: ORT's
    'subsequent prompt'), then decode; rotary positions continue across chunks."""
    hq, hkv, d, dt = 8, 2, 32, np.float32
    model = gqa_model(hq=hq, hkv=hkv, d=d, dt=dt, packed=True, rotary="half", window=6)
    ep, cpu = _sessions(model, tmp_path)
    rng = np.random.default_rng(12)
    past_ep = past_cpu = (np.zeros((1, hkv, 0, d), dt), np.zeros((1, hkv, 0, d), dt))
    total = 0
    for n in [5, 4, 3] + [1] * 10:
        total += n
        feeds = _new_tokens(rng, 1, n, hq, hkv, d, dt, True)
        feeds["seqlens_k"] = np.array([total - 1], np.int32)
        feeds["total_sequence_length"] = np.array(total, np.int32)
        y_ep, pk_ep, pv_ep = ep.run(None, dict(feeds, past_key=past_ep[0], past_value=past_ep[1]))
        y_cpu, pk_cpu, pv_cpu = cpu.run(None, dict(feeds, past_key=past_cpu[0], past_value=past_cpu[1]))
        assert np.array_equal(pk_ep, pk_cpu) and np.array_equal(pv_ep, pv_cpu), f"total {total}"
        _compare(y_ep, y_cpu, dt, f"total {total}")
        past_ep, past_cpu = (pk_ep, pv_ep), (pk_cpu, pv_cpu)
    _assert_ran_on(ep, EP)


def genai_style_model(*, hq, hkv, d, dt, layers=2, max_len=64, seed=0):
    """What onnxruntime-genai's builder emits around GQA: hidden -> MatMul (packed QKV) ->
    GQA(do_rotary, cos/sin initializers, past_key_values.N.* -> present.N.*) -> MatMul (o_proj)
    -> next layer; seqlens_k / total_sequence_length computed in-graph from attention_mask."""
    rng = np.random.default_rng(seed)
    t = _onnx_t(dt)
    vi = helper.make_tensor_value_info
    hidden = hq * d
    cos, sin = _rotary_caches(max_len, d, dt)
    inits = [numpy_helper.from_array(cos, "cos_cache"), numpy_helper.from_array(sin, "sin_cache"),
             numpy_helper.from_array(np.array([1], np.int64), "axes1"),
             numpy_helper.from_array(np.array(1, np.int64), "one"),
             numpy_helper.from_array(np.array(1, np.int64), "idx1")]
    nodes = [helper.make_node("ReduceSum", ["attention_mask", "axes1"], ["mask_sum"], keepdims=0),
             helper.make_node("Sub", ["mask_sum", "one"], ["seqlens_k_i64"]),
             helper.make_node("Cast", ["seqlens_k_i64"], ["seqlens_k"], to=TensorProto.INT32),
             helper.make_node("Shape", ["attention_mask"], ["mask_shape"]),
             helper.make_node("Gather", ["mask_shape", "idx1"], ["total_i64"], axis=0),
             helper.make_node("Cast", ["total_i64"], ["total_sequence_length"], to=TensorProto.INT32)]
    inputs = [vi("input_embeds", t, ["B", "S", hidden]), vi("attention_mask", TensorProto.INT64, ["B", "T"])]
    outputs = []
    x = "input_embeds"
    for layer in range(layers):
        wqkv = (rng.standard_normal((hidden, (hq + 2 * hkv) * d)) / np.sqrt(hidden)).astype(dt)
        wo = (rng.standard_normal((hidden, hidden)) / np.sqrt(hidden)).astype(dt)
        inits += [numpy_helper.from_array(wqkv, f"wqkv.{layer}"), numpy_helper.from_array(wo, f"wo.{layer}")]
        pk, pv = f"past_key_values.{layer}.key", f"past_key_values.{layer}.value"
        nodes += [helper.make_node("MatMul", [x, f"wqkv.{layer}"], [f"qkv.{layer}"]),
                  helper.make_node("GroupQueryAttention",
                                   [f"qkv.{layer}", "", "", pk, pv, "seqlens_k", "total_sequence_length",
                                    "cos_cache", "sin_cache"],
                                   [f"attn.{layer}", f"present.{layer}.key", f"present.{layer}.value"],
                                   domain=MS, name=f"gqa.{layer}", num_heads=hq, kv_num_heads=hkv, do_rotary=1,
                                   rotary_interleaved=0, local_window_size=-1),
                  helper.make_node("MatMul", [f"attn.{layer}", f"wo.{layer}"], [f"h.{layer}"])]
        inputs += [vi(pk, t, ["B", hkv, "P", d]), vi(pv, t, ["B", hkv, "P", d])]
        outputs += [vi(f"present.{layer}.key", t, None), vi(f"present.{layer}.value", t, None)]
        x = f"h.{layer}"
    outputs.insert(0, vi(x, t, None))
    g = helper.make_graph(nodes, "genai_like", inputs, outputs, initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)],
                             ir_version=10)


@pytest.mark.parametrize("dt", [np.float32, np.float16], ids=["float32", "float16"])
def test_genai_style_graph(dt, tmp_path):
    """Two layers, packed QKV from a MatMul, rotary, seqlens_k/total from the mask in-graph;
    right-padded batch-2 prompt then 10 decode steps. Both GQA nodes run on the EP."""
    hq, hkv, d, layers = 8, 2, 16, 2
    model = genai_style_model(hq=hq, hkv=hkv, d=d, dt=dt, layers=layers)
    ep, cpu = _sessions(model, tmp_path)
    rng = np.random.default_rng(13)
    B, S = len(PROMPT_LENS), int(PROMPT_LENS.max())
    past = {side: {f"past_key_values.{l}.{kv}": np.zeros((B, hkv, 0, d), dt) for l in range(layers)
                   for kv in ("key", "value")} for side in ("ep", "cpu")}
    for step in range(DECODE_STEPS + 1):
        n = S if step == 0 else 1
        mask = np.zeros((B, S + step), np.int64)
        for b in range(B):
            mask[b, :PROMPT_LENS[b] + step] = 1
        feeds = {"input_embeds": rng.standard_normal((B, n, hq * d)).astype(dt), "attention_mask": mask}
        outs = {}
        for side, sess in (("ep", ep), ("cpu", cpu)):
            res = sess.run(None, dict(feeds, **past[side]))
            outs[side] = res
            past[side] = {f"past_key_values.{l}.{kv}": res[1 + 2 * l + i] for l in range(layers)
                          for i, kv in enumerate(("key", "value"))}
        # Layer 0's presents are copies of the same inputs: bit-exact. Later layers' K/V are
        # MatMuls of the previous layer's attention output, so they carry its tolerance.
        for i in range(1, 1 + 2 * layers):
            if i <= 2:
                np.testing.assert_array_equal(outs["ep"][i], outs["cpu"][i], err_msg=f"step {step} present #{i}")
            else:
                _compare(outs["ep"][i], outs["cpu"][i], dt, f"step {step} present #{i}")
        # Rows of padding carry no meaning downstream: compare the valid rows of the last layer.
        for b in range(B):
            valid = slice(0, PROMPT_LENS[b]) if step == 0 else slice(0, 1)
            _compare(outs["ep"][0][b, valid], outs["cpu"][0][b, valid], dt, f"step {step} row {b}")
    got = _gqa_providers(ep)
    assert set(got) == {EP} and len(got) == layers * (DECODE_STEPS + 1), got


UNSUPPORTED = [
    # (id, model kwargs, logged reason)
    ("smooth_softmax", dict(extra_attrs={"smooth_softmax": 1}), "smooth_softmax=1"),
    ("head_sink", dict(extra_inputs=[("head_sink", TensorProto.FLOAT, [4])]), "input head_sink is given"),
    ("position_ids", dict(rotary="half", extra_inputs=[("position_ids", TensorProto.INT64, ["B", "S"])]),
     "input position_ids is given"),
]


@pytest.mark.parametrize("name,kw,reason", UNSUPPORTED, ids=[u[0] for u in UNSUPPORTED])
def test_unsupported_is_left_to_ort(name, kw, reason, tmp_path, capfd):
    """A GQA node with a feature the EP does not implement is refused in GetCapability
    (reason logged at verbose level) and runs on ORT's CPU kernel with ORT's output."""
    hq, hkv, d = 4, 2, 16
    model = gqa_model(hq=hq, hkv=hkv, d=d, **kw)
    ep, cpu = _sessions(model, tmp_path, verbose=True)
    assert f"leaving to ORT: GroupQueryAttention: {reason}" in capfd.readouterr().err
    rng = np.random.default_rng(14)
    B, S = 2, 5
    feeds = _new_tokens(rng, B, S, hq, hkv, d, np.float32, False)
    feeds.update(past_key=np.zeros((B, hkv, 0, d), np.float32), past_value=np.zeros((B, hkv, 0, d), np.float32),
                 seqlens_k=np.array([4, 2], np.int32), total_sequence_length=np.array(S, np.int32))
    if name == "head_sink":
        feeds["head_sink"] = rng.standard_normal(hq).astype(np.float32)
    if name == "position_ids":
        feeds["position_ids"] = np.tile(np.arange(3, 3 + S, dtype=np.int64), (B, 1))
    got, want = ep.run(None, feeds), cpu.run(None, feeds)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    _assert_ran_on(ep, CPU)


def test_bad_seqlens_k_fails_the_run_with_the_reason(tmp_path):
    model = gqa_model(hq=4, hkv=2, d=16)
    ep, _ = _sessions(model, tmp_path)
    rng = np.random.default_rng(15)
    feeds = _new_tokens(rng, 1, 3, 4, 2, 16, np.float32, False)
    feeds.update(past_key=np.zeros((1, 2, 0, 16), np.float32), past_value=np.zeros((1, 2, 0, 16), np.float32),
                 seqlens_k=np.array([3], np.int32), total_sequence_length=np.array(3, np.int32))
    with pytest.raises(Exception, match=r"GroupQueryAttention: seqlens_k\[0\]; expected in \[0, 3\), got 3"):
        ep.run(None, feeds)
