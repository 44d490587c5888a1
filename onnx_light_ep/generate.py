"""Text generation over a converted model on ``OnnxLightExecutionProvider`` with a ``KVCache``.

``generate(model, prompt, ...)`` runs a prefill and then one token per step,
feeding ``input_ids``, ``attention_mask`` (past + current tokens) and
``position_ids`` as the source exporter expects (left padding for
decomposed/Attention exports, right padding with the valid tokens as a prefix
for GroupQueryAttention exports: ``onnx_light.padding_side``, see
``onnx_light_ep._runner``), and the ``kv_cache`` handle. Decoding is greedy
(``temperature <= 0``) or sampled (temperature, top-k, top-p, seeded
``numpy.random.Generator``). A row stops at an end-of-sequence id (from the
model folder's ``genai_config.json``/``generation_config.json``/tokenizer, or
``eos_token_ids``) or after ``max_new_tokens``. Text in and out needs
``tokenizer.json`` next to the model (or ``tokenizer_dir``) and the
``tokenizers`` package; otherwise pass ``prompt_ids``.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Union

import numpy as np

from ._runner import DecodeState, PastFeeds, check_inputs

__all__ = ["GenerateError", "GenerateResult", "generate", "sample_next"]


@dataclass
class GenerateResult:
    """Output of :func:`generate` (times in seconds; ``tokens_per_second`` counts decode steps only)."""

    token_ids: List[List[int]]
    texts: Optional[List[str]]
    prompt_lengths: List[int]
    finished: List[bool]
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int
    providers: List[str] = field(default_factory=list)

    @property
    def text(self) -> Optional[str]:
        return self.texts[0] if self.texts else None

    @property
    def tokens_per_second(self) -> float:
        n = self.decode_steps * len(self.token_ids)
        return n / self.decode_seconds if self.decode_seconds > 0 else float("nan")


class GenerateError(RuntimeError):
    """A run failed after generation started: ``partial`` is the :class:`GenerateResult` of the
    tokens generated before the failure (``__cause__`` is the original error)."""

    def __init__(self, message: str, partial: "GenerateResult"):
        super().__init__(message)
        self.partial = partial


def sample_next(logits: np.ndarray, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                rng: Optional[np.random.Generator] = None) -> np.ndarray:
    """Next token per row from ``logits`` ``[B, vocab]``.

    ``temperature <= 0``: argmax. Otherwise softmax(logits / temperature),
    keeping the ``top_k`` largest (0 = all) and then the smallest set whose
    probability reaches ``top_p`` (the token that crosses it included).
    Returns int64 ``[B]``.
    """
    logits = np.asarray(logits, dtype=np.float64)
    if temperature <= 0:
        return logits.argmax(-1).astype(np.int64)
    if rng is None:
        rng = np.random.default_rng()
    out = np.empty(logits.shape[0], dtype=np.int64)
    for b, row in enumerate(logits):
        x = row / temperature
        if 0 < top_k < x.size:
            kth = np.partition(x, -top_k)[-top_k]
            x = np.where(x < kth, -np.inf, x)
        p = np.exp(x - x.max())
        p /= p.sum()
        if top_p < 1.0:
            order = np.argsort(-p)
            cum = np.cumsum(p[order])
            keep = order[: int(np.searchsorted(cum, top_p) + 1)]
            q = np.zeros_like(p)
            q[keep] = p[keep]
            p = q / q.sum()
        out[b] = rng.choice(p.size, p=p)
    return out


# KVCache.for_model keywords generate passes through (batch size and length come from the run).
CACHE_OPTIONS = ("pool", "page_tokens", "sliding_window", "rollback_tokens", "kv_quant", "recent_tokens",
                 "sink_tokens", "memory_limit_bytes")


def _check_cache_options(cache_options) -> None:
    if cache_options is None:
        return
    if not isinstance(cache_options, dict):
        raise ValueError(f"generate: cache_options; expected a dict of KVCache options ({', '.join(CACHE_OPTIONS)}), "
                         f"got {type(cache_options).__name__}")
    bad = sorted(k for k in cache_options if k not in CACHE_OPTIONS)
    if bad:
        raise ValueError(f"generate: cache_options; unknown key(s) {', '.join(map(repr, bad))}: expected any of "
                         f"{', '.join(CACHE_OPTIONS)} (batch size and length are set by the run)")


def generate(model, prompt: Union[str, Sequence[str], None] = None, *,
             prompt_ids: Optional[Sequence[Sequence[int]]] = None, chat: bool = False, max_new_tokens: int = 128,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = None,
             eos_token_ids: Optional[Sequence[int]] = None, tokenizer_dir: Optional[str] = None,
             stream: Optional[Callable[[str], None]] = None, progress: bool = False, session=None,
             threads: Optional[int] = None, provider_options=None,
             cache_options: Optional[dict] = None) -> GenerateResult:
    """Generate from a converted model (``onnx_light_ep.convert``) on the EP.

    Args:
        model: path of the converted model (an unconverted export is converted
            into a temporary file first).
        prompt: text or list of texts (one row each); or ``prompt_ids``.
        chat: wrap each text prompt in the tokenizer's chat template as one user turn.
        max_new_tokens: upper bound on generated tokens per row (>= 1).
        temperature, top_k, top_p, seed: sampling (see :func:`sample_next`).
        eos_token_ids: override the end-of-sequence ids found next to the model.
        stream: called with each new piece of row 0's text (needs a tokenizer).
        progress: tqdm bar (or stderr lines) when not streaming.
        session: an existing EP session of ``model`` to reuse.
        cache_options: keyword arguments for the run's :class:`KVCache`
            (``KVCache.for_model``), e.g. ``{"kv_quant": "int8"}``: any of
            ``CACHE_OPTIONS`` (the cache is sized by the run itself).

    Returns:
        :class:`GenerateResult`.

    Raises:
        ValueError: bad arguments, text without a tokenizer, or model inputs
            this loop cannot feed.
    """
    from . import InferenceSession, KVCache
    from ._text import TextTokenizer, eos_token_ids as _eos_ids
    from .rewrite import convert as _convert
    from .rewrite import read_metadata

    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens; expected >= 1, got {max_new_tokens}")
    _check_cache_options(cache_options)
    if not (math.isfinite(temperature) and temperature >= 0.0):
        raise ValueError(f"generate: temperature; expected a finite number >= 0 (0 = greedy), got {temperature}")
    if top_k < 0 or not 0.0 < top_p <= 1.0:
        raise ValueError(f"generate: top_k/top_p; expected top_k >= 0 and 0 < top_p <= 1, got {top_k}, {top_p}")
    if tokenizer_dir is not None and not os.path.isdir(os.fspath(tokenizer_dir)):
        raise ValueError(f"generate: tokenizer_dir; expected a folder with tokenizer.json, got "
                         f"{os.fspath(tokenizer_dir)!r} (not a folder)")
    path = os.fspath(model)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"generate: model; expected an ONNX file, got {path!r} "
                                f"({'a folder' if os.path.isdir(path) else 'not found'})")
    src_dir = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        meta = read_metadata(path)
    except ValueError:
        tmp = tempfile.TemporaryDirectory(prefix="onnx_light_generate_")
        converted = os.path.join(tmp.name, "model.onnx")
        _convert(path, converted)
        path, meta = converted, read_metadata(converted)
    try:
        tok = TextTokenizer.find([tokenizer_dir, src_dir])
        if prompt is not None:
            if tok is None:
                raise ValueError("generate: prompt; expected token ids (no tokenizer.json usable with the "
                                 "tokenizers package next to the model), got text")
            texts = [prompt] if isinstance(prompt, str) else list(prompt)
            for i, t in enumerate(texts):
                if not t:
                    raise ValueError(f"generate: prompt[{i}]; expected non-empty text, got {t!r}")
            if chat:
                texts = [tok.chat_prompt(t) or t for t in texts]
            prompt_ids = [tok.encode(t) for t in texts]
        if not prompt_ids:
            raise ValueError("generate: expected a prompt or prompt_ids")
        rows = [list(map(int, p)) for p in prompt_ids]
        for i, r in enumerate(rows):
            if not r:
                raise ValueError(f"generate: prompt_ids[{i}]; expected at least one token id, got []")
        limit = meta.get("max_position")
        longest = max(len(r) for r in rows)
        if limit and longest + max_new_tokens > int(limit):
            raise ValueError(f"generate: max_new_tokens; the prompt ({longest} tokens) plus {max_new_tokens} new "
                             f"tokens exceeds the model's {int(limit)} positions (onnx_light.max_position); "
                             f"expected max_new_tokens <= {int(limit) - longest}")
        eos = set(eos_token_ids) if eos_token_ids is not None else (
            tok.eos_token_ids if tok is not None else _eos_ids(tokenizer_dir or "", src_dir))
        if session is None:
            import onnxruntime as ort

            so = ort.SessionOptions()
            so.log_severity_level = 3
            if threads:
                so.intra_op_num_threads = int(threads)
            session = InferenceSession(path, so, provider_options)
        logits_shape = next((o.shape for o in session.get_outputs()
                             if o.name == (meta.get("logits_output") or session.get_outputs()[0].name)), None)
        vocab = logits_shape[-1] if logits_shape and isinstance(logits_shape[-1], int) else None
        for i, r in enumerate(rows):
            bad = [t for t in r if t < 0 or (vocab is not None and t >= vocab)]
            if bad:
                raise ValueError(f"generate: prompt_ids[{i}]; expected token ids in [0, {vocab}) (the model's "
                                 f"vocabulary), got {bad[0]}")
        pairs = [tuple(p) for p in meta.get("tensor_pairs", [])]
        pasts = PastFeeds(session, pairs, len(rows), meta["head_dim"], meta["v_head_dim"]) if pairs else None
        check_inputs(session, ["input_ids", "attention_mask", "position_ids", "seqlens_k", "total_sequence_length",
                              meta["cache_input"]] +
                     [p for p, _ in pairs], "generate")
        state = DecodeState(rows, meta["padding_side"], pad_token_id=min(eos) if eos else 0)
        logits_name = meta.get("logits_output") or session.get_outputs()[0].name
        out_names = [o.name for o in session.get_outputs()]
        rng = np.random.default_rng(seed)
        generated: List[List[int]] = [[] for _ in rows]
        finished = [False] * len(rows)
        shown = ""
        prefill_s = decode_s = 0.0
        steps = 0
        tick = _Progress(max_new_tokens, progress and stream is None)
        def partial_result():
            return GenerateResult(token_ids=[list(g) for g in generated],
                                  texts=[tok.decode(g) for g in generated] if tok is not None else None,
                                  prompt_lengths=[len(r) for r in rows], finished=list(finished),
                                  prefill_seconds=prefill_s, decode_seconds=decode_s, decode_steps=steps,
                                  providers=session.get_providers())

        with KVCache.for_model(session, len(rows), state.total_length + max_new_tokens,
                               **(cache_options or {})) as cache:
            for step in range(max_new_tokens):
                feeds = dict(state.feeds(session), **{meta["cache_input"]: cache.handle})
                if pasts is not None:
                    feeds.update(pasts.values)
                t0 = time.perf_counter()
                try:
                    outs = dict(zip(out_names, session.run(None, feeds)))
                except Exception as e:
                    tick.close()
                    raise GenerateError(f"generate: the run of step {step} failed after "
                                        f"{sum(map(len, generated))} generated token(s): {e}",
                                        partial_result()) from e
                dt = time.perf_counter() - t0
                if pasts is not None:
                    pasts.update(outs)
                if step == 0:
                    prefill_s = dt
                else:
                    decode_s += dt
                    steps += 1
                nxt = sample_next(state.last_logits(outs[logits_name]), temperature=temperature, top_k=top_k,
                                  top_p=top_p, rng=rng)
                for b, t in enumerate(nxt):
                    if not finished[b]:
                        if int(t) in eos:
                            finished[b] = True
                        else:
                            generated[b].append(int(t))
                if stream is not None and tok is not None:
                    text = tok.decode(generated[0])
                    if text.startswith(shown) and len(text) > len(shown) and not text.endswith("\ufffd"):
                        stream(text[len(shown):])
                        shown = text
                tick(step)
                if all(finished) or step == max_new_tokens - 1:
                    break
                state.advance([t if not f else (min(eos) if eos else t) for t, f in zip(nxt, finished)])
        tick.close()
        texts = [tok.decode(g) for g in generated] if tok is not None else None
        if stream is not None and texts and texts[0].startswith(shown) and len(texts[0]) > len(shown):
            stream(texts[0][len(shown):])
        return GenerateResult(token_ids=generated, texts=texts, prompt_lengths=[len(r) for r in rows],
                              finished=finished, prefill_seconds=prefill_s, decode_seconds=decode_s,
                              decode_steps=steps, providers=session.get_providers())
    finally:
        if tmp is not None:
            tmp.cleanup()


class _Progress:
    """tqdm bar (if installed) or a stderr line every 32 tokens; ``close()`` ends it."""

    def __init__(self, total: int, enabled: bool):
        self.bar, self.enabled = None, enabled
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc="generate", unit="tok", leave=False)
            except ImportError:
                pass

    def __call__(self, i: int) -> None:
        if self.bar is not None:
            self.bar.update(1)
        elif self.enabled and (i + 1) % 32 == 0:
            print(f"generate: {i + 1} tokens", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
