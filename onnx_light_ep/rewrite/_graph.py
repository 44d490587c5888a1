"""Small mutable view over an ``onnx.GraphProto`` used by the rewrite.

Pure onnx + numpy (no onnxruntime). The editor keeps producer/consumer maps
(subgraph reads of outer names included), creates uniquely named nodes
(prefix ``onnx_light/``) and initializers, rewires uses, removes dead nodes
and re-sorts the graph topologically. Constants, shape vectors and static
dimensions come from ``ValueMixin`` (``_values``). Node identity inside one
pass is the Python wrapper kept in the maps; across passes, positions.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ._values import MAX_CONST_ELEMENTS, Dim, ValueMixin, attr  # noqa: F401  (re-exported)

FLOAT_TYPES = {
    TensorProto.FLOAT: "float32",
    TensorProto.FLOAT16: "float16",
    TensorProto.BFLOAT16: "bfloat16",
}


def _subgraph_outer_names(node: onnx.NodeProto) -> Set[str]:
    """Names a node's subgraphs (If/Loop/Scan bodies) read from the enclosing scope."""
    names: Set[str] = set()
    for a in node.attribute:
        graphs = []
        if a.type == onnx.AttributeProto.GRAPH:
            graphs = [a.g]
        elif a.type == onnx.AttributeProto.GRAPHS:
            graphs = list(a.graphs)
        for g in graphs:
            local = {i.name for i in g.input} | {i.name for i in g.initializer}
            for n in g.node:
                local.update(n.output)
            for n in g.node:
                for x in list(n.input) + sorted(_subgraph_outer_names(n)):
                    if x and x not in local:
                        names.add(x)
            for o in g.output:
                if o.name not in local:
                    names.add(o.name)
    return names


def node_inputs(node: onnx.NodeProto) -> List[str]:
    """Explicit inputs (non-empty) plus outer-scope names read by subgraphs."""
    names = [x for x in node.input if x]
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
        names += sorted(_subgraph_outer_names(node) - set(names))
    return names


class GraphEditor(ValueMixin):
    """Editable view of ``model.graph`` (the model is modified in place).

    Args:
        model: the ``onnx.ModelProto`` to edit (external data need not be loaded).
        base_dir: directory that external-data locations are relative to, or None.
    """

    def __init__(self, model: onnx.ModelProto, base_dir: Optional[str] = None):
        self.model = model
        self.graph = model.graph
        self.base_dir = base_dir
        self._const_cache: Dict[str, Optional[np.ndarray]] = {}
        self._used_names: Set[str] = set()
        self._counter = 0
        self.shapes: Dict[str, Tuple[int, List[Dim]]] = {}
        #: per-edit scratch space for builders that share nodes across layers
        self.memo: Dict[str, dict] = {}
        self.refresh()

    # -- maps ---------------------------------------------------------------

    def refresh(self) -> None:
        """Rebuild producer/consumer maps after structural edits."""
        g = self.graph
        self.producers: Dict[str, onnx.NodeProto] = {}
        self.consumer_map: Dict[str, List[onnx.NodeProto]] = defaultdict(list)
        for n in g.node:
            for o in n.output:
                if o:
                    self.producers[o] = n
            for i in node_inputs(n):
                self.consumer_map[i].append(n)
        self.inits = {t.name: t for t in g.initializer}
        self.input_names = [i.name for i in g.input]
        self.output_names = [o.name for o in g.output]
        self._used_names.update(self.producers)
        self._used_names.update(self.inits)
        self._used_names.update(self.input_names)
        self._used_names.update(n.name for n in g.node if n.name)
        for vi in g.value_info:
            self._used_names.add(vi.name)

    def producer(self, name: str) -> Optional[onnx.NodeProto]:
        return self.producers.get(name)

    def consumers(self, name: str) -> List[onnx.NodeProto]:
        return list(self.consumer_map.get(name, ()))

    def is_graph_input(self, name: str) -> bool:
        return name in self.input_names and name not in self.inits

    def is_graph_output(self, name: str) -> bool:
        return name in self.output_names

    # -- names and construction ---------------------------------------------

    def new_name(self, hint: str) -> str:
        base = f"onnx_light/{hint}"
        name = base
        while name in self._used_names:
            self._counter += 1
            name = f"{base}_{self._counter}"
        self._used_names.add(name)
        return name

    def add_node(self, op_type: str, inputs: Sequence[str], num_outputs: int = 1, *, hint: str,
                 domain: str = "", **attrs) -> List[str]:
        """Append a node (sorted later by :meth:`topo_sort`); returns its output names."""
        outputs = [self.new_name(f"{hint}/out{i}" if num_outputs > 1 else hint) for i in range(num_outputs)]
        node = helper.make_node(op_type, list(inputs), outputs, name=self.new_name(f"{hint}/node"),
                                domain=domain or None, **attrs)
        self.graph.node.append(node)
        for o in outputs:
            self.producers[o] = node
        for i in node_inputs(node):
            self.consumer_map[i].append(node)
        return outputs

    def add_node1(self, op_type: str, inputs: Sequence[str], *, hint: str, domain: str = "", **attrs) -> str:
        return self.add_node(op_type, inputs, 1, hint=hint, domain=domain, **attrs)[0]

    def add_const(self, value: np.ndarray, hint: str) -> str:
        name = self.new_name(hint)
        t = numpy_helper.from_array(np.asarray(value), name)
        self.graph.initializer.append(t)
        self.inits[name] = t
        self._const_cache[name] = np.asarray(value)
        return name

    def replace_uses(self, old: str, new: str, nodes: Optional[Iterable[onnx.NodeProto]] = None) -> None:
        """Make ``nodes`` (default: every consumer) read ``new`` instead of ``old``."""
        targets = list(self.consumer_map.get(old, ())) if nodes is None else list(nodes)
        for n in targets:
            for k, x in enumerate(n.input):
                if x == old:
                    n.input[k] = new
            if _subgraph_outer_names(n) and old in _subgraph_outer_names(n):
                raise ValueError(f"rewrite: cannot rename {old!r} read inside a subgraph of node {n.name!r}")
            self.consumer_map[old] = [c for c in self.consumer_map.get(old, []) if c is not n]
            self.consumer_map[new].append(n)

    # -- clean-up -----------------------------------------------------------

    def eliminate_dead(self) -> None:
        """Remove nodes whose outputs reach no graph output, then unused initializers."""
        nodes = list(self.graph.node)
        producers: Dict[str, int] = {}
        for k, n in enumerate(nodes):
            for o in n.output:
                if o:
                    producers[o] = k
        live: Set[str] = set()
        live_nodes: Set[int] = set()
        stack = list(self.output_names)
        while stack:
            t = stack.pop()
            if t in live:
                continue
            live.add(t)
            k = producers.get(t)
            if k is not None and k not in live_nodes:
                live_nodes.add(k)
                stack.extend(node_inputs(nodes[k]))
        keep = [n for k, n in enumerate(nodes) if k in live_nodes]
        del self.graph.node[:]
        self.graph.node.extend(keep)
        used = set(live)
        inits = [t for t in self.graph.initializer if t.name in used]
        del self.graph.initializer[:]
        self.graph.initializer.extend(inits)
        vis = [v for v in self.graph.value_info if v.name in used]
        del self.graph.value_info[:]
        self.graph.value_info.extend(vis)
        self.refresh()

    def topo_sort(self) -> None:
        """Stable topological order (original order wins ties). Raises ValueError on a cycle."""
        nodes = list(self.graph.node)
        available = set(self.input_names) | set(self.inits) | {""}
        produced_by: Dict[str, int] = {}
        for k, n in enumerate(nodes):
            for o in n.output:
                if o:
                    produced_by[o] = k
        deps = []
        for k, n in enumerate(nodes):
            deps.append({produced_by[i] for i in node_inputs(n) if i in produced_by and i not in available})
        done = [False] * len(nodes)
        order: List[int] = []
        dependents: Dict[int, List[int]] = defaultdict(list)
        remaining = [len(d) for d in deps]
        for k, d in enumerate(deps):
            for j in d:
                dependents[j].append(k)
        import heapq

        heap = [k for k in range(len(nodes)) if remaining[k] == 0]
        heapq.heapify(heap)
        while heap:
            k = heapq.heappop(heap)
            if done[k]:
                continue
            done[k] = True
            order.append(k)
            for j in dependents[k]:
                remaining[j] -= 1
                if remaining[j] == 0:
                    heapq.heappush(heap, j)
        if len(order) != len(nodes):
            raise ValueError("rewrite: the edited graph has a cycle; expected a DAG")
        del self.graph.node[:]
        self.graph.node.extend(nodes[k] for k in order)
        self.refresh()

    def ancestors(self, names: Iterable[str], stop: Set[str] = frozenset()) -> Set[int]:
        """ids of the nodes that ``names`` depend on (not crossing ``stop`` tensors)."""
        seen: Set[int] = set()
        stack = [n for n in names if n not in stop]
        visited_t: Set[str] = set()
        while stack:
            t = stack.pop()
            if t in visited_t:
                continue
            visited_t.add(t)
            p = self.producers.get(t)
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            for x in node_inputs(p):
                if x not in stop:
                    stack.append(x)
        return seen


def external_data_files(model: onnx.ModelProto, base_dir: str) -> Set[str]:
    """Absolute paths of the external-data files ``model`` references."""
    files: Set[str] = set()
    for t in _all_tensors(model):
        if t.data_location == TensorProto.EXTERNAL:
            for e in t.external_data:
                if e.key == "location":
                    files.add(os.path.realpath(os.path.join(base_dir, e.value)))
    return files


def _all_tensors(model: onnx.ModelProto):
    yield from model.graph.initializer
    for n in model.graph.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                yield a.t
