"""Decomposed attention on ``Concat(past, new)`` → ``ai.onnx_light.CacheAttention``.

The chain exporters write when attention is not one op (torch.onnx opset 18
via torchlib's SDPA decomposition, optimum/transformers eager attention),
matched backwards and forwards from its ``Softmax``::

    q ─[Mul/Div by constants, Add 0, Identity, Cast]──────────────┐
    Concat(past_k, k) ─[repeat_kv]─[Kᵀ: Transpose or Reshape/Transpose/Reshape]─[Mul c]─ MatMul
        ─[Mul/Div c]─[softcap: Mul(Tanh(Div(x, c)), c)]─[Add mask | Where(mask, x, -big)]*─ Softmax
        ─[Cast, Dropout, Where(IsNaN(p), 0, p)]─ MatMul(p, [repeat_kv] Concat(past_v, v)) → Y

Semantics kept exactly:

- ``scale`` = the product of every constant factor on the Q·K path (Q side,
  K side and scores), never "absent → 1/sqrt(d)" (CASES C10b).
- Masks are the graph's own tensors (padding and causal masks as the exporter
  built them from ``attention_mask``), fed to CacheAttention's ``attn_mask``;
  several are combined (bool AND, float add, ``Where(bool, float, -inf)``).
  Their last axis covers past + new tokens, which is exactly the cache
  (every step appends all S rows of every sequence, so ``P_b = P``).
  CacheAttention runs with ``is_causal=0`` (the causal part is in the mask).
- A fully masked row gives zeros, as the NaN guard ``Where(IsNaN(p), 0, p)``
  of torchlib does.
- Scaling after a mask, softcap after a mask, or probabilities observed
  elsewhere are refused.

An optional ``sliding_window`` (from the model config; exporters often drop
it, CASES C06) becomes ``local_window_size`` and is recorded in the metadata.

A graph that starts the cache (the prefill graph of transformers' exporter:
no past input, the rotated K and the V of the new tokens are graph outputs
that the decode graph takes back as its pasts) is matched the same way with
``K = V = the new rows`` (pattern ``decomposed (no past)``): converted with
P = 0, the masks it builds from the new length keep their meaning on an
empty cache.
"""

from __future__ import annotations

from typing import List, Optional, Tuple, Union

import onnx

from ._graph import GraphEditor, attr
from ._kvpath import reads_past_concat, starts_cache_reason, trace_kv
from ._plan import LayerPlan, Operands, Refusal, anchor_name, combine_masks

PATTERN = "Concat+decomposed"
PATTERN_NO_PAST = "decomposed (no past)"
_NEG_LIMIT = -1.0e4  # a Where fill at or below this is a mask value


def _is(node, *ops) -> bool:
    return node is not None and node.op_type in ops and node.domain in ("", "ai.onnx")


def _float_cast(ed: GraphEditor, node) -> bool:
    return _is(node, "Cast") and attr(node, "to") in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16,
                                                      onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE)


def _reaches_matmul(ed: GraphEditor, name: str, depth: int = 12) -> bool:
    """Does ``name`` come from a MatMul through score-path ops (used to tell scores from masks)?"""
    for _ in range(depth):
        p = ed.producer(name)
        if p is None:
            return False
        if _is(p, "MatMul"):
            return True
        if _is(p, "Mul", "Div", "Add", "Sub", "Cast", "Identity", "Tanh", "Where"):
            if _is(p, "Where"):
                name = p.input[1] if ed.scalar(p.input[2]) is not None else p.input[2]
            elif _is(p, "Mul", "Add") and ed.const_value(p.input[0]) is not None:
                name = p.input[1]
            else:
                name = p.input[0]
            continue
        return False
    return False


def _forward_to_pv(ed: GraphEditor, softmax) -> Union[onnx.NodeProto, str]:
    """The ``MatMul(p, V)`` after ``softmax`` through no-op/NaN-guard nodes, or a reason."""
    t = softmax.output[0]
    for _ in range(8):
        cons = ed.consumers(t)
        if ed.is_graph_output(t):
            return "attention probabilities are a graph output"
        if len(cons) == 1 and _is(cons[0], "MatMul") and cons[0].input[0] == t:
            return cons[0]
        if len(cons) == 1 and (_is(cons[0], "Identity") or _float_cast(ed, cons[0])):
            t = cons[0].output[0]
            continue
        if len(cons) == 1 and _is(cons[0], "Dropout"):
            d = cons[0]
            if len(d.output) > 1 and d.output[1] and (ed.consumers(d.output[1]) or ed.is_graph_output(d.output[1])):
                return "Dropout mask output is used"
            if len(d.input) > 2 and d.input[2]:
                tm = ed.const_value(d.input[2])
                if tm is None or bool(tm.ravel()[0]):
                    return "Dropout may run in training mode"
            t = d.output[0]
            continue
        # torchlib NaN guard: Where(IsNaN(p), 0, p)
        isnan = [c for c in cons if _is(c, "IsNaN")]
        where = [c for c in cons if _is(c, "Where") and c.input[2] == t]
        if len(cons) == 2 and len(isnan) == 1 and len(where) == 1:
            w = where[0]
            if (w.input[0] == isnan[0].output[0] and ed.scalar(w.input[1]) == 0.0
                    and len(ed.consumers(isnan[0].output[0])) == 1):
                t = w.output[0]
                continue
        return f"attention probabilities {t!r} are consumed by {[c.op_type for c in cons]}, not only by MatMul(p, V)"
    return "no MatMul(p, V) after Softmax"


def _softcap(ed: GraphEditor, mul) -> Optional[Tuple[float, str]]:
    """``(c, y)`` if ``mul`` is ``Mul(Tanh(y / c), c)`` (or ``Tanh(y * (1/c))``), else None."""
    for t_in, c_in in ((mul.input[0], mul.input[1]), (mul.input[1], mul.input[0])):
        tanh, c = ed.producer(t_in), ed.scalar(c_in)
        if not _is(tanh, "Tanh") or c is None or c <= 0:
            continue
        inner = ed.producer(tanh.input[0])
        if _is(inner, "Div") and ed.scalar(inner.input[1]) == c:
            return c, inner.input[0]
        if _is(inner, "Mul") and ed.scalar(inner.input[1]) is not None and \
                abs(ed.scalar(inner.input[1]) * c - 1.0) < 1e-6:
            return c, inner.input[0]
    return None


def _scores_backward(ed: GraphEditor, x: str):
    """Walk from the Softmax input back to ``MatMul(Q, Kᵀ)``.

    Returns ``(qk_matmul, factor, softcap, masks)`` or a reason string;
    ``masks`` is a list of ``(tensor, is_bool, negate)``.
    """
    # Walking backwards, the forward order must be: scale, softcap, masks.
    factor, softcap = 1.0, 0.0
    masks: List[Tuple[str, bool, bool]] = []

    def mask_ok():
        return None if factor == 1.0 and not softcap else "a scale or softcap is applied after a mask"

    for _ in range(32):
        p = ed.producer(x)
        if p is None:
            return "the Softmax input is not computed from MatMul(Q, Kᵀ)"
        if _is(p, "MatMul"):
            return p, factor, softcap, masks
        if _is(p, "Identity") or _float_cast(ed, p):
            x = p.input[0]
            continue
        if _is(p, "Add", "Sub"):
            a, b = p.input[0], p.input[1]
            ca, cb = ed.scalar(a), ed.scalar(b)
            if cb is not None or (ca is not None and p.op_type == "Add"):
                x = a if cb is not None else b  # a constant shift: softmax is invariant to it
                continue
            if p.op_type == "Sub":
                return "Sub of a tensor on the score path"
            sa, sb = _reaches_matmul(ed, a), _reaches_matmul(ed, b)
            if sa == sb:
                return f"Add {p.name!r}: cannot tell the scores from the mask"
            score, m = (a, b) if sa else (b, a)
            if mask_ok():
                return mask_ok()
            masks.append((m, ed.elem_type(m) == onnx.TensorProto.BOOL, False))
            x = score
            continue
        if _is(p, "Where"):
            c, a, b = p.input
            fa, fb = ed.scalar(a), ed.scalar(b)
            if mask_ok() and ((fb is not None and fb <= _NEG_LIMIT) or (fa is not None and fa <= _NEG_LIMIT)):
                return mask_ok()
            if fb is not None and fb <= _NEG_LIMIT:
                masks.append((c, True, False))
                x = a
            elif fa is not None and fa <= _NEG_LIMIT:
                masks.append((c, True, True))
                x = b
            else:
                return f"Where {p.name!r} on the score path is not a mask (fill value not very negative)"
            continue
        if _is(p, "Mul"):
            cap = _softcap(ed, p)
            if cap is not None:
                if softcap:
                    return "two softcaps on the score path"
                if factor != 1.0:
                    return "the scores are scaled after softcap"
                softcap, x = cap
                continue
        if _is(p, "Mul", "Div"):
            a, b = p.input[0], p.input[1]
            s = ed.scalar(b)
            data = a
            if s is None and p.op_type == "Mul":
                s, data = ed.scalar(a), b
            if s is None:
                return f"{p.op_type} {p.name!r} on the score path has no constant operand"
            factor *= 1.0 / s if p.op_type == "Div" else s
            x = data
            continue
        return f"{p.op_type} {p.name!r} on the score path is not scale/softcap/mask"
    return "score path too long"


def _query_backward(ed: GraphEditor, x: str) -> Tuple[str, float]:
    """Strip constant scaling (Mul/Div), ``Add 0``, Identity and no-op casts from the Q operand."""
    factor = 1.0
    for _ in range(16):
        p = ed.producer(x)
        if _is(p, "Identity"):
            x = p.input[0]
        elif _is(p, "Cast") and attr(p, "to") == ed.elem_type(p.input[0]):
            x = p.input[0]
        elif _is(p, "Add") and (ed.scalar(p.input[1]) == 0.0 or ed.scalar(p.input[0]) == 0.0):
            x = p.input[0] if ed.scalar(p.input[1]) == 0.0 else p.input[1]
        elif _is(p, "Mul", "Div") and ed.scalar(p.input[1]) is not None:
            s = ed.scalar(p.input[1])
            factor *= 1.0 / s if p.op_type == "Div" else s
            x = p.input[0]
        elif _is(p, "Mul") and ed.scalar(p.input[0]) is not None:
            factor *= ed.scalar(p.input[0])
            x = p.input[1]
        else:
            break
    return x, factor


def match_decomposed(ed: GraphEditor, softmax: onnx.NodeProto,
                     sliding_window: Optional[int] = None) -> Union[LayerPlan, Refusal, None]:
    """Plan for the decomposed attention around ``softmax``, a :class:`Refusal`, or None."""
    if not _is(softmax, "Softmax"):
        return None
    name = anchor_name(softmax)
    sd = ed.dims(softmax.input[0])
    axis = attr(softmax, "axis", -1 if ed.opset() >= 13 else 1)
    if sd is not None and axis < 0:
        axis += len(sd)
    if sd is None or len(sd) != 4 or axis != 3:
        return None  # not a [B, H, S, T] attention softmax
    pv = _forward_to_pv(ed, softmax)
    back = _scores_backward(ed, softmax.input[0])
    if isinstance(back, str):
        # Only a refusal when the thing clearly reads a cached Concat.
        cached = not isinstance(pv, str) and reads_past_concat(ed, pv.input[1])
        return Refusal(name, PATTERN, back) if cached else None
    qk, s_factor, softcap, masks = back
    tk = trace_kv(ed, qk.input[1], present_only=True)
    if isinstance(tk, str):
        return Refusal(name, PATTERN, tk) if reads_past_concat(ed, qk.input[1]) else None
    pattern = PATTERN if tk.past else PATTERN_NO_PAST

    def refuse(reason):
        return Refusal(name, pattern, reason)

    if isinstance(pv, str):
        return refuse(pv)
    tv = trace_kv(ed, pv.input[1], present_only=True)
    if isinstance(tv, str):
        return refuse(tv)
    if (tk.past is None) != (tv.past is None):
        return refuse("one of K and V comes from a past input, the other does not")
    q_in, _ = _query_backward(ed, qk.input[0])
    why = starts_cache_reason(ed, tk, q_in) or starts_cache_reason(ed, tv, q_in)
    if why:
        return refuse(why)
    if not tk.swapped:
        return refuse("K reaches MatMul(Q, K) without being transposed")
    if tv.swapped:
        return refuse("V reaches MatMul(p, V) transposed")
    if tv.factor != 1.0:
        return refuse(f"V is scaled by {tv.factor}")
    if tk.n_rep != tv.n_rep or tk.present == tv.present:
        return refuse("K and V paths disagree (head expansion or past input)")
    q, q_factor = _query_backward(ed, qk.input[0])
    qd, pkd, pvd = ed.dims(q), ed.dims(tk.present), ed.dims(tv.present)
    if qd is None or len(qd) != 4:
        return refuse(f"query {q!r} is not 4-D BNSH (shape {qd})")
    hkv, d, dv = pkd[1], pkd[3], pvd[3]
    # MatMul(Q, Kᵀ) pairs query head h with expanded key head h, so Q has Hkv * n_rep heads.
    hq = qd[1] if isinstance(qd[1], int) else (hkv * tk.n_rep if isinstance(hkv, int) else None)
    if not all(isinstance(x, int) for x in (hq, hkv, d, dv)):
        return refuse(f"head counts/sizes not static (query {qd}, present {pkd}, {pvd})")
    if hq != hkv * tk.n_rep:
        return refuse(f"query has {hq} heads but K provides {hkv} kv heads x {tk.n_rep}")
    if qd[3] is not None and qd[3] != d:
        return refuse(f"query head size {qd[3]} != key head size {d}")
    elem_type = ed.elem_type(q) or ed.elem_type(tk.present)
    scale = q_factor * tk.factor * s_factor
    attrs = {"scale": float(scale), "is_causal": 0}
    if softcap:
        attrs["softcap"] = float(softcap)
    notes = [f"scale {scale:g} = product of the constant factors on the Q·K path"]
    if tk.n_rep > 1:
        notes.append(f"GQA head expansion x{tk.n_rep} (repeat-interleave) dropped; CacheAttention maps heads itself")
    if sliding_window is not None and sliding_window > 0:
        attrs["local_window_size"] = int(sliding_window)
        notes.append(f"sliding window {sliding_window} from the options (not in the exported graph)")
    if not masks:
        notes.append("no mask on the scores: every cached key is attended")
    if tk.past is None:
        notes.append("no past input: a graph that starts the cache, converted with P = 0 (its masks are built "
                     "from the new tokens alone; run it on an empty cache, as the original runs without a past)")

    def prepare(ed: GraphEditor) -> Operands:
        h = f"L/{name}"
        parts = []
        for m, is_bool, negate in masks:
            if negate:
                m = ed.add_node1("Not", [m], hint=f"{h}/not_mask")
            parts.append((m, is_bool))
        return Operands(q, tk.new, tv.new, mask=combine_masks(ed, parts, elem_type, f"{h}/mask"))

    return LayerPlan(
        pattern=pattern, anchor=softmax, y_old=pv.output[0], past_key=tk.past, past_value=tv.past,
        present_key=tk.present, present_value=tv.present,
        chain_tensors=[n.output[0] for n in tk.nodes + tv.nodes], q_num_heads=hq, kv_num_heads=hkv, head_dim=d,
        v_head_dim=dv, elem_type=elem_type, attrs=attrs, prepare=prepare, notes=notes)
