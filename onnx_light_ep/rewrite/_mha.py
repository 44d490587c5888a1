"""``com.microsoft.MultiHeadAttention`` and ``com.microsoft.Attention`` → ``ai.onnx_light.CacheAttention``.

ONNX Runtime's transformer optimizer (``onnxruntime.transformers``) writes these: ``Attention``
with the stacked ``past`` for GPT-2 (``models/gpt2/convert_to_onnx.py -o``) and
``MultiHeadAttention`` with ``past_key``/``past_value`` for Llama-style models (rotary
attention fusion, ``models/llama``). Semantics source: ONNX Runtime's contrib operator doc
(docs/ContribOperators.md, both ops) and ORT 1.32's CPU kernels, checked per variant in
tests/rewrite/test_rewrite_mha.py (the original on plain ORT against the conversion):

- Scores ``scale · Q·Kᵀ`` (``scale`` attribute, default ``1/sqrt(head_size)``) over
  ``K = concat(past, new)``; no GQA (``num_heads`` for Q, K and V).
- ``unidirectional = 1``: query row ``i`` sees key ``j <= P + i`` (bottom-right, P = past
  length); the CPU kernels drop the future keys (they do not add ``mask_filter_value``), which
  is CacheAttention's ``is_causal = 1``.
- Padding masks (``Attention.mask_index``, ``MultiHeadAttention.key_padding_mask``, int32, a
  key is kept where the value is ``> 0``) add ``mask_filter_value`` (default −10000) to the
  scores of the other keys. The rewrite computes exactly that additive float mask in the
  graph: ``[B, T]`` (raw, over past + new keys) → ``[B, 1, 1, T]``, ``[B, S, T]`` →
  ``[B, 1, S, T]``, ``[B]`` (end positions, right padding) → keys ``j >= end_b``; the width T
  is the ``attention_mask`` input's, so the ``[B]`` form needs that input.
- ``MultiHeadAttention.attention_bias`` ([B|1, N|1, S, T], float) is added to the scores as
  it is; ``bias`` (the Q/K/V projection bias) is added to Q, K and V before the attention.
- ``Attention`` is the QKV projection and the attention in one: ``input · weights + bias``
  ([B, S, Din] · [Din, Dq + Dk + Dv]; ``qkv_hidden_sizes`` or three equal parts) split into
  Q, K, V; the rewrite emits that MatMul, Add and Split. ``past`` is one
  ``[2, B, N, P, D]`` tensor (key at index 0, value at 1) and ``present`` ``[2, B, N, T, D]``:
  the plan marks it ``past_stacked``.

Refused (left as they are, with the reason): ``past_present_share_buffer`` /
``past_sequence_length`` (a fixed max-length buffer), ``cache_indirection`` (beam search),
``do_rotary`` on ``Attention`` and ``attention_bias`` together with ``past`` (ORT's CPU kernel
rejects both), packed QKV / KV and BNSH key/value (cross-attention) on
``MultiHeadAttention``, the ``[3B+2]`` and Megatron ``[B, 1, M, M]`` masks and a 1-D mask of
unprovable length, a used ``qk`` output, presents without pasts, pasts that are not graph
inputs, Q and K of provably different lengths, ``unidirectional`` other than 0/1, a NaN
``mask_filter_value`` (and, for every pattern, ``_convert``: a negative or non-finite scale,
which CacheAttention refuses when ORT creates the session).
"""

from __future__ import annotations

import math
from typing import Optional, Union

import numpy as np
import onnx

from ._graph import GraphEditor, attr
from ._kvpath import resolve_identity
from ._plan import node_input as _inp, node_output as _out, is_used as _used
from ._plan import LayerPlan, Operands, Refusal, anchor_name, combine_masks, const_i64, total_length, unsqueeze

MS = "com.microsoft"
PATTERN_MHA = "MultiHeadAttention"
PATTERN_ATTENTION = "com.microsoft.Attention"
DEFAULT_MASK_FILTER_VALUE = -10000.0








def _rank(ed: GraphEditor, name: str) -> Optional[int]:
    d = ed.dims(name)
    return len(d) if d is not None else None


def _same_dim(a, b) -> bool:
    return a is not None and b is not None and a == b


def _mask_form(ed: GraphEditor, mask: str, batch_dim) -> Union[str, tuple]:
    """``"2d"``, ``"3d"`` or ``"1d"`` for a padding mask, or ``("refuse", reason)``."""
    dims = ed.dims(mask)
    if dims is None:
        return ("refuse", f"padding mask {mask!r}: rank unknown (its form [B, T], [B, S, T] or [B] decides "
                          f"what it means)")
    if ed.elem_type(mask) is None:
        return ("refuse", f"padding mask {mask!r}: element type unknown")
    if len(dims) == 2:
        return "2d"
    if len(dims) == 3:
        return "3d"
    if len(dims) == 1:
        if _same_dim(dims[0], batch_dim):
            return "1d"
        return ("refuse", f"1-D padding mask {mask!r} of length {dims[0]!r}: not provably [batch] (end positions); "
                          f"the [2*batch] (end + start) and [3*batch+2] forms mean other things")
    return ("refuse", f"padding mask {mask!r} of rank {len(dims)} (the Megatron [B, 1, M, M] form): ORT's CPU "
                      f"kernel does not run it, so its meaning cannot be checked")


def _padding_bias(ed: GraphEditor, mask: str, form: str, mfv: float, elem_type: int, h: str) -> str:
    """float ``[B, 1, 1|S, T]``: 0 where ``mask > 0`` (key kept), ``mask_filter_value`` elsewhere."""
    np_t = onnx.helper.tensor_dtype_to_np_dtype(elem_type)
    zero = ed.add_const(np.array(0, dtype=np_t), f"{h}/zero")
    fill = ed.add_const(np.array(mfv).astype(np_t), f"{h}/mask_filter_value")
    if form == "1d":  # end positions: keys j >= end_b are padding
        t = ed.add_node1("Squeeze", [total_length(ed)], hint=f"{h}/T")
        cols = ed.add_node1("Range", [const_i64(ed, 0, f"{h}/c0"), t, const_i64(ed, 1, f"{h}/c1")], hint=f"{h}/cols")
        end = ed.add_node1("Cast", [mask], hint=f"{h}/end64", to=onnx.TensorProto.INT64)
        end = unsqueeze(ed, end, [1], f"{h}/end_col")
        keep = ed.add_node1("Less", [cols, end], hint=f"{h}/keep")                       # [B, T]
    else:
        mzero = ed.add_const(np.array(0, dtype=onnx.helper.tensor_dtype_to_np_dtype(ed.elem_type(mask))),
                             f"{h}/mask_zero")
        keep = ed.add_node1("Greater", [mask, mzero], hint=f"{h}/keep")                  # [B, T] or [B, S, T]
    biased = ed.add_node1("Where", [keep, zero, fill], hint=f"{h}/padding_bias")
    axes = [1, 2] if form in ("1d", "2d") else [1]
    return unsqueeze(ed, biased, axes, f"{h}/padding_bias4")


def _attr_problem(unidirectional: int, mask_filter_value: float) -> Optional[str]:
    """Why CacheAttention cannot take these attribute values, or None."""
    if unidirectional not in (0, 1):
        return f"unidirectional={unidirectional}: expected 0 or 1 (its meaning for other values is not documented)"
    if math.isnan(mask_filter_value):
        return "mask_filter_value nan: expected a number (NaN scores poison every padded row)"
    return None


def _past_input(ed: GraphEditor, name: str) -> Optional[str]:
    p = resolve_identity(ed, name)
    return p if p and ed.is_graph_input(p) else None


# -- MultiHeadAttention --------------------------------------------------------------------------

def match_mha(ed: GraphEditor, node: onnx.NodeProto) -> Union[LayerPlan, Refusal, None]:
    """Plan for one ``com.microsoft.MultiHeadAttention``, a :class:`Refusal`, or None (stateless)."""
    if node.op_type != "MultiHeadAttention" or node.domain != MS:
        return None
    name = anchor_name(node)

    def refuse(reason: str) -> Refusal:
        return Refusal(name, PATTERN_MHA, reason)

    query, key, value, bias = _inp(node, 0), _inp(node, 1), _inp(node, 2), _inp(node, 3)
    kpm, attn_bias, past_k, past_v = _inp(node, 4), _inp(node, 5), _inp(node, 6), _inp(node, 7)
    present_k, present_v = _out(node, 1), _out(node, 2)
    if not past_k and not past_v:
        if _used(ed, present_k) or _used(ed, present_v):
            return refuse("present_key/present_value without past_key/past_value (a prefill-only graph) is not "
                          "converted")
        return None  # no cache: an encoder or cross attention, not ours
    if not past_k or not past_v:
        return refuse("only one of past_key/past_value is given")
    if _inp(node, 8):
        return refuse("past_sequence_length is given: past and present share one max_sequence_length buffer "
                      "(DecoderMaskedMultiHeadAttention style), not a growing past")
    if _inp(node, 9):
        return refuse("cache_indirection (beam search over a shared buffer) is not supported")
    if _used(ed, _out(node, 3)):
        return refuse("output qk is used; CacheAttention does not produce attention scores")
    if not present_k or not present_v:
        return refuse("past_key/past_value are inputs but present_key/present_value are not produced")
    pk, pv = _past_input(ed, past_k), _past_input(ed, past_v)
    if pk is None or pv is None:
        return refuse(f"past {past_k if pk is None else past_v!r} is not a graph input (expected the loop-carried "
                      f"past_key/past_value)")
    rq = _rank(ed, query)
    if rq == 5:
        return refuse("packed QKV query [B, S, N, 3, H]: not implemented by ORT's CPU kernel, so its meaning "
                      "cannot be checked")
    if not key or not value:
        return refuse("key/value missing (packed QKV) is not supported")
    rk, rv = _rank(ed, key), _rank(ed, value)
    if rk == 5:
        return refuse("packed KV key [B, L, N, 2, H]: not implemented by ORT's CPU kernel")
    if rk == 4 or rv == 4:
        return refuse("key/value given as BNSH (cross-attention over precomputed keys), not new rows to cache")
    if rq != 3 or rk != 3 or rv != 3:
        return refuse(f"query/key/value ranks {rq}, {rk}, {rv}: expected 3-D [B, S, hidden]")
    n = attr(node, "num_heads")
    qd, kd, vd = ed.last_dim(query), ed.last_dim(key), ed.last_dim(value)
    pkd, pvd = ed.dims(pk), ed.dims(pv)
    if not n or n <= 0:
        return refuse(f"num_heads={n}: expected a positive int")
    d = qd // n if qd and qd % n == 0 else None
    dv = vd // n if vd and vd % n == 0 else None
    if d is None and pkd and len(pkd) == 4 and isinstance(pkd[3], int):
        d = pkd[3]
    if dv is None and pvd and len(pvd) == 4 and isinstance(pvd[3], int):
        dv = pvd[3]
    if d is None or dv is None:
        return refuse(f"head sizes not static (query {qd}, value {vd}, num_heads {n})")
    if kd is not None and kd != n * d:
        return refuse(f"key hidden size {kd} != query hidden size {n * d}")
    for p, dd, what in ((pkd, d, "past_key"), (pvd, dv, "past_value")):
        if p is not None and (len(p) != 4 or (isinstance(p[1], int) and p[1] != n)
                              or (isinstance(p[3], int) and p[3] != dd)):
            return refuse(f"{what} shape {p}: expected [B, {n}, P, {dd}] (BNSH)")
    qdims, kdims = ed.dims(query), ed.dims(key)
    if isinstance(qdims[1], int) and isinstance(kdims[1], int) and qdims[1] != kdims[1]:
        return refuse(f"query length {qdims[1]} != key length {kdims[1]} (cross-attention): CacheAttention "
                      f"appends the rows of its queries")
    elem_type = ed.elem_type(query) or ed.elem_type(pk)
    if elem_type is None:
        return refuse("element type of query unknown")
    form = _mask_form(ed, kpm, qdims[0]) if kpm else None
    if isinstance(form, tuple):
        return refuse(form[1])
    if form == "1d" and total_length(ed) is None:
        return refuse("1-D key_padding_mask (end positions) needs the total length from an attention_mask input")
    bsizes = None
    if bias:
        bd = ed.dims(bias)
        bsizes = [n * d, n * d, n * dv]
        if bd is None or len(bd) != 1 or bd[0] != sum(bsizes):
            return refuse(f"bias shape {bd}: expected [{sum(bsizes)}] (Q, K and V biases)")
    if attn_bias and ed.elem_type(attn_bias) not in (None, elem_type):
        return refuse("attention_bias element type differs from query")
    scale = attr(node, "scale")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    mfv = float(attr(node, "mask_filter_value", DEFAULT_MASK_FILTER_VALUE))
    uni = int(attr(node, "unidirectional", 0) or 0)
    problem = _attr_problem(uni, mfv)
    if problem:
        return refuse(problem)
    attrs = {"q_num_heads": n, "kv_num_heads": n, "scale": scale, "is_causal": uni}
    notes = []
    if kpm:
        notes.append(f"key_padding_mask ({form.upper()}) becomes an additive mask of mask_filter_value={mfv:g}")
    if bias:
        notes.append("Q/K/V projection bias added in front of the attention")

    def prepare(ed: GraphEditor) -> Operands:
        h = f"L/{name}"
        q, k, v = query, key, value
        if bias:
            split = const_i64(ed, bsizes, f"{h}/bias_sizes")
            bq, bk, bv = ed.add_node("Split", [bias, split], 3, hint=f"{h}/bias", axis=0)
            q = ed.add_node1("Add", [q, bq], hint=f"{h}/q_bias")
            k = ed.add_node1("Add", [k, bk], hint=f"{h}/k_bias")
            v = ed.add_node1("Add", [v, bv], hint=f"{h}/v_bias")
        masks = []
        if kpm:
            masks.append((_padding_bias(ed, kpm, form, mfv, elem_type, f"{h}/kpm"), False))
        if attn_bias:
            masks.append((attn_bias, False))
        return Operands(q, k, v, mask=combine_masks(ed, masks, elem_type, f"{h}/mask"))

    return LayerPlan(
        pattern=PATTERN_MHA, anchor=node, y_old=node.output[0], past_key=pk, past_value=pv,
        present_key=present_k, present_value=present_v, q_num_heads=n, kv_num_heads=n, head_dim=d,
        v_head_dim=dv, elem_type=elem_type, attrs=attrs, prepare=prepare, notes=notes)


# -- Attention (QKV projection + attention, stacked past) ----------------------------------------

def match_ms_attention(ed: GraphEditor, node: onnx.NodeProto) -> Union[LayerPlan, Refusal, None]:
    """Plan for one ``com.microsoft.Attention``, a :class:`Refusal`, or None (no past/present: stateless)."""
    if node.op_type != "Attention" or node.domain != MS:
        return None
    name = anchor_name(node)

    def refuse(reason: str) -> Refusal:
        return Refusal(name, PATTERN_ATTENTION, reason)

    x, weights, bias, mask, past = (_inp(node, i) for i in range(5))
    attn_bias, past_len = _inp(node, 5), _inp(node, 6)
    present = _out(node, 1)
    if not past:
        if _used(ed, present):
            return refuse("present without past (a prefill-only graph) is not converted")
        return None  # an encoder (BERT) attention: no cache
    if int(attr(node, "past_present_share_buffer", 0) or 0) or past_len:
        return refuse("past_present_share_buffer / past_sequence_length (past and present share one "
                      "max_sequence_length buffer): ORT's CPU kernel does not run it, so its meaning cannot be checked")
    if int(attr(node, "do_rotary", 0) or 0):
        return refuse("do_rotary=1: ORT's CPU Attention kernel does not support rotary, so its meaning cannot be "
                      "checked")
    if attn_bias:
        return refuse("attention_bias together with past: ORT's CPU kernel rejects it ('Attention cannot have both "
                      "past and attention_bias')")
    if not present or not _used(ed, present):
        return refuse("past is an input but present is not produced")
    p = _past_input(ed, past)
    if p is None:
        return refuse(f"past {past!r} is not a graph input (expected the loop-carried [2, B, N, P, D] past)")
    n = attr(node, "num_heads")
    if not n or n <= 0:
        return refuse(f"num_heads={n}: expected a positive int")
    wd = ed.dims(weights)
    if wd is None or len(wd) != 2 or not isinstance(wd[1], int):
        return refuse(f"weights shape {wd}: expected a static [input_hidden, Dq + Dk + Dv]")
    sizes = attr(node, "qkv_hidden_sizes")
    sizes = [int(s) for s in sizes] if sizes else [wd[1] // 3] * 3
    if sum(sizes) != wd[1] or len(set(sizes)) != 1 or sizes[0] % n:
        return refuse(f"qkv_hidden_sizes {sizes} with weights [.., {wd[1]}]: with past ORT needs three equal "
                      f"hidden sizes divisible by num_heads={n}")
    d = sizes[0] // n
    pd = ed.dims(p)
    if pd is None or len(pd) != 5 or pd[0] not in (2, None) or (isinstance(pd[2], int) and pd[2] != n) \
            or (isinstance(pd[4], int) and pd[4] != d):
        return refuse(f"past shape {pd}: expected [2, B, {n}, P, {d}]")
    bd = ed.dims(bias) if bias else None
    if bias and (bd is None or len(bd) != 1 or bd[0] != wd[1]):
        return refuse(f"bias shape {bd}: expected [{wd[1]}]")
    elem_type = ed.elem_type(x) or ed.elem_type(p)
    if elem_type is None:
        return refuse("element type of input unknown")
    xd = ed.dims(x)
    form = _mask_form(ed, mask, xd[0] if xd else None) if mask else None
    if isinstance(form, tuple):
        return refuse(form[1])
    if form == "1d" and total_length(ed) is None:
        return refuse("1-D mask_index (end positions) needs the total length from an attention_mask input")
    scale = attr(node, "scale")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    mfv = float(attr(node, "mask_filter_value", DEFAULT_MASK_FILTER_VALUE))
    uni = int(attr(node, "unidirectional", 0) or 0)
    problem = _attr_problem(uni, mfv)
    if problem:
        return refuse(problem)
    attrs = {"q_num_heads": n, "kv_num_heads": n, "scale": scale, "is_causal": uni}
    notes = ["QKV projection (input x weights + bias) and its split into Q/K/V moved in front of the attention; "
             "the stacked past/present [2, B, N, T, D] replaced by the cache"]
    if mask:
        notes.append(f"mask_index ({form.upper()}) becomes an additive mask of mask_filter_value={mfv:g}")

    def prepare(ed: GraphEditor) -> Operands:
        h = f"L/{name}"
        qkv = ed.add_node1("MatMul", [x, weights], hint=f"{h}/qkv")
        if bias:
            qkv = ed.add_node1("Add", [qkv, bias], hint=f"{h}/qkv_bias")
        if ed.opset() >= 13:
            q, k, v = ed.add_node("Split", [qkv, const_i64(ed, sizes, f"{h}/qkv_sizes")], 3, hint=f"{h}/split",
                                  axis=-1)
        else:
            q, k, v = ed.add_node("Split", [qkv], 3, hint=f"{h}/split", axis=-1, split=sizes)
        m = _padding_bias(ed, mask, form, mfv, elem_type, f"{h}/mask") if mask else ""
        return Operands(q, k, v, mask=m)

    return LayerPlan(
        pattern=PATTERN_ATTENTION, anchor=node, y_old=node.output[0], past_key=p, past_value=p,
        present_key=present, present_value=present, q_num_heads=n, kv_num_heads=n, head_dim=d, v_head_dim=d,
        elem_type=elem_type, attrs=attrs, prepare=prepare, notes=notes, past_stacked=True)
