"""Beam search on the real SmolLM2-135M-Instruct (converted, EP + KVCache) against Hugging Face transformers'
``generate(num_beams=N, do_sample=False)`` on the same weights in torch fp32: the fixture
data/beam_hf_smollm2.json, written by tools/make_beam_reference.py (6 chat prompts, N in {2, 3, 4},
24 new tokens, length penalties -0.5 .. 2, early_stopping False/True/"never"; needs no torch here).

Every returned hypothesis (all N, best first) must have transformers' token ids (EOS included when it
ended on one) and its sequences_score within fp32 tolerance. Tolerance: the fixture records the
largest |logit difference| between torch and the EP over one prefill of each prompt + best sequence,
1.07e-4 (max_abs_dlogits); the beams' logits come from decode steps (other accumulation order), so
the bound used is DLOGITS = 2.5e-4, and the fixture's own measurement must stay below it. A
log-softmax moves by at most twice the largest logit change, so a hypothesis of L tokens scores
within 2 * DLOGITS * L / L ** length_penalty (5e-4 at length_penalty 1, where the score is a mean).
"""
import json
import os

import pytest

from onnx_light_ep import InferenceSession
from onnx_light_ep.generate import generate

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "beam_hf_smollm2.json")
FIXTURE = json.load(open(DATA))
DLOGITS = 2.5e-4


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """(converted model path, its EP session)."""
    from onnx_light_ep.models.smollm2 import ensure_smollm2_onnx
    from onnx_light_ep.rewrite import convert

    folder = ensure_smollm2_onnx(progress=False)
    dst = str(tmp_path_factory.mktemp("smollm2_beam") / "model.onnx")
    convert(os.path.join(folder, "model.onnx"), dst)
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    return dst, InferenceSession(dst, so)


def test_fixture_covers_the_cases():
    cases = FIXTURE["cases"]
    assert FIXTURE["max_abs_dlogits"] < DLOGITS
    assert len({c["prompt"] for c in cases if c["num_beams"] == 2}) >= 5
    assert len({c["prompt"] for c in cases if c["num_beams"] == 4}) >= 5
    assert {c["early_stopping"] for c in cases} == {False, True, "never"}
    assert any(c["length_penalty"] != 1.0 for c in cases)
    eos = FIXTURE["eos_token_id"]
    assert any(s[-1] == eos for c in cases for s in c["sequences"])          # some end on EOS
    assert any(len(s) == FIXTURE["max_new_tokens"] and s[-1] != eos for c in cases for s in c["sequences"])


@pytest.mark.parametrize("case", FIXTURE["cases"],
                         ids=[f"p{c['prompt']}-N{c['num_beams']}-lp{c['length_penalty']}-es{c['early_stopping']}"
                              for c in FIXTURE["cases"]])
def test_beam_matches_transformers(smollm2, case):
    dst, sess = smollm2
    n, lp, eos = case["num_beams"], case["length_penalty"], FIXTURE["eos_token_id"]
    res = generate(dst, prompt_ids=[FIXTURE["prompt_ids"][case["prompt"]]], session=sess, num_beams=n,
                   num_return_sequences=n, max_new_tokens=FIXTURE["max_new_tokens"], eos_token_ids=[eos],
                   length_penalty=lp, early_stopping=case["early_stopping"])
    got = [ids + [eos] if fin else ids for ids, fin in zip(res.token_ids, res.finished)]
    assert got == case["sequences"]
    for seq, score, want in zip(got, res.sequences_scores, case["sequences_scores"]):
        tol = 2 * DLOGITS * len(seq) / float(len(seq)) ** lp
        assert abs(score - want) <= tol, (score, want, tol)
