"""tools/eval_kv_quant.py's teacher-forced pass on a committed fixture: the caches run in lockstep
chunk by chunk and keep per-position numbers only; a run with the reference's own options agrees
exactly, the reference's log-likelihoods are those of plain ORT on the whole text at once, and an
int8 run differs a little."""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import onnxruntime as ort

import onnx_light_ep as olep
from onnx_light_ep.rewrite import convert, read_metadata

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURE = os.path.join(ROOT, "tests", "data", "genai_llama_fp32.onnx")


def _tool():
    spec = importlib.util.spec_from_file_location("eval_kv_quant", os.path.join(ROOT, "tools", "eval_kv_quant.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _plain_logprobs(ids, tool, converted):
    s = ort.InferenceSession(FIXTURE, providers=["CPUExecutionProvider"])
    feeds = {"input_ids": np.asarray([ids], np.int64), "attention_mask": np.ones((1, len(ids)), np.int64)}
    meta = read_metadata(converted)
    for i in s.get_inputs():
        if i.name.startswith("past_key_values."):
            feeds[i.name] = np.zeros((1, meta["kv_num_heads"], 0, meta["head_dim"]), np.float32)
    (logits,) = s.run(["logits"], feeds)
    return tool.log_softmax(logits[0])


def test_teacher_forced_lockstep_matches_plain_ort(tmp_path):
    tool = _tool()
    dst = str(tmp_path / "model.onnx")
    convert(FIXTURE, dst)
    ids = np.random.default_rng(0).integers(3, 1000, size=120).tolist()
    session = olep.InferenceSession(dst)
    runs = {tool.NATIVE: {}, "same": {},
            "int8": {"kv_quant": "int8", "recent_tokens": 4, "sink_tokens": 1, "page_tokens": 32}}
    per_pos, stats = tool.teacher_forced(session, read_metadata(dst), ids, 8, runs)
    assert set(per_pos) == {"same", "int8"} and set(stats) == set(runs)
    for r in per_pos.values():
        assert all(len(v) == len(ids) for v in r.values())

    same = per_pos["same"]
    assert not same["kld"].any() and same["top1"].all() and np.array_equal(same["nll"], same["nll_ref"])
    s = tool.summarize(same)
    assert s["mean_kld"] == 0.0 and s["ppl"] == s["ppl_native"] and s["top1_agreement"] == 1.0

    plain = _plain_logprobs(ids, tool, dst)
    want = -plain[np.arange(len(ids) - 1), ids[1:]]
    np.testing.assert_allclose(per_pos["int8"]["nll_ref"][:-1], want, atol=1e-4)

    q = tool.summarize(per_pos["int8"])
    assert 0.0 < q["mean_kld"] < 0.05 and np.isfinite(q["ppl"])
    assert stats["int8"]["committed_bytes"] < stats[tool.NATIVE]["committed_bytes"]
