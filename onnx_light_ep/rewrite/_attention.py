"""Standard ONNX ``Attention`` (opset 23/24/25) → ``ai.onnx_light.CacheAttention``.

Semantics source: ONNX operator spec, section Attention (opset 23, 24, 25) and
TensorScatter (opset 24). Four forms are recognised:

1. ``Attention`` with its own ``past_key``/``past_value`` inputs and
   ``present_key``/``present_value`` outputs. CacheAttention is defined as
   exactly this op with past = the cached rows, so the inputs, ``is_causal``,
   ``scale``, ``softcap`` and head attributes carry over; opset 25
   ``left_window_size = L`` becomes ``local_window_size = L + 1`` (both
   anchor at the past length).
2. ``Attention`` without past but with present outputs (a prefill graph,
   CASES C01): converted with P = 0; the presents stay as outputs through
   ``CacheExport`` (present = K for an empty cache). Query and key lengths
   must agree (CASES C04(a): with different lengths the causal mask is
   upper-left and CacheAttention cannot express it, so it is refused).
3. ``Concat(past, new)`` feeding a stateless ``Attention`` (torch.onnx
   dynamo, opset 23), possibly through the GQA head expansion
   (see ``_kvpath``). A stateless ``Attention`` with ``is_causal=1`` aligns
   the causal mask upper-left over the concatenated keys (offset 0, CASES
   C04); the rewrite keeps that exactly by building the mask in the graph and
   running CacheAttention with ``is_causal=0``.
4. The opset-24 in-place idiom: ``TensorScatter(past, new, write_indices)``
   into a static buffer feeding ``Attention(..., nonpad_kv_seqlen)``. The
   cache replaces the buffer: ``seqlens_k = nonpad_kv_seqlen − 1`` and the
   causal frontier ``j <= nonpad_kv_seqlen − S + i`` is built as a mask.
   ``write_indices`` becomes unused: the cache appends after its own
   per-sequence length, which must equal the caller's write index.

Refused: ``qk_matmul_output`` in use, ``nonpad_kv_seqlen`` with past,
``right_window_size`` without ``is_causal``, TensorScatter ``circular`` mode,
pasts that are not graph inputs.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import onnx

from ._graph import GraphEditor, attr
from ._kvpath import reads_past_concat, resolve_identity, starts_cache_reason, trace_kv
from ._plan import node_input as _inp, node_output as _out, is_used as _used
from ._plan import (LayerPlan, Operands, Refusal, anchor_name, causal_mask, combine_masks, const_i64,
                    dim_of, total_length)


PATTERN_NO_PAST = "stateless Attention (no past)"








def match_attention(ed: GraphEditor, node: onnx.NodeProto) -> Union[LayerPlan, Refusal, None]:
    """Plan for one ONNX ``Attention`` node, a :class:`Refusal`, or None (stateless, not a cache)."""
    if node.op_type != "Attention" or node.domain not in ("", "ai.onnx"):
        return None
    name = anchor_name(node)
    Q, K, V, mask = _inp(node, 0), _inp(node, 1), _inp(node, 2), _inp(node, 3)
    past_k, past_v, nonpad = _inp(node, 4), _inp(node, 5), _inp(node, 6)
    present_k, present_v = _out(node, 1), _out(node, 2)
    has_present = _used(ed, present_k) or _used(ed, present_v)

    if past_k or past_v:
        pattern = "Attention"
    elif has_present:
        pattern = "Attention (no past)"
    else:
        kp = ed.producer(resolve_identity(ed, K))
        pattern = "TensorScatter+Attention" if kp is not None and kp.op_type == "TensorScatter" else "Concat+Attention"

    def refuse(reason):
        return Refusal(name, pattern, reason)

    if _used(ed, _out(node, 3)):
        return refuse("output qk_matmul_output is used; CacheAttention does not produce attention scores")
    is_causal = int(attr(node, "is_causal", 0) or 0)
    left, right = int(attr(node, "left_window_size", -1)), int(attr(node, "right_window_size", -1))
    if right >= 0 and not is_causal:
        return refuse(f"right_window_size={right} without is_causal is not supported")
    if left >= 0 and not is_causal and pattern != "Attention":
        return refuse(f"left_window_size={left} without is_causal is only supported with a past input")
    qd = ed.dims(Q)
    rank = len(qd) if qd else (3 if attr(node, "q_num_heads") else None)
    if rank not in (3, 4):
        return refuse("query rank unknown; expected 3-D or 4-D")
    elem_type = ed.elem_type(Q)
    if elem_type is None:
        return refuse("element type of Q unknown")
    softcap = float(attr(node, "softcap", 0.0) or 0.0)
    base_attrs = {"is_causal": is_causal}
    if softcap > 0:
        base_attrs["softcap"] = softcap

    if pattern in ("Attention", "Attention (no past)"):
        return _with_past(ed, node, pattern, refuse, rank, elem_type, base_attrs, left)
    if pattern == "TensorScatter+Attention":
        return _tensor_scatter(ed, node, refuse, rank, elem_type, base_attrs, left)
    # Concat(past, new) -> [expansion] -> Attention; or, in a graph that starts the cache, the new
    # rows themselves (graph outputs the decode graph takes back) -> [expansion] -> Attention
    if rank != 4:
        return None
    tk, tv = trace_kv(ed, K, present_only=True), trace_kv(ed, V, present_only=True)
    if isinstance(tk, str) and isinstance(tv, str):
        if reads_past_concat(ed, K) or reads_past_concat(ed, V):
            return refuse(tk if reads_past_concat(ed, K) else tv)
        return None  # a stateless attention (no cache): not ours
    if not isinstance(tk, str) and tk.past is None:
        pattern = PATTERN_NO_PAST
    if isinstance(tk, str) or isinstance(tv, str):
        return refuse(tk if isinstance(tk, str) else tv)
    if (tk.past is None) != (tv.past is None):
        return refuse("one of K and V comes from a past input, the other does not")
    why = starts_cache_reason(ed, tk, Q) or starts_cache_reason(ed, tv, Q)
    if why:
        return refuse(why)
    if tk.swapped or tv.swapped:
        return refuse("K/V reach Attention with the last two axes swapped")
    if tv.factor != 1.0:
        return refuse(f"V is scaled by {tv.factor} on its way to Attention")
    if tk.n_rep != tv.n_rep or tk.present == tv.present:
        return refuse("K and V paths disagree (head expansion or past input)")
    pkd, pvd = ed.dims(tk.present), ed.dims(tv.present)
    hq = qd[1] if isinstance(qd[1], int) else None
    hkv, d, dv = pkd[1], pkd[3], pvd[3]
    if not all(isinstance(x, int) for x in (hkv, d, dv)) or hq is None:
        return refuse(f"head counts/sizes not static (q heads {hq}, present {pkd}, {pvd})")
    if hq != hkv * tk.n_rep:
        return refuse(f"query has {hq} heads but K provides {hkv} kv heads x {tk.n_rep}")
    scale = attr(node, "scale")
    scale = (1.0 / math.sqrt(d) if scale is None else float(scale)) * tk.factor
    attrs = dict(base_attrs, scale=scale, is_causal=0)
    notes = []
    if tk.n_rep > 1:
        notes.append(f"GQA head expansion x{tk.n_rep} (repeat-interleave) dropped; CacheAttention maps heads itself")
    if tk.past is None:
        # no past: Q and K have the same length, so upper-left causal equals bottom-right (P = 0)
        attrs["is_causal"] = is_causal
        if is_causal and left >= 0:
            attrs["local_window_size"] = left + 1
        notes.append("no past input: a graph that starts the cache, converted with P = 0 (run it on an empty "
                     "cache, as the original runs without a past)")
        is_causal = 0
    if is_causal:
        if "attention_mask" not in ed.input_names:
            return refuse("is_causal=1 on concatenated keys is upper-left (offset 0, CASES C04); keeping it as a "
                          "mask needs the total length from an attention_mask input, and there is none")
        notes.append("is_causal=1 on concatenated keys is upper-left (offset 0); kept as an explicit mask")

    def prepare(ed: GraphEditor) -> Operands:
        h = f"L/{name}"
        masks = [(mask, ed.elem_type(mask) == onnx.TensorProto.BOOL)] if mask else []
        if is_causal:
            s = dim_of(ed, Q, 2, f"{h}/S")
            t = total_length(ed)
            masks.append((causal_mask(ed, seq=s, total=t, offset=None, window=left, hint=f"{h}/causal"), True))
        return Operands(Q, tk.new, tv.new, mask=combine_masks(ed, masks, elem_type, f"{h}/mask"))

    return LayerPlan(
        pattern=pattern, anchor=node, y_old=node.output[0], past_key=tk.past, past_value=tv.past,
        present_key=tk.present, present_value=tv.present,
        chain_tensors=[n.output[0] for n in tk.nodes + tv.nodes], q_num_heads=hq, kv_num_heads=hkv, head_dim=d,
        v_head_dim=dv, elem_type=elem_type, attrs=attrs, prepare=prepare, notes=notes)


def _geometry(ed, node, rank, K, V):
    """(hq, hkv, d, dv) from shapes/attributes, None entries when unknown."""
    if rank == 3:
        hq, hkv = attr(node, "q_num_heads"), attr(node, "kv_num_heads")
        qd, kd, vd = ed.last_dim(_inp(node, 0)), ed.last_dim(K), ed.last_dim(V)
        d = qd // hq if hq and qd and qd % hq == 0 else None
        dv = vd // hkv if hkv and vd and vd % hkv == 0 else None
        if d is None and hkv and kd:
            d = kd // hkv
        return hq, hkv, d, dv
    qd, kd, vd = ed.dims(_inp(node, 0)), ed.dims(K), ed.dims(V)
    pick = lambda dims, i: dims[i] if dims and isinstance(dims[i], int) else None  # noqa: E731
    return pick(qd, 1), pick(kd, 1), pick(qd, 3) or pick(kd, 3), pick(vd, 3)


def _with_past(ed, node, pattern, refuse, rank, elem_type, base_attrs, left):
    Q, K, V, mask = _inp(node, 0), _inp(node, 1), _inp(node, 2), _inp(node, 3)
    past_k, past_v, nonpad = _inp(node, 4), _inp(node, 5), _inp(node, 6)
    present_k, present_v = _out(node, 1), _out(node, 2)
    hq, hkv, d, dv = _geometry(ed, node, rank, K, V)
    if pattern == "Attention":
        if nonpad:
            return refuse("nonpad_kv_seqlen together with past_key is not allowed by the ONNX spec")
        past_k, past_v = resolve_identity(ed, past_k), resolve_identity(ed, past_v)
        for p in (past_k, past_v):
            if not ed.is_graph_input(p):
                return refuse(f"past {p!r} is not a graph input (expected the loop-carried past)")
        if not present_k or not present_v:
            return refuse("past_key/past_value are inputs but present_key/present_value are not produced")
        pd = ed.dims(past_k)
        if pd and len(pd) == 4:
            hkv = pd[1] if isinstance(pd[1], int) else hkv
            d = pd[3] if isinstance(pd[3], int) else d
        pvd = ed.dims(past_v)
        if pvd and len(pvd) == 4 and isinstance(pvd[3], int):
            dv = pvd[3]
    else:
        past_k = past_v = None
        if not present_k or not present_v:
            return refuse("only one of present_key/present_value is produced")
        seq_axis = 1 if rank == 3 else 2
        qd, kd = ed.dims(Q), ed.dims(K)
        sq, sk = (qd[seq_axis] if qd else None), (kd[seq_axis] if kd else None)
        if isinstance(sq, int) and isinstance(sk, int) and sq != sk:
            return refuse(f"query length {sq} != key length {sk}: without past the causal mask is upper-left "
                          f"(CASES C04a); CacheAttention needs one length for Q and K")
        if nonpad:
            return refuse("nonpad_kv_seqlen without past/TensorScatter is not supported")
    if not all(isinstance(x, int) and x > 0 for x in (hq, hkv, d, dv)):
        return refuse(f"head counts/sizes not static (q heads {hq}, kv heads {hkv}, head_dim {d}, v_head_dim {dv})")
    scale = attr(node, "scale")
    attrs = dict(base_attrs, scale=1.0 / math.sqrt(d) if scale is None else float(scale))
    if rank == 3:
        attrs.update(q_num_heads=hq, kv_num_heads=hkv)
    if left >= 0:
        attrs["local_window_size"] = left + 1
    notes = []
    if past_k is None:
        notes.append("no past input: converted as a prefill with P = 0; presents kept through CacheExport; "
                     "use an empty cache for each run to keep the original semantics")

    def prepare(ed):
        return Operands(Q, K, V, mask=mask)

    return LayerPlan(
        pattern=pattern, anchor=node, y_old=node.output[0], past_key=past_k, past_value=past_v,
        present_key=present_k, present_value=present_v, q_num_heads=hq, kv_num_heads=hkv, head_dim=d,
        v_head_dim=dv, elem_type=elem_type, attrs=attrs, prepare=prepare, notes=notes)


def _scatter(ed, name) -> Optional[onnx.NodeProto]:
    p = ed.producer(resolve_identity(ed, name))
    return p if p is not None and p.op_type == "TensorScatter" else None


def _tensor_scatter(ed, node, refuse, rank, elem_type, base_attrs, left):
    Q, K, V, mask, nonpad = _inp(node, 0), _inp(node, 1), _inp(node, 2), _inp(node, 3), _inp(node, 6)
    sk, sv = _scatter(ed, K), _scatter(ed, V)
    if sk is None or sv is None:
        return refuse("K is written by TensorScatter but V is not")
    if rank != 4:
        return refuse("TensorScatter idiom with 3-D Q/K/V is not supported")
    if not nonpad:
        return refuse("TensorScatter into a static cache without nonpad_kv_seqlen: valid length unknown")
    pasts = []
    for s in (sk, sv):
        mode = attr(s, "mode", b"linear")
        mode = mode.decode() if isinstance(mode, bytes) else mode
        if mode != "linear":
            return refuse(f"TensorScatter mode {mode!r} is not supported (ring buffer)")
        if attr(s, "axis", -2) not in (-2, 2):
            return refuse(f"TensorScatter axis {attr(s, 'axis')} is not the BNSH sequence axis")
        p = resolve_identity(ed, s.input[0])
        if not ed.is_graph_input(p):
            return refuse(f"TensorScatter cache {p!r} is not a graph input")
        pasts.append(p)
    hq, hkv, d, dv = _geometry(ed, node, rank, K, V)
    pkd, pvd = ed.dims(pasts[0]), ed.dims(pasts[1])
    if pkd and len(pkd) == 4:
        hkv = pkd[1] if isinstance(pkd[1], int) else hkv
        d = pkd[3] if isinstance(pkd[3], int) else d
    if pvd and len(pvd) == 4 and isinstance(pvd[3], int):
        dv = pvd[3]
    if not all(isinstance(x, int) and x > 0 for x in (hq, hkv, d, dv)):
        return refuse(f"head counts/sizes not static (q heads {hq}, kv heads {hkv}, head_dim {d}, v_head_dim {dv})")
    is_causal = base_attrs["is_causal"]
    scale = attr(node, "scale")
    attrs = dict(base_attrs, scale=1.0 / math.sqrt(d) if scale is None else float(scale), is_causal=0)
    name = anchor_name(node)
    notes = ["TensorScatter write_indices are no longer read: the cache appends after its own lengths "
             "(keep them equal to KVCache.seq_lens)"]

    def prepare(ed):
        h = f"L/{name}"
        one = const_i64(ed, 1, f"{h}/one")
        nonpad64 = ed.add_node1("Cast", [nonpad], hint=f"{h}/nonpad64", to=onnx.TensorProto.INT64)
        seqlens = ed.add_node1("Sub", [nonpad64, one], hint=f"{h}/seqlens_k")
        total = ed.add_node1("ReduceMax", [nonpad64], hint=f"{h}/total", keepdims=1)
        masks = []
        if mask:
            zero = const_i64(ed, [0], f"{h}/zero1")
            axes = const_i64(ed, [-1], f"{h}/axis")
            cut = ed.add_node1("Slice", [mask, zero, total, axes], hint=f"{h}/mask_cols")
            masks.append((cut, ed.elem_type(mask) == onnx.TensorProto.BOOL))
        if is_causal:
            s = dim_of(ed, Q, 2, f"{h}/S")
            off = ed.add_node1("Sub", [nonpad64, s], hint=f"{h}/offset")
            masks.append((causal_mask(ed, seq=s, total=total, offset=off, window=left, hint=f"{h}/causal"), True))
        return Operands(Q, sk.input[1], sv.input[1], mask=combine_masks(ed, masks, elem_type, f"{h}/mask"),
                        seqlens_k=seqlens)

    return LayerPlan(
        pattern="TensorScatter+Attention", anchor=node, y_old=node.output[0], past_key=pasts[0],
        past_value=pasts[1], present_key=sk.output[0], present_value=sv.output[0], q_num_heads=hq,
        kv_num_heads=hkv, head_dim=d, v_head_dim=dv, elem_type=elem_type, attrs=attrs, prepare=prepare,
        padding="right", notes=notes)
