"""Tracing a key/value operand of an attention back to ``Concat(past, new)``.

Exporters put layout plumbing between the present tensor (the ``Concat``
output, BNSH ``[B, Hkv, T, D]``) and the place attention consumes it:

- GQA/MQA head expansion (``repeat_kv`` in transformers, torchlib's
  ``_attention_repeat_kv_for_group_query``): ``Unsqueeze(axis=2)`` →
  ``Expand`` → ``Reshape`` to ``[B, Hq, T, D]``;
- the transposition of K for ``Q·Kᵀ``: ``Transpose(perm=[0,1,3,2])`` or
  torchlib's ``Reshape [-1, T, D]`` → ``Transpose [0,2,1]`` → ``Reshape``;
- scalar scaling (``Mul``/``Div`` by a constant, e.g. ``sqrt(scale)`` on K),
  ``Identity`` and no-op ``Cast``.

:func:`trace_kv` walks back from the consumed tensor to the ``Concat`` and
then replays the chain forward, tracking each axis as a group of labels
(``B``, ``H`` for the kv heads, ``R`` for an inserted repeat axis) and whether
the last two axes are swapped. Reshapes must keep the last two dimensions
(checked on the inferred symbolic shapes) and only regroup the leading ones,
which row-major order does without moving data. The result is accepted only
if the leading labels end as ``B, H, R`` — query head ``h`` then reads kv head
``h // R`` (repeat-interleave, CASES C05). ``B, R, H`` (tile) is refused.

A graph that starts the cache (the prefill graph of a prefill/decode pair,
as transformers' exporter writes it) has no past: its presents are the new
rows themselves, graph outputs that the decode graph takes back as its pasts.
With ``present_only=True`` the walk also stops at such a graph output (one
that no ``Concat`` produces): ``past`` is then None and ``new`` is ``present``
(P = 0 in the original).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple, Union

import onnx

from ._graph import FLOAT_TYPES, GraphEditor, attr

_PASS_OPS = {"Identity", "Cast", "Reshape", "Transpose", "Unsqueeze", "Expand", "Mul", "Div"}


@dataclass
class KVTrace:
    """A traced K or V operand (see module docstring).

    Attributes:
        concat: the ``Concat(past, new, axis=seq)`` node, or None (no past).
        past: graph input holding the past rows (BNSH ``[B, Hkv, P, D]``), or None
            (a graph that starts the cache: the present is the new rows).
        new: tensor of the new rows (BNSH ``[B, Hkv, S, D]``).
        present: the ``Concat`` output (BNSH ``[B, Hkv, P+S, D]``).
        n_rep: query heads per kv head introduced by the expansion (1 = none).
        swapped: True when the consumed tensor is ``[..., D, T]``.
        factor: product of the scalar factors on the path.
        nodes: the path nodes, present side first.
    """

    concat: Optional[onnx.NodeProto]
    past: Optional[str]
    new: str
    present: str
    n_rep: int = 1
    swapped: bool = False
    factor: float = 1.0
    nodes: List[onnx.NodeProto] = field(default_factory=list)


def resolve_identity(ed: GraphEditor, name: str) -> str:
    """Follow ``Identity`` producers back to the first other tensor."""
    seen = set()
    while name not in seen:
        seen.add(name)
        p = ed.producer(name)
        if p is None or p.op_type != "Identity" or p.domain not in ("", "ai.onnx"):
            return name
        name = p.input[0]
    return name


def concat_past(ed: GraphEditor, node: onnx.NodeProto) -> Union[Tuple[str, str], str]:
    """``(past_input, new)`` if ``node`` is ``Concat(past, new)`` on the sequence axis of BNSH data.

    Returns a reason string otherwise.
    """
    if node.op_type != "Concat" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
        return "not a two-input Concat"
    past = resolve_identity(ed, node.input[0])
    if not ed.is_graph_input(past):
        return f"Concat input 0 ({node.input[0]!r}) is not a graph input"
    dims = ed.dims(past) or ed.dims(node.input[1]) or ed.dims(node.output[0])
    rank = len(dims) if dims is not None else None
    axis = attr(node, "axis")
    if rank != 4:
        return f"Concat {node.name!r}: expected 4-D BNSH past/present, got rank {rank}"
    if axis not in (2, -2):
        return f"Concat {node.name!r}: axis {axis} is not the sequence axis of BNSH (2)"
    return past, node.input[1]


def reads_past_concat(ed: GraphEditor, name: str, depth: int = 16) -> bool:
    """Does ``name`` come (through single-input layout/scale ops) from ``Concat(<graph input>, ...)``?

    Used to tell an attention over a cache that :func:`trace_kv` cannot prove
    (refused, with the reason) from a stateless one (not a candidate).
    """
    t = name
    for _ in range(depth):
        p = ed.producer(t)
        if p is None or p.domain not in ("", "ai.onnx"):
            return False
        if p.op_type == "Concat":
            return len(p.input) >= 2 and ed.is_graph_input(resolve_identity(ed, p.input[0]))
        if p.op_type not in _PASS_OPS or not p.input:
            return False
        t = _data_input(ed, p) or p.input[0]
    return False


def _data_input(ed: GraphEditor, node: onnx.NodeProto) -> Optional[str]:
    """The single non-constant input a pass-through op transforms."""
    if node.op_type in ("Mul", "Div"):
        a, b = node.input[0], node.input[1]
        if ed.scalar(b) is not None:
            return a
        if node.op_type == "Mul" and ed.scalar(a) is not None:
            return b
        return None
    return node.input[0] if node.input else None


def _same(a, b) -> bool:
    return a is not None and b is not None and a == b


def trace_kv(ed: GraphEditor, name: str, present_only: bool = False) -> Union[KVTrace, str]:
    """Trace ``name`` back to ``Concat(past, new)``; see the module docstring.

    ``present_only``: also accept a graph output (not made by ``Concat``) as
    the present of a graph with no past.

    Returns a :class:`KVTrace`, or a reason string when the path is not one
    this module can prove equivalent.
    """
    chain: List[onnx.NodeProto] = []
    t = name
    while True:
        p = ed.producer(t)
        if p is None:
            return f"{name!r} does not come from Concat(past, new)"
        if p.op_type == "Concat" and p.domain in ("", "ai.onnx"):
            break
        if present_only and ed.is_graph_output(t):
            p = None
            break
        if p.op_type not in _PASS_OPS or p.domain not in ("", "ai.onnx"):
            return f"{name!r} comes from {p.op_type} {p.name!r}, not from Concat(past, new) through layout ops"
        d = _data_input(ed, p)
        if d is None:
            return f"{p.op_type} {p.name!r} on the path of {name!r} has no constant scalar operand"
        chain.append(p)
        t = d
    chain.reverse()
    if p is None:
        tr = KVTrace(concat=None, past=None, new=t, present=t, nodes=chain)
    else:
        cp = concat_past(ed, p)
        if isinstance(cp, str):
            return cp
        past, new = cp
        tr = KVTrace(concat=p, past=past, new=new, present=p.output[0], nodes=chain)
    pdims = ed.dims(tr.present)
    if pdims is None or len(pdims) != 4:
        return f"present {tr.present!r}: expected 4-D BNSH, shape unknown"
    sizes = {"B": pdims[0], "H": pdims[1]}
    # axes: label groups of the leading axes; cur_dims: the tracked shape (ints or symbols).
    axes: List[Tuple[str, ...]] = [("B",), ("H",)]
    repeat_sizes: dict = {}
    cur, cur_dims = tr.present, list(pdims)
    for node in chain:
        op = node.op_type
        out = node.output[0]
        if op == "Identity":
            pass
        elif op == "Cast":
            if attr(node, "to") != ed.elem_type(cur) and ed.elem_type(cur) is not None:
                return f"Cast {node.name!r} changes the element type on the K/V path"
        elif op in ("Mul", "Div"):
            s = ed.scalar(node.input[1] if _data_input(ed, node) == node.input[0] else node.input[0])
            tr.factor *= (1.0 / s) if op == "Div" else s
        elif op == "Transpose":
            perm = list(attr(node, "perm", []))
            r = len(axes) + 2
            if not perm:
                return f"Transpose {node.name!r} without perm reverses all axes"
            if perm[: r - 2] != list(range(r - 2)) or sorted(perm[r - 2:]) != [r - 2, r - 1]:
                return f"Transpose {node.name!r} perm {perm} moves batch/head axes"
            if perm[r - 2:] == [r - 1, r - 2]:
                tr.swapped = not tr.swapped
            cur_dims = [cur_dims[p] for p in perm]
        elif op == "Unsqueeze":
            ax = attr(node, "axes")
            if ax is None and len(node.input) > 1:
                v = ed.const_value(node.input[1])
                ax = None if v is None else [int(x) for x in v.ravel()]
            if not ax or len(ax) != 1:
                return f"Unsqueeze {node.name!r}: expected one constant axis"
            r_out = len(axes) + 3
            a = ax[0] + r_out if ax[0] < 0 else ax[0]
            if a >= r_out - 2:
                return f"Unsqueeze {node.name!r} inserts axis {ax[0]} among the sequence/head_dim axes"
            label = f"R{len(repeat_sizes)}"
            repeat_sizes[label] = 1
            axes.insert(a, (label,))
            cur_dims.insert(a, 1)
        elif op == "Expand":
            new = _expand_dims(ed, node, cur_dims, axes, repeat_sizes)
            if isinstance(new, str):
                return new
            cur_dims = new
        elif op == "Reshape":
            od = _reshape_dims(ed, node, cur_dims)
            if od is None or len(od) < 3:
                return f"Reshape {node.name!r}: shapes unknown; cannot verify it only regroups batch/head axes"
            if not (_same(cur_dims[-1], od[-1]) and _same(cur_dims[-2], od[-2])):
                return f"Reshape {node.name!r} changes the last two axes ({cur_dims} -> {od})"
            flat = [lab for group in axes for lab in group]
            groups = _partition(flat, od[:-2], sizes, repeat_sizes)
            if groups is None:
                return f"Reshape {node.name!r}: cannot match output dims {od[:-2]} to axes {flat}"
            axes = groups
            cur_dims = list(od)
        cur = out
    if len(axes) != 2:
        return f"{name!r}: expected a 4-D tensor at the end of the K/V path, got rank {len(axes) + 2}"

    def real(group):
        return [lab for lab in group if lab not in repeat_sizes or repeat_sizes[lab] != 1]

    if real(axes[0]) != ["B"]:
        return f"{name!r}: the batch axis is mixed with other axes on the K/V path ({axes})"
    heads = real(axes[1])
    reps = [lab for lab in heads if lab != "H"]
    if heads != ["H"] + reps:
        if "H" in heads:
            return (f"{name!r}: the head expansion tiles the kv heads (query head h would read kv head "
                    f"h % Hkv); CacheAttention maps h to h // (Hq/Hkv) (repeat-interleave)")
        return f"{name!r}: unsupported head arrangement {axes}"
    n = 1
    for lab in reps:
        n *= repeat_sizes[lab]
    tr.n_rep = n
    return tr


def starts_cache_reason(ed: GraphEditor, tr: KVTrace, query: str) -> Optional[str]:
    """Why a trace without past (``present_only``) is not the new rows of a graph that starts the
    cache, or None when it is: the present must have the query's sequence length (S new rows; a
    fixed-size buffer such as a static cache's has its capacity instead) and be computed without
    any floating-point graph input (a past or a cache buffer written in place, e.g. by ScatterND)."""
    if tr.past is not None:
        return None
    pasts = set()
    stack, seen = [tr.present], set()
    while stack:
        t = stack.pop()
        if t in seen:
            continue
        seen.add(t)
        if ed.is_graph_input(t) and ed.elem_type(t) in FLOAT_TYPES:
            pasts.add(t)
        p = ed.producer(t)
        if p is not None:
            stack.extend(x for x in p.input if x)
    if pasts:
        return (f"K/V come from the graph output {tr.present!r}, computed from the input(s) {sorted(pasts)} but not "
                f"by Concat(past, new): a cache written in place (e.g. ScatterND into a static buffer) is not "
                f"supported")
    pd, qd = ed.dims(tr.present), ed.dims(query)
    s_p = pd[2] if pd and len(pd) == 4 else None
    s_q = qd[2] if qd and len(qd) == 4 else None
    if s_p is None or s_q is None or s_p != s_q:
        return (f"K/V come from the graph output {tr.present!r} of length {s_p} for {s_q} new tokens, not from "
                f"Concat(past, new): a fixed-size (static) cache buffer is not supported")
    return None


def _expand_dims(ed: GraphEditor, node, cur_dims, axes, repeat_sizes):
    """New tracked dims after ``Expand``; only inserted repeat axes may grow (else a reason string)."""
    r = len(cur_dims)
    od = ed.dims(node.output[0])
    od = od if od is not None and len(od) == r else [None] * r
    tgt = ed.sym_vector(node.input[1])
    tv = [None] * r
    if tgt is not None and len(tgt[0]) <= r:
        tv = [None] * (r - len(tgt[0])) + [ed.dim_value(e) for e in tgt[0]]
    new = []
    for k in range(r):
        ik = cur_dims[k]
        labels = axes[k] if k < len(axes) else ()
        if len(labels) == 1 and labels[0] in repeat_sizes:
            n = od[k] if isinstance(od[k], int) else tv[k]
            if not isinstance(n, int) or n < 1:
                return f"Expand {node.name!r}: repeat count is not static"
            repeat_sizes[labels[0]] = n
            new.append(n)
        elif (isinstance(ik, int) and ik != 1) or _same(ik, od[k]) or tv[k] == 1 or _same(ik, tv[k]):
            new.append(ik)
        else:
            return f"Expand {node.name!r} broadcasts axis {k}, which is not an inserted repeat axis"
    return new


def _reshape_dims(ed: GraphEditor, node, cur_dims):
    """Output dims of ``Reshape`` from inference, completed from its target vector."""
    od = ed.dims(node.output[0])
    tgt = ed.sym_vector(node.input[1])
    n = len(od) if od is not None else (len(tgt[0]) if tgt is not None else None)
    if n is None:
        return None
    out = list(od) if od is not None else [None] * n
    if tgt is not None and len(tgt[0]) == n:
        allowzero = attr(node, "allowzero", 0)
        for k, e in enumerate(tgt[0]):
            if out[k] is not None:
                continue
            if e == 0 and not allowzero and k < len(cur_dims):
                out[k] = cur_dims[k]
            elif e != -1:
                out[k] = ed.dim_value(e)
    return out


def _partition(flat, out_dims, sizes, repeat_sizes) -> Optional[List[Tuple[str, ...]]]:
    """Split the row-major label list ``flat`` into groups matching ``out_dims``."""
    def size_of(lab):
        if lab in repeat_sizes:
            return repeat_sizes[lab]
        return sizes[lab]

    groups: List[Tuple[str, ...]] = []
    k = 0
    for i, d in enumerate(out_dims):
        if i == len(out_dims) - 1:
            groups.append(tuple(flat[k:]))
            k = len(flat)
            break
        if isinstance(d, int):
            prod, start = 1, k
            while k < len(flat):
                sz = size_of(flat[k])
                if not isinstance(sz, int) or prod * sz > d:
                    break
                if not (k == start or prod < d or (sz == 1 and flat[k] in repeat_sizes)):
                    break
                prod *= sz
                k += 1
            if prod != d or k == start:
                return None
            groups.append(tuple(flat[start:k]))
        else:
            if k < len(flat) and d is not None and d == size_of(flat[k]):
                groups.append((flat[k],))
                k += 1
            else:
                return None
    if k != len(flat) or len(groups) != len(out_dims):
        return None
    return groups
