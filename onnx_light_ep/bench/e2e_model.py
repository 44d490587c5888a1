"""What one end-to-end decode step of a decoder must read, and where ORT spends a prefill.

``decode_read_bytes(model_path)``: the initializer bytes a one-token step reads (every weight
once; of a table read by ``Gather``/``GatherBlockQuantized`` only one row: the embedding, GroupQueryAttention's cos/sin caches),
from the ONNX file without loading external data. ``kv_bytes_per_token``: K+V bytes one
position adds over all layers. ``decode_limit_tokens_per_s``: the physical ceiling of decode
at context ``C``: read bandwidth / (weights + C x K/V bytes per token).

``split_profile(events)``: the node time of a profiled prefill (ORT session profiling,
``SessionOptions.enable_profiling``) split into attention, weight MatMuls and the rest.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np

#: op types counted as attention in a prefill profile (the EP's fused nodes are CacheAttention
#: and its cache bookkeeping: the EP claims only ai.onnx_light cache nodes)
ATTENTION_OPS = ("GroupQueryAttention", "MultiHeadAttention", "Attention", "CacheAttention")
#: op types counted as weight MatMuls (fp32 MatMul / Gemm, int4 MatMulNBits)
MATMUL_OPS = ("MatMul", "MatMulNBits", "Gemm", "FusedMatMul")
#: (op, input index) that read one row of an initializer per decode token: Gather tables
#: and GroupQueryAttention's cos_cache / sin_cache (one position's row)
_ROW_READS = {("Gather", 0), ("GatherBlockQuantized", 0), ("GroupQueryAttention", 7),
              ("GroupQueryAttention", 8)}


def _tensor_bytes(t) -> int:
    for e in t.external_data:
        if e.key == "length":
            return int(e.value)
    if t.raw_data:
        return len(t.raw_data)
    import onnx

    return int(onnx.numpy_helper.to_array(t).nbytes)


def decode_read_bytes(model_path: str) -> Dict[str, int]:
    """{``weights``: bytes a one-token step reads, ``initializers``: all initializer bytes,
    ``gather_tables``: bytes of the tables read one row per token (Gather data, GQA's cos/sin
    caches; one row each counted in weights)}. A tied embedding reached through a node (the
    genai builder's ``Transpose(lm_head weight)``) is counted once, as the lm_head MatMul's.

    Reads the graph only (``load_external_data=False``); sizes of external tensors come from
    their ``length`` entries."""
    import onnx

    m = onnx.load(model_path, load_external_data=False)
    inits = {t.name: t for t in m.graph.initializer}
    sizes = {n: _tensor_bytes(t) for n, t in inits.items()}
    users: Dict[str, List] = {}
    for node in m.graph.node:
        for i, name in enumerate(node.input):
            if name in inits:
                users.setdefault(name, []).append((node.op_type, i))
    tables = {n for n, us in users.items() if all(u in _ROW_READS for u in us) and len(inits[n].dims) >= 1}
    row = {n: sizes[n] // max(1, int(inits[n].dims[0])) for n in tables}
    weights = sum(s for n, s in sizes.items() if n not in tables) + sum(row.values())
    return {"weights": int(weights), "initializers": int(sum(sizes.values())),
            "gather_tables": int(sum(sizes[n] for n in tables))}


def matmul_nbits_accuracy_level(model_path: str) -> Optional[int]:
    """The largest ``accuracy_level`` of the model's ``MatMulNBits`` nodes (None without any).
    4 = activations quantized to int8 per block inside the MatMul: a last-bit difference of its
    input (another attention kernel's rounding) can flip a code and move the logits by ~1."""
    import onnx

    m = onnx.load(model_path, load_external_data=False)
    levels = [a.i for n in m.graph.node if n.op_type == "MatMulNBits" for a in n.attribute
              if a.name == "accuracy_level"]
    return max(levels) if levels else None


def kv_bytes_per_token(num_layers: int, kv_num_heads: int, head_dim: int, elem_bytes: int = 4) -> int:
    """K+V bytes one position holds over all layers."""
    return 2 * num_layers * kv_num_heads * head_dim * elem_bytes


def decode_limit_tokens_per_s(weight_bytes: int, kv_token_bytes: int, context: int,
                              read_gb_per_s: Optional[float]) -> Optional[float]:
    """Tokens/s if a step took exactly its bytes (weights + ``context`` positions of K/V) at the
    read bandwidth; None without a bandwidth."""
    if not read_gb_per_s:
        return None
    return read_gb_per_s * 1e9 / (weight_bytes + kv_token_bytes * context)


def split_profile(events: List[Dict], ep_prefix: str = "OnnxLightExecutionProvider_") -> Dict:
    """Node kernel time of the last ``model_run`` of an ORT profile trace, by kind.

    Returns {``run_ms``: the run's wall time, ``node_ms``: sum of node kernel times,
    ``attention_ms``, ``matmul_ms``, ``other_ms``, ``attention_share`` / ``matmul_share`` (of
    node_ms), ``by_op``: {op: ms}}. Nodes of the EP (``ep_prefix`` + hash) count as attention."""
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    lo, hi = (runs[-1]["ts"], runs[-1]["ts"] + runs[-1]["dur"]) if runs else (-np.inf, np.inf)
    by_op: Dict[str, float] = {}
    for e in events:
        args = e.get("args") or {}
        if e.get("cat") != "Node" or not str(e.get("name", "")).endswith("_kernel_time"):
            continue
        if not lo <= e.get("ts", 0) <= hi:
            continue
        op = args.get("op_name", "?")
        if op.startswith(ep_prefix):
            op = "CacheAttention (EP)"
        by_op[op] = by_op.get(op, 0.0) + e.get("dur", 0) / 1e3
    att = sum(v for k, v in by_op.items() if k.split(" ")[0] in ATTENTION_OPS)
    mm = sum(v for k, v in by_op.items() if k in MATMUL_OPS)
    node = sum(by_op.values())
    return {"run_ms": runs[-1]["dur"] / 1e3 if runs else None, "node_ms": node, "attention_ms": att,
            "matmul_ms": mm, "other_ms": node - att - mm,
            "attention_share": att / node if node else None, "matmul_share": mm / node if node else None,
            "by_op": dict(sorted(by_op.items(), key=lambda kv: -kv[1]))}
