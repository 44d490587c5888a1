"""Mini decoders with ONNX Runtime's contrib attentions, as its transformer optimizer writes them.

- ``mha_block`` (for ``rw_graphs.decoder``): ``com.microsoft.MultiHeadAttention`` with 3-D
  Q/K/V, BNSH ``past_key_{l}``/``past_value_{l}`` and the masks of the rotary attention fusion
  (``attention_bias`` [B, 1, S, T] additive from the causal + padding mask) or an int32
  ``key_padding_mask`` ([B, T], [B, S, T] or [B]), optional projection ``bias``.
- ``ms_attention_decoder``: ``com.microsoft.Attention`` (QKV projection inside the op) with the
  stacked ``past_{l}`` [2, B, N, P, D] → ``present_{l}``, GPT-2 style learned positions read
  from ``Shape(past_0)`` (the past length) and an int32 ``mask_index`` from ``attention_mask``.
"""
import math

import numpy as np
from onnx import TensorProto as TP

import rw_graphs as G

F = TP.FLOAT
MS = "com.microsoft"
FMIN = float(np.finfo(np.float32).min)


def _int32_mask(g):
    if "mask32" not in g.__dict__:
        g.mask32 = g.node("Cast", ["attention_mask"], to=TP.INT32)
    return g.mask32


def _past_len(g, past):
    """int64 [1]: the past length, Shape(past)[2] (BNSH)."""
    return g.dim(past, 2)


def mha_block(g, layer, q3, k3, v3, *, hq, hkv, d, mask="bias", unidirectional=0, bias=False, scale=None,
              mask_filter_value=None, extra_inputs=(), qk_output=False):
    """``mask``: "bias" (attention_bias from the transformers-style causal + padding mask, finfo.min),
    "kpm2d" / "kpm3d" / "kpm1d" (int32 key_padding_mask [B, T] / [B, S, T] / [B] end positions) or ""."""
    assert hq == hkv, "MultiHeadAttention has no GQA"
    pk, pv, prk, prv = g.past_io(layer, hkv, d)
    attn_bias, kpm, b = "", "", ""
    if mask == "bias":
        if "hf_bias" not in g.__dict__:
            allow = G.hf_bool_mask(g, q3, g.node("Squeeze", [_past_len(g, pk)]))
            g.hf_bias = g.node("Where", [allow, g.f32(0.0), g.f32(FMIN)])
        attn_bias = g.hf_bias
    elif mask == "kpm2d":
        kpm = _int32_mask(g)
    elif mask == "kpm3d":  # [B, S, T]: the padding row repeated for every query
        shp = g.node("Concat", [g.dim("attention_mask", 0), g.dim("input_ids", 1), g.dim("attention_mask", 1)], axis=0)
        kpm = g.node("Expand", [g.node("Unsqueeze", [_int32_mask(g), g.i64([1])]), shp])
    elif mask == "kpm1d":  # end positions: the valid length of each row
        kpm = g.node("Cast", [g.node("ReduceSum", ["attention_mask", g.i64([1])], keepdims=0)], to=TP.INT32)
    if bias:
        b = g.f32(g.rng.standard_normal(3 * hq * d) * 0.3, "qkv_bias")
    attrs = {"num_heads": hq, "unidirectional": unidirectional}
    if scale is not None:
        attrs["scale"] = scale
    if mask_filter_value is not None:
        attrs["mask_filter_value"] = mask_filter_value
    ins = [q3, k3, v3, b, kpm, attn_bias, pk, pv, *extra_inputs]
    outs = [g.name("mha_y"), prk, prv] + ([g.name("qk")] if qk_output else [])
    y = g.node("MultiHeadAttention", ins, out=outs, domain=MS, **attrs)[0]
    if qk_output:
        g.out(outs[3], F, None)
    return y


def ms_attention_decoder(*, layers=2, vocab=50, hidden=32, heads=4, d=8, mask="2d", unidirectional=1, bias=True,
                         scale=None, mask_filter_value=None, qkv_hidden_sizes=None, opset=17, seed=0, **extra_attrs):
    """GPT-2-like decoder around ``com.microsoft.Attention``; ``mask``: "2d", "3d", "1d", "4d" or ""."""
    g = G.GB(seed)
    g.inp("input_ids", TP.INT64, ["batch", "seq"])
    g.inp("attention_mask", TP.INT64, ["batch", "total"])
    pasts = [g.inp(f"past_{l}", F, [2, "batch", heads, "past", d]) for l in range(layers)]
    for l in range(layers):
        g.out(f"present_{l}", F, [2, "batch", heads, "total", d])
    # learned positions past + arange(S), the past length read from Shape(past_0)[3]
    past_len = g.node("Squeeze", [g.dim(pasts[0], 3)])
    s = g.node("Squeeze", [g.dim("input_ids", 1)])
    pos = g.node("Range", [past_len, g.node("Add", [past_len, s]), g.i64(1)])
    h = g.node("Add", [g.node("Gather", [g.weight([vocab, hidden], 1.0), "input_ids"]),
                       g.node("Gather", [g.weight([64, hidden], 0.5), pos])])
    w = 1.0 / math.sqrt(hidden)
    m = ""
    if mask == "2d":
        m = _int32_mask(g)
    elif mask == "3d":
        shp = g.node("Concat", [g.dim("attention_mask", 0), g.dim("input_ids", 1), g.dim("attention_mask", 1)], axis=0)
        m = g.node("Expand", [g.node("Unsqueeze", [_int32_mask(g), g.i64([1])]), shp])
    elif mask == "1d":
        m = g.node("Cast", [g.node("ReduceSum", ["attention_mask", g.i64([1])], keepdims=0)], to=TP.INT32)
    elif mask == "4d":
        m = g.const(np.tril(np.ones((64, 64), np.int32))[None, None], "megatron_mask")
    for l in range(layers):
        attrs = {"num_heads": heads, "unidirectional": unidirectional, **extra_attrs}
        if scale is not None:
            attrs["scale"] = scale
        if mask_filter_value is not None:
            attrs["mask_filter_value"] = mask_filter_value
        sizes = qkv_hidden_sizes or [heads * d] * 3
        if qkv_hidden_sizes is not None:
            attrs["qkv_hidden_sizes"] = list(qkv_hidden_sizes)
        wqkv = g.weight([hidden, sum(sizes)], 2 * w, "qkv_weight")
        b = g.f32(g.rng.standard_normal(sum(sizes)) * 0.3, "qkv_bias") if bias else ""
        y = g.node("Attention", [h, wqkv, b, m, pasts[l]], out=[g.name("att_y"), f"present_{l}"], domain=MS,
                   **attrs)[0]
        h = g.node("Add", [h, g.node("MatMul", [y, g.weight([sizes[2], hidden], 1.0 / math.sqrt(sizes[2]))])])
    g.node("MatMul", [h, g.weight([hidden, vocab], w)], out="logits")
    g.out("logits", F, ["batch", "seq", vocab])
    return g.model([("", opset), (MS, 1)])
