"""ONNX model builders for the tests (onnx.helper only).

``cache_attention_model``: one ``ai.onnx_light.CacheAttention`` node per layer.
    Inputs: ``query_{l}, key_{l}, value_{l}`` per layer, shared ``kv_cache`` (int64 [1]),
    optional shared ``attn_mask`` and ``seqlens_k``. Outputs ``Y_{l}`` (and, with
    ``with_export``, ``present_key_{l}/present_value_{l}`` from ``CacheExport``).
``onnx_attention_model``: standard ONNX ``Attention`` (opset 23) per layer with
    ``past_key_{l}/past_value_{l}`` inputs and ``present_key_{l}/present_value_{l}`` outputs,
    for the plain-ORT side of the differential tests.
"""
import dataclasses

import numpy as np
import onnx
from onnx import TensorProto, helper

DOMAIN = "ai.onnx_light"
IR_VERSION = 10

_ONNX_TYPE = {
    "float32": TensorProto.FLOAT,
    "float16": TensorProto.FLOAT16,
    "bfloat16": TensorProto.BFLOAT16,
}


def onnx_type(dtype):
    from reference import dtype_name

    return _ONNX_TYPE[dtype_name(dtype)]


def _qkv_shapes(rank, hq, hkv, d, dv):
    if rank == 4:
        return (["batch", hq, "seq", d], ["batch", hkv, "seq", d], ["batch", hkv, "seq", dv],
                ["batch", hq, "seq", dv])
    if rank == 3:
        return (["batch", "seq", hq * d], ["batch", "seq", hkv * d], ["batch", "seq", hkv * dv],
                ["batch", "seq", hq * dv])
    raise ValueError(f"rank must be 3 or 4, got {rank}")


def _mask_vi(with_mask, mask_rank, t):
    if with_mask not in ("bool", "float"):
        raise ValueError(f"with_mask must be None, 'bool' or 'float', got {with_mask!r}")
    if not 2 <= mask_rank <= 4:
        raise ValueError("mask_rank must be 2..4")
    mt = TensorProto.BOOL if with_mask == "bool" else t
    return helper.make_tensor_value_info(
        "attn_mask", mt, [f"mask_d{i}" for i in range(4 - mask_rank, 4)])


def _model(nodes, inputs, outputs, opsets, name, initializers=()):
    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    model.ir_version = IR_VERSION
    return model


def cache_attention_model(*, layer_count=1, q_num_heads, kv_num_heads, head_dim, v_head_dim=None,
                          dtype="float32", rank=4, with_mask=None, mask_rank=4,
                          with_seqlens_k=False, seqlens_k_rank=1, is_causal=0, softcap=0.0,
                          local_window_size=-1, scale=None, with_export=False, chain_layers=True,
                          with_commit=False):
    """``chain_layers``: layer l>0 reads ``query_{l}`` through a Reshape whose target shape
    depends on ``Y_{l-1}`` (value-preserving, bit-exact, any dtype), so ORT must run the layers
    in order 0..n-1 as in a real decoder (independent nodes may be scheduled in any order).
    ``with_commit``: the layers carry ``commit_node=1`` and a ``CacheCommit`` node after every
    output commits the step (output ``kv_cache_seq_lens``), as ``convert`` writes it."""
    t = onnx_type(dtype)
    dv = head_dim if v_head_dim is None else v_head_dim
    qs, ks, vs, ys = _qkv_shapes(rank, q_num_heads, kv_num_heads, head_dim, dv)
    inputs, outputs, nodes = [], [], []
    for l in range(layer_count):
        inputs += [helper.make_tensor_value_info(f"query_{l}", t, qs),
                   helper.make_tensor_value_info(f"key_{l}", t, ks),
                   helper.make_tensor_value_info(f"value_{l}", t, vs)]
    inputs.append(helper.make_tensor_value_info("kv_cache", TensorProto.INT64, [1]))
    if with_mask is not None:
        inputs.append(_mask_vi(with_mask, mask_rank, t))
    if with_seqlens_k:
        shp = ["batch"] if seqlens_k_rank == 1 else ["batch", 1]
        inputs.append(helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, shp))
    inits = []
    if chain_layers and layer_count > 1:
        inits.append(helper.make_tensor("zero_i64", TensorProto.INT64, [], [0]))
    for l in range(layer_count):
        qname = f"query_{l}"
        if chain_layers and l > 0:
            nodes += [
                helper.make_node("Shape", [f"query_{l}"], [f"dep{l}_qshape"]),
                helper.make_node("Shape", [f"Y_{l - 1}"], [f"dep{l}_yshape"]),
                helper.make_node("ReduceMin", [f"dep{l}_yshape"], [f"dep{l}_min"], keepdims=1),
                helper.make_node("Mul", [f"dep{l}_min", "zero_i64"], [f"dep{l}_zero"]),
                helper.make_node("Add", [f"dep{l}_qshape", f"dep{l}_zero"], [f"dep{l}_shape"]),
                helper.make_node("Reshape", [f"query_{l}", f"dep{l}_shape"], [f"query_{l}_after_{l - 1}"]),
            ]
            qname = f"query_{l}_after_{l - 1}"
        ins = [qname, f"key_{l}", f"value_{l}", "kv_cache"]
        if with_mask is not None or with_seqlens_k:
            ins.append("attn_mask" if with_mask is not None else "")
        if with_seqlens_k:
            ins.append("seqlens_k")
        attrs = {"layer": l, "is_causal": int(is_causal)}
        if rank == 3:
            attrs["q_num_heads"] = q_num_heads
            attrs["kv_num_heads"] = kv_num_heads
        if scale is not None:
            attrs["scale"] = float(scale)
        if softcap:
            attrs["softcap"] = float(softcap)
        if local_window_size != -1:
            attrs["local_window_size"] = int(local_window_size)
        if with_commit:
            attrs["commit_node"] = 1
        nodes.append(helper.make_node("CacheAttention", ins, [f"Y_{l}"], name=f"cache_attention_{l}",
                                      domain=DOMAIN, **attrs))
        outputs.append(helper.make_tensor_value_info(f"Y_{l}", t, ys))
        if with_export:
            nodes.append(helper.make_node("CacheExport", ["kv_cache", f"Y_{l}"],
                                          [f"present_key_{l}", f"present_value_{l}"],
                                          name=f"cache_export_{l}", domain=DOMAIN, layer=l))
            outputs += [
                helper.make_tensor_value_info(f"present_key_{l}", t, ["batch", kv_num_heads, "total", head_dim]),
                helper.make_tensor_value_info(f"present_value_{l}", t, ["batch", kv_num_heads, "total", dv])]
    if with_commit:
        nodes.append(helper.make_node("CacheCommit", ["kv_cache"] + [o.name for o in outputs],
                                      ["kv_cache_seq_lens"], name="cache_commit", domain=DOMAIN))
        outputs.append(helper.make_tensor_value_info("kv_cache_seq_lens", TensorProto.INT64, ["batch"]))
    return _model(nodes, inputs, outputs, [("", 23), (DOMAIN, 1)], "cache_attention", inits)


def onnx_attention_model(*, layer_count=1, q_num_heads, kv_num_heads, head_dim, v_head_dim=None,
                         dtype="float32", rank=4, with_mask=None, mask_rank=4, with_past=True,
                         is_causal=0, softcap=0.0, scale=None):
    t = onnx_type(dtype)
    dv = head_dim if v_head_dim is None else v_head_dim
    qs, ks, vs, ys = _qkv_shapes(rank, q_num_heads, kv_num_heads, head_dim, dv)
    inputs, outputs, nodes = [], [], []
    for l in range(layer_count):
        inputs += [helper.make_tensor_value_info(f"query_{l}", t, qs),
                   helper.make_tensor_value_info(f"key_{l}", t, ks),
                   helper.make_tensor_value_info(f"value_{l}", t, vs)]
        if with_past:
            inputs += [
                helper.make_tensor_value_info(f"past_key_{l}", t, ["batch", kv_num_heads, "past", head_dim]),
                helper.make_tensor_value_info(f"past_value_{l}", t, ["batch", kv_num_heads, "past", dv])]
    if with_mask is not None:
        inputs.append(_mask_vi(with_mask, mask_rank, t))
    for l in range(layer_count):
        ins = [f"query_{l}", f"key_{l}", f"value_{l}", "attn_mask" if with_mask is not None else ""]
        outs = [f"Y_{l}"]
        if with_past:
            ins += [f"past_key_{l}", f"past_value_{l}"]
            outs += [f"present_key_{l}", f"present_value_{l}"]
        attrs = {"is_causal": int(is_causal)}
        if rank == 3:
            attrs["q_num_heads"] = q_num_heads
            attrs["kv_num_heads"] = kv_num_heads
        if scale is not None:
            attrs["scale"] = float(scale)
        if softcap:
            attrs["softcap"] = float(softcap)
        nodes.append(helper.make_node("Attention", ins, outs, name=f"attention_{l}", **attrs))
        outputs.append(helper.make_tensor_value_info(f"Y_{l}", t, ys))
        if with_past:
            outputs += [
                helper.make_tensor_value_info(f"present_key_{l}", t, ["batch", kv_num_heads, "total", head_dim]),
                helper.make_tensor_value_info(f"present_value_{l}", t, ["batch", kv_num_heads, "total", dv])]
    return _model(nodes, inputs, outputs, [("", 23)], "onnx_attention")


def model_bytes(model):
    return model if isinstance(model, (bytes, bytearray)) else model.SerializeToString()


@dataclasses.dataclass(frozen=True)
class AttnCfg:
    """One attention shape of a differential test: q_num_heads, kv_num_heads, head_dim, dtype."""
    id: str
    hq: int
    hkv: int
    d: int
    dtype: str
