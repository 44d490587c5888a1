#!/usr/bin/env python3
"""Regenerate ``tests/generate/data/beam_hf_smollm2.json``: Hugging Face transformers' beam search
on SmolLM2-135M-Instruct, the reference ``tests/generate/test_beam_smollm2.py`` compares
``onnx_light_ep.generate(num_beams=N)`` against (so the default tests need no torch).

The weights are the GGUF the SmolLM2 export is built from (``onnx_light_ep.models.smollm2``),
loaded by transformers dequantized to fp32 (``GgufConfig(dequantize=True)``, as the export
pipeline does), run in fp32 on the CPU. Prompts are the chat-template token ids of the
converted model's tokenizer (stored in the fixture). For every case transformers runs
``generate(num_beams=N, do_sample=False, num_return_sequences=N, max_new_tokens, length_penalty,
early_stopping, eos_token_id=2, output_scores=True, return_dict_in_generate=True)`` with a fresh
``GenerationConfig`` (no other logits processor) and the fixture keeps each returned sequence's
generated ids (up to and including the EOS token) and its ``sequences_scores``.

The fixture also records ``max_abs_dlogits``: the largest |logit difference| between torch and
the converted model on ``OnnxLightExecutionProvider`` (one prefill of prompt + best sequence,
every position, every case) -- the number the test's score tolerance is derived from.

Usage (needs torch 2.13.0, transformers 5.x, gguf; about a minute on 2 cores)::

    python tools/make_beam_reference.py [--out tests/generate/data/beam_hf_smollm2.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "How do I boil an egg?",
    "Explain what a prime number is.",
    "Give me a synonym for happy.",
]
MAX_NEW_TOKENS = 24
EOS = 2
# (num_beams, length_penalty, early_stopping) per prompt index; defaults first
CASES = ([(i, n, 1.0, False) for i in range(len(PROMPTS)) for n in (2, 4)]
         + [(0, 4, 0.5, True), (1, 3, 2.0, "never"), (2, 4, -0.5, False), (3, 2, 1.0, True),
            (4, 3, 0.0, "never"), (5, 4, 1.5, True)])


def load_torch_model():
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig

    from onnx_light_ep.models.smollm2 import GGUF_FILE, _gguf_path, default_cache_dir

    gguf = _gguf_path(default_cache_dir(), False)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=GGUF_FILE, dtype=torch.float32,
                                                 quantization_config=GgufConfig(gguf_file=GGUF_FILE,
                                                                                dequantize=True))
    return model.eval()


def hf_beam(model, ids, num_beams, length_penalty, early_stopping):
    import torch
    from transformers import GenerationConfig

    cfg = GenerationConfig(num_beams=num_beams, do_sample=False, num_return_sequences=num_beams,
                           max_new_tokens=MAX_NEW_TOKENS, length_penalty=length_penalty,
                           early_stopping=early_stopping, eos_token_id=EOS, pad_token_id=EOS,
                           output_scores=True, return_dict_in_generate=True)
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=cfg)
    seqs = []
    for row in out.sequences[:, len(ids):].tolist():
        cut = row.index(EOS) + 1 if EOS in row else len(row)
        seqs.append(row[:cut])
    return seqs, [float(s) for s in out.sequences_scores]


def max_dlogits(model, session, meta, tokens):
    """max |torch - EP| over every position's logits of one prefill of ``tokens``."""
    import torch

    from onnx_light_ep import KVCache
    from onnx_light_ep.generate import CacheStepper

    with torch.no_grad():
        ref = model(torch.tensor([tokens])).logits[0].double().numpy()
    st = CacheStepper(session, meta)
    with KVCache.for_model(session, 1, len(tokens)) as cache:
        got = st.run(cache, np.array([tokens]))[0]
    return float(np.abs(ref - got).max())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "generate", "data", "beam_hf_smollm2.json"))
    args = ap.parse_args(argv)

    import torch
    import transformers

    from onnx_light_ep import InferenceSession
    from onnx_light_ep._text import TextTokenizer
    from onnx_light_ep.models.smollm2 import ensure_smollm2_onnx
    from onnx_light_ep.rewrite import convert, read_metadata

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    folder = ensure_smollm2_onnx(progress=True)
    tok = TextTokenizer.find([str(folder)])
    converted = os.path.join(str(folder) + "-onnx-light", "model.onnx")
    if not os.path.isfile(converted):
        converted = os.path.join(ROOT, "build", "beam_ref_smollm2.onnx")
        convert(os.path.join(folder, "model.onnx"), converted)
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    session = InferenceSession(converted, so)
    meta = read_metadata(converted)
    model = load_torch_model()
    prompt_ids = [tok.encode(tok.chat_prompt(p)) for p in PROMPTS]
    cases, worst = [], 0.0
    for i, n, lp, es in CASES:
        t0 = time.time()
        seqs, scores = hf_beam(model, prompt_ids[i], n, lp, es)
        worst = max(worst, max_dlogits(model, session, meta, prompt_ids[i] + seqs[0]))
        cases.append({"prompt": i, "num_beams": n, "length_penalty": lp, "early_stopping": es,
                      "sequences": seqs, "sequences_scores": scores})
        print(f"prompt {i} N={n} lp={lp} es={es}: {scores[0]:.5f} {tok.decode(seqs[0])!r} "
              f"({time.time() - t0:.1f}s)", file=sys.stderr)
    data = {"model": "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized to fp32; torch fp32 CPU)",
            "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
            "max_new_tokens": MAX_NEW_TOKENS, "eos_token_id": EOS, "prompts": PROMPTS,
            "prompt_ids": prompt_ids, "max_abs_dlogits": worst, "cases": cases}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}: {len(cases)} cases, max |dlogits| torch vs EP {worst:.3g}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
