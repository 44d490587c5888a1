"""The loop of ``generate(..., prefix_cache=pc)``: one prompt, its cached prefix forked, the rest prefilled.

:meth:`PrefixCache.match` gives a cache holding the longest cached prefix of
the prompt; :class:`CacheStepper` prefills the remaining tokens (in runs of at
most ``PREFILL_CHUNK_TOKENS``, with progress) and then decodes one token per
step; right after the prefill the prompt's new full blocks go into the
PrefixCache. A run that exceeds the pool's budget releases the least recently
used entries and runs again (runs are transactions: a failed one changed
nothing), until it fits or no entry is left.
"""

from __future__ import annotations

import time
from typing import Callable, List, Optional

import numpy as np

from ..errors import KVCacheMemoryError
from ._prepare import Prepared
from ._prefix import PrefixCache
from ._progress import PrefillProgress, Progress
from ._result import GenerateError, GenerateResult
from ._sampling import sample_next
from ._stepper import CacheStepper

__all__ = ["PREFILL_CHUNK_TOKENS", "run_prefixed"]

PREFILL_CHUNK_TOKENS = 256
"""Longest prefill run, rounded up to a multiple of the block size (runs then end on block boundaries)."""


def _with_room(pc: PrefixCache, fn):
    """``fn()``, releasing least recently used entries while it raises ``KVCacheMemoryError``."""
    while True:
        try:
            return fn()
        except KVCacheMemoryError:
            if not pc.evict():
                raise


def run_prefixed(prep: Prepared, pc: PrefixCache, *, model, max_new_tokens: int, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = None,
                 stream: Optional[Callable[[str], None]] = None, progress: bool = False,
                 cache_options: Optional[dict] = None) -> GenerateResult:
    """Run the one prompt of ``prep`` reusing ``pc``'s cached prefix (see ``generate``).

    ``model`` is the caller's model path (the key's model identity; ``prep.path``
    may be a temporary conversion). ``cached_tokens`` of the result: positions reused.
    """
    if len(prep.rows) != 1:
        raise ValueError(f"generate: prefix_cache; expected one prompt (batch 1: each request reuses its own "
                         f"prefix), got {len(prep.rows)}")
    session, tok, eos, row = prep.session, prep.tokenizer, prep.eos, prep.rows[0]
    stepper = CacheStepper(session, prep.meta, "generate")
    rng = np.random.default_rng(seed)
    generated: List[int] = []
    finished = False
    shown = ""
    prefill_s = decode_s = 0.0
    steps = cached = 0

    def partial_result():
        return GenerateResult(token_ids=[list(generated)], texts=[tok.decode(generated)] if tok is not None else None,
                              prompt_lengths=[len(row)], finished=[finished], prefill_seconds=prefill_s,
                              decode_seconds=decode_s, decode_steps=steps, providers=session.get_providers(),
                              cached_tokens=cached)

    t0 = time.perf_counter()
    match = pc.match(model, row, meta=prep.meta, cache_options=cache_options)
    cache, cached = match.cache, match.cached_tokens
    chunk = -(-PREFILL_CHUNK_TOKENS // match.block_tokens) * match.block_tokens
    ids = np.asarray([row], dtype=np.int64)
    bar = PrefillProgress(len(row) - cached, progress and stream is None and len(row) - cached > chunk)
    tick = Progress(max_new_tokens, progress and stream is None)
    try:
        def prefill():
            done = stepper.past_length(cache)  # > cached when a retry follows committed chunks
            return stepper.prefill(cache, ids[:, done:], chunk_tokens=chunk,
                                   progress=lambda d, t: bar(done - cached + d))
        try:
            logits = _with_room(pc, prefill)
        except Exception as e:
            raise GenerateError(f"generate: the prefill of {len(row) - cached} token(s) after {cached} cached "
                                f"failed: {e}", partial_result()) from e
        finally:
            bar.close()
        prefill_s = time.perf_counter() - t0
        for step in range(max_new_tokens):
            t = int(sample_next(logits, temperature=temperature,
                                top_k=top_k, top_p=top_p, rng=rng)[0])
            if t in eos:
                finished = True
            else:
                generated.append(t)
            if step == 0:
                try:
                    pc.insert(model, row, cache, meta=prep.meta, cache_options=cache_options)
                except ValueError:
                    if not pc.closed:
                        raise   # closed meanwhile (another thread): this request's cache is its own, go on
            if stream is not None and tok is not None:
                text = tok.decode(generated)
                if text.startswith(shown) and len(text) > len(shown) and not text.endswith("\ufffd"):
                    stream(text[len(shown):])
                    shown = text
            tick(step)
            if finished or step == max_new_tokens - 1:
                break
            t1 = time.perf_counter()
            try:
                logits = _with_room(pc, lambda: stepper.run(cache, np.array([[t]], dtype=np.int64))[:, -1])
            except Exception as e:
                raise GenerateError(f"generate: the run of step {step + 1} failed after {len(generated)} "
                                    f"generated token(s): {e}", partial_result()) from e
            decode_s += time.perf_counter() - t1
            steps += 1
    finally:
        tick.close()
        cache.close()
    texts = [tok.decode(generated)] if tok is not None else None
    if stream is not None and texts and texts[0].startswith(shown) and len(texts[0]) > len(shown):
        stream(texts[0][len(shown):])
    return GenerateResult(token_ids=[generated], texts=texts, prompt_lengths=[len(row)], finished=[finished],
                          prefill_seconds=prefill_s, decode_seconds=decode_s, decode_steps=steps,
                          providers=session.get_providers(), cached_tokens=cached)
