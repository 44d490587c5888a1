"""Values a graph computes before run time: constants, shape vectors and static dimensions.

Mixed into ``GraphEditor`` (``_graph``). Pure onnx + numpy:

- :meth:`ValueMixin.const_value`: initializers (external data read on demand,
  small tensors only), ``Constant`` nodes and default-domain ops over
  constants evaluated with ``onnx.reference``;
- :meth:`ValueMixin.sym_vector`: the elements of shape-like int vectors
  (``Shape`` → ``Gather``/``Slice``/``Concat``/...), static or symbolic, which
  also lets ``const_value`` fold ``Slice(Shape(x))`` when the sliced dims are
  static;
- :meth:`ValueMixin.dims`: static/symbolic dimensions from
  ``onnx.shape_inference`` (data propagation on), with local rules where
  inference stops at contrib ops (``MatMul`` with constant weights,
  ``MatMulNBits``, broadcasting elementwise ops).
"""

from __future__ import annotations

import copy
from typing import List, Optional, Tuple, Union

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

#: Constants larger than this (in elements) are never evaluated or folded.
MAX_CONST_ELEMENTS = 1 << 16

Dim = Union[int, str, None]

_SHAPE_OPS = {"Gather", "Slice", "Concat", "Unsqueeze", "Squeeze", "Reshape", "Identity", "Cast", "Where"}


def attr(node: onnx.NodeProto, name: str, default=None):
    """Value of attribute ``name`` of ``node`` (python types), or ``default``."""
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


class ValueMixin:
    """Constant folding, shape vectors and dims over ``self.graph`` / ``self.producers`` / ``self.inits``."""

    # -- constants ----------------------------------------------------------

    def const_value(self, name: str) -> Optional[np.ndarray]:
        """numpy value of ``name`` if it is a (small) constant, else None."""
        if not name:
            return None
        if name in self._const_cache:
            return self._const_cache[name]
        self._const_cache[name] = None  # guards cycles
        value = self._compute_const(name)
        self._const_cache[name] = value
        return value

    def _compute_const(self, name: str) -> Optional[np.ndarray]:
        if name in self.inits:
            t = self.inits[name]
            if int(np.prod(t.dims)) > MAX_CONST_ELEMENTS:
                return None
            if t.data_location == TensorProto.EXTERNAL:
                if self.base_dir is None:
                    return None
                t = copy.deepcopy(t)
                onnx.external_data_helper.load_external_data_for_tensor(t, self.base_dir)
            return numpy_helper.to_array(t)
        if name in self.input_names:
            return None
        node = self.producers.get(name)
        if node is None or node.domain not in ("", "ai.onnx"):
            return None
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    return numpy_helper.to_array(a.t)
                if a.name == "value_float":
                    return np.array(a.f, dtype=np.float32)
                if a.name == "value_floats":
                    return np.array(list(a.floats), dtype=np.float32)
                if a.name == "value_int":
                    return np.array(a.i, dtype=np.int64)
                if a.name == "value_ints":
                    return np.array(list(a.ints), dtype=np.int64)
            return None
        if node.op_type == "Shape":
            dims = self.dims(node.input[0])
            if dims is None or not all(isinstance(d, int) for d in dims):
                return None
            start, end = attr(node, "start", 0), attr(node, "end", None)
            return np.array(dims[slice(start, end)], dtype=np.int64)
        if node.op_type in ("If", "Loop", "Scan", "RandomNormal", "RandomUniform", "RandomNormalLike",
                            "RandomUniformLike", "Multinomial", "Bernoulli", "Dropout"):
            return None
        values = []
        for x in node.input:
            if not x:
                values.append(None)
                continue
            v = self.const_value(x)
            if v is None:
                sv = self.sym_vector(name) if node.op_type in _SHAPE_OPS else None
                if sv is not None and all(isinstance(e, int) for e in sv[0]):
                    return np.array(sv[0][0] if sv[1] else sv[0], dtype=np.int64)
                return None
            values.append(v)
        if not values:
            return None
        try:
            from onnx.reference import ReferenceEvaluator

            feeds = {}
            inputs = []
            for k, (x, v) in enumerate(zip(node.input, values)):
                if v is None:
                    inputs.append("")
                else:
                    inputs.append(f"i{k}")
                    feeds[f"i{k}"] = v
            outs = [f"o{k}" for k in range(len(node.output))]
            tmp = helper.make_node(node.op_type, inputs, outs, domain=node.domain or None)
            tmp.attribute.extend(node.attribute)
            results = ReferenceEvaluator(tmp, opsets={"": self.opset()}).run(None, feeds)
            out = np.asarray(results[list(node.output).index(name)])
            return out if out.size <= MAX_CONST_ELEMENTS else None
        except Exception:
            return None

    def sym_vector(self, name: str, depth: int = 0) -> Optional[Tuple[List[object], bool]]:
        """Elements of a small int shape-like tensor: ``(elements, is_scalar)`` or None.

        Each element is an ``int``, ``("dim", tensor, axis)`` (a dimension
        read with ``Shape``, static or not) or None (unknown). Follows Shape,
        Gather, Slice, Concat, Unsqueeze/Squeeze/Reshape/Identity/Cast and
        the ``Where(Equal(v, -1), 1, v)`` idiom of TorchScript ``expand``.
        """
        if depth > 24 or not name:
            return None
        if name in self.inits or (self.producers.get(name) is not None and
                                  self.producers[name].op_type == "Constant"):
            v = self.const_value(name)
            if v is None or v.ndim > 1 or v.dtype.kind not in "iu":
                return None
            return [int(x) for x in v.ravel()], v.ndim == 0
        node = self.producers.get(name)
        if node is None or node.domain not in ("", "ai.onnx"):
            return None
        op = node.op_type
        sub = lambda i: self.sym_vector(node.input[i], depth + 1) if len(node.input) > i else None  # noqa: E731
        if op == "Shape":
            dims = self.dims(node.input[0])
            if dims is None:
                return None
            r = len(dims)
            start, end = attr(node, "start", 0), attr(node, "end", r)
            axes = list(range(r))[slice(start, end)]
            return [dims[a] if isinstance(dims[a], int) else ("dim", node.input[0], a) for a in axes], False
        if op in ("Identity", "Reshape", "Squeeze", "Unsqueeze") or (
                op == "Cast" and attr(node, "to") in (TensorProto.INT64, TensorProto.INT32)):
            v = sub(0)
            if v is None:
                return None
            if op == "Squeeze":
                return (v[0], True) if len(v[0]) == 1 else None
            if op == "Unsqueeze" or op == "Reshape":
                return v[0], False
            return v
        if op == "Gather" and attr(node, "axis", 0) == 0:
            v, idx = sub(0), self.const_value(node.input[1])
            if v is None or idx is None:
                return None
            n = len(v[0])
            try:
                picked = [v[0][int(i) + (n if int(i) < 0 else 0)] for i in idx.ravel()]
            except IndexError:
                return None
            return picked, idx.ndim == 0
        if op == "Slice":
            v = sub(0)
            params = [self.const_value(x) if x else None for x in list(node.input[1:]) + [""] * 4][:4]
            if v is None or params[0] is None or params[1] is None:
                return None
            if params[2] is not None and [int(a) for a in params[2].ravel()] not in ([0], [-1]):
                return None
            step = int(params[3].ravel()[0]) if params[3] is not None else 1
            start, end = int(params[0].ravel()[0]), int(params[1].ravel()[0])
            n = len(v[0])
            end = max(min(end, n), -n - 1) if end < 0 else min(end, n)
            return v[0][slice(start, end, step)], False
        if op == "Concat":
            out: List[object] = []
            for k in range(len(node.input)):
                v = sub(k)
                if v is None:
                    return None
                out += v[0]
            return out, False
        if op == "Where":
            cond = self.producers.get(node.input[0])
            if cond is not None and cond.op_type == "Equal" and cond.input[0] == node.input[2] and \
                    self.scalar(cond.input[1]) == -1 and self.scalar(node.input[1]) == 1:
                v = sub(2)
                if v is None:
                    return None
                return [1 if e == -1 else e for e in v[0]], v[1]
        return None

    def dim_value(self, elem) -> object:
        """The int, or symbolic name, an element of :meth:`sym_vector` stands for (None if unknown)."""
        if isinstance(elem, int) or elem is None:
            return elem
        _, t, a = elem
        d = self.dims(t)
        return d[a] if d is not None and a < len(d) else None

    def scalar(self, name: str) -> Optional[float]:
        """A constant whose elements are all equal, as a Python float; else None."""
        v = self.const_value(name)
        if v is None or v.size == 0:
            return None
        flat = np.asarray(v, dtype=np.float64).ravel()
        return float(flat[0]) if np.all(flat == flat[0]) else None

    def opset(self, domain: str = "") -> int:
        for o in self.model.opset_import:
            if o.domain == domain or (domain == "" and o.domain == "ai.onnx"):
                return int(o.version)
        return 0

    # -- types and shapes ---------------------------------------------------

    def infer_shapes(self) -> None:
        """Fill :attr:`shapes` from ``onnx.shape_inference`` (best effort)."""
        self.shapes = {}
        try:
            inferred = onnx.shape_inference.infer_shapes(self.model, check_type=False, strict_mode=False,
                                                         data_prop=True)
            vis = list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output)
        except Exception:
            vis = list(self.graph.value_info) + list(self.graph.input) + list(self.graph.output)
        for vi in vis:
            if not vi.type.HasField("tensor_type"):
                continue
            tt = vi.type.tensor_type
            dims: Optional[List[Dim]] = None
            if tt.HasField("shape"):
                dims = []
                for d in tt.shape.dim:
                    if d.HasField("dim_value"):
                        dims.append(int(d.dim_value))
                    elif d.HasField("dim_param") and not d.dim_param.startswith("unk__"):
                        dims.append(d.dim_param)  # unk__N: a placeholder inference made up
                    else:
                        dims.append(None)
            self.shapes[vi.name] = (tt.elem_type, dims)

    def elem_type(self, name: str) -> Optional[int]:
        if name in self.inits:
            return self.inits[name].data_type
        if name in self.shapes and self.shapes[name][0]:
            return self.shapes[name][0]
        return None

    def dims(self, name: str) -> Optional[List[Dim]]:
        """Dimensions of ``name`` (int, symbolic str or None each), or None if the rank is unknown."""
        if name in self.inits:
            return [int(d) for d in self.inits[name].dims]
        if name in self.shapes and self.shapes[name][1] is not None:
            return list(self.shapes[name][1])
        return self._local_dims(name)

    def _local_dims(self, name: str) -> Optional[List[Dim]]:
        """Rules for a few ops when shape inference stopped (e.g. after a contrib op)."""
        node = self.producers.get(name)
        if node is None:
            return None
        op = node.op_type
        if op == "MatMul" and node.domain in ("", "ai.onnx"):
            b = self.dims(node.input[1]) if node.input[1] in self.inits else None
            a = self.dims(node.input[0])
            if b is not None and len(b) == 2:
                if a is not None:
                    return a[:-1] + [b[-1]]
                return None
        if op in ("Add", "Mul", "Sub", "Div", "Identity", "Cast") and node.input:
            return self.dims(node.input[0]) if op in ("Identity", "Cast") else self._broadcast(node)
        if node.domain == "com.microsoft" and node.output[0] == name:
            return self._contrib_attention_dims(node)
        return None

    def _contrib_attention_dims(self, node: onnx.NodeProto) -> Optional[List[Dim]]:
        """Output 0 of the 3-D contrib attentions: ``[B, S, v_hidden]`` (ORT's contrib operator doc)."""
        q = self.dims(node.input[0]) if node.input else None
        if q is None or len(q) != 3:
            return None
        op, ins = node.op_type, list(node.input) + [""] * 3
        hidden: Dim = None
        if op == "MultiHeadAttention" and ins[2]:
            v = self.dims(ins[2])
            hidden = v[-1] if v is not None and len(v) == 3 else None
        elif op == "Attention":
            sizes = attr(node, "qkv_hidden_sizes")
            w = self.dims(ins[1])
            hidden = int(sizes[2]) if sizes else (w[1] // 3 if w and len(w) == 2 and isinstance(w[1], int) else None)
        elif op == "GroupQueryAttention":
            n, nkv = attr(node, "num_heads"), attr(node, "kv_num_heads")
            if n and nkv and isinstance(q[2], int):
                hidden = q[2] // (n + 2 * nkv) * n if not ins[1] else q[2]
        else:
            return None
        return [q[0], q[1], hidden]

    def _broadcast(self, node: onnx.NodeProto) -> Optional[List[Dim]]:
        shapes = [self.dims(x) for x in node.input if x]
        if any(s is None for s in shapes):
            return None
        rank = max(len(s) for s in shapes)
        out: List[Dim] = []
        for k in range(rank):
            col = [s[len(s) - rank + k] for s in shapes if len(s) - rank + k >= 0]
            known = [c for c in col if c != 1]
            out.append(known[0] if known and all(c == known[0] for c in known) else (1 if not known else None))
        return out

    def last_dim(self, name: str) -> Optional[int]:
        d = self.dims(name)
        return d[-1] if d and isinstance(d[-1], int) else None

