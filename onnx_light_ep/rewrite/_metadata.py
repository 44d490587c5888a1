"""The ``metadata_props`` a converted model carries, and reading them back.

Keys (all strings, prefix ``onnx_light.``):

=========================  ==================================================
``format_version``         ``"1"``
``num_layers``             int: ``CacheAttention`` nodes (layers 0..n-1)
``kv_num_heads``           int ``Hkv``
``head_dim``               int ``D`` (key head size)
``v_head_dim``             int ``Dv``
``dtype``                  ``"float32"`` / ``"float16"`` / ``"bfloat16"``
``cache_input``            name of the int64 ``[1]`` cache-handle input
``source_pattern``         pattern(s) replaced, comma separated
``padding_side``           ``"left"`` (masks carry padding; use left padding)
                           or ``"right"`` (``seqlens_k`` models, GQA)
``inputs``                 JSON ``{"input_ids", "attention_mask",
                           "position_ids", "inputs_embeds"}`` → input name
                           or null
``logits_output``          name of the logits output (or null)
``logits_to_keep``         name of the int64 scalar input that keeps the
                           logits of the last N positions only (``_logits``;
                           absent when the LM head was not found)
``commit_output``          name of the ``CacheCommit`` output (int64
                           ``[batch]``: lengths after the step), the last
                           graph output
``layers``                 JSON list, per layer: ``layer``, ``node``,
                           ``pattern``, ``q_num_heads``, ``scale``,
                           ``softcap``, ``local_window_size``, ``is_causal``,
                           ``past_key``/``past_value``/``present_key``/
                           ``present_value`` (original names or null),
                           ``exported`` (present kept through CacheExport),
                           ``past_capacity`` (only for an original with
                           fixed-size window buffers: their positions)
``tensor_pairs``           JSON ``[[past_input, present_output], ...]`` still
                           loop-carried as tensors (layers left untouched)
``max_position``           int, rotary table length when known (optional)
``stage``                  ``"prefill"`` / ``"decode"``: one graph of a
                           prefill/decode pair (absent: a model for every step)
=========================  ==================================================
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Mapping

PREFIX = "onnx_light."
FORMAT_VERSION = "1"
_INT_KEYS = ("num_layers", "kv_num_heads", "head_dim", "v_head_dim", "max_position")
_JSON_KEYS = ("inputs", "layers", "tensor_pairs")


def write_metadata(model, values: Mapping[str, Any]) -> None:
    """Set ``onnx_light.<key>`` entries of ``model.metadata_props`` (replacing old ones)."""
    entries = {PREFIX + "format_version": FORMAT_VERSION}
    for k, v in values.items():
        if v is None:
            continue
        entries[PREFIX + k] = json.dumps(v) if k in _JSON_KEYS else str(v)
    keep = [p for p in model.metadata_props if p.key not in entries]
    del model.metadata_props[:]
    for p in keep:
        model.metadata_props.add(key=p.key, value=p.value)
    for k, v in entries.items():
        model.metadata_props.add(key=k, value=v)


def _raw_map(model: Any) -> Dict[str, str]:
    if isinstance(model, (str, os.PathLike)):
        import onnx

        try:
            proto = onnx.load(os.fspath(model), load_external_data=False)
        except (OSError, ValueError):
            raise
        except Exception as e:  # protobuf DecodeError: not an ONNX file
            raise ValueError(f"read_metadata: model; {os.fspath(model)!r} is not a readable ONNX model "
                             f"({type(e).__name__}: {str(e) or 'no detail'})") from None
        return {p.key: p.value for p in proto.metadata_props}
    if hasattr(model, "metadata_props"):
        return {p.key: p.value for p in model.metadata_props}
    if hasattr(model, "get_modelmeta"):
        return dict(model.get_modelmeta().custom_metadata_map)
    if isinstance(model, Mapping):
        return {str(k): str(v) for k, v in model.items()}
    raise ValueError(
        "read_metadata: model; expected a path, an onnx.ModelProto, an onnxruntime.InferenceSession "
        f"or a metadata dict, got {type(model).__name__}")


def read_metadata(model: Any) -> Dict[str, Any]:
    """The ``onnx_light.*`` entries of a converted model, decoded (prefix stripped).

    Args:
        model: model path (str/PathLike; weights are not loaded), ``onnx.ModelProto``,
            ``onnxruntime.InferenceSession``, or a dict of metadata strings.

    Returns:
        dict with ints for the geometry keys and decoded JSON for ``inputs``,
        ``layers`` and ``tensor_pairs``.

    Raises:
        ValueError: the model has no ``onnx_light.`` metadata (not converted
            by ``onnx_light_ep.convert``) or an unknown format version.
    """
    raw = _raw_map(model)
    out: Dict[str, Any] = {}
    for k, v in raw.items():
        if not k.startswith(PREFIX):
            continue
        key = k[len(PREFIX):]
        if key in _INT_KEYS:
            out[key] = int(v)
        elif key in _JSON_KEYS:
            out[key] = json.loads(v)
        else:
            out[key] = v
    if not out:
        raise ValueError(
            "read_metadata: model; expected onnx_light.* metadata written by onnx_light_ep.convert, "
            "found none (convert the model first: onnx-light convert MODEL -o OUT)")
    if out.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"read_metadata: onnx_light.format_version; expected {FORMAT_VERSION!r}, "
            f"got {out.get('format_version')!r}")
    return out
