"""``convert(input_path, output_path, **options) -> ConvertReport``."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import onnx
from onnx import TensorProto

from ._config_windows import MAX_WINDOW, config_windows
from ._convert import attempt
from ._graph import FLOAT_TYPES, external_data_files
from ._logits import logits_output_name
from ._metadata import write_metadata
from ._plan import Refusal

#: Saved with external data above this many bytes of tensors (protobuf's limit is 2 GiB).
EXTERNAL_DATA_THRESHOLD = 1_800_000_000

_LOOKED_FOR = (
    "com.microsoft.GroupQueryAttention with past_key/past_value; "
    "ONNX Attention (opset 23+) with past_key/past_value or present outputs; "
    "Concat(past, new) feeding a stateless ONNX Attention; "
    "TensorScatter(past, new) feeding Attention(nonpad_kv_seqlen); "
    "Concat(past, new) feeding MatMul/scale/mask/Softmax/MatMul; "
    "com.microsoft.MultiHeadAttention with past_key/past_value; "
    "com.microsoft.Attention with past [2, B, N, P, D]"
)


class ConvertError(ValueError):
    """The model cannot be converted; the message says what was looked for and why."""


@dataclass
class ConvertReport:
    """What :func:`convert` did.

    Attributes:
        input_path, output_path: the files (the input is never modified).
        num_layers: ``CacheAttention`` nodes written (layers ``0..num_layers-1``).
        kv_num_heads, head_dim, v_head_dim, dtype: the cache geometry
            (what ``KVCache.for_model`` reads back from the metadata).
        patterns: source patterns replaced.
        layers: per layer: ``layer``, ``node``, ``pattern``, ``past_key``,
            ``past_value``, ``present_key``, ``present_value``, ``exported``
            (present kept through ``CacheExport``), ``attrs``, ``notes``.
        refused: attentions left as they were: ``node``, ``pattern``, ``reason``.
        removed_inputs, removed_outputs: the loop-carried tensors removed.
        kept_outputs: present outputs kept (produced by ``CacheExport``).
        cache_input: name of the added int64 ``[1]`` input.
        metadata: the ``onnx_light.*`` entries written.
        notes: model-level remarks.
    """

    input_path: str
    output_path: str
    num_layers: int
    kv_num_heads: int
    head_dim: int
    v_head_dim: int
    dtype: str
    patterns: List[str]
    layers: List[Dict[str, Any]]
    refused: List[Dict[str, str]]
    removed_inputs: List[str]
    removed_outputs: List[str]
    kept_outputs: List[str]
    cache_input: str
    metadata: Dict[str, Any] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        lines = [
            f"converted {self.input_path} -> {self.output_path}",
            f"  {self.num_layers} layer(s) -> ai.onnx_light.CacheAttention ({', '.join(self.patterns)}); "
            f"cache: kv_num_heads={self.kv_num_heads} head_dim={self.head_dim} v_head_dim={self.v_head_dim} "
            f"dtype={self.dtype}; input {self.cache_input!r} added",
            f"  removed {len(self.removed_inputs)} past input(s) and {len(self.removed_outputs)} present output(s)",
        ]
        exported = [str(x["layer"]) for x in self.layers if x["exported"]]
        if exported:
            lines.append(f"  present kept through CacheExport for layer(s) {', '.join(exported)}: "
                         f"{', '.join(self.kept_outputs) or 'consumed inside the graph'}")
        for r in self.refused:
            lines.append(f"  left unchanged: {r['node']} ({r['pattern']}): {r['reason']}")
        for n in self.notes:
            lines.append(f"  note: {n}")
        by_note: Dict[str, List[int]] = {}
        for x in self.layers:
            for n in x["notes"]:
                by_note.setdefault(n, []).append(int(x["layer"]))
        for n, ls in by_note.items():
            lines.append(f"  note ({_layer_span(ls)}): {n}")
        windows = [int(x.get("local_window_size", -1)) for x in self.layers]
        if any(w > 0 for w in windows):
            spans: Dict[int, List[int]] = {}
            for i, w in enumerate(windows):
                spans.setdefault(w, []).append(i)
            lines.append("  sliding windows: " + "; ".join(
                f"{_layer_span(ls)}: {w if w > 0 else 'none (full attention)'}" for w, ls in spans.items()) +
                " (KVCache.for_model releases pages beyond them)")
        return "\n".join(lines)


def _layer_span(layers: List[int]) -> str:
    """'layer 3', 'layers 0-2', 'layers 0, 2, 4' for sorted layer indices."""
    if len(layers) == 1:
        return f"layer {layers[0]}"
    if layers == list(range(layers[0], layers[-1] + 1)):
        return f"layers {layers[0]}-{layers[-1]}"
    return "layers " + ", ".join(map(str, layers))


def _refusal_dict(r: Refusal) -> Dict[str, str]:
    return {"node": r.anchor, "pattern": r.pattern, "reason": r.reason}


def _tensor_bytes(model: onnx.ModelProto) -> int:
    total = 0
    for t in model.graph.initializer:
        n = 1
        for d in t.dims:
            n *= d
        total += n * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    return total


def convert(input_path, output_path, *, keep_present: Sequence[str] = (), sliding_window: Optional[int] = None,
            cache_input: str = "kv_cache", check: bool = True, stage: Optional[str] = None,
            fuse_gqa: bool = True, logits_to_keep: bool = False):
    """Rewrite a decoder ONNX model so its attention uses a persistent ``KVCache``.

    Args:
        input_path: the exported model (str or PathLike; external data next
            to it is read, never written).
        output_path: where to write the converted model. Its external data (if
            any) goes to ``<output_path>.data`` next to it. Must differ from
            the input file and from the input's external-data files.
        keep_present: present output names to keep as outputs (produced by
            ``CacheExport``, so each run copies that layer's cache out).
        sliding_window: window (tokens including the current one) for
            attentions whose exported graph carries none (decomposed or
            Concat patterns, CASES C06); recorded in the metadata. None = the
            per-layer windows of a Hugging Face ``config.json`` beside the input
            (``sliding_window`` + ``layer_types``, see ``_config_windows``) for
            layers whose graph has none, else no window.
        cache_input: name of the int64 ``[1]`` cache-handle input to add.
        check: run ``onnx.checker.check_model`` on the result.
        stage: ``"prefill"`` or ``"decode"`` when the input is one graph of a
            prefill/decode pair (transformers' exporter): recorded as
            ``onnx_light.stage``; ``"prefill"`` also removes the presents that
            have no past (they start the cache the decode graph continues)
            instead of keeping them through ``CacheExport``. None: one model
            that runs every step. A folder holding ``prefill.onnx`` and
            ``decode.onnx`` as ``input_path`` converts both (``stage`` must be
            None then) into the folder ``output_path``.
        fuse_gqa: True (default): each ``com.microsoft.GroupQueryAttention``
            becomes one ``CacheAttention`` that takes the packed QKV and the
            rotary caches (``cos_cache``/``sin_cache``, ``rotary_interleaved``)
            itself, one attention node per layer as in the original. False: the
            QKV ``Split`` and two ``com.microsoft.RotaryEmbedding`` nodes (with
            positions computed in the graph) stay in front of a ``CacheAttention``
            on separate Q/K/V, the form written before the fused op existed;
            kept to compare the two (same arithmetic) and for libraries without
            the fused inputs.
        logits_to_keep: add the required int64 scalar input
            ``logits_to_keep`` in front of the LM head (``_logits``;
            transformers' argument of that name): ``N >= 1`` computes the
            logits of the last ``N`` positions of a run only, ``0`` of every
            position. A prefill then runs the LM head on one row instead of
            the prompt's (SmolLM2-135M: a fifth of its weight multiply-adds per
            token) and returns ``[B, 1, vocab]`` instead of ``[B, S, vocab]``.
            Recorded as ``onnx_light.logits_to_keep``; a graph whose LM head is
            not found (see ``_logits``) is converted without it, with the reason
            in the notes. False (default): the inputs stay the original's plus
            the cache handle. ``generate``, ``chat`` and ``onnx-light`` convert
            with it.

    Returns:
        :class:`ConvertReport`, or for a folder a :class:`PairReport`
        (``.prefill``, ``.decode``).

    Raises:
        ConvertError: no recognizable attention with a cache (the message lists
            the patterns looked for and the reasons attentions were refused),
            or bad paths/options.
        FileNotFoundError: ``input_path`` does not exist.
    """
    src = os.fspath(input_path)
    dst = os.fspath(output_path)
    if stage not in (None, "prefill", "decode"):
        raise ConvertError(f"convert: stage; expected None, 'prefill' or 'decode', got {stage!r}")
    if os.path.isdir(src) and stage is not None:
        raise ConvertError(f"convert: stage; expected None for the folder {src!r} (a folder converts as a "
                           f"prefill/decode pair, both stages), got {stage!r} (stage names the role of one graph file)")
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or not 0 < sliding_window <= MAX_WINDOW):
        raise ConvertError(f"convert: sliding_window; expected a positive int <= {MAX_WINDOW} (the longest sequence "
                           f"a KVCache holds) or None, got {sliding_window!r}")
    if os.path.isdir(src):
        from ._pair import convert_pair

        return convert_pair(src, dst, keep_present=keep_present, sliding_window=sliding_window,
                            cache_input=cache_input, check=check, logits_to_keep=logits_to_keep)
    if not os.path.isfile(src):
        raise FileNotFoundError(f"convert: input_path; expected an ONNX file, got {src!r} "
                                f"({'a folder' if os.path.isdir(src) else 'not found'})")
    base_dir = os.path.dirname(os.path.abspath(src))
    try:
        original = onnx.load(src, load_external_data=False)
    except Exception as e:  # protobuf DecodeError, truncated or random bytes
        raise ConvertError(f"convert: input_path; {src!r} is not a readable ONNX model "
                           f"({type(e).__name__}: {str(e) or 'no detail'})") from None
    protected = {os.path.realpath(src)} | external_data_files(original, base_dir)
    dst_data = dst + ".data"
    for path, what in ((dst, "output_path"), (dst_data, "output external data file")):
        if os.path.realpath(path) in protected:
            raise ConvertError(f"convert: {what}; expected a file that is not part of the input model, got {path!r}")
    done = sum(1 for n in original.graph.node if n.domain == "ai.onnx_light" and n.op_type == "CacheAttention")
    if done:
        raise ConvertError(f"convert: {src!r} is already converted: {done} CacheAttention node(s) "
                           "(ai.onnx_light); run it as it is (onnx-light generate / compare) or convert the original "
                           "export")
    keep = list(keep_present)
    outputs = {o.name for o in original.graph.output}
    for k in keep:
        if k not in outputs:
            raise ConvertError(f"convert: keep_present; expected output names of the model, got {k!r}")

    windows_from_config = config_windows(base_dir) if sliding_window is None else None
    excluded: Dict[str, Refusal] = {}
    for _ in range(256):
        try:
            res = attempt(original, base_dir, excluded, keep, sliding_window, cache_input, stage, windows_from_config,
                          fuse_gqa, logits_to_keep)
        except ValueError as e:
            raise ConvertError(str(e)) from e
        if not res.new_refusals:
            break
        for r in res.new_refusals:
            excluded[r.anchor] = r
    else:  # pragma: no cover - each round excludes at least one attention
        raise ConvertError("convert: could not settle which layers are safe to convert")
    refused = [_refusal_dict(r) for r in res.refusals]
    if not res.plans:
        why = "; ".join(f"{r['node']} ({r['pattern']}): {r['reason']}" for r in refused) or "none found"
        raise ConvertError(f"convert: no attention with a loop-carried KV cache to convert in {src!r}. "
                           f"Looked for: {_LOOKED_FOR}. Attentions refused: {why}")

    plans = res.plans
    p0 = plans[0]
    layers = []
    for layer, p in enumerate(plans):
        layers.append({
            "layer": layer, "node": p.anchor_name, "pattern": p.pattern, "q_num_heads": p.q_num_heads,
            "scale": p.attrs.get("scale"), "softcap": p.attrs.get("softcap", 0.0),
            "local_window_size": p.attrs.get("local_window_size", -1), "is_causal": p.attrs.get("is_causal", 0),
            "past_key": p.past_key, "past_value": p.past_value, "present_key": p.present_key,
            "present_value": p.present_value, "exported": layer in res.exported, "notes": list(p.notes),
            "attrs": dict(p.attrs),
            **({"past_capacity": int(p.past_capacity)} if p.past_capacity else {}),
        })
    tensor_pairs = _untouched_pairs(res)
    max_position = _max_position(res)
    meta = {
        "num_layers": len(plans), "kv_num_heads": p0.kv_num_heads, "head_dim": p0.head_dim,
        "v_head_dim": p0.v_head_dim, "dtype": FLOAT_TYPES[p0.elem_type], "cache_input": cache_input,
        "source_pattern": ",".join(sorted({p.pattern for p in plans})),
        "padding_side": "right" if any(p.padding == "right" for p in plans) else "left",
        "inputs": res.io_names, "logits_output": logits_output_name(res.model),
        "logits_to_keep": res.logits_to_keep, "commit_output": res.commit_output,
        "layers": [{k: v for k, v in x.items() if k not in ("notes", "attrs")} for x in layers],
        "tensor_pairs": tensor_pairs, "max_position": max_position, "stage": stage,
    }
    write_metadata(res.model, meta)
    _check_single_producers(res.model)
    notes = list(res.notes)
    out_dir = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(out_dir):
        notes.append(f"created the output folder {out_dir}")
    # Written under a temporary folder next to the output and moved into place only once it is
    # complete and checked: a convert that fails leaves no broken output behind.
    os.makedirs(out_dir, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=".onnx_light_convert_", dir=out_dir)
    try:
        tmp_dst = os.path.join(tmp_dir, os.path.basename(dst))
        try:
            _save(res.model, tmp_dst, base_dir, original)
        except onnx.checker.ValidationError as e:  # onnx refuses external data through links
            raise ConvertError(f"convert: input_path; onnx refuses to read the external data of {src!r}: "
                               f"{str(e).splitlines()[0]} (onnx reads external data only from regular files "
                               f"with one link: copy the model folder with `cp -L` first)") from None
        if check:
            notes += _check(src, tmp_dst)
        for name in (os.path.basename(dst) + ".data", os.path.basename(dst)):  # the model file last
            if os.path.exists(os.path.join(tmp_dir, name)):
                os.replace(os.path.join(tmp_dir, name), os.path.join(out_dir, name))
            elif name.endswith(".data") and os.path.exists(os.path.join(out_dir, name)):
                os.remove(os.path.join(out_dir, name))  # a stale data file of an earlier output
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    copied = _copy_tokenizer_files(base_dir, out_dir)
    if copied:
        notes.append(f"copied {', '.join(copied)} from {base_dir} to {out_dir}")
    return ConvertReport(
        input_path=src, output_path=dst, num_layers=len(plans), kv_num_heads=p0.kv_num_heads,
        head_dim=p0.head_dim, v_head_dim=p0.v_head_dim, dtype=FLOAT_TYPES[p0.elem_type],
        patterns=sorted({p.pattern for p in plans}), layers=layers, refused=refused,
        removed_inputs=res.removed_inputs, removed_outputs=res.removed_outputs, kept_outputs=res.kept_outputs,
        cache_input=cache_input, metadata={k: v for k, v in meta.items() if v is not None}, notes=notes)


def _check(src: str, dst: str) -> List[str]:
    """``onnx.checker`` on the result; a failure the input model has too is reported, not raised."""
    try:
        onnx.checker.check_model(dst)
        return []
    except onnx.checker.ValidationError as e:
        err = str(e).splitlines()[0]
    try:
        onnx.checker.check_model(src)
    except onnx.checker.ValidationError as e0:
        if str(e0).splitlines()[0] == err:
            return [f"onnx.checker fails on the input model already, the same way: {err}"]
    raise ConvertError(f"convert: the converted model fails onnx.checker: {err}")


def _untouched_pairs(res) -> List[List[str]]:
    """Past/present pairs still in the graph (layers left as they were), paired by name."""
    ins = [i.name for i in res.model.graph.input if i.type.tensor_type.elem_type in FLOAT_TYPES]
    outs = [o.name for o in res.model.graph.output]
    pairs = []
    for i in ins:
        for a, b in (("past_key_values", "present"), ("past_key", "present_key"), ("past_value", "present_value"),
                     ("past", "present")):
            cand = i.replace(a, b, 1)
            if a in i and cand in outs:
                pairs.append([i, cand])
                break
    return pairs


def _max_position(res) -> Optional[int]:
    """Rows of the rotary cos_cache (GroupQueryAttention input 7): from the data, checked against
    the declared dims (a declared [2^40, D] holding [512, D] is an error, not 2^40 positions)."""
    for p in res.plans:
        if p.pattern == "GroupQueryAttention" and len(p.anchor.input) > 7 and p.anchor.input[7]:
            for t in res.model.graph.initializer:
                if t.name == p.anchor.input[7] and len(t.dims) == 2:
                    declared = int(t.dims[0]) * int(t.dims[1])
                    held = _held_elements(t)
                    if held is not None and held != declared:
                        raise ConvertError(f"convert: initializer {t.name!r} (cos_cache) declares dims "
                                           f"{list(t.dims)} ({declared} elements) but holds {held} elements")
                    return int(t.dims[0])
    return None


def _held_elements(t: onnx.TensorProto) -> Optional[int]:
    """Elements an initializer's data holds (None for external data, not read here)."""
    if t.data_location == TensorProto.EXTERNAL:
        return None
    size = onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    if t.HasField("raw_data"):
        return len(t.raw_data) // size
    for field_name in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
        vals = getattr(t, field_name)
        if len(vals):
            return len(vals)
    return 0


# Files a tokenizer/chat template needs, copied next to a converted model written to another
# folder, so `generate`/`compare` find them there as they would next to the original.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def _copy_tokenizer_files(src_dir: str, dst_dir: str) -> List[str]:
    """Copies the tokenizer files that are regular files inside src_dir (never a symlink, which
    could point anywhere) and absent from dst_dir; returns their names."""
    if os.path.realpath(src_dir) == os.path.realpath(dst_dir):
        return []
    copied = []
    for name in TOKENIZER_FILES:
        a, b = os.path.join(src_dir, name), os.path.join(dst_dir, name)
        if os.path.islink(a) or not os.path.isfile(a) or os.path.lexists(b):
            continue
        shutil.copyfile(a, b, follow_symlinks=False)
        copied.append(name)
    return copied


def _check_single_producers(model: onnx.ModelProto) -> None:
    """Every tensor of the converted graph has one producer (graph input, initializer or one node
    output): a defect onnx.checker may not reach when the input model already fails it earlier."""
    seen = {i.name for i in model.graph.input} | {t.name for t in model.graph.initializer}
    for n in model.graph.node:
        for o in n.output:
            if not o:
                continue
            if o in seen:
                raise ConvertError(f"convert: the converted graph would have two producers of tensor {o!r} "
                                   f"(node {n.name or n.op_type!r}); nothing was written")
            seen.add(o)


def _save(model: onnx.ModelProto, dst: str, base_dir: str, original: onnx.ModelProto) -> None:
    has_external = any(t.data_location == TensorProto.EXTERNAL for t in model.graph.initializer)
    big = _tensor_bytes(model) > EXTERNAL_DATA_THRESHOLD
    out_dir = os.path.dirname(os.path.abspath(dst))
    os.makedirs(out_dir, exist_ok=True)
    data_name = os.path.basename(dst) + ".data"
    data_path = os.path.join(out_dir, data_name)
    if has_external:
        onnx.external_data_helper.load_external_data_for_model(model, base_dir)
    if has_external or big:
        if os.path.exists(data_path):
            os.remove(data_path)  # onnx appends to an existing file
        # Mark the large initializers external ourselves, then save: onnx's save_model(location=...)
        # and convert_model_to_external_data check for an existing file relative to the *current
        # directory*, not to dst; save_model writes the data next to dst.
        from onnx import numpy_helper
        from onnx.external_data_helper import set_external_data

        for t in model.graph.initializer:
            if not t.HasField("raw_data"):
                t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t), t.name))
            if len(t.raw_data) >= 1024:
                set_external_data(t, location=data_name)
        onnx.save_model(model, dst)
        # onnx creates the data file owner-only (0600); give it the model file's permissions.
        if os.path.exists(data_path):
            os.chmod(data_path, os.stat(dst).st_mode & 0o777)
    else:
        onnx.save_model(model, dst)
