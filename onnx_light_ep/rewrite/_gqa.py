"""``com.microsoft.GroupQueryAttention`` → ``ai.onnx_light.CacheAttention``.

Semantics source: ONNX Runtime contrib operator doc (docs/ContribOperators.md,
``com.microsoft.GroupQueryAttention``) and ORT 1.32 CPU behaviour, checked in
tests/rewrite:

- inputs ``query, key, value, past_key, past_value, seqlens_k,
  total_sequence_length, cos_cache, sin_cache, position_ids, attention_bias,
  head_sink, k_scale, v_scale, q_norm_weight, k_norm_weight``; outputs
  ``output, present_key, present_value, output_qk``. Q/K/V are 3-D
  ``[B, S, H*D]``; past/present BNSH.
- Packed QKV (``key``/``value`` empty): ``query`` is
  ``[B, S, (num_heads + 2*kv_num_heads) * head_size]`` in q, k, v order, so
  ``head_size = last_dim / (num_heads + 2*kv_num_heads)`` (CASES C10a); the
  default ``scale`` is ``1/sqrt(head_size)``.
- ``seqlens_k[b]`` = valid length − 1 after the step; sequences are
  right-padded (valid rows first). CacheAttention takes the same input with
  the same meaning, so the graph's own seqlens_k subgraph (genai computes it
  as ``ReduceSum(attention_mask) − 1``) feeds it unchanged.
- ``do_rotary``: the op rotates Q and K with ``cos_cache``/``sin_cache`` at
  positions ``s`` (first prompt: ``total_sequence_length == S``) or
  ``seqlens_k[b] + 1 − S + s`` otherwise, and caches K rotated.
- ``local_window_size = W``: a query sees W keys including itself, as
  CacheAttention's ``local_window_size`` (verified on ORT 1.32 CPU).
- ``softcap`` is applied to the scaled scores before masking in both ops.
- ``sliding_window_cache = 1`` (the genai builder's default for
  sliding-window layers): the past/present buffers hold only the last
  ``local_window_size`` positions (fixed capacity, oldest rows overwritten)
  while ``seqlens_k``/``total_sequence_length`` and the rotary positions stay
  absolute, so the attention is the same local-window attention over absolute
  positions: it converts like ``local_window_size = W`` on a full past (the
  cache evicts pages beyond the window). The capacity is recorded as the
  layer's ``past_capacity`` so ``compare`` feeds the original W-sized buffers
  (verified on ORT 1.32 CPU and against onnxruntime-genai's own generator).

Fused form (the default, ``fuse=True``): one ``CacheAttention`` per layer, as
the original has one GroupQueryAttention: it takes the packed ``query`` with
``key``/``value`` absent, and ``cos_cache``/``sin_cache`` (+ ``rotary_interleaved``)
as its inputs 6 and 7, rotating Q and the new K before the append at positions
``P_b + s`` where ``P_b`` is the cache's own length of row ``b``. These are
GQA's positions whenever GQA's own inputs are consistent: a first prompt has
``P_b = 0``; afterwards ``seqlens_k[b] + 1 − S = P_b`` for rows whose ``S``
tokens are all valid (ORT's CPU kernel takes ``S > 1`` after the first prompt
for batch 1 only, and a padded such row has no past length GQA could derive).
Unfused form (``fuse=False``): a QKV ``Split`` and ``com.microsoft.RotaryEmbedding``
(the kernel GQA itself calls) on Q and K, with exactly GQA's positions computed
in the graph, in front of a ``CacheAttention`` on separate Q/K/V. Both do the
same arithmetic (bit-identical outputs, tests/differential); the unfused form
stays for comparisons and for libraries that predate the fused inputs. The
fused op covers every GroupQueryAttention this matcher converts, so nothing
falls back to the unfused form on its own.

Refused (left as they are, with the reason): quantized caches (``k_scale``,
``v_scale``, ``*_quant_type``, ``kv_cache_bit_width``), ``smooth_softmax``,
``head_sink``, ``qk_output``/``output_qk``, ``sliding_window_cache`` without a window,
``q_norm_weight``/``k_norm_weight``, ``position_ids`` together with
``do_rotary``, and a past that is not a graph input.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import onnx

from ._graph import GraphEditor, attr
from ._kvpath import resolve_identity
from ._plan import node_input as _inp, node_output as _out
from ._plan import MS_DOMAIN, LayerPlan, Operands, Refusal, anchor_name, const_i64, dim_of

PATTERN = "GroupQueryAttention"






def match_gqa(ed: GraphEditor, node: onnx.NodeProto, fuse: bool = True) -> Union[LayerPlan, Refusal, None]:
    """Plan for one ``GroupQueryAttention`` node, a :class:`Refusal`, or None if not GQA.

    ``fuse``: one ``CacheAttention`` taking packed QKV and the rotary caches (module docstring);
    False: QKV ``Split`` and ``RotaryEmbedding`` nodes in front of it.
    """
    if node.op_type != "GroupQueryAttention" or node.domain != MS_DOMAIN:
        return None
    name = anchor_name(node)

    def refuse(reason: str) -> Refusal:
        return Refusal(name, PATTERN, reason)

    hq, hkv = attr(node, "num_heads"), attr(node, "kv_num_heads")
    if not hq or not hkv or hq % hkv:
        return refuse(f"num_heads={hq}, kv_num_heads={hkv}: expected positive with num_heads % kv_num_heads == 0")
    for a, bad in (("smooth_softmax", 0), ("qk_output", 0)):
        if (attr(node, a, 0) or 0) != bad:
            return refuse(f"attribute {a}={attr(node, a)} is not supported by CacheAttention")
    swc = attr(node, "sliding_window_cache", 0) or 0
    if swc not in (0, 1):
        return refuse(f"attribute sliding_window_cache={swc}: expected 0 or 1")
    if swc and not (attr(node, "local_window_size", -1) or -1) > 0:
        return refuse("sliding_window_cache=1 without a local_window_size > 0: the window-sized past has no "
                      "window to keep")
    for a in ("k_quant_type", "v_quant_type"):
        v = attr(node, a)
        if v is not None and (v.decode() if isinstance(v, bytes) else v) not in ("NONE", ""):
            return refuse(f"quantized KV cache ({a}={v!r}) is not supported")
    if attr(node, "kv_cache_bit_width", 0):
        return refuse("quantized KV cache (kv_cache_bit_width) is not supported")
    for i, what in ((11, "head_sink"), (12, "k_scale"), (13, "v_scale"), (14, "q_norm_weight"),
                    (15, "k_norm_weight")):
        if _inp(node, i):
            return refuse(f"input {what} is not supported by CacheAttention")
    if _out(node, 3) and (ed.consumers(_out(node, 3)) or ed.is_graph_output(_out(node, 3))):
        return refuse("output output_qk is used; CacheAttention does not produce attention scores")
    do_rotary = int(attr(node, "do_rotary", 0) or 0)
    if do_rotary and _inp(node, 9):
        return refuse("position_ids together with do_rotary is not supported (positions are derived from seqlens_k)")

    query, key, value = _inp(node, 0), _inp(node, 1), _inp(node, 2)
    packed = not key and not value
    if bool(key) != bool(value):
        return refuse("exactly one of key/value is given; expected both or neither (packed QKV)")
    qdim = ed.last_dim(query)
    head_dim: Optional[int] = None
    if packed and qdim:
        if qdim % (hq + 2 * hkv) == 0:
            head_dim = qdim // (hq + 2 * hkv)
    elif not packed:
        kd = ed.last_dim(key)
        head_dim = kd // hkv if kd and kd % hkv == 0 else (qdim // hq if qdim and qdim % hq == 0 else None)
    past_k, past_v = _inp(node, 3), _inp(node, 4)
    if head_dim is None and past_k:
        d = ed.dims(past_k)
        head_dim = d[3] if d and len(d) == 4 and isinstance(d[3], int) else None
    if head_dim is None:
        return refuse("cannot determine head_size statically (query/key last dimension unknown)")
    v_head_dim = head_dim
    if not packed:
        vd = ed.last_dim(value)
        if vd and vd % hkv == 0:
            v_head_dim = vd // hkv

    present_k, present_v = _out(node, 1), _out(node, 2)
    if past_k or past_v:
        past_k, past_v = resolve_identity(ed, past_k), resolve_identity(ed, past_v)
        for p in (past_k, past_v):
            if not p or not ed.is_graph_input(p):
                return refuse(f"past {p!r} is not a graph input (expected the loop-carried past_key/past_value)")
        if not present_k or not present_v:
            return refuse("past_key/past_value are inputs but present_key/present_value are not produced")
    else:
        past_k = past_v = None
    if not present_k or not present_v:
        return refuse("present_key/present_value are not produced; nothing to cache")

    elem_type = ed.elem_type(query) or (ed.elem_type(past_k) if past_k else None)
    if elem_type is None:
        return refuse("element type of query unknown")
    if past_k and ed.elem_type(past_k) not in (None, elem_type):
        return refuse("past_key element type differs from query (quantized cache)")

    cos, sin = _inp(node, 7), _inp(node, 8)
    rot_dim = None
    if do_rotary:
        cd = ed.dims(cos)
        if not cos or not sin or cd is None or len(cd) != 2 or not isinstance(cd[1], int):
            return refuse("do_rotary=1 needs cos_cache/sin_cache of static shape [max_position, rotary_dim/2]")
        rot_dim = 2 * cd[1]
        if rot_dim > head_dim:
            return refuse(f"rotary dimension {rot_dim} exceeds head_size {head_dim}")

    scale = attr(node, "scale", 0.0) or 0.0
    if scale == 0.0:
        scale = 1.0 / math.sqrt(head_dim)
    softcap = float(attr(node, "softcap", 0.0) or 0.0)
    window = int(attr(node, "local_window_size", -1))
    causal = int(attr(node, "causal", 1))
    interleaved = int(attr(node, "rotary_interleaved", 0) or 0)
    seqlens_k, total = _inp(node, 5), _inp(node, 6)
    bias = _inp(node, 10)
    if not seqlens_k:
        return refuse("input seqlens_k is missing")
    if do_rotary and not total:
        return refuse("input total_sequence_length is missing")

    attrs = {"q_num_heads": hq, "kv_num_heads": hkv, "scale": float(scale), "is_causal": causal}
    if softcap > 0:
        attrs["softcap"] = softcap
    if window > 0:
        attrs["local_window_size"] = window
    if fuse and do_rotary:
        attrs["rotary_interleaved"] = interleaved
    notes = []
    if fuse and (packed or do_rotary):
        notes.append("one CacheAttention per layer: " + " and ".join(
            (["packed QKV"] if packed else []) +
            ([f"rotary (rotary_dim {rot_dim}{', interleaved' if interleaved else ''}, positions from the cache)"]
             if do_rotary else [])) + " taken by the op as GroupQueryAttention takes them")
    if packed and not fuse:
        notes.append(f"packed QKV split into q/k/v ({hq}, {hkv}, {hkv} heads of {head_dim})")
    if swc:
        notes.append(f"window-sized past/present (sliding_window_cache=1, {window} positions) replaced by the cache; "
                     f"KVCache.for_model releases this layer's pages beyond the window")
    if do_rotary and not fuse:
        notes.append("rotary moved out of the attention into com.microsoft.RotaryEmbedding with positions "
                     "computed from seqlens_k/total_sequence_length")

    def prepare(ed: GraphEditor) -> Operands:
        if fuse:
            return Operands(query, key if not packed else "", value if not packed else "", mask=bias,
                            seqlens_k=seqlens_k, cos_cache=cos if do_rotary else "",
                            sin_cache=sin if do_rotary else "")
        h = f"L/{name}"
        q, k, v = query, key, value
        if packed:
            sizes = [hq * head_dim, hkv * head_dim, hkv * v_head_dim]
            if ed.opset() >= 13:
                split = const_i64(ed, sizes, f"{h}/split_sizes")
                q, k, v = ed.add_node("Split", [query, split], 3, hint=f"{h}/qkv", axis=-1)
            else:
                q, k, v = ed.add_node("Split", [query], 3, hint=f"{h}/qkv", axis=-1, split=sizes)
        if do_rotary:
            pos = _rotary_positions(ed, query, seqlens_k, total, h)
            q = ed.add_node1("RotaryEmbedding", [q, pos, cos, sin], hint=f"{h}/rotary_q", domain=MS_DOMAIN,
                             interleaved=interleaved, num_heads=hq, rotary_embedding_dim=rot_dim)
            k = ed.add_node1("RotaryEmbedding", [k, pos, cos, sin], hint=f"{h}/rotary_k", domain=MS_DOMAIN,
                             interleaved=interleaved, num_heads=hkv, rotary_embedding_dim=rot_dim)
        return Operands(q, k, v, mask=bias, seqlens_k=seqlens_k)

    return LayerPlan(
        pattern=PATTERN, anchor=node, y_old=node.output[0], past_key=past_k, past_value=past_v,
        present_key=present_k, present_value=present_v, q_num_heads=hq, kv_num_heads=hkv,
        head_dim=head_dim, v_head_dim=v_head_dim, elem_type=elem_type, attrs=attrs, prepare=prepare,
        padding="right", notes=notes, needs_ms_domain=bool(do_rotary and not fuse),
        past_capacity=window if swc else None,
    )


def _rotary_positions(ed: GraphEditor, query: str, seqlens_k: str, total: str, h: str) -> str:
    """int64 ``[B, S]``: GQA's rotary positions (see module docstring); built once per graph."""
    memo = ed.memo.setdefault("gqa_positions", {})
    if (seqlens_k, total) not in memo:
        memo[(seqlens_k, total)] = _build_positions(ed, query, seqlens_k, total, "rotary")
    return memo[(seqlens_k, total)]


def _build_positions(ed: GraphEditor, query: str, seqlens_k: str, total: str, h: str) -> str:
    s = dim_of(ed, query, 1, f"{h}/S")                                     # [1]
    s0 = ed.add_node1("Squeeze", [s], hint=f"{h}/S0")
    zero = const_i64(ed, 0, f"{h}/zero")
    one = const_i64(ed, 1, f"{h}/one")
    steps = ed.add_node1("Range", [zero, s0, one], hint=f"{h}/steps")        # [S]
    sk = ed.add_node1("Cast", [seqlens_k], hint=f"{h}/seqlens_k64", to=onnx.TensorProto.INT64)
    sk = ed.add_node1("Reshape", [sk, const_i64(ed, [-1, 1], f"{h}/col")], hint=f"{h}/seqlens_col")
    base = ed.add_node1("Add", [sk, one], hint=f"{h}/total_b")
    base = ed.add_node1("Sub", [base, s], hint=f"{h}/past_b")                # [B, 1]
    tot = ed.add_node1("Cast", [total], hint=f"{h}/total64", to=onnx.TensorProto.INT64)
    tot = ed.add_node1("Reshape", [tot, const_i64(ed, [1], f"{h}/one_d")], hint=f"{h}/total1")
    first = ed.add_node1("Equal", [tot, s], hint=f"{h}/first_prompt")       # [1]
    base = ed.add_node1("Where", [first, zero, base], hint=f"{h}/base")      # [B, 1]
    return ed.add_node1("Add", [base, steps], hint=f"{h}/positions")         # [B, S]
