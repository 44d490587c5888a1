"""Graphs whose K/V reach the attention from a graph output without Concat(past, new): the prefill graph
of a pair (the presents are the new rows) converts; a cache written in place (ScatterND into the past)
or a fixed-size buffer is refused with the reason."""
import math
import os

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP

import onnx_light_ep as ole
import rw_graphs as G
import rw_harness as H
from onnx_light_ep.rewrite import ConvertError, convert

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")


def test_a_prefill_graph_alone_keeps_its_presents_through_cache_export(tmp_path):
    """Without stage="prefill" a graph with presents and no past keeps them as outputs (CacheExport):
    on an empty cache they equal the original's presents (the new rows) exactly for layer 0."""
    src = os.path.join(DATA, "transformers_gpt2", "prefill.onnx")
    report = convert(src, tmp_path / "prefill.onnx")
    assert report.patterns == ["decomposed (no past)"] and not report.refused
    assert report.kept_outputs == [f"cache.layers.{i}.{kv}" for i in range(2) for kv in ("keys", "values")]
    a = ort.InferenceSession(src, H.so(), providers=["CPUExecutionProvider"])
    b = ole.InferenceSession(str(tmp_path / "prefill.onnx"), H.so())
    feeds = {"input_ids": np.array([[1, 601, 960, 908, 177]] * 2), "position_ids": np.tile(np.arange(5), (2, 1))}
    oa = dict(zip([o.name for o in a.get_outputs()], a.run(None, feeds)))
    with ole.KVCache.for_model(b, 2, 32) as cache:
        ob = dict(zip([o.name for o in b.get_outputs()], b.run(None, dict(feeds, kv_cache=cache.handle))))
        assert cache.seq_lens.tolist() == [5, 5]
    for name in report.kept_outputs:
        assert ob[name].shape == oa[name].shape == (2, 4, 5, 16)
        tol = 0.0 if ".0." in name else 1e-5  # layer 0's K/V do not depend on attention; layer 1's do (fp32)
        assert np.abs(ob[name] - oa[name]).max() <= tol, name
    assert np.abs(ob["logits"] - oa["logits"]).max() <= 1e-4


def _in_place_cache_model(fixed_buffer: bool):
    """One decomposed layer whose present is ScatterND(past, positions, k) (fixed_buffer=False) or
    ScatterND(zeros [B, H, 16, D], positions, k) (a static buffer without past input)."""
    g = G.GB(3)
    hidden, h, d, cap = 16, 2, 8, 16
    g.inp("input_ids", TP.INT64, [1, "seq"])
    g.inp("positions", TP.INT64, [1, h, "seq", d, 4])
    x = g.node("Gather", [g.weight([20, hidden], 1.0), "input_ids"])
    w = 1.0 / math.sqrt(hidden)
    q, k, v = (g.to_bnsh(g.node("MatMul", [x, g.weight([hidden, h * d], w)]), h, d) for _ in range(3))
    if fixed_buffer:
        pk = pv = g.f32(np.zeros((1, h, cap, d)), "buffer")
        g.out("present_key", TP.FLOAT, [1, h, cap, d])
        g.out("present_value", TP.FLOAT, [1, h, cap, d])
    else:
        pk = g.inp("past_key", TP.FLOAT, [1, h, cap, d])
        pv = g.inp("past_value", TP.FLOAT, [1, h, cap, d])
        g.out("present_key", TP.FLOAT, [1, h, cap, d])
        g.out("present_value", TP.FLOAT, [1, h, cap, d])
    kc = g.node("ScatterND", [pk, "positions", k], out="present_key")
    vc = g.node("ScatterND", [pv, "positions", v], out="present_value")
    s = g.node("Div", [g.node("MatMul", [q, g.node("Transpose", [kc], perm=[0, 1, 3, 2])]), g.f32(math.sqrt(d))])
    y = g.node("MatMul", [g.node("Softmax", [s], axis=-1), vc])
    g.node("MatMul", [g.from_bnsh(y, h * d), g.weight([h * d, 20], w)], out="logits")
    g.out("logits", TP.FLOAT, [1, "seq", 20])
    return g.model([("", 18)])


@pytest.mark.parametrize("fixed_buffer", [False, True])
def test_a_cache_written_in_place_is_refused_with_the_reason(tmp_path, fixed_buffer):
    src = H.save(_in_place_cache_model(fixed_buffer), tmp_path / "in_place.onnx")
    with pytest.raises(ConvertError) as e:
        convert(src, tmp_path / "out.onnx", stage="prefill")
    msg = str(e.value)
    assert "K/V come from the graph output 'present_key'" in msg
    if fixed_buffer:
        assert "of length 16 for seq new tokens, not from Concat(past, new)" in msg
        assert "fixed-size (static) cache buffer is not supported" in msg
    else:
        assert "computed from the input(s) ['past_key'] but not by Concat(past, new)" in msg
        assert "a cache written in place" in msg
    assert not (tmp_path / "out.onnx").exists()
