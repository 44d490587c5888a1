"""Gemma-3-270M (onnx_light_ep.models.gemma3) end to end: OPT-IN. This folder is collected only
with ONNX_LIGHT_ACCEPT_GEMMA_TERMS=1 (accepting the Gemma Terms of Use; tests/conftest.py), as

    ONNX_LIGHT_ACCEPT_GEMMA_TERMS=1 python -m pytest -q tests/optin

The genai export converted by onnx-light keeps the model's sliding windows (512 on five of every
six layers, none on the others) and matches plain ORT over a padded batch of two prompts longer
than the window (prefill + greedy steps), and over a short text.
"""
import pydoc_data.topics as topics

from onnx_light_ep._text import TextTokenizer
from onnx_light_ep.compare import compare
from onnx_light_ep.models import gemma3
from onnx_light_ep.rewrite import read_metadata


def test_gemma3_converted_matches_plain_ort():
    src = gemma3.ensure_gemma3_onnx(progress=False)
    conv = gemma3.ensure_gemma3_converted(progress=False) / "model.onnx"
    meta = read_metadata(str(conv))
    assert (meta["num_layers"], meta["kv_num_heads"], meta["head_dim"]) == (18, 1, 256)
    assert meta["source_pattern"] == "GroupQueryAttention"
    assert [x["local_window_size"] for x in meta["layers"]] == [-1 if i % 6 == 5 else 512 for i in range(18)]

    tok = TextTokenizer.find([str(conv.parent)])
    bos = tok.prefix_ids()
    assert bos == [gemma3.BOS_TOKEN_ID]
    text = tok.encode("\n\n".join(topics.topics[k] for k in sorted(topics.topics)))
    rows = [bos + text[:599], bos + text[3:599]]  # past the 512-token window; the second row padded
    result = compare(str(src / "model.onnx"), str(conv), prompt_ids=rows, batch_size=2, steps=8)
    assert all(s.agree for s in result.steps) and result.ok, result.summary()

    short = compare(str(src / "model.onnx"), str(conv), prompt_ids=[bos + tok.encode("The capital of France is")],
                    steps=12)
    assert all(s.agree for s in short.steps) and short.ok, short.summary()
    assert "France" in short.texts[0], short.texts
