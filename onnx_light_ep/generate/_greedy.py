"""The batch loop: one prefill of every (padded) prompt row, then one token per row per step.

Rows of equal length longer than ``PREFILL_CHUNK_TOKENS`` (a single long
prompt, the usual case) are prefilled in runs of that many tokens
(``CacheStepper.prefill``, with a progress bar when ``progress`` is on): the
logits of one run are ``[B, chunk, vocab]`` instead of ``[B, prompt, vocab]``
(2.2 GB per 2K tokens at Gemma-3's 262144-token vocabulary) and the user sees
the prefill advance.

Greedy (``temperature <= 0``) or sampled; rows of different lengths are
padded as the exporter expects (``onnx_light_ep._runner.DecodeState``); a row
stops at an end-of-sequence id or after ``max_new_tokens``.
"""

from __future__ import annotations

import time
from typing import Callable, List, Optional

import numpy as np

from .._runner import DecodeState, PastFeeds, check_inputs
from ._prepare import Prepared
from ._progress import PrefillProgress, Progress
from ._result import GenerateError, GenerateResult
from ._sampling import sample_next
from ._stepper import CacheStepper

__all__ = ["PREFILL_CHUNK_TOKENS", "run_batch"]

PREFILL_CHUNK_TOKENS = 512


def run_batch(prep: Prepared, *, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
              top_p: float = 1.0, seed: Optional[int] = None, stream: Optional[Callable[[str], None]] = None,
              progress: bool = False, cache_options: Optional[dict] = None) -> GenerateResult:
    """Run :class:`Prepared` rows to completion on a fresh ``KVCache`` (see ``generate``)."""
    from .. import KVCache

    session, meta, rows, eos, tok = prep.session, prep.meta, prep.rows, prep.eos, prep.tokenizer
    first, later = prep.step_sessions  # a prefill/decode pair: step 0 on its prefill graph, then its decode graph
    pairs = [tuple(p) for p in meta.get("tensor_pairs", [])]
    keep_name = meta.get("logits_to_keep")
    pasts = PastFeeds(session, pairs, len(rows), meta["head_dim"], meta["v_head_dim"]) if pairs else None
    for s in {id(first): first, id(later): later}.values():
        check_inputs(s, ["input_ids", "attention_mask", "position_ids", "seqlens_k", "total_sequence_length",
                         meta["cache_input"]] + [p for p, _ in pairs] + [keep_name] * bool(keep_name), "generate")
    # the input's name per session that takes it (a pair's graphs both do or neither: check_pair_metadata)
    keeps = {id(s): keep_name for s in (first, later) if keep_name and keep_name in {i.name for i in s.get_inputs()}}
    state = DecodeState(rows, meta["padding_side"], pad_token_id=min(eos) if eos else 0)
    logits_name = meta.get("logits_output") or session.get_outputs()[0].name
    rng = np.random.default_rng(seed)
    generated: List[List[int]] = [[] for _ in rows]
    finished = [False] * len(rows)
    shown = ""
    prefill_s = decode_s = 0.0
    steps = 0
    tick = Progress(max_new_tokens, progress and stream is None)

    def partial_result():
        return GenerateResult(token_ids=[list(g) for g in generated],
                              texts=[tok.decode(g) for g in generated] if tok is not None else None,
                              prompt_lengths=[len(r) for r in rows], finished=list(finished),
                              prefill_seconds=prefill_s, decode_seconds=decode_s, decode_steps=steps,
                              providers=session.get_providers())

    chunked = (pasts is None and first is later and len({len(r) for r in rows}) == 1
               and len(rows[0]) > PREFILL_CHUNK_TOKENS)
    with KVCache.for_model(session, len(rows), state.total_length + max_new_tokens,
                           **(cache_options or {})) as cache:
        for step in range(max_new_tokens):
            run = first if step == 0 else later
            t0 = time.perf_counter()
            try:
                if step == 0 and chunked:
                    bar = PrefillProgress(len(rows[0]), progress and stream is None)
                    try:
                        last = CacheStepper(run, meta).prefill(cache, np.array(rows, np.int64),
                                                               chunk_tokens=PREFILL_CHUNK_TOKENS,
                                                               progress=lambda done, total: bar(done))
                    finally:
                        bar.close()
                else:
                    feeds = dict(state.feeds(run), **{meta["cache_input"]: cache.handle})
                    if pasts is not None:
                        feeds.update(pasts.values)
                    # Every row's newest token in the last column (left padding, equal lengths, a
                    # decode step): the LM head runs on that column only where the model can.
                    last_only = state.padding_side == "left" or state.step > 0 or len(set(state.lengths)) == 1
                    if id(run) in keeps:
                        feeds[keeps[id(run)]] = np.array(1 if last_only else 0, dtype=np.int64)
                    outs = dict(zip([o.name for o in run.get_outputs()], run.run(None, feeds)))
                    if pasts is not None:
                        pasts.update(outs)
                    last = outs[logits_name][:, -1] if last_only else state.last_logits(outs[logits_name])
            except Exception as e:
                tick.close()
                raise GenerateError(f"generate: the run of step {step} failed after "
                                    f"{sum(map(len, generated))} generated token(s): {e}",
                                    partial_result()) from e
            dt = time.perf_counter() - t0
            if step == 0:
                prefill_s = dt
            else:
                decode_s += dt
                steps += 1
            nxt = sample_next(last, temperature=temperature, top_k=top_k, top_p=top_p, rng=rng)
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
