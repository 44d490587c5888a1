"""Small decoder graphs (onnx.helper only) reproducing each pattern the rewrite must recognise.

Every model is a mini decoder: ``input_ids`` [B, S] → embedding → per layer
(q/k/v projections → attention block → o_proj + residual) → ``logits``
[B, S, V], with ``attention_mask`` [B, past + S] (int64, 1 = real token) and
loop-carried ``past_key_{l}``/``past_value_{l}`` (BNSH) → ``present_key_{l}``/
``present_value_{l}``. The attention block is what differs:

- ``gqa``: ``com.microsoft.GroupQueryAttention`` as the onnxruntime-genai
  builder writes it (seqlens_k = ReduceSum(mask) − 1 as int32,
  total_sequence_length = mask width; optional packed QKV, ``do_rotary``
  with cos/sin caches, ``local_window_size``, ``softcap``).
- ``attention``: ONNX ``Attention`` (opset 23) with its own past/present
  (3-D or 4-D inputs), is_causal + bool padding mask.
- ``concat_attention``: torch.onnx dynamo opset 23: ``Concat(past, k)`` →
  repeat_kv (Unsqueeze/Expand/Reshape) → stateless ``Attention`` with a bool
  mask built from ``attention_mask`` and ``Shape(past)`` (cache position).
- ``decomposed``: torchlib opset 18 (Reshape/Transpose/Reshape Kᵀ, sqrt(scale)
  on Q and K, Where(bool, 0, -inf) + Add, Softmax, NaN guard) or transformers
  eager/GPT-2 (Transpose, Div, Where(causal, x, min), Add(padding), Softmax).
- ``gpt2_legacy``: GPT-2 eager with its causal mask sliced from a constant
  buffer at the key length read from ``Shape(present_key)`` (no
  ``attention_mask`` needed: ``decoder(..., attention_mask=False)``).
"""
import math

import numpy as np
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper

F = TP.FLOAT


class GB:
    """Tiny graph builder: unique names, constants, nodes."""

    def __init__(self, seed=0):
        self.nodes, self.inits, self.inputs, self.outputs = [], [], [], []
        self.n = 0
        self.rng = np.random.default_rng(seed)

    def name(self, hint):
        self.n += 1
        return f"{hint}_{self.n}"

    def const(self, value, hint="c"):
        name = self.name(hint)
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def i64(self, values, hint="i"):
        return self.const(np.asarray(values, dtype=np.int64), hint)

    def f32(self, values, hint="f"):
        return self.const(np.asarray(values, dtype=np.float32), hint)

    def weight(self, shape, scale=0.3, hint="w"):
        return self.f32(self.rng.standard_normal(shape) * scale, hint)

    def node(self, op, ins, n_out=1, domain=None, out=None, **attrs):
        outs = out if out is not None else [self.name(op.lower()) for _ in range(n_out)]
        outs = [outs] if isinstance(outs, str) else outs
        self.nodes.append(oh.make_node(op, list(ins), outs, name=self.name(op), domain=domain, **attrs))
        return outs[0] if len(outs) == 1 else outs

    def inp(self, name, elem, shape):
        self.inputs.append(oh.make_tensor_value_info(name, elem, shape))
        return name

    def out(self, name, elem, shape):
        self.outputs.append(oh.make_tensor_value_info(name, elem, shape))

    def model(self, opsets, name="m"):
        g = oh.make_graph(self.nodes, name, self.inputs, self.outputs, initializer=self.inits)
        m = oh.make_model(g, opset_imports=[oh.make_opsetid(d, v) for d, v in opsets])
        m.ir_version = 10
        return m

    # layout helpers
    def dim(self, x, axis):
        return self.node("Shape", [x], start=axis, end=axis + 1)

    def to_bnsh(self, x3, heads, d):
        return self.node("Transpose", [self.node("Reshape", [x3, self.i64([0, 0, heads, d])])], perm=[0, 2, 1, 3])

    def from_bnsh(self, x4, width):
        t = self.node("Transpose", [x4], perm=[0, 2, 1, 3])
        return self.node("Reshape", [t, self.i64([0, 0, width])])

    def repeat_kv(self, x4, hkv, n_rep, d, tile=False):
        """transformers repeat_kv (interleave: Unsqueeze axis 2) or tile (axis 1)."""
        if n_rep == 1:
            return x4
        b, t = self.dim(x4, 0), self.dim(x4, 2)
        if tile:
            u = self.node("Unsqueeze", [x4, self.i64([1])])
            shp = self.node("Concat", [b, self.i64([n_rep]), self.i64([hkv]), t, self.i64([d])], axis=0)
        else:
            u = self.node("Unsqueeze", [x4, self.i64([2])])
            shp = self.node("Concat", [b, self.i64([hkv]), self.i64([n_rep]), t, self.i64([d])], axis=0)
        e = self.node("Expand", [u, shp])
        return self.node("Reshape", [e, self.node("Concat", [b, self.i64([hkv * n_rep]), t, self.i64([d])], axis=0)])

    past_dim, total_dim = "past", "total"  # dim_param names of past/present sequence axes

    def past_io(self, layer, hkv, d, past=None, total=None):
        past, total = past or self.past_dim, total or self.total_dim
        pk = self.inp(f"past_key_{layer}", F, ["batch", hkv, past, d])
        pv = self.inp(f"past_value_{layer}", F, ["batch", hkv, past, d])
        self.out(f"present_key_{layer}", F, ["batch", hkv, total, d])
        self.out(f"present_value_{layer}", F, ["batch", hkv, total, d])
        return pk, pv, f"present_key_{layer}", f"present_value_{layer}"


def hf_bool_mask(g: GB, seq_len_src, past_len):
    """bool [B,1,S,T]: (j <= past + i) & attention_mask[b, j] (transformers' causal + padding mask)."""
    s = g.node("Squeeze", [g.dim(seq_len_src, 1)])
    t = g.node("Squeeze", [g.dim("attention_mask", 1)])
    zero, one = g.i64(0), g.i64(1)
    rows = g.node("Add", [g.node("Range", [zero, s, one]), past_len])
    rows = g.node("Reshape", [rows, g.i64([1, 1, -1, 1])])
    cols = g.node("Reshape", [g.node("Range", [zero, t, one]), g.i64([1, 1, 1, -1])])
    causal = g.node("LessOrEqual", [cols, rows])
    pad = g.node("Unsqueeze", [g.node("Cast", ["attention_mask"], to=TP.BOOL), g.i64([1, 2])])
    return g.node("And", [causal, pad])


def decoder(block, *, layers=1, vocab=50, hidden=32, hq=4, hkv=2, d=8, opsets=(("", 23),), seed=0,
            mask_dims=("batch", "total"), position_ids=False, seq_dims=("past", "total"), attention_mask=True,
            **kw):
    """A mini decoder around ``block(g, layer, q3, k3, v3) -> y3`` (3-D [B, S, H*D] tensors).

    ``seq_dims``: dim_param names of the past and present sequence axes; ``attention_mask=False``:
    no such input (only blocks that build their masks from shapes work then)."""
    g = GB(seed)
    g.past_dim, g.total_dim = seq_dims
    g.inp("input_ids", TP.INT64, ["batch", "seq"])
    if attention_mask:
        g.inp("attention_mask", TP.INT64, list(mask_dims))
    if position_ids:
        g.inp("position_ids", TP.INT64, ["batch", "seq"])
    w = 1.0 / math.sqrt(hidden)
    h = g.node("Gather", [g.weight([vocab, hidden], 1.0), "input_ids"])
    for layer in range(layers):
        q3 = g.node("MatMul", [h, g.weight([hidden, hq * d], 2 * w)])
        k3 = g.node("MatMul", [h, g.weight([hidden, hkv * d], 2 * w)])
        v3 = g.node("MatMul", [h, g.weight([hidden, hkv * d], w)])
        y3 = block(g, layer, q3, k3, v3, hq=hq, hkv=hkv, d=d, **kw)
        h = g.node("Add", [h, g.node("MatMul", [y3, g.weight([hq * d, hidden], 1.0 / math.sqrt(hq * d))])])
    g.node("MatMul", [h, g.weight([hidden, vocab], w)], out="logits")
    g.out("logits", F, ["batch", "seq", vocab])
    return g.model(list(opsets))


# -- attention blocks --------------------------------------------------------------------------

def gqa_block(g, layer, q3, k3, v3, *, hq, hkv, d, packed=False, do_rotary=False, window=-1, softcap=0.0,
              scale=None, smooth_softmax=0, max_pos=64, interleaved=0):
    pk, pv, prk, prv = g.past_io(layer, hkv, d)
    if "seqlens_k" not in g.__dict__:
        red = g.node("ReduceSum", ["attention_mask", g.i64([1])], keepdims=0)
        g.seqlens_k = g.node("Cast", [g.node("Sub", [red, g.i64(1)])], to=TP.INT32)
        g.total = g.node("Cast", [g.node("Squeeze", [g.dim("attention_mask", 1)])], to=TP.INT32)
        ang = np.arange(max_pos)[:, None] * (1.0 / 10000 ** (np.arange(0, d, 2) / d))[None]
        g.cos, g.sin = g.f32(np.cos(ang), "cos_cache"), g.f32(np.sin(ang), "sin_cache")
    ins = [g.node("Concat", [q3, k3, v3], axis=-1), "", ""] if packed else [q3, k3, v3]
    ins += [pk, pv, g.seqlens_k, g.total]
    if do_rotary:
        ins += [g.cos, g.sin]
    attrs = dict(num_heads=hq, kv_num_heads=hkv, local_window_size=window, softcap=softcap, do_rotary=int(do_rotary),
                 rotary_interleaved=interleaved)
    if scale is not None:
        attrs["scale"] = scale
    if smooth_softmax:
        attrs["smooth_softmax"] = smooth_softmax
    y = g.node("GroupQueryAttention", ins, out=[g.name("gqa_y"), prk, prv], domain="com.microsoft", **attrs)[0]
    return y


def attention_block(g, layer, q3, k3, v3, *, hq, hkv, d, rank=4, with_past=True, is_causal=1, mask="bool",
                    softcap=0.0, scale=None, left_window=None):
    """ONNX Attention with its own past/present; mask from attention_mask ([B,1,1,T] bool or additive)."""
    attrs = {"is_causal": is_causal}
    if softcap:
        attrs["softcap"] = softcap
    if scale is not None:
        attrs["scale"] = scale
    if left_window is not None:
        attrs["left_window_size"] = left_window
    if rank == 3:
        attrs.update(q_num_heads=hq, kv_num_heads=hkv)
        q, k, v = q3, k3, v3
    else:
        q, k, v = g.to_bnsh(q3, hq, d), g.to_bnsh(k3, hkv, d), g.to_bnsh(v3, hkv, d)
    m = ""
    if mask:  # padding mask [B, 1, S, T] (ORT's Attention wants the S axis spelled out)
        mb = g.node("Unsqueeze", [g.node("Cast", ["attention_mask"], to=TP.BOOL), g.i64([1, 2])])
        shp = g.node("Concat", [g.dim("attention_mask", 0), g.i64([1]), g.dim(q3, 1), g.dim("attention_mask", 1)],
                     axis=0)
        mb = g.node("Expand", [mb, shp])
        m = mb if mask == "bool" else g.node("Where", [mb, g.f32(0.0), g.f32(-np.inf)])
    if with_past:
        pk, pv, prk, prv = g.past_io(layer, hkv, d)
        y = g.node("Attention", [q, k, v, m, pk, pv], out=[g.name("att_y"), prk, prv], **attrs)[0]
    else:
        g.out(f"present_key_{layer}", F, None)
        g.out(f"present_value_{layer}", F, None)
        y = g.node("Attention", [q, k, v, m], out=[g.name("att_y"), f"present_key_{layer}", f"present_value_{layer}"],
                   **attrs)[0]
    return y if rank == 3 else g.from_bnsh(y, hq * d)


def concat_attention_block(g, layer, q3, k3, v3, *, hq, hkv, d, is_causal=0, tile=False, scale=None):
    pk, pv, prk, prv = g.past_io(layer, hkv, d)
    q, k, v = g.to_bnsh(q3, hq, d), g.to_bnsh(k3, hkv, d), g.to_bnsh(v3, hkv, d)
    g.node("Concat", [pk, k], axis=-2, out=prk)
    g.node("Concat", [pv, v], axis=-2, out=prv)
    kx = g.repeat_kv(prk, hkv, hq // hkv, d, tile=tile)
    vx = g.repeat_kv(prv, hkv, hq // hkv, d, tile=tile)
    ins = [q, kx, vx]
    attrs = {"is_causal": is_causal}
    if scale is not None:
        attrs["scale"] = scale
    if not is_causal:
        past_len = g.node("Squeeze", [g.dim(pk, 2)])   # cache position from Shape(past)
        ins.append(hf_bool_mask(g, q3, past_len))
    return g.from_bnsh(g.node("Attention", ins, **attrs), hq * d)


def decomposed_block(g, layer, q3, k3, v3, *, hq, hkv, d, style="torchlib", tile=False, softcap=0.0,
                     extra_present_consumer=False):
    """torchlib opset-18 SDPA decomposition, transformers eager (GPT-2 style) or the C10b chain."""
    pk, pv, prk, prv = g.past_io(layer, hkv, d)
    q, k, v = g.to_bnsh(q3, hq, d), g.to_bnsh(k3, hkv, d), g.to_bnsh(v3, hkv, d)
    g.node("Concat", [pk, k], axis=2, out=prk)
    g.node("Concat", [pv, v], axis=2, out=prv)
    if extra_present_consumer:
        g.node("ReduceSum", [prk], out=f"present_checksum_{layer}", keepdims=0)
        g.out(f"present_checksum_{layer}", F, [])
    kx = g.repeat_kv(prk, hkv, hq // hkv, d, tile=tile)
    vx = g.repeat_kv(prv, hkv, hq // hkv, d, tile=tile)
    past_len = g.node("Squeeze", [g.dim(pk, 2)])
    allow = hf_bool_mask(g, q3, past_len)
    if style == "torchlib":
        sq = g.f32(math.sqrt(1.0 / math.sqrt(d)))
        kd = g.dim(kx, 3)
        k3d = g.node("Reshape", [kx, g.node("Concat", [g.i64([-1]), g.dim(kx, 2), kd], axis=0)])
        kt = g.node("Transpose", [k3d], perm=[0, 2, 1])
        kt = g.node("Reshape", [kt, g.node("Concat", [g.dim(kx, 0), g.dim(kx, 1), kd, g.dim(kx, 2)], axis=0)])
        s = g.node("MatMul", [g.node("Mul", [q, sq]), g.node("Mul", [kt, sq])])
        s = g.node("Add", [s, g.node("Where", [allow, g.f32(0.0), g.f32(-np.inf)])])
        p = g.node("Softmax", [s], axis=-1)
        p = g.node("Where", [g.node("IsNaN", [p]), g.f32(0.0), p])
    elif style == "eager":
        s = g.node("MatMul", [q, g.node("Transpose", [kx], perm=[0, 1, 3, 2])])
        s = g.node("Div", [s, g.f32(math.sqrt(d))])
        if softcap:
            s = g.node("Mul", [g.node("Tanh", [g.node("Div", [s, g.f32(softcap)])]), g.f32(softcap)])
        causal_only = g.node("Or", [allow, g.node("Not", [g.node("Unsqueeze", [g.node(
            "Cast", ["attention_mask"], to=TP.BOOL), g.i64([1, 2])])])])
        s = g.node("Where", [causal_only, s, g.f32(np.finfo(np.float32).min)])
        pad = g.node("Unsqueeze", [g.node("Cast", ["attention_mask"], to=TP.BOOL), g.i64([1, 2])])
        s = g.node("Add", [s, g.node("Where", [pad, g.f32(0.0), g.f32(np.finfo(np.float32).min)])])
        p = g.node("Softmax", [s], axis=3)
    elif style == "c10b":  # only scaling: Mul(Q, 0.5) -> Add(., 0) -> Identity (CASES C10b)
        qs = g.node("Identity", [g.node("Add", [g.node("Mul", [q, g.f32(0.5)]), g.f32(0.0)])])
        s = g.node("MatMul", [qs, g.node("Transpose", [kx], perm=[0, 1, 3, 2])])
        s = g.node("Add", [s, g.node("Where", [allow, g.f32(0.0), g.f32(-np.inf)])])
        p = g.node("Softmax", [s], axis=-1)
    else:
        raise ValueError(style)
    return g.from_bnsh(g.node("MatMul", [p, vx]), hq * d)


def gpt2_legacy_block(g, layer, q3, k3, v3, *, hq, hkv, d, max_pos=64, padding=None):
    """GPT-2 as transformers < 4.45 exports it (eager attention): ``Concat(past, k)``, the key length
    ``T`` read from ``Shape(present_key)`` and the query length ``S`` from the query, the causal mask
    sliced from a constant lower-triangular buffer ``bias[:, :, T-S:T, :T]``, then ``Where(causal,
    scores, finfo.min)``; with ``padding`` (the graph has ``attention_mask``) an additive padding mask."""
    pk, pv, prk, prv = g.past_io(layer, hkv, d)
    q, k, v = g.to_bnsh(q3, hq, d), g.to_bnsh(k3, hkv, d), g.to_bnsh(v3, hkv, d)
    g.node("Concat", [pk, k], axis=-2, out=prk)
    g.node("Concat", [pv, v], axis=-2, out=prv)
    key_len = g.node("Shape", [prk], start=2, end=3)          # the key length from the present's shape
    query_len = g.dim(q, 2)
    if "gpt2_bias" not in g.__dict__:
        g.gpt2_bias = g.const(np.tril(np.ones((max_pos, max_pos), bool))[None, None], "bias")
    start = g.node("Sub", [key_len, query_len])
    causal = g.node("Slice", [g.gpt2_bias, g.node("Concat", [start, g.i64([0])], axis=0),
                              g.node("Concat", [key_len, key_len], axis=0), g.i64([2, 3])])
    kx = g.repeat_kv(prk, hkv, hq // hkv, d)
    vx = g.repeat_kv(prv, hkv, hq // hkv, d)
    s = g.node("Div", [g.node("MatMul", [q, g.node("Transpose", [kx], perm=[0, 1, 3, 2])]), g.f32(math.sqrt(d))])
    s = g.node("Where", [causal, s, g.f32(np.finfo(np.float32).min)])
    if padding:
        pad = g.node("Unsqueeze", [g.node("Cast", ["attention_mask"], to=TP.BOOL), g.i64([1, 2])])
        s = g.node("Add", [s, g.node("Where", [pad, g.f32(0.0), g.f32(np.finfo(np.float32).min)])])
    p = g.node("Softmax", [s], axis=-1)
    return g.from_bnsh(g.node("MatMul", [p, vx]), hq * d)


def tensor_scatter_block(g, layer, q3, k3, v3, *, hq, hkv, d, max_len=16):
    """Opset-24 in-place idiom: TensorScatter into static [B, Hkv, M, D] buffers + Attention(nonpad_kv_seqlen)."""
    pk = g.inp(f"past_key_{layer}", F, ["batch", hkv, max_len, d])
    pv = g.inp(f"past_value_{layer}", F, ["batch", hkv, max_len, d])
    g.out(f"present_key_{layer}", F, ["batch", hkv, max_len, d])
    g.out(f"present_value_{layer}", F, ["batch", hkv, max_len, d])
    if "write_indices" not in [i.name for i in g.inputs]:
        g.inp("write_indices", TP.INT64, ["batch"])
        g.inp("nonpad_kv_seqlen", TP.INT64, ["batch"])
    q, k, v = g.to_bnsh(q3, hq, d), g.to_bnsh(k3, hkv, d), g.to_bnsh(v3, hkv, d)
    kc = g.node("TensorScatter", [pk, k, "write_indices"], out=f"present_key_{layer}")
    vc = g.node("TensorScatter", [pv, v, "write_indices"], out=f"present_value_{layer}")
    y = g.node("Attention", [q, kc, vc, "", "", "", "nonpad_kv_seqlen"], is_causal=1)
    return g.from_bnsh(y, hq * d)
