"""The conversion driver: match, apply, prove safe, write.

One attempt works on a fresh copy of the input graph:

1. run every matcher; order the plans by the position of their attention
   node (layer numbers follow the topological order, which is the order the
   layers append in at run time);
2. build each ``CacheAttention`` and switch the consumers of the old
   attention output to it; add the int64 ``[1]`` cache input;
3. drop the loop-carried presents from the graph outputs and the pasts from
   the graph inputs (a present with no past partner, or one named in
   ``keep_present``, stays, produced by ``CacheExport``, except in the
   prefill graph of a prefill/decode pair, ``stage="prefill"``, whose presents
   start the cache the decode graph continues); remove dead nodes;
4. what still reads a present: ``Shape`` gets the shape computed from the
   other inputs, anything else gets ``CacheExport`` (the value is kept);
5. what still reads a past: ``Shape`` gets the computed shape; anything else
   means the layer cannot be proven safe, so it is refused and the attempt
   restarts without it.

The past length used for shapes is ``attention_mask`` width minus the new
length (``input_ids``/``inputs_embeds``/``position_ids`` dim 1): the meaning
``attention_mask`` keeps after conversion. A graph without ``attention_mask``
reads it from the cache: ``ai.onnx_light.CacheShape`` gives ``[B, Hkv, P, D]``
(``P`` = the longest committed sequence), and a present's shape adds the new
length on axis 2.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple

import onnx
from onnx import TensorProto, helper

from ._attention import match_attention
from ._decomposed import match_decomposed
from ._gqa import match_gqa
from ._mha import match_mha, match_ms_attention
from ._graph import FLOAT_TYPES, GraphEditor
from ._logits import add_logits_to_keep, logits_output_name
from ._plan import DOMAIN, MS_DOMAIN, LayerPlan, Refusal, const_i64, dim_of, unsqueeze
from ._shapes import Shapes, substitute_chain_shapes, substitute_shape


@dataclass
class Attempt:
    model: onnx.ModelProto
    plans: List[LayerPlan] = field(default_factory=list)
    refusals: List[Refusal] = field(default_factory=list)
    new_refusals: List[Refusal] = field(default_factory=list)
    exported: Set[int] = field(default_factory=set)
    removed_inputs: List[str] = field(default_factory=list)
    removed_outputs: List[str] = field(default_factory=list)
    kept_outputs: List[str] = field(default_factory=list)
    io_names: Dict[str, Optional[str]] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)
    commit_output: Optional[str] = None
    logits_to_keep: Optional[str] = None  # the added input (``_logits``), or None


def _attrs_problem(attrs: dict) -> Optional[str]:
    """Why CacheAttention (which checks them when ORT creates the session) cannot take a plan's attributes."""
    scale = attrs.get("scale")
    if scale is not None and not (math.isfinite(float(scale)) and float(scale) >= 0):
        return f"scale {float(scale):g}: CacheAttention takes a finite scale >= 0 (0 = 1/sqrt(head_dim))"
    softcap = attrs.get("softcap")
    if softcap is not None and not (math.isfinite(float(softcap)) and float(softcap) >= 0):
        return f"softcap {float(softcap):g}: CacheAttention takes a finite softcap >= 0 (0 = none)"
    if int(attrs.get("is_causal", 0) or 0) not in (0, 1):
        return f"is_causal={attrs['is_causal']}: expected 0 or 1"
    return None


def find_plans(ed: GraphEditor, sliding_window: Optional[int],
               config_windows: Optional[List[Optional[int]]] = None,
               fuse_gqa: bool = True) -> Tuple[List[LayerPlan], List[Refusal]]:
    """All plans and refusals of the current graph, plans in node order.

    ``fuse_gqa``: ``GroupQueryAttention`` becomes one ``CacheAttention`` taking the packed
    QKV and the rotary caches itself (False: QKV ``Split`` and ``RotaryEmbedding`` nodes in
    front of it, see ``_gqa``).

    ``config_windows``: per-layer windows from the model's config.json
    (``_config_windows``), applied only when the attentions found (converted or
    refused) are exactly one per layer, to layers whose graph has no window.
    """
    plans, refusals, found = [], [], []
    for node in list(ed.graph.node):
        r = (match_gqa(ed, node, fuse=fuse_gqa) or match_attention(ed, node) or match_mha(ed, node)
             or match_ms_attention(ed, node))
        if isinstance(r, LayerPlan) and sliding_window is not None:
            # The decomposed matcher applies the option itself; the others get it here.
            had = int(r.attrs.get("local_window_size", -1))
            r.attrs["local_window_size"] = int(sliding_window)
            r.notes.append(f"sliding window {sliding_window} from the options" +
                           (f" (replaces the graph's {had})" if had not in (-1, sliding_window) else
                            "" if had == sliding_window else " (not in the exported graph)"))
        if r is None and node.op_type == "Softmax":
            r = match_decomposed(ed, node, sliding_window)
        if isinstance(r, LayerPlan):
            problem = _attrs_problem(r.attrs)
            if problem:   # a model whose session ORT would refuse: leave the attention as it is, say why
                r = Refusal(r.anchor_name, r.pattern, problem)
        if isinstance(r, LayerPlan):
            plans.append(r)
        elif isinstance(r, Refusal):
            refusals.append(r)
        if isinstance(r, (LayerPlan, Refusal)):
            found.append(r)
    if sliding_window is None and config_windows and len(found) == len(config_windows):
        for r, w in zip(found, config_windows):
            if not isinstance(r, LayerPlan) or not w:
                continue
            had = int(r.attrs.get("local_window_size", -1))
            if had == -1:
                r.attrs["local_window_size"] = int(w)
                r.notes.append(f"sliding window {w} from config.json (sliding_window, layer_types) beside the model, "
                               f"applied with the graph's own mask")
            elif had != w:
                r.notes.append(f"the graph's window {had} kept; config.json says {w}")
    return plans, refusals


def _identity_outputs(ed: GraphEditor, name: str) -> List[str]:
    """Graph outputs equal to ``name`` (itself or through Identity nodes)."""
    found, stack, seen = [], [name], set()
    while stack:
        t = stack.pop()
        if t in seen:
            continue
        seen.add(t)
        if ed.is_graph_output(t):
            found.append(t)
        for c in ed.consumers(t):
            if c.op_type == "Identity" and c.domain in ("", "ai.onnx"):
                stack.append(c.output[0])
    return found


def _aliases(ed: GraphEditor, name: str) -> List[str]:
    """``name`` and every tensor that is it through Identity."""
    out, stack = [], [name]
    while stack:
        t = stack.pop()
        if t in out:
            continue
        out.append(t)
        stack += [c.output[0] for c in ed.consumers(t) if c.op_type == "Identity" and c.domain in ("", "ai.onnx")]
    return out


def io_names(ed: GraphEditor) -> Dict[str, Optional[str]]:
    names = {k: (k if k in ed.input_names else None)
             for k in ("input_ids", "attention_mask", "position_ids", "inputs_embeds")}
    if names["input_ids"] is None:
        for i in ed.graph.input:
            t = i.type.tensor_type
            if t.elem_type in (TensorProto.INT64, TensorProto.INT32) and ed.consumers(i.name) and any(
                    c.op_type == "Gather" and c.input[1] == i.name for c in ed.consumers(i.name)):
                names["input_ids"] = i.name
                break
    return names


def attempt(original: onnx.ModelProto, base_dir: Optional[str], excluded: Dict[str, Refusal],
            keep_present: Sequence[str], sliding_window: Optional[int], cache_input: str,
            stage: Optional[str] = None, config_windows: Optional[List[Optional[int]]] = None,
            fuse_gqa: bool = True, logits_to_keep: bool = False) -> Attempt:
    """One conversion attempt on a copy of ``original`` (see module docstring)."""
    model = copy.deepcopy(original)
    ed = GraphEditor(model, base_dir)
    ed.infer_shapes()
    res = Attempt(model=model)
    plans, refusals = find_plans(ed, sliding_window, config_windows, fuse_gqa)
    res.refusals = list(refusals) + list(excluded.values())
    plans = [p for p in plans if p.anchor_name not in excluded]
    # Two attentions sharing one past cannot both own it.
    owners: Dict[str, List[LayerPlan]] = {}
    for p in plans:
        for x in {p.past_key, p.past_value}:  # one name twice for a stacked past
            if x:
                owners.setdefault(x, []).append(p)
    for x, ps in owners.items():
        if len(ps) > 1:
            for p in ps:
                res.new_refusals.append(Refusal(p.anchor_name, p.pattern, f"past {x!r} is read by several attentions"))
    for p in plans:
        if p.past_key:
            for past, present in ((p.past_key, p.present_key), (p.past_value, p.present_value)):
                if not _identity_outputs(ed, present):
                    res.new_refusals.append(Refusal(p.anchor_name, p.pattern,
                                                    f"past {past!r} has no present graph output to pair with"))
    if res.new_refusals:
        return res
    res.plans = plans
    res.io_names = io_names(ed)
    if not plans:
        return res
    if cache_input in ed.input_names or cache_input in ed.producers:
        raise ValueError(f"convert: cache_input; expected a new name, got {cache_input!r} (already in the graph)")
    dtypes = {p.elem_type for p in plans}
    if len(dtypes) != 1 or next(iter(dtypes)) not in FLOAT_TYPES:
        raise ValueError(f"convert: attention element types {sorted(dtypes)}; expected one of float/float16/bfloat16")
    geo = {(p.kv_num_heads, p.head_dim, p.v_head_dim) for p in plans}
    if len(geo) != 1:
        raise ValueError(f"convert: layers disagree on (kv_num_heads, head_dim, v_head_dim): {sorted(geo)}; "
                         "one KVCache needs one geometry")

    ed.graph.input.append(helper.make_tensor_value_info(cache_input, TensorProto.INT64, [1]))
    ed.refresh()
    ys, cas = [], []  # per layer: the output consumers read, the CacheAttention output
    for layer, p in enumerate(plans):
        ops = p.prepare(ed)
        # Schema order; trailing absent inputs are dropped, absent ones in between stay "".
        ins = [ops.query, ops.key, ops.value, cache_input, ops.mask, ops.seqlens_k, ops.cos_cache, ops.sin_cache]
        while not ins[-1]:
            ins.pop()
        y = ed.add_node1("CacheAttention", ins, hint=f"layer{layer}/cache_attention", domain=DOMAIN,
                         layer=layer, **p.attrs)
        _copy_value_info(ed, p.y_old, y)
        cas.append(y)
        y = _pin_shape(ed, res, y, ops.query, p)
        if ed.is_graph_output(p.y_old):
            ed.add_node("Identity", [y], 1, hint="y_out")
            ident = ed.graph.node[-1]
            old_node = ed.producer(p.y_old)
            old_node.output[list(old_node.output).index(p.y_old)] = ed.new_name("dead_y")
            ident.output[0] = p.y_old
            ed.refresh()
        else:
            ed.replace_uses(p.y_old, y)
        ys.append(y)

    keep = set(keep_present)
    drop_outputs: Set[str] = set()
    for p in plans:
        for past, present in ((p.past_key, p.present_key), (p.past_value, p.present_value)):
            for o in _identity_outputs(ed, present):
                # A prefill graph's presents (no past) start the cache its decode graph continues.
                if (past is not None or stage == "prefill") and o not in keep:
                    drop_outputs.add(o)
    res.removed_outputs = [o for o in ed.output_names if o in drop_outputs]
    outs = [o for o in ed.graph.output if o.name not in drop_outputs]
    del ed.graph.output[:]
    ed.graph.output.extend(outs)
    pasts = {x for p in plans for x in (p.past_key, p.past_value) if x}
    res.removed_inputs = [i for i in ed.input_names if i in pasts]
    ins = [i for i in ed.graph.input if i.name not in pasts]
    del ed.graph.input[:]
    ed.graph.input.extend(ins)
    ed.refresh()
    ed.eliminate_dead()
    # A layer whose output no remaining output needs is dropped with its cache
    # (only its presents used it); the others are renumbered 0..n-1.
    live = [k for k, y in enumerate(ys) if ed.producer(y) is not None]
    if len(live) != len(plans):
        for k in range(len(plans)):
            if k not in live:
                res.notes.append(f"attention {plans[k].anchor_name} only fed its present outputs; it was removed")
        plans = [plans[k] for k in live]
        ys = [ys[k] for k in live]
        cas = [cas[k] for k in live]
        for layer, y in enumerate(cas):
            for a in ed.producer(y).attribute:
                if a.name == "layer":
                    a.i = layer
        res.plans = plans

    shapes = Shapes(ed, res.io_names, cache_input)
    for layer, p in enumerate(plans):
        for present, d, value in ((p.present_key, p.head_dim, False), (p.present_value, p.v_head_dim, True)):
            for alias in _aliases(ed, present):
                for c in ed.consumers(alias):
                    if c.op_type == "Shape" and c.domain in ("", "ai.onnx") and shapes.available():
                        substitute_shape(ed, c, shapes.get("present", p.kv_num_heads, d, layer, value, p.past_stacked),
                                         5 if p.past_stacked else 4)
        if shapes.available():
            substitute_chain_shapes(ed, p, layer, shapes)
    ed.eliminate_dead()
    for layer, p in enumerate(plans):
        ca = ed.producer(cas[layer])
        presents = (p.present_key, p.present_value)
        # A graph that starts the cache has present = the new rows, which its CacheAttention reads as key/value.
        readers = {x: [c for c in ed.consumers(x) if c is not ca] for x in presents}
        if any(readers[x] or ed.is_graph_output(x) for x in presents):
            anc = ed.ancestors(list(ca.input))
            early = [(x, c) for x in presents for c in readers[x] if id(c) in anc]
            if early:
                res.new_refusals.append(Refusal(p.anchor_name, p.pattern, _early_reader_reason(early)))
                continue
            _export(ed, p, layer, ys[layer], cache_input, ca)
            res.exported.add(layer)
    if res.new_refusals:
        return res
    ed.eliminate_dead()
    res.kept_outputs = [o for o in ed.output_names
                        if any(o in _identity_outputs(ed, x) for p in plans for x in (p.present_key, p.present_value))]

    for layer, p in enumerate(plans):
        for past, d, value in ((p.past_key, p.head_dim, False), (p.past_value, p.v_head_dim, True)):
            if not past:
                continue
            for alias in _aliases(ed, past):
                for c in ed.consumers(alias):
                    if c.op_type == "Shape" and c.domain in ("", "ai.onnx"):
                        if not shapes.available():
                            res.new_refusals.append(Refusal(p.anchor_name, p.pattern, (
                                f"Shape of past {past!r} is used but the graph has no input giving the new length "
                                f"(input_ids/inputs_embeds/position_ids)")))
                            continue
                        substitute_shape(ed, c, shapes.get("past", p.kv_num_heads, d, layer, value, p.past_stacked),
                                         5 if p.past_stacked else 4)
    ed.eliminate_dead()
    if res.new_refusals:
        return res
    if shapes.cache_shapes:
        res.notes.append("no attention_mask input: the shapes of the pasts/presents that the graph reads (Shape) "
                         "come from the cache (ai.onnx_light.CacheShape: P = the longest sequence's length), exact "
                         "when every row of the cache holds the same number of positions")
    for layer, p in enumerate(plans):
        for past in (p.past_key, p.past_value):
            if past and ed.consumers(past):
                users = sorted({f"{c.op_type} {c.name!r}" for c in ed.consumers(past)})
                res.new_refusals.append(Refusal(p.anchor_name, p.pattern,
                                                f"past {past!r} is also read by {', '.join(users)}"))
    if res.new_refusals:
        return res
    if logits_to_keep:
        res.logits_to_keep, why = add_logits_to_keep(ed, logits_output_name(model))
        if res.logits_to_keep is None:
            res.notes.append(f"no logits_to_keep input (the logits of every position are computed): {why}")
    res.commit_output = _add_commit(ed, cache_input)
    _finish_opsets(model, any(p.needs_ms_domain for p in plans))
    ed.topo_sort()
    _check_chain(ed, ys, res)
    return res


def _add_commit(ed: GraphEditor, cache_input: str) -> str:
    """The run's commit point: ``CacheCommit(cache, <every graph output>) -> <cache>_seq_lens``.

    It consumes every graph output, so it runs after every node that produces one; only then do
    the rows the run appended become visible (a run that fails or is cancelled before it leaves
    the cache as it was). The layers get ``commit_node=1`` (their last layer no longer commits).
    Its output (int64 ``[batch]``, each sequence's length after the step) is appended to the
    graph outputs so ORT keeps the node; every other output keeps its name and position.
    """
    for node in ed.graph.node:
        if node.op_type == "CacheAttention" and node.domain == DOMAIN:
            node.attribute.append(helper.make_attribute("commit_node", 1))
    name = f"{cache_input}_seq_lens"
    if name in ed.producers or name in ed.input_names:
        name = ed.new_name(name)
    outs = [o.name for o in ed.graph.output]
    ed.graph.node.append(helper.make_node("CacheCommit", [cache_input] + outs, [name], domain=DOMAIN,
                                          name=ed.new_name("cache_commit")))
    ed.graph.output.append(helper.make_tensor_value_info(name, TensorProto.INT64, ["batch"]))
    ed.refresh()
    return name


def _pin_shape(ed: GraphEditor, res: "Attempt", y: str, query: str, p: LayerPlan) -> str:
    """``Reshape(y, [B, Hq, S, Dv])`` (3-D: ``[B, S, Hq*Dv]``) with B, S read from ``input_ids``.

    CacheAttention's output takes the query's dims. When ORT cannot infer them (TorchScript
    exports compute reshape targets at run time), its data propagation later sees unknown dims
    where the original attention output had some, and a downstream ``Reshape(x, [B, S, -1])``
    is rejected at session creation ("multiple -1"). The reshape, a no-op on the data, restores
    the dims from the graph inputs: the query of a decoder step has the batch and the new
    tokens of ``input_ids``.
    """
    q_dims = ed.dims(query)
    rank = len(q_dims) if q_dims is not None else None
    lead = (q_dims or [])[:2 if rank == 3 else 3]
    if rank not in (3, 4) or all(d is not None for d in lead):
        return y
    n = res.io_names
    src = n.get("input_ids") or n.get("position_ids") or n.get("inputs_embeds")
    if not src:
        return y
    memo = ed.memo.setdefault("pin", {})
    if "bs" not in memo:
        memo["bs"] = (dim_of(ed, src, 0, "pin/B"), dim_of(ed, src, 1, "pin/S"))
    b, s = memo["bs"]
    if rank == 4:
        parts = [b, const_i64(ed, [p.q_num_heads], "pin/H"), s, const_i64(ed, [p.v_head_dim], "pin/D")]
    else:
        parts = [b, s, const_i64(ed, [p.q_num_heads * p.v_head_dim], "pin/HD")]
    shape = ed.add_node1("Concat", parts, hint="pin/shape", axis=0)
    return ed.add_node1("Reshape", [y, shape], hint="pin/y")


def _copy_value_info(ed: GraphEditor, old: str, new: str) -> None:
    """Give ``new`` the inferred type/shape of ``old`` (same shape: CacheAttention returns what the
    attention it replaces returned). ORT's data propagation through ``Shape`` of a tensor with unknown
    dims can otherwise make a later ``Reshape`` target look like it has several -1."""
    info = ed.shapes.get(old)
    if info and info[1] is not None:
        ed.graph.value_info.append(helper.make_tensor_value_info(new, info[0], info[1]))


def _early_reader_reason(early: List[Tuple[str, onnx.NodeProto]]) -> str:
    """Why a layer whose attention inputs (mask, query) depend on its present tensors is refused."""
    who = ", ".join(sorted({f"{c.op_type} {c.name or c.output[0]!r} reads {x!r}" for x, c in early}))
    if all(c.op_type == "Shape" and c.domain in ("", "ai.onnx") for _, c in early):
        return (f"the attention's own inputs (mask or query) read the shape of its present tensor ({who}), and "
                "the graph has no input giving the new length (input_ids/inputs_embeds/position_ids) to rebuild "
                "that shape from the cache")
    return (f"the attention's own inputs (mask or query) read the present tensor's values ({who}); the cache "
            "cannot provide them before the attention runs")


def _export(ed: GraphEditor, p: LayerPlan, layer: int, y: str, cache_input: str, ca: onnx.NodeProto) -> None:
    """Make ``CacheExport`` produce the present tensors under their own names.

    A present that is the new rows themselves (a graph that starts the cache) keeps feeding its
    ``CacheAttention`` under a new name; every other reader gets the exported present. A stacked
    present (``[2, B, H, T, D]``, com.microsoft.Attention) is ``Concat(Unsqueeze(key, 0), Unsqueeze(value, 0))``.
    """
    names = []
    for present in dict.fromkeys((p.present_key, p.present_value)):
        prod = ed.producer(present)
        if prod is not None:
            fresh = ed.new_name("dead_present")
            if present in ca.input:
                fresh = ed.new_name("new_rows")
                ed.replace_uses(present, fresh, [ca])
            prod.output[list(prod.output).index(present)] = fresh
        names.append(present)
    if p.past_stacked:
        kv = [ed.new_name(f"layer{layer}/export_key"), ed.new_name(f"layer{layer}/export_value")]
    else:
        kv = names
    node = helper.make_node("CacheExport", [cache_input, y], kv, name=ed.new_name(f"layer{layer}/cache_export"),
                            domain=DOMAIN, layer=layer)
    ed.graph.node.append(node)
    if p.past_stacked:
        parts = [unsqueeze(ed, t, [0], f"layer{layer}/export_stack") for t in kv]
        ed.graph.node.append(helper.make_node("Concat", parts, names, name=ed.new_name(f"layer{layer}/export_present"),
                                              axis=0))
    ed.refresh()


def _finish_opsets(model: onnx.ModelProto, needs_ms: bool) -> None:
    domains = {o.domain for o in model.opset_import}
    if DOMAIN not in domains:
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    if needs_ms and MS_DOMAIN not in domains:
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))


def _check_chain(ed: GraphEditor, ys: List[str], res: Attempt) -> None:
    """Note layers whose CacheAttention does not depend on the previous layer's."""
    nodes = [ed.producer(y) for y in ys]
    for layer in range(1, len(nodes)):
        anc = ed.ancestors(list(nodes[layer].input))
        if id(nodes[layer - 1]) not in anc:
            res.notes.append(
                f"layer {layer} does not depend on layer {layer - 1}: ORT may run them out of order, which "
                f"CacheAttention rejects at run time ('layers must append ... in order')")
