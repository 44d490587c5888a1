"""Speculative decoding on SmolLM2-135M-Instruct (fp32 target; int4 export of the same weights as the draft model):
the tokens of plain greedy decoding, prompt by prompt, including a copy task and an answer that ends with EOS."""
import os

import pytest

from onnx_light_ep import InferenceSession
from onnx_light_ep.generate import generate
from onnx_light_ep.rewrite import convert

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _converted(tmp_path_factory, precision):
    from onnx_light_ep.models.smollm2 import ensure_smollm2_onnx

    folder = ensure_smollm2_onnx(progress=False, precision=precision)
    dst = str(tmp_path_factory.mktemp(f"smollm2-{precision}") / "model.onnx")
    convert(os.path.join(folder, "model.onnx"), dst)
    return dst


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """(converted fp32 target, its EP session, converted int4 draft)."""
    import onnxruntime as ort

    target = _converted(tmp_path_factory, "fp32")
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return target, InferenceSession(target, so), _converted(tmp_path_factory, "int4")


def _copy_prompt():
    from onnx_light_ep._text import TextTokenizer
    from onnx_light_ep.models.smollm2 import ensure_smollm2_onnx

    from onnx_light_ep.bench.gen_speculative import COPY_TASK, copy_task_text

    text, _ = copy_task_text(TextTokenizer.find([str(ensure_smollm2_onnx(progress=False))]), 300)
    return f"{COPY_TASK}\n\n{text}"


@pytest.mark.parametrize("prompt,n", [("copy", 128), ("What is the capital of France?", 64),
                                      ("Write a Python function that returns the squares of a list.", 64)])
def test_smollm2_speculative_gives_the_greedy_tokens(smollm2, prompt, n):
    target, sess, draft = smollm2
    prompt = _copy_prompt() if prompt == "copy" else prompt
    want = generate(target, prompt, chat=True, max_new_tokens=n, session=sess)
    got = generate(target, prompt, chat=True, max_new_tokens=n, session=sess, speculative="prompt-lookup",
                   num_draft_tokens=5)
    assert got.token_ids == want.token_ids and got.finished == want.finished
    # a run gives 1 + its accepted drafts, less what follows an end-of-sequence id
    assert got.decode_tokens == got.decode_steps + got.accepted_tokens or got.finished[0]
    got = generate(target, prompt, chat=True, max_new_tokens=n, session=sess, speculative="draft",
                   draft_model=draft, num_draft_tokens=4)
    assert got.token_ids == want.token_ids and got.finished == want.finished
    assert got.draft_tokens > got.accepted_tokens > 0   # the int4 copy agrees often, not always
    if prompt.startswith("Rewrite"):
        assert len(want.token_ids[0]) == n and not want.finished[0]
    if "France" in prompt:
        assert want.finished == [True] and "Paris" in want.text   # the answer ends with EOS inside the run


def test_smollm2_draft_of_another_vocabulary_is_refused(smollm2, mini_decoder):
    """The mini decoder (50 tokens) as a draft for SmolLM2 (49152 tokens): refused before any run."""
    target, sess, _ = smollm2
    _, small = mini_decoder()
    with pytest.raises(ValueError, match=r"draft_model; expected a model with the target's vocabulary \(49152 "
                                         r"logits\), got 50 logits"):
        generate(target, prompt_ids=[[1, 2, 3]], max_new_tokens=4, session=sess, speculative="draft",
                 draft_model=small)


def test_smollm2_precision_is_checked():
    from onnx_light_ep.models.smollm2 import ensure_smollm2_onnx

    with pytest.raises(ValueError, match=r"precision; expected one of fp32, int4, got 'int8'"):
        ensure_smollm2_onnx(progress=False, precision="int8")


def test_smollm2_speculative_streams_the_text(smollm2):
    target, sess, _ = smollm2
    pieces = {}
    for mode in (None, "prompt-lookup"):
        got = []
        res = generate(target, "List three colours.", chat=True, max_new_tokens=24, session=sess, speculative=mode,
                       stream=got.append)
        assert "".join(got) == res.text and len(got) > 3
        pieces[mode] = "".join(got)
    assert pieces["prompt-lookup"] == pieces[None]
