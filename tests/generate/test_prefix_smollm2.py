"""PrefixCache on the pretrained SmolLM2-135M-Instruct: a ~2K-token system prompt shared by two questions.

The second request reuses the whole-block prefix it shares with the first (the system prompt and the
chat template's turn header up to the last full block) and must answer with the greedy ids of an
uncached run (fp32: the reused K/V are the same floats; only the split of the prefill into runs
differs, which moves logits by rounding, far below any greedy margin of this model).
"""
import os

import onnxruntime as ort
import pytest

from onnx_light_ep import InferenceSession, KVPool, default_page_tokens
from onnx_light_ep._text import TextTokenizer
from onnx_light_ep.bench.prompts import catalogue_questions, catalogue_system_prompt
from onnx_light_ep.generate import PrefixCache, generate
from onnx_light_ep.models.smollm2 import ensure_smollm2_onnx
from onnx_light_ep.rewrite import convert, read_metadata


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    folder = ensure_smollm2_onnx(progress=False)
    dst = str(tmp_path_factory.mktemp("smollm2") / "model.onnx")
    convert(os.path.join(folder, "model.onnx"), dst)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return dst, TextTokenizer.find([folder]), InferenceSession(dst, so)


def _common(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_second_question_reuses_the_system_prompt_with_the_uncached_answer(smollm2):
    dst, tok, sess = smollm2
    system = catalogue_system_prompt(tok, 2048)
    rows = [tok.encode(tok.chat_prompt(q, system=system)) for q in catalogue_questions(2)]
    assert min(map(len, rows)) > 2048
    with KVPool() as pool, PrefixCache(pool) as pc:
        cold = generate(dst, prompt_ids=[rows[0]], max_new_tokens=32, prefix_cache=pc, session=sess)
        warm = generate(dst, prompt_ids=[rows[1]], max_new_tokens=32, prefix_cache=pc, session=sess)
        stats = pc.stats()
    meta = read_metadata(dst)
    block = default_page_tokens(meta["head_dim"], meta["dtype"], meta["v_head_dim"])  # PrefixCache's default
    assert cold.cached_tokens == 0
    assert warm.cached_tokens == _common(*rows) // block * block >= 2048 - block
    assert stats["hits"] == warm.cached_tokens // block and stats["entries"] == len(rows[0]) // block + \
        (len(rows[1]) // block - warm.cached_tokens // block)
    for got, row in ((cold, rows[0]), (warm, rows[1])):
        want = generate(dst, prompt_ids=[row], max_new_tokens=32, session=sess)
        assert got.token_ids == want.token_ids, (got.text, want.text)
    assert cold.token_ids != warm.token_ids   # two questions, two answers: the reuse kept them apart

