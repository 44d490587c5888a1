"""``logits_to_keep``: an input that limits the LM head to the last positions of a run.

A causal LM's graph computes the logits of every position it runs, ``[B, S,
vocab]``, while a generation loop samples from the last one only. In a prefill
the LM head (hidden ``[B, S, H]`` times ``[H, vocab]``) then costs ``S`` rows
for one that is read: SmolLM2-135M's tied 49152 x 576 head is a fifth of the
model's weight multiply-adds per token, Gemma-3-270M's 262144 x 640 head more
than half, and the output alone is ``S x vocab x 4`` bytes (0.8 GB for a 4096-token
SmolLM2 prompt).

``convert(..., logits_to_keep=True)`` adds the int64 scalar input
``logits_to_keep`` with the meaning of transformers' argument of that name
(``LlamaForCausalLM.forward``): ``N > 0`` keeps the logits of the last ``N``
positions of the run (all of them when ``N >= S``), ``0`` keeps every position.
It is a required input: ORT logs a warning for every session of a model whose
input has a default (an initializer of the same name), so the option is off
unless asked for, and the converted model's inputs stay the original's plus the
cache handle. In the graph: ``Slice(hidden, starts=[-max(N, 0)], ends=[INT64_MAX],
axes=[1])`` in front of the LM head, so the head and whatever follows it up to
the logits output (a softcap, a cast) run on the kept rows only (a negative N
keeps every position, as 0 does); the logits
output's dimension 1 is renamed ``logits_length``.

The LM head is found from the logits output backwards: through nodes that act
element by element on one tensor of the graph (``Cast``, ``Identity``,
``Tanh``, and ``Mul``/``Div``/``Add``/``Sub`` against a constant of rank <= 1),
each the only reader of what the one before it wrote, to a ``MatMul``
(``com.microsoft.MatMulNBits`` for quantized weights) whose second input is a
weight (an initializer, or a ``Transpose``/``Cast``/``DequantizeLinear``/
``Identity``/``Reshape`` of weights). Its first input must be rank 3 (``[B, S,
H]``: by shape inference, or where inference stopped short of it, by the
declared rank of the logits, which the head and the chain keep), and where
the graph names the positions (``input_ids`` ``[B, S]`` or ``inputs_embeds``
``[B, S, H]``) the logits' declared dimension 1 and the head input's inferred
one must be them (a seq-first ``[S, B, ...]`` layout would slice the batch).
Constants in the chain are initializers or constant subgraphs, never inputs
(an initializer that is also an input can be fed another shape).
Anything else (a ``Gemm`` on flattened rows, logits read by another node, an
opset below 10) leaves the graph as it was, with the reason in the report's
notes. The kept rows' values are those of the full run up to the LM head
kernel's rounding (a one-row ``MatMul`` may take another kernel than a
many-row one; on every committed fixture, tests/data, they were equal bit for
bit).
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import onnx
from onnx import TensorProto, helper

from ._graph import GraphEditor

__all__ = ["LOGITS_TO_KEEP", "add_logits_to_keep", "logits_output_name"]

#: name of the added input (transformers' argument name)
LOGITS_TO_KEEP = "logits_to_keep"

_UNARY = {"Cast", "Identity", "Tanh"}
_BINARY = {"Mul", "Div", "Add", "Sub"}
_WEIGHT_OPS = {"Transpose", "Cast", "DequantizeLinear", "Identity", "Reshape"}
_MS = "com.microsoft"
_INT64_MAX = np.iinfo(np.int64).max


def logits_output_name(model: onnx.ModelProto) -> Optional[str]:
    """The graph output named ``logits``, else the first output (None without outputs)."""
    names = [o.name for o in model.graph.output]
    if "logits" in names:
        return "logits"
    return names[0] if names else None


def _is_weight(ed: GraphEditor, name: str, depth: int = 0) -> bool:
    """``name`` is an initializer, or a few layout/dtype ops on initializers and constants."""
    if name in ed.inits:
        return name not in ed.input_names  # (an initializer that is also an input can be fed)
    node = ed.producer(name)
    if node is None or depth > 4:
        return False
    if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
        return True
    if node.op_type not in _WEIGHT_OPS or node.domain not in ("", "ai.onnx"):
        return False
    return all(_is_weight(ed, x, depth + 1) for x in node.input if x)


def _rank(ed: GraphEditor, name: str) -> Optional[int]:
    dims = ed.dims(name)
    return None if dims is None else len(dims)


def _find_head(ed: GraphEditor, logits: str) -> Tuple[Optional[onnx.NodeProto], list, str]:
    """(the LM head node, the chain's outputs from the head's to ``logits``, why not) walking back."""
    cur, chain = logits, []
    for _ in range(16):
        node = ed.producer(cur)
        if node is None:
            return None, chain, f"{cur!r} is not computed by a node"
        readers = ed.consumers(cur)
        if cur == logits and readers:
            return None, chain, f"the logits output {logits!r} is also read by {readers[0].op_type} {readers[0].name!r}"
        if cur != logits and (len(readers) != 1 or ed.is_graph_output(cur)):
            return None, chain, f"{cur!r}, between the LM head and the logits, is read elsewhere too"
        chain.append(cur)
        default = node.domain in ("", "ai.onnx")
        if default and node.op_type == "MatMul" or node.domain == _MS and node.op_type == "MatMulNBits":
            if len(node.input) < 2 or not _is_weight(ed, node.input[1]):
                return None, chain, f"{node.op_type} {node.name!r} does not multiply by a weight"
            if node.op_type == "MatMul" and _rank(ed, node.input[1]) not in (None, 2):
                return None, chain, f"the weight of {node.name!r} is not a matrix"
            return node, chain, ""
        if default and node.op_type in _UNARY:
            cur = node.input[0]
            continue
        if default and node.op_type in _BINARY and len(node.input) == 2:
            # (an initializer that is also an input is fed at run time: not a constant)
            const = [x not in ed.input_names and (ed.const_value(x) is not None or _is_weight(ed, x))
                     for x in node.input]
            if const.count(True) != 1:
                return None, chain, f"{node.op_type} {node.name!r} combines two computed tensors"
            other = node.input[const.index(False)]
            c = node.input[const.index(True)]
            if _rank(ed, c) is None or _rank(ed, c) > 1:
                return None, chain, f"{node.op_type} {node.name!r} broadcasts a constant of rank > 1"
            cur = other
            continue
        return None, chain, f"{node.op_type} {node.name!r} is not an LM head (MatMul by a weight) or element-wise"
    return None, chain, "no LM head within 16 nodes of the logits output"


def add_logits_to_keep(ed: GraphEditor, logits: Optional[str]) -> Tuple[Optional[str], str]:
    """Add the ``logits_to_keep`` input in front of the LM head (see module docstring).

    Args:
        ed: the editor of the graph being converted (maps up to date; refreshed here).
        logits: name of the logits graph output, or None.

    Returns:
        (``"logits_to_keep"``, "") when added, else (None, the reason).
    """
    if not logits or not ed.is_graph_output(logits):
        return None, "no logits output"
    if LOGITS_TO_KEEP in ed.input_names or LOGITS_TO_KEEP in ed.inits or ed.producer(LOGITS_TO_KEEP) is not None:
        return None, f"the graph already has a tensor named {LOGITS_TO_KEEP!r}"
    if ed.opset() < 10:
        return None, f"opset {ed.opset()} < 10 (Slice takes its bounds as inputs from opset 10)"
    out = next(o for o in ed.graph.output if o.name == logits)
    out_dims = out.type.tensor_type.shape.dim if out.type.tensor_type.HasField("shape") else None
    if out_dims is None or len(out_dims) != 3:
        return None, f"the logits output {logits!r} is not declared [B, S, vocab]"
    head, chain, why = _find_head(ed, logits)
    if head is None:
        return None, why
    hidden = head.input[0]
    rank = _rank(ed, hidden)
    if rank is None and (head.op_type == "MatMulNBits" or _rank(ed, head.input[1]) == 2):
        # Shape inference stopped before it (a contrib op upstream): the head keeps its input's
        # rank, and so does the chain (constants of rank <= 1), so it is the logits' declared 3.
        rank = 3
    if rank != 3:
        return None, f"the LM head's input {hidden!r} is not [B, S, H] (rank {rank})"
    # Axis 1 must be the positions: where the graph names them (input_ids [B, S] or inputs_embeds
    # [B, S, H]), the logits' declared dimension 1 and the head input's inferred one must agree.
    src = next((x for x in ("input_ids", "inputs_embeds") if x in ed.input_names), None)
    src_dims = ed.dims(src) if src else None
    pos = src_dims[1] if src_dims and len(src_dims) >= 2 else None
    seq = out_dims[1].dim_param or (out_dims[1].dim_value if out_dims[1].HasField("dim_value") else None)
    hidden_dims = ed.dims(hidden)
    for what, d in (("of the logits output", seq), (f"of the LM head's input {hidden!r}",
                                                     hidden_dims[1] if hidden_dims else None)):
        if pos is not None and d not in (None, "") and d != pos:
            return None, (f"dimension 1 {what} ({d!r}) is not {src}'s positions ({pos!r}): not a [B, S, ...] "
                          f"layout")

    ed.graph.input.append(helper.make_tensor_value_info(LOGITS_TO_KEEP, TensorProto.INT64, []))
    ed.refresh()
    n = ed.add_node1("Reshape", [LOGITS_TO_KEEP, ed.add_const(np.array([1], np.int64), "logits_to_keep/shape")],
                     hint="logits_to_keep/as_1d")
    # A negative N keeps every position, as 0 does: Where(N < 0, 0, N) (Less and Where take int64
    # from opset 9; Max only from 12).
    zero = ed.add_const(np.array([0], np.int64), "logits_to_keep/zero")
    n = ed.add_node1("Where", [ed.add_node1("Less", [n, zero], hint="logits_to_keep/negative"), zero, n],
                     hint="logits_to_keep/at_least_0")
    starts = ed.add_node1("Neg", [n], hint="logits_to_keep/starts")
    kept = ed.add_node1("Slice", [hidden, starts, ed.add_const(np.array([_INT64_MAX], np.int64), "logits_to_keep/ends"),
                                  ed.add_const(np.array([1], np.int64), "logits_to_keep/axes")],
                        hint="logits_to_keep/hidden")
    ed.replace_uses(hidden, kept, nodes=[head])
    # The chain's tensors are now [B, min(N, S) or S, ...]: drop what value_info said of their
    # dimension 1, and rename the output's.
    stale = set(chain)
    keep_vi = [vi for vi in ed.graph.value_info if vi.name not in stale]
    del ed.graph.value_info[:]
    ed.graph.value_info.extend(keep_vi)
    d1 = out.type.tensor_type.shape.dim[1]
    d1.Clear()
    d1.dim_param = "logits_length"
    ed.refresh()
    return LOGITS_TO_KEEP, ""
