"""Decode-step graphs for the benchmark (``onnx.helper`` only; no onnxruntime).

Every builder returns an ``onnx.ModelProto`` with ``num_layers`` attention
layers of one decode step (sequence length 1). Layer ``l > 0`` takes the
previous layer's output ``Y`` as its query (``[B, 1, Hq*D]`` 3-D, or
``[B, Hq, 1, D]`` 4-D, which is the same memory for one token), so ORT must
run the layers in order 0..n-1 as in a decoder (the KV cache requires it) and
the benchmark cannot be shortened by the scheduler skipping a layer. Only the
last layer's ``Y`` is a graph output (named ``Y``). New keys and values of
layer ``l`` are graph inputs ``key_{l}``/``value_{l}``.

Names follow docs/API.md: ``past_key_{l}``/``present_key_{l}`` (BNSH
``[B, Hkv, P, D]``), ``seqlens_k`` (ORT meaning: total - 1),
``total_sequence_length``, ``kv_cache`` (``KVCache.handle``).
"""

from __future__ import annotations

from typing import List

import onnx
from onnx import TensorProto, helper

from .._registration import DOMAIN

__all__ = [
    "attention_past_model",
    "cache_attention_model",
    "gqa_shared_buffer_model",
    "tensor_scatter_model",
]

_ONNX_TYPES = {
    "float32": TensorProto.FLOAT,
    "float16": TensorProto.FLOAT16,
    "bfloat16": TensorProto.BFLOAT16,
}


def _vi(name, elem_type, shape):
    return helper.make_tensor_value_info(name, elem_type, shape)


def _model(nodes, inputs, outputs, opsets, name, ir_version=10) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    model.ir_version = ir_version
    return model


def _query_name(layer: int) -> str:
    """Layer 0 reads the graph input ``query``; layer l reads ``Y_{l-1}``."""
    return "query" if layer == 0 else f"Y_{layer - 1}"


def _out_name(layer: int, num_layers: int) -> str:
    return "Y" if layer == num_layers - 1 else f"Y_{layer}"


def _kv_inputs_3d(t, num_layers, kv_num_heads, head_dim) -> List[onnx.ValueInfoProto]:
    out = []
    for l in range(num_layers):
        out += [_vi(f"key_{l}", t, ["batch", 1, kv_num_heads * head_dim]),
                _vi(f"value_{l}", t, ["batch", 1, kv_num_heads * head_dim])]
    return out


def _present_outputs(t, num_layers, kv_num_heads, head_dim, seq="total"):
    out = []
    for l in range(num_layers):
        out += [_vi(f"present_key_{l}", t, ["batch", kv_num_heads, seq, head_dim]),
                _vi(f"present_value_{l}", t, ["batch", kv_num_heads, seq, head_dim])]
    return out


def attention_past_model(num_layers: int, q_num_heads: int, kv_num_heads: int, head_dim: int,
                         dtype: str) -> onnx.ModelProto:
    """ONNX ``Attention`` (opset 23), 3-D query/key/value, tensor past/present.

    Inputs: ``query`` ``[B, 1, Hq*D]``; per layer ``key_{l}``, ``value_{l}``
    ``[B, 1, Hkv*D]``, ``past_key_{l}``, ``past_value_{l}`` BNSH ``[B, Hkv, P, D]``.
    Outputs: ``Y`` ``[B, 1, Hq*D]``; per layer ``present_key_{l}``,
    ``present_value_{l}`` ``[B, Hkv, P+1, D]`` (new tensors every step).
    """
    t = _ONNX_TYPES[dtype]
    inputs = [_vi("query", t, ["batch", 1, q_num_heads * head_dim])]
    inputs += _kv_inputs_3d(t, num_layers, kv_num_heads, head_dim)
    nodes = []
    for l in range(num_layers):
        inputs += [_vi(f"past_key_{l}", t, ["batch", kv_num_heads, "past", head_dim]),
                   _vi(f"past_value_{l}", t, ["batch", kv_num_heads, "past", head_dim])]
        nodes.append(helper.make_node(
            "Attention",
            [_query_name(l), f"key_{l}", f"value_{l}", "", f"past_key_{l}", f"past_value_{l}"],
            [_out_name(l, num_layers), f"present_key_{l}", f"present_value_{l}"],
            name=f"attention_{l}", q_num_heads=q_num_heads, kv_num_heads=kv_num_heads))
    outputs = [_vi("Y", t, ["batch", 1, q_num_heads * head_dim])]
    outputs += _present_outputs(t, num_layers, kv_num_heads, head_dim)
    return _model(nodes, inputs, outputs, [("", 23)], "bench_attention_past")


def gqa_shared_buffer_model(num_layers: int, q_num_heads: int, kv_num_heads: int, head_dim: int,
                            dtype: str) -> onnx.ModelProto:
    """``com.microsoft.GroupQueryAttention`` with a past/present shared buffer.

    Inputs: ``query`` ``[B, 1, Hq*D]``; per layer ``key_{l}``, ``value_{l}``
    ``[B, 1, Hkv*D]``, ``past_key_{l}``, ``past_value_{l}`` BNSH
    ``[B, Hkv, max_len, D]``; ``seqlens_k`` int32 ``[B]`` (total - 1);
    ``total_sequence_length`` int32 scalar. Outputs ``Y`` and per layer
    ``present_key_{l}``/``present_value_{l}`` ``[B, Hkv, max_len, D]``, which the
    caller binds to the same OrtValue as the past (onnxruntime-genai's
    ``past_present_share_buffer``), so only the new row is written.
    """
    t = _ONNX_TYPES[dtype]
    inputs = [_vi("query", t, ["batch", 1, q_num_heads * head_dim])]
    inputs += _kv_inputs_3d(t, num_layers, kv_num_heads, head_dim)
    nodes = []
    for l in range(num_layers):
        inputs += [_vi(f"past_key_{l}", t, ["batch", kv_num_heads, "max_len", head_dim]),
                   _vi(f"past_value_{l}", t, ["batch", kv_num_heads, "max_len", head_dim])]
        nodes.append(helper.make_node(
            "GroupQueryAttention",
            [_query_name(l), f"key_{l}", f"value_{l}", f"past_key_{l}", f"past_value_{l}",
             "seqlens_k", "total_sequence_length"],
            [_out_name(l, num_layers), f"present_key_{l}", f"present_value_{l}"],
            name=f"gqa_{l}", domain="com.microsoft", num_heads=q_num_heads,
            kv_num_heads=kv_num_heads))
    inputs += [_vi("seqlens_k", TensorProto.INT32, ["batch"]),
               _vi("total_sequence_length", TensorProto.INT32, [])]
    outputs = [_vi("Y", t, ["batch", 1, q_num_heads * head_dim])]
    outputs += _present_outputs(t, num_layers, kv_num_heads, head_dim, seq="max_len")
    return _model(nodes, inputs, outputs, [("", 23), ("com.microsoft", 1)], "bench_gqa_shared")


def tensor_scatter_model(num_layers: int, q_num_heads: int, kv_num_heads: int, head_dim: int,
                         dtype: str) -> onnx.ModelProto:
    """Opset-24 static-cache idiom: ``TensorScatter`` + ``Attention(nonpad_kv_seqlen)``.

    4-D BNSH throughout. Inputs: ``query`` ``[B, Hq, 1, D]``; per layer
    ``key_{l}``, ``value_{l}`` ``[B, Hkv, 1, D]``, ``past_key_{l}``,
    ``past_value_{l}`` ``[B, Hkv, max_len, D]``; ``write_indices`` int64 ``[B]``
    (row the new token goes to = past length); ``nonpad_kv_seqlen`` int64 ``[B]``
    (valid rows after the write). Per layer the scatter outputs
    ``present_key_{l}``/``present_value_{l}`` feed the layer's ``Attention`` as
    its full key/value; ORT's CPU ``TensorScatter`` skips its copy only when the
    output buffer is the input buffer (bind both to one OrtValue).
    """
    t = _ONNX_TYPES[dtype]
    inputs = [_vi("query", t, ["batch", q_num_heads, 1, head_dim])]
    nodes = []
    for l in range(num_layers):
        inputs += [_vi(f"key_{l}", t, ["batch", kv_num_heads, 1, head_dim]),
                   _vi(f"value_{l}", t, ["batch", kv_num_heads, 1, head_dim]),
                   _vi(f"past_key_{l}", t, ["batch", kv_num_heads, "max_len", head_dim]),
                   _vi(f"past_value_{l}", t, ["batch", kv_num_heads, "max_len", head_dim])]
        nodes += [
            helper.make_node("TensorScatter", [f"past_key_{l}", f"key_{l}", "write_indices"],
                             [f"present_key_{l}"], name=f"scatter_key_{l}", axis=2),
            helper.make_node("TensorScatter", [f"past_value_{l}", f"value_{l}", "write_indices"],
                             [f"present_value_{l}"], name=f"scatter_value_{l}", axis=2),
            helper.make_node("Attention",
                             [_query_name(l), f"present_key_{l}", f"present_value_{l}", "", "", "",
                              "nonpad_kv_seqlen"],
                             [_out_name(l, num_layers)], name=f"attention_{l}"),
        ]
    inputs += [_vi("write_indices", TensorProto.INT64, ["batch"]),
               _vi("nonpad_kv_seqlen", TensorProto.INT64, ["batch"])]
    outputs = [_vi("Y", t, ["batch", q_num_heads, 1, head_dim])]
    outputs += _present_outputs(t, num_layers, kv_num_heads, head_dim, seq="max_len")
    return _model(nodes, inputs, outputs, [("", 24)], "bench_tensor_scatter", ir_version=11)


def cache_attention_model(num_layers: int, q_num_heads: int, kv_num_heads: int, head_dim: int,
                          dtype: str) -> onnx.ModelProto:
    """``ai.onnx_light.CacheAttention`` per layer, 3-D, one shared ``kv_cache`` input.

    Inputs: ``query`` ``[B, 1, Hq*D]``; per layer ``key_{l}``, ``value_{l}``
    ``[B, 1, Hkv*D]``; ``kv_cache`` int64 ``[1]``. Output ``Y``.
    """
    t = _ONNX_TYPES[dtype]
    inputs = [_vi("query", t, ["batch", 1, q_num_heads * head_dim])]
    inputs += _kv_inputs_3d(t, num_layers, kv_num_heads, head_dim)
    inputs.append(_vi("kv_cache", TensorProto.INT64, [1]))
    nodes = [
        helper.make_node("CacheAttention", [_query_name(l), f"key_{l}", f"value_{l}", "kv_cache"],
                         [_out_name(l, num_layers)], name=f"cache_attention_{l}", domain=DOMAIN,
                         layer=l, q_num_heads=q_num_heads, kv_num_heads=kv_num_heads)
        for l in range(num_layers)
    ]
    outputs = [_vi("Y", t, ["batch", 1, q_num_heads * head_dim])]
    return _model(nodes, inputs, outputs, [("", 23), (DOMAIN, 1)], "bench_cache_attention")
