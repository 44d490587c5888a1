"""Graph rewrite: exported decoder models → cache-aware models (``convert``).

Works on ``onnx`` + numpy only; it never imports onnxruntime, so it runs
wherever the exporter runs.

What it does (design: docs/API.md, "Convert an exported model" in README.md):

- recognises the attention of each layer: ``com.microsoft.GroupQueryAttention``
  (``_gqa``), ONNX ``Attention`` with past/present, ``Concat(past, new)``
  feeding a stateless ``Attention``, the opset-24 ``TensorScatter`` idiom
  (``_attention``), and ``Concat(past, new)`` feeding the decomposed
  MatMul/scale/mask/Softmax/MatMul chain (``_decomposed``, ``_kvpath``);
- pairs each past input with its present output through the graph (the node
  that reads the past produces the present), never by name;
- replaces each attention with ``ai.onnx_light.CacheAttention`` (layer ``l``
  = position of the attention in topological order); rotary, QKV splitting
  and causal masks that the source op did internally become ordinary nodes in
  front of it; removes the loop-carried ``past_*`` inputs and ``present_*``
  outputs and adds one int64 ``[1]`` input, ``kv_cache``;
- keeps every other input with its name and meaning (``attention_mask``
  still spans past + current tokens, ``position_ids`` unchanged);
- safe or nothing: a present read by another node or named in
  ``keep_present`` is produced by ``CacheExport``; an attention whose past is
  read by anything but a ``Shape`` stays as it was and the report says why;
  a model with nothing to convert raises :class:`ConvertError` naming the
  patterns looked for; the input file is never written;
- writes the cache geometry and the input roles into ``metadata_props``
  (keys in ``_metadata``), read back by ``KVCache.for_model``;
- a graph without ``attention_mask`` that reads the shape of a past or
  present (the causal mask from the cache position) gets it from the cache:
  ``ai.onnx_light.CacheShape``;
- a prefill/decode pair (transformers' exporter: a folder holding
  ``prefill.onnx`` and ``decode.onnx``) converts into a folder whose two
  graphs share one cache (``_pair``).

Padding: decomposed/Attention patterns carry padding in their masks, so a
batch is left-padded as the exporters expect (``onnx_light.padding_side =
"left"``). GroupQueryAttention derives the valid length from ``seqlens_k``
(= ``ReduceSum(attention_mask) − 1``) and treats the valid tokens as a
prefix: such models are right-padded (``padding_side = "right"``), exactly
as ORT's GQA kernel requires.
"""

from ._api import ConvertError, ConvertReport, convert
from ._metadata import read_metadata
from ._pair import PairReport

__all__ = ["ConvertError", "ConvertReport", "PairReport", "convert", "read_metadata"]
