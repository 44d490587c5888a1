"""What a matcher hands to the converter, and small in-graph builders.

A matcher (``_gqa``, ``_attention``, ``_decomposed``, ``_mha``) looks at one attention
and returns either a :class:`LayerPlan` (how to replace it with one
``ai.onnx_light.CacheAttention``) or a :class:`Refusal` (why it stays as it
is). Plans do not touch the graph until :meth:`LayerPlan.build` is called.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import onnx
from onnx import TensorProto

from ._graph import GraphEditor

DOMAIN = "ai.onnx_light"
MS_DOMAIN = "com.microsoft"



def node_input(node: onnx.NodeProto, i: int) -> str:
    """Input ``i`` of ``node``, or "" when it has fewer (an omitted optional input)."""
    return node.input[i] if len(node.input) > i else ""


def node_output(node: onnx.NodeProto, i: int) -> str:
    """Output ``i`` of ``node``, or "" when it has fewer."""
    return node.output[i] if len(node.output) > i else ""


def is_used(ed: GraphEditor, name: str) -> bool:
    """``name`` is read by a node or is a graph output."""
    return bool(name) and (bool(ed.consumers(name)) or ed.is_graph_output(name))

@dataclass
class Operands:
    """Inputs of the ``CacheAttention`` node a plan builds (tensor names, '' = absent)."""

    query: str
    key: str
    value: str
    mask: str = ""
    seqlens_k: str = ""
    cos_cache: str = ""
    sin_cache: str = ""


@dataclass
class LayerPlan:
    """How one attention becomes ``CacheAttention``.

    Attributes:
        pattern: source pattern name (``GroupQueryAttention``, ``Attention``,
            ``Concat+Attention``, ``TensorScatter+Attention``, ``Concat+decomposed``).
        anchor: the node that identifies the attention (its position orders layers).
        y_old: tensor whose consumers switch to the ``CacheAttention`` output.
        past_key, past_value: loop-carried graph inputs, or None (no past: P = 0).
        present_key, present_value: tensors that equal present K/V (BNSH).
        q_num_heads, kv_num_heads, head_dim, v_head_dim: geometry (ints).
        elem_type: ``TensorProto`` element type of Q/K/V and the cache.
        attrs: ``CacheAttention`` attributes other than ``layer``.
        prepare: ``prepare(ed) -> Operands``; emits the nodes the inputs need
            (QKV split, rotary, masks) and returns the operand names.
        padding: "left" (masks carry padding; every step appends all S rows)
            or "right" (``seqlens_k``: valid rows first).
        notes: remarks for the report.
        needs_ms_domain: the plan emits ``com.microsoft`` ops.
        chain_tensors: layout-only views of the presents (head expansion,
            transposes) whose ``Shape`` may still be read after the rewrite.
        past_capacity: positions the original's past/present buffers hold when
            they are fixed-size (GroupQueryAttention ``sliding_window_cache=1``:
            window-sized buffers, oldest rows overwritten), else None (past =
            every earlier position). Recorded so ``compare`` can drive the original.
        past_stacked: the past is one ``[2, B, Hkv, P, D]`` input holding key (index 0) and
            value (index 1), and the present one ``[2, B, Hkv, T, D]`` output
            (``com.microsoft.Attention``); ``past_key == past_value`` and
            ``present_key == present_value`` name them.
    """

    pattern: str
    anchor: onnx.NodeProto
    y_old: str
    past_key: Optional[str]
    past_value: Optional[str]
    present_key: str
    present_value: str
    q_num_heads: int
    kv_num_heads: int
    head_dim: int
    v_head_dim: int
    elem_type: int
    attrs: Dict[str, object]
    prepare: Callable[[GraphEditor], Operands]
    padding: str = "left"
    notes: List[str] = field(default_factory=list)
    needs_ms_domain: bool = False
    chain_tensors: List[str] = field(default_factory=list)
    past_capacity: Optional[int] = None
    past_stacked: bool = False

    @property
    def anchor_name(self) -> str:
        return anchor_name(self.anchor)


@dataclass
class Refusal:
    """An attention the rewrite leaves as it is, with the reason."""

    anchor: str
    pattern: str
    reason: str


def anchor_name(node: onnx.NodeProto) -> str:
    """A stable identity for a node: its name, else its first output."""
    return node.name or f"<{node.op_type} -> {node.output[0]}>"


# -- in-graph builders --------------------------------------------------------


def const_i64(ed: GraphEditor, values, hint: str = "const") -> str:
    return ed.add_const(np.asarray(values, dtype=np.int64), hint)


def dim_of(ed: GraphEditor, x: str, axis: int, hint: str) -> str:
    """int64 ``[1]``: ``Shape(x)[axis]`` (``Shape`` start/end from opset 15, else ``Shape`` + ``Slice``)."""
    end = axis + 1 if axis != -1 else None
    if ed.opset() < 15:
        shape = ed.add_node1("Shape", [x], hint=f"{hint}/shape")
        ends = const_i64(ed, [end if end is not None else np.iinfo(np.int64).max], f"{hint}/end")
        return ed.add_node1("Slice", [shape, const_i64(ed, [axis], f"{hint}/start"), ends], hint=hint)
    kw = {"start": axis}
    if end is not None:
        kw["end"] = end
    return ed.add_node1("Shape", [x], hint=hint, **kw)


def unsqueeze(ed: GraphEditor, x: str, axes: List[int], hint: str) -> str:
    """``Unsqueeze(x, axes)``: axes as an input from opset 13, as an attribute before."""
    if ed.opset() >= 13:
        return ed.add_node1("Unsqueeze", [x, const_i64(ed, axes, f"{hint}/axes")], hint=hint)
    return ed.add_node1("Unsqueeze", [x], hint=hint, axes=list(axes))


def total_length(ed: GraphEditor) -> Optional[str]:
    """int64 ``[1]``: past + current tokens, read from the ``attention_mask`` graph input (dim 1), or None.

    Built once per graph. Never derived from a present tensor (that would make
    the mask depend on the cache it feeds).
    """
    if "attention_mask" not in ed.input_names:
        return None
    if "total_length" not in ed.memo:
        ed.memo["total_length"] = {"t": dim_of(ed, "attention_mask", 1, "total_length")}
    return ed.memo["total_length"]["t"]


def causal_mask(ed: GraphEditor, *, seq: str, total: str, offset: Optional[str],
                window: int = -1, hint: str) -> str:
    """bool ``[B|1, 1, S, T]``: query ``i`` sees key ``j`` iff ``j <= offset + i``.

    Args:
        seq, total: int64 ``[1]`` tensors S and T.
        offset: int64 ``[B]`` per-row offset, or None for 0 (upper-left, ONNX
            Attention without past, CASES C04).
        window: when >= 0, additionally ``j >= offset + i - window`` (ONNX
            opset-25 ``left_window_size``).
    """
    zero = const_i64(ed, 0, f"{hint}/zero")
    one = const_i64(ed, 1, f"{hint}/one")
    s = ed.add_node1("Squeeze", [seq], hint=f"{hint}/S")
    t = ed.add_node1("Squeeze", [total], hint=f"{hint}/T")
    rows = ed.add_node1("Range", [zero, s, one], hint=f"{hint}/rows")            # [S]
    cols = ed.add_node1("Range", [zero, t, one], hint=f"{hint}/cols")            # [T]
    rows = ed.add_node1("Reshape", [rows, const_i64(ed, [1, 1, -1, 1], f"{hint}/rs")], hint=f"{hint}/rows4")
    cols = ed.add_node1("Reshape", [cols, const_i64(ed, [1, 1, 1, -1], f"{hint}/cs")], hint=f"{hint}/cols4")
    if offset is not None:
        off = ed.add_node1("Reshape", [offset, const_i64(ed, [-1, 1, 1, 1], f"{hint}/os")], hint=f"{hint}/off4")
        rows = ed.add_node1("Add", [rows, off], hint=f"{hint}/pos")              # [B,1,S,1]
    allow = ed.add_node1("LessOrEqual", [cols, rows], hint=f"{hint}/causal")
    if window >= 0:
        lo = ed.add_node1("Sub", [rows, const_i64(ed, window, f"{hint}/w")], hint=f"{hint}/lo")
        inwin = ed.add_node1("GreaterOrEqual", [cols, lo], hint=f"{hint}/inwin")
        allow = ed.add_node1("And", [allow, inwin], hint=f"{hint}/allow")
    return allow


def combine_masks(ed: GraphEditor, masks: List[Tuple[str, bool]], elem_type: int, hint: str) -> str:
    """One mask from several ``(name, is_bool)`` (all broadcastable to ``[B, H, S, T]``).

    bool masks (true = attend) are ANDed; float masks are added; a bool mask
    combined with a float one becomes ``Where(bool, float, -inf)``.
    Returns '' for no masks.
    """
    masks = [(m, b) for m, b in masks if m]
    if not masks:
        return ""
    if len(masks) == 1:
        return masks[0][0]
    bools = [m for m, b in masks if b]
    floats = [m for m, b in masks if not b]
    b = bools[0] if bools else ""
    for m in bools[1:]:
        b = ed.add_node1("And", [b, m], hint=f"{hint}/and")
    f = floats[0] if floats else ""
    for m in floats[1:]:
        f = ed.add_node1("Add", [f, m], hint=f"{hint}/add")
    if not f:
        return b
    if not b:
        return f
    np_t = onnx.helper.tensor_dtype_to_np_dtype(elem_type)
    ninf = ed.add_const(np.array(-np.inf, dtype=np_t), f"{hint}/ninf")
    return ed.add_node1("Where", [b, f, ninf], hint=f"{hint}/where")


def elem_type_name(elem_type: Optional[int]) -> str:
    if elem_type is None:
        return "unknown"
    return TensorProto.DataType.Name(elem_type)
