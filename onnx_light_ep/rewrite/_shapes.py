"""Shapes of pasts and presents after the rewrite: what a remaining ``Shape`` node reads instead.

A past or present tensor leaves the graph when its layer moves into the cache,
but the graph may still read its shape (the cache position ``P`` of a causal
mask, the key length ``P + S``, a reshape target). :class:`Shapes` builds those
shapes from what the converted graph still has: the ``attention_mask`` width
(``P + S``) and the new length ``S`` when the graph has ``attention_mask``,
else the cache itself (``ai.onnx_light.CacheShape``, ``P`` = the longest
committed sequence) plus ``S``. :func:`substitute_shape` points a ``Shape`` node's
readers at such a vector (honouring ``start``/``end``), and
:func:`substitute_chain_shapes` does it for the layout views of a present (the
GQA-expanded K, the transposed K) whose dims are present dims or constants.
"""

from __future__ import annotations

from typing import Dict, Optional

import numpy as np
import onnx
from onnx import helper

from ._graph import GraphEditor
from ._plan import DOMAIN, LayerPlan, const_i64, dim_of


class Shapes:
    """Builds the shapes ``[B, Hkv, P, D]`` (a past) and ``[B, Hkv, P+S, D]`` (a present) of a layer.

    With an ``attention_mask`` input: from its width ``P + S`` and the new length ``S``
    (``input_ids``/``inputs_embeds``/``position_ids`` dim 1), once per geometry, the meaning the
    mask keeps after conversion. Without one: from the cache itself,
    ``ai.onnx_light.CacheShape(cache, layer)`` (``P`` = the longest sequence's committed length),
    plus ``S`` on axis 2 for a present. :meth:`available` is False only when neither source exists
    (no input gives ``S``).
    """

    def __init__(self, ed: GraphEditor, names: Dict[str, Optional[str]], cache_input: str):
        self.ed, self.names, self.cache_input, self.cache = ed, names, cache_input, {}
        self.cache_shapes = False  # a CacheShape node was written

    def _seq_src(self) -> Optional[str]:
        n = self.names
        return n["input_ids"] or n["inputs_embeds"] or n["position_ids"]

    def from_mask(self) -> bool:
        return bool(self.names["attention_mask"]) and bool(self._seq_src())

    def available(self) -> bool:
        return bool(self._seq_src())

    def get(self, kind: str, hkv: int, d: int, layer: int, value: bool, stacked: bool = False) -> str:
        """int64 ``[4]``: the shape of layer ``layer``'s past (``kind="past"``) or present key
        (``value=False``, last dim ``d`` = head_dim) or value (``value=True``, ``d`` = v_head_dim);
        ``[5]`` ``[2, B, Hkv, P|T, D]`` for a ``stacked`` key/value tensor (com.microsoft.Attention)."""
        if stacked:
            key = ("stacked", kind, hkv, d, layer)
            if key not in self.cache:
                self.cache[key] = self.ed.add_node1(
                    "Concat", [const_i64(self.ed, [2], "shape/kv"), self.get(kind, hkv, d, layer, value)],
                    hint=f"shape/{kind}_stacked", axis=0)
            return self.cache[key]
        if self.from_mask():
            return self._from_mask(kind, hkv, d)
        key = (kind, layer, value)
        if key in self.cache:
            return self.cache[key]
        ed = self.ed
        self.cache_shapes = True
        vec = ed.add_node1("CacheShape", [self.cache_input], hint=f"shape/layer{layer}_{'v' if value else 'k'}_past",
                           domain=DOMAIN, layer=layer, value=int(value))
        if kind == "present":
            s = dim_of(ed, self._seq_src(), 1, "shape/new")
            zero = const_i64(ed, [0], "shape/zero")
            step = ed.add_node1("Concat", [zero, zero, s, zero], hint="shape/new_rows", axis=0)
            vec = ed.add_node1("Add", [vec, step], hint=f"shape/layer{layer}_{'v' if value else 'k'}_present")
        self.cache[key] = vec
        return vec

    def _from_mask(self, kind: str, hkv: int, d: int) -> str:
        key = (kind, hkv, d)
        if key in self.cache:
            return self.cache[key]
        ed, n = self.ed, self.names
        mask = n["attention_mask"]
        seq_src = self._seq_src()
        b = dim_of(ed, mask, 0, "shape/batch")
        total = dim_of(ed, mask, 1, "shape/total")
        length = total
        if kind == "past":
            s = dim_of(ed, seq_src, 1, "shape/new")
            length = ed.add_node1("Sub", [total, s], hint="shape/past")
        vec = ed.add_node1("Concat", [b, const_i64(ed, [hkv], "shape/hkv"), length, const_i64(ed, [d], "shape/d")],
                           hint=f"shape/{kind}_{hkv}x{d}", axis=0)
        self.cache[key] = vec
        return vec


def substitute_shape(ed: GraphEditor, node: onnx.NodeProto, vec: str, rank: int = 4) -> None:
    """Point the readers of ``Shape`` node ``node`` at ``vec`` (int64 ``[rank]``), sliced by its start/end."""
    start = next((a.i for a in node.attribute if a.name == "start"), 0)
    end = next((a.i for a in node.attribute if a.name == "end"), None)
    idx = list(range(rank))[slice(start, end)]
    sliced = vec
    if idx != list(range(rank)):
        if not idx:
            sliced = ed.add_const(np.zeros(0, dtype=np.int64), "shape/empty")
        else:
            sliced = ed.add_node1("Slice", [vec, const_i64(ed, [idx[0]], "shape/s"),
                                            const_i64(ed, [idx[-1] + 1], "shape/e")], hint="shape/slice")
    ed.replace_uses(node.output[0], sliced)
    for k, o in enumerate(ed.output_names):
        if o == node.output[0]:  # a shape that is a graph output keeps its name
            ident = helper.make_node("Identity", [sliced], [o], name=ed.new_name("shape/out"))
            node.output[0] = ed.new_name("shape/dead")
            ed.graph.node.append(ident)
    ed.refresh()


def substitute_chain_shapes(ed: GraphEditor, p: LayerPlan, layer: int, shapes: Shapes) -> None:
    """``Shape`` of a layout view of a present (e.g. the GQA-expanded K whose length sizes the mask),
    rebuilt from the present's computed shape when every dimension is a constant or a present dimension.

    K and V views share the batch and sequence dims; head counts and sizes are constants.
    """
    pdims = ed.dims(p.present_key)
    if pdims is None:
        return
    for t in p.chain_tensors:
        dims = ed.dims(t)
        if dims is None:
            continue
        for c in ed.consumers(t):
            if c.op_type != "Shape" or c.domain not in ("", "ai.onnx"):
                continue
            rank = len(dims)
            start = next((a.i for a in c.attribute if a.name == "start"), 0)
            end = next((a.i for a in c.attribute if a.name == "end"), rank)
            idx = list(range(rank))[slice(start, end)]
            parts = []
            for k in idx:
                e = dims[k]
                if isinstance(e, int):
                    parts.append(const_i64(ed, [e], "shape/view_dim"))
                elif e is not None and e in pdims:
                    j = pdims.index(e)
                    vec = shapes.get("present", p.kv_num_heads, p.head_dim, layer, False)
                    parts.append(ed.add_node1("Slice", [vec, const_i64(ed, [j], "shape/s"),
                                                        const_i64(ed, [j + 1], "shape/e")], hint="shape/view"))
                else:
                    parts = None
                    break
            if not parts:
                continue
            vec = ed.add_node1("Concat", parts, hint="shape/view_shape", axis=0) if len(parts) > 1 else parts[0]
            ed.replace_uses(c.output[0], vec)
            ed.refresh()
