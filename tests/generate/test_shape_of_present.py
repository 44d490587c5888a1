"""Graphs that read only the SHAPE of a present (GPT-2 as transformers < 4.45 exported it: the key
length from Shape(present_key) slices a constant causal buffer) convert: the shape comes from the
cache (CacheShape + the new length without an attention_mask, the mask's width with one), and the
converted model matches plain ORT over a prefill and 16 greedy steps at batch 1 and 2.

fp32 tolerance: compare's DEFAULT_TOL["float32"], |dlogits| <= 1e-4 + 1e-5 * |logit| at every real
position, and equal argmax (ties excepted).
"""
import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP

import rw_graphs as G
import rw_harness as H
from onnx_light_ep.compare import DEFAULT_TOL, compare
from onnx_light_ep.rewrite import ConvertError, convert

PROMPT = [3, 17, 8, 41, 22, 5, 30, 12, 9, 44]


def _ops(path):
    return [n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node]


@pytest.mark.parametrize("batch", [1, 2])
def test_without_attention_mask_the_present_shape_comes_from_the_cache(tmp_path, batch):
    m = G.decoder(G.gpt2_legacy_block, layers=2, hkv=4, attention_mask=False, opsets=(("", 18),))
    report, src, dst = H.convert_model(m, tmp_path, "gpt2_legacy")
    assert report.num_layers == 2 and not report.refused, report
    # no present copied out (no CacheExport): only its shape was read
    assert not any(x["exported"] for x in report.layers) and not report.kept_outputs
    assert len(report.removed_inputs) == 4 and _ops(dst).count("CacheShape") == 2  # one per layer (keys)
    # no attention_mask: a batch is rows of equal length (rotated copies of the prompt)
    rows = [PROMPT[b:] + PROMPT[:b] for b in range(batch)]
    res = compare(src, dst, prompt_ids=rows, batch_size=batch, steps=16)
    assert (res.atol, res.rtol) == DEFAULT_TOL["float32"] == (1e-4, 1e-5)
    assert res.ok, res.summary()
    assert len(res.steps) == 17 and all(s.agree for s in res.steps)
    assert all(s.ep_bytes_copied == 0 for s in res.steps[1:])


def test_with_attention_mask_left_padding_matches(tmp_path):
    m = G.decoder(G.gpt2_legacy_block, layers=2, hkv=4, padding=True, opsets=(("", 18),))
    report, src, dst = H.convert_model(m, tmp_path, "gpt2_legacy_mask")
    assert report.num_layers == 2 and not report.refused
    assert "CacheShape" not in _ops(dst)  # the shape comes from attention_mask's width
    res = compare(src, dst, prompt_ids=[PROMPT, PROMPT[3:]], batch_size=2, steps=16)
    assert res.prompt_lengths == [10, 7] and res.padding_side == "left"
    assert res.ok, res.summary()


def test_refusal_names_the_shape_when_no_input_gives_the_new_length(tmp_path):
    """Without input_ids/inputs_embeds/position_ids the present's shape cannot be rebuilt: the
    refusal says the mask reads its shape (not its values)."""
    g = G.GB(1)
    hidden, hq, hkv, d = 16, 2, 2, 8
    g.inp("x", TP.FLOAT, ["batch", "seq", hidden])
    w = 1.0 / math.sqrt(hidden)
    q3, k3, v3 = (g.node("MatMul", ["x", g.weight([hidden, h * d], w)]) for h in (hq, hkv, hkv))
    g.node("MatMul", [G.gpt2_legacy_block(g, 0, q3, k3, v3, hq=hq, hkv=hkv, d=d), g.weight([hq * d, 4], w)], out="y")
    g.out("y", TP.FLOAT, ["batch", "seq", 4])
    src = H.save(g.model([("", 18)]), tmp_path / "no_ids.onnx")
    with pytest.raises(ConvertError) as e:
        convert(src, tmp_path / "no_ids.light.onnx")
    msg = str(e.value)
    assert "read the shape of its present tensor" in msg and "present_key_0" in msg
    assert "values" not in msg
    assert not (tmp_path / "no_ids.light.onnx").exists()
