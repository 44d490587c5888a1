"""The ``logits_to_keep`` pass (onnx_light_ep/rewrite/_logits.py) on small graphs, run on plain ORT.

The pass finds the LM head from the logits output back (element-wise nodes against constants,
then a MatMul by a weight) and slices its ``[B, S, H]`` input to the last N positions. What the
kept rows must hold: the full run's last rows, to fp32 rounding of the head's MatMul (a k-row
MatMul may take another kernel than an S-row one): rtol 1e-6, atol 1e-6. Graphs whose head it
cannot prove (logits read by another node, a Gemm on flattened rows, a weight that is an input,
the name taken, opset < 10) are left unchanged, with the reason.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper

from onnx_light_ep.rewrite._graph import GraphEditor
from onnx_light_ep.rewrite._logits import LOGITS_TO_KEEP, add_logits_to_keep

B, S, H, V = 2, 7, 16, 40
RTOL = ATOL = 1e-6  # fp32: the head's MatMul on k rows against S rows


def _lm(kind: str = "plain", opset: int = 17) -> onnx.ModelProto:
    """input_ids [B, S] -> Gather -> Mul -> (LM head of ``kind``) -> logits [B, S, V]."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((V, H)).astype(np.float32), "emb"),
             numpy_helper.from_array(np.float32(0.5), "half")]
    nodes = [oh.make_node("Gather", ["emb", "input_ids"], ["e"]), oh.make_node("Mul", ["e", "half"], ["h"])]
    inputs = [oh.make_tensor_value_info("input_ids", TP.INT64, ["batch", "seq"])]
    outputs = [oh.make_tensor_value_info("logits", TP.FLOAT, ["seq", "batch", V] if kind == "seq_first"
                                         else [None, None, V] if kind == "transposed_hidden"
                                         else ["batch", "seq", V])]
    w = rng.standard_normal((H, V)).astype(np.float32)
    if kind == "transposed":  # the head as Transpose(W^T), as tied embeddings export
        inits.append(numpy_helper.from_array(np.ascontiguousarray(w.T), "wt"))
        nodes += [oh.make_node("Transpose", ["wt"], ["w"], perm=[1, 0]), oh.make_node("MatMul", ["h", "w"], ["logits"])]
    elif kind == "transposed_hidden":  # [S, B, H] into the head, the logits' dims unnamed
        inits.append(numpy_helper.from_array(w, "w"))
        nodes += [oh.make_node("Transpose", ["h"], ["hs"], perm=[1, 0, 2]), oh.make_node("MatMul", ["hs", "w"], ["logits"])]
    elif kind == "overridable_const":  # Mul by an initializer that is also an input: any shape can be fed
        inits += [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.ones(1, np.float32), "scale")]
        inputs.append(oh.make_tensor_value_info("scale", TP.FLOAT, None))
        nodes += [oh.make_node("MatMul", ["h", "w"], ["raw"]), oh.make_node("Mul", ["raw", "scale"], ["logits"])]
    elif kind == "weight_input":
        inputs.append(oh.make_tensor_value_info("w", TP.FLOAT, [H, V]))
        nodes.append(oh.make_node("MatMul", ["h", "w"], ["logits"]))
    elif kind == "gemm":  # rows flattened to [B * S, H]: axis 1 is no longer the positions
        inits += [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array([-1, H], np.int64), "flat"),
                  numpy_helper.from_array(np.array([B, -1, V], np.int64), "unflat")]
        nodes += [oh.make_node("Reshape", ["h", "flat"], ["h2"]), oh.make_node("Gemm", ["h2", "w"], ["l2"]),
                  oh.make_node("Reshape", ["l2", "unflat"], ["logits"])]
    else:
        inits.append(numpy_helper.from_array(w, "w"))
        head = "logits" if kind in ("plain", "read_elsewhere", "name_taken", "seq_first") else "raw"
        nodes.append(oh.make_node("MatMul", ["h", "w"], [head]))
        if kind == "softcap":  # gemma-2's final_logit_softcapping: tanh(x / cap) * cap, then a bias
            inits += [numpy_helper.from_array(np.float32(3.0), "cap"),
                      numpy_helper.from_array(rng.standard_normal(V).astype(np.float32), "bias")]
            nodes += [oh.make_node("Div", ["raw", "cap"], ["d"]), oh.make_node("Tanh", ["d"], ["t"]),
                      oh.make_node("Mul", ["t", "cap"], ["c"]), oh.make_node("Add", ["c", "bias"], ["logits"])]
        if kind == "read_elsewhere":
            nodes.append(oh.make_node("ArgMax", ["logits"], ["next_token"], axis=-1, keepdims=0))
            outputs.append(oh.make_tensor_value_info("next_token", TP.INT64, ["batch"]))
        if kind == "name_taken":
            inputs.append(oh.make_tensor_value_info(LOGITS_TO_KEEP, TP.INT64, []))
            nodes.append(oh.make_node("Identity", [LOGITS_TO_KEEP], ["echo"]))
            outputs.append(oh.make_tensor_value_info("echo", TP.INT64, []))
    g = oh.make_graph(nodes, "lm", inputs, outputs, inits)
    return oh.make_model(g, opset_imports=[oh.make_opsetid("", opset)], ir_version=8)


def _pruned(model: onnx.ModelProto):
    ed = GraphEditor(model)
    ed.infer_shapes()
    name, why = add_logits_to_keep(ed, "logits")
    if name is not None:
        ed.topo_sort()
    return name, why


def _session(model):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


IDS = np.random.default_rng(1).integers(0, V, (B, S)).astype(np.int64)


@pytest.mark.parametrize("kind", ["plain", "softcap", "transposed"])
def test_kept_rows_are_the_last_rows_of_the_full_run(kind):
    full = _session(_lm(kind)).run(["logits"], {"input_ids": IDS})[0]
    model = _lm(kind)
    name, why = _pruned(model)
    assert name == LOGITS_TO_KEEP, why
    onnx.checker.check_model(model)
    sess = _session(model)
    assert [i.name for i in sess.get_inputs()] == ["input_ids", LOGITS_TO_KEEP]
    for n, rows in ((0, S), (1, 1), (3, 3), (S, S), (S + 4, S), (-2, S), (2 ** 63 - 1, S), (-2 ** 63, S)):
        got = sess.run(["logits"], {"input_ids": IDS, LOGITS_TO_KEEP: np.array(n, np.int64)})[0]
        assert got.shape == (B, rows, V), (n, got.shape)
        np.testing.assert_allclose(got, full[:, S - rows:], rtol=RTOL, atol=ATOL, err_msg=f"logits_to_keep={n}")
    out = next(o for o in model.graph.output if o.name == "logits")
    assert [d.dim_param or d.dim_value for d in out.type.tensor_type.shape.dim] == ["batch", "logits_length", V]


@pytest.mark.parametrize("opset", [10, 11, 12])
def test_a_negative_count_keeps_every_row_at_every_opset(opset):
    """Slice's bounds are inputs from opset 10; Max takes int64 only from 12, so the clamp of a
    negative N is Where(N < 0, 0, N) (a bare -N at opset 11 dropped the first |N| rows)."""
    full = _session(_lm("plain", opset)).run(["logits"], {"input_ids": IDS})[0]
    model = _lm("plain", opset)
    assert _pruned(model)[0] == LOGITS_TO_KEEP
    sess = _session(model)
    for n in (-1, -3):
        got = sess.run(["logits"], {"input_ids": IDS, LOGITS_TO_KEEP: np.array(n, np.int64)})[0]
        np.testing.assert_allclose(got, full, rtol=RTOL, atol=ATOL, err_msg=f"opset {opset}, N={n}")
    got = sess.run(["logits"], {"input_ids": IDS, LOGITS_TO_KEEP: np.array(2, np.int64)})[0]
    np.testing.assert_allclose(got, full[:, -2:], rtol=RTOL, atol=ATOL)


def test_one_token_run_keeps_its_row():
    model = _lm("softcap")
    assert _pruned(model)[0] == LOGITS_TO_KEEP
    one = IDS[:, :1]
    got = _session(model).run(["logits"], {"input_ids": one, LOGITS_TO_KEEP: np.array(1, np.int64)})[0]
    np.testing.assert_allclose(got, _session(_lm("softcap")).run(["logits"], {"input_ids": one})[0],
                               rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("kind, opset, reason", [
    ("read_elsewhere", 17, "also read by ArgMax"),
    ("gemm", 17, "not an LM head"),
    ("weight_input", 17, "does not multiply by a weight"),
    ("name_taken", 17, "already has a tensor named 'logits_to_keep'"),
    ("plain", 9, "opset 9 < 10"),
    ("seq_first", 17, "is not input_ids's positions"),  # declared [S, B, vocab]: axis 1 is not the positions
    ("transposed_hidden", 17, "of the LM head's input 'hs' ('batch') is not input_ids's positions"),
    ("overridable_const", 17, "combines two computed tensors"),
])
def test_unprovable_heads_leave_the_graph_unchanged(kind, opset, reason):
    model = _lm(kind, opset)
    before = model.SerializeToString()
    name, why = _pruned(model)
    assert name is None and reason in why, why
    assert model.SerializeToString() == before
