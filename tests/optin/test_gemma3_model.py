"""Gemma-3-270M (onnx_light_ep.models.gemma3) end to end: OPT-IN. This folder is collected only
with ONNX_LIGHT_ACCEPT_GEMMA_TERMS=1 (accepting the Gemma Terms of Use; tests/conftest.py), as

    ONNX_LIGHT_ACCEPT_GEMMA_TERMS=1 python -m pytest -q tests/optin

The genai export converted by onnx-light keeps the model's sliding windows (512 on five of every
six layers, none on the others) and matches plain ORT over a padded batch of two prompts longer
than the window (prefill + greedy steps), and over a short text. The torch.onnx and optimum exports
(the window only in the mask) take their windows from the config.json beside them and match plain ORT
over a 2100-token prompt.
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


def test_gemma3_torch_onnx_export_windows_from_config_json(tmp_path):
    """The same weights exported with torch.onnx (dynamo, opset 23: ONNX Attention, the 512-key window
    only in the mask): convert reads the windows from the config.json beside the export (512 on 15
    of 18 layers, reported), the converted model gives plain ORT's greedy tokens over a 2100-token
    prompt (4 windows long) and 16 steps, and its sliding layers' pages stop growing with the context
    while the 3 full-attention layers' grow."""
    from onnx_light_ep.rewrite import convert

    src = gemma3.ensure_gemma3_dynamo_onnx(progress=False) / "model.onnx"
    dst = tmp_path / "model.onnx"
    report = convert(str(src), str(dst))
    _check_windowed_export(src, dst, report)


def test_gemma3_optimum_export_windows_from_config_json(tmp_path):
    """The same weights exported with optimum (optimum-cli, opset 18: MatMul/Softmax/MatMul, the 512-key
    window only in the mask, no position_ids input; optimum's own config.json beside it): convert reads
    the windows from that config.json (512 on 15 of 18 layers, reported), the converted model gives plain
    ORT's greedy tokens over a 2100-token prompt (4 windows long) and 16 steps, and its sliding layers'
    pages stop growing with the context while the 3 full-attention layers' grow."""
    import json

    import onnx

    from onnx_light_ep.rewrite import convert

    folder = gemma3.ensure_gemma3_optimum_onnx(progress=False)
    src = folder / "model.onnx"
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["transformers_version"].startswith("4.") and cfg["sliding_window"] == 512  # optimum's, not ours
    graph = onnx.load(str(src), load_external_data=False).graph
    names = {i.name for i in graph.input}
    assert "position_ids" not in names and "past_key_values.0.key" in names
    assert "present.17.value" in {o.name for o in graph.output}
    dst = tmp_path / "model.onnx"
    report = convert(str(src), str(dst))
    assert report.patterns == ["Concat+decomposed"], report.patterns
    _check_windowed_export(src, dst, report)


def _check_windowed_export(src, dst, report):
    """The checks both exports of the windows-in-the-mask kind share: windows 512 on 15 of 18 layers from
    config.json (reported); plain ORT's greedy ids over a 2099-token prompt + 16 steps; the sliding layers'
    pages bounded while the full-attention layers' grow."""
    import numpy as np

    from onnx_light_ep import InferenceSession, KVCache
    from onnx_light_ep.generate import CacheStepper

    windows = [x["local_window_size"] for x in read_metadata(str(dst))["layers"]]
    assert windows == [-1 if i % 6 == 5 else 512 for i in range(18)]
    assert "sliding windows: layers 0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16: 512" in str(report)
    tok = TextTokenizer.find([str(src.parent)])
    bos = tok.prefix_ids()
    assert bos == [gemma3.BOS_TOKEN_ID]
    text = tok.encode("\n\n".join(topics.topics[k] for k in sorted(topics.topics)))
    # compare() would hold the prefill's logits for every position (2100 x 262144 fp32 per side):
    # run both sides in prefill chunks of 300 and compare the logits of each chunk, then 16 greedy steps
    want, got, max_abs = _chunked_greedy_pair(str(src), str(dst), bos + text[:2099], chunk=300, steps=16)
    assert got == want, (got, want)
    assert max_abs <= 1e-3, max_abs  # fp32, |logits| up to ~40 over 262144 entries: same bound as compare's rtol

    sess = InferenceSession(str(dst))
    stepper = CacheStepper(sess, read_metadata(str(dst)))
    with KVCache.for_model(sess, 1, 8192) as cache:
        page = cache.page_tokens
        held = []
        for start in range(0, 4096, 1024):
            stepper.run(cache, np.array([text[start:start + 1024]]))
            held.append([len(cache._page_ids(layer, 0, 0)) for layer in range(18)])
        for layer, w in enumerate(windows):
            pages = [h[layer] for h in held]
            if w > 0:  # at most the window plus two pages, from the first chunk on
                assert max(pages) <= -(-512 // page) + 2, (layer, pages)
            else:
                assert pages == [1024 * (i + 1) // page for i in range(4)], (layer, pages)


def _chunked_greedy_pair(src, dst, prompt, *, chunk, steps):
    """Plain ORT on the export (pasts fed back) and the EP on the converted model (CacheStepper), the
    prompt in chunks, then greedy steps (position_ids fed when the export has them); returns
    (ORT ids, EP ids, max |dlogits| over every position)."""
    import numpy as np
    import onnxruntime as ort

    from onnx_light_ep import InferenceSession, KVCache
    from onnx_light_ep.generate import CacheStepper

    so = ort.SessionOptions()
    so.log_severity_level = 3
    plain = ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
    info = {i.name: i for i in plain.get_inputs()}
    names = [o.name for o in plain.get_outputs()]
    pasts = {n: np.zeros((1, info[n].shape[1], 0, info[n].shape[3]), np.float32) for n in info
             if n.startswith("past_key_values.")}
    sess = InferenceSession(dst, so)
    stepper = CacheStepper(sess, read_metadata(dst))
    done, want, got, max_abs = 0, [], [], 0.0
    with KVCache.for_model(sess, 1, len(prompt) + steps + 1) as cache:
        pieces = [prompt[i:i + chunk] for i in range(0, len(prompt), chunk)]
        for i in range(len(pieces) + steps):
            ids = pieces[i] if i < len(pieces) else [want[-1]]
            feeds = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, done + len(ids)), np.int64),
                     **pasts}
            if "position_ids" in info:  # torch.onnx's export takes them; optimum's Gemma export does not
                feeds["position_ids"] = np.arange(done, done + len(ids))[None]
            out = dict(zip(names, plain.run(None, feeds)))
            pasts = {n: out[n.replace("past_key_values.", "present.")] for n in pasts}
            ep = stepper.run(cache, np.array([ids if i < len(pieces) else [got[-1]]]))
            max_abs = max(max_abs, float(np.abs(ep - out["logits"]).max()))
            done += len(ids)
            if i >= len(pieces) - 1:
                want.append(int(out["logits"][0, -1].argmax()))
                got.append(int(ep[0, -1].argmax()))
    return want[:steps], got[:steps], max_abs
