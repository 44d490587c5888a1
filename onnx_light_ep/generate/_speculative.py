"""Speculative decoding on the paged ``KVCache``: drafts verified in one run, rejected drafts truncated.

Greedy only. Each step appends the last accepted token and ``k <= K`` draft
tokens to the target's cache in ONE run (``CacheStepper.run``, ``S = k + 1``
query rows), takes the target's argmax at every row, accepts the longest
prefix of drafts equal to those argmaxes, adds the target's own next token
(the argmax after the last accepted draft) and drops the rejected drafts'
positions with ``KVCache.truncate`` (whole pages released, nothing copied).
The tokens are those plain greedy decoding gives: every emitted token is the
target's argmax after exactly the tokens before it (up to the arithmetic of a
``k + 1``-row run against a one-row run; see docs/API.md).

Drafts come from:

- ``"prompt-lookup"``: :func:`prompt_lookup_drafts`, n-gram lookup in the
  prompt and the tokens generated so far, as transformers'
  ``PromptLookupCandidateGenerator`` defines it;
- ``"draft"``: a second converted model with the target's vocabulary
  (:class:`DraftModelProposer`), greedy on its own cache in the same
  ``KVPool`` as the target's; after each verification its cache is truncated
  to the accepted tokens it holds, and the next proposal first feeds it the
  accepted tokens it lacks (one run).

Rows of a batch are decoded one after the other, each on its own cache.
Limits kept exactly: a step drafts at most ``max_new_tokens - generated - 1``
tokens, so a row never gets more than ``max_new_tokens`` tokens and its
cache never holds more than ``prompt + max_new_tokens - 1`` positions (what
plain greedy decoding holds): the drafts need no positions beyond those
``prepare`` checks against the model's ``max_position``.
"""

from __future__ import annotations

import time
from typing import Callable, List, Optional, Sequence, Set

import numpy as np

from ._prepare import Prepared
from ._progress import Progress
from ._result import GenerateError, GenerateResult
from ._stepper import CacheStepper

__all__ = ["SPECULATIVE_MODES", "DraftModelProposer", "check_speculative", "check_draft_vocab",
           "prompt_lookup_drafts", "run_speculative"]

SPECULATIVE_MODES = ("prompt-lookup", "draft")


def check_speculative(speculative: str, *, num_draft_tokens: int, max_ngram_size: int, draft_model,
                      temperature: float, draft_session=None) -> None:
    """Validate the speculative-decoding arguments of ``generate`` (``ValueError`` naming the argument)."""
    if speculative not in SPECULATIVE_MODES:
        raise ValueError(f"generate: speculative; expected one of {', '.join(map(repr, SPECULATIVE_MODES))} or "
                         f"None, got {speculative!r}")
    if temperature > 0:
        raise ValueError(f"generate: temperature; speculative decoding is greedy only: expected 0, got {temperature}")
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, (int, np.integer)) \
            or num_draft_tokens < 1:
        raise ValueError(f"generate: num_draft_tokens; expected an int >= 1, got {num_draft_tokens!r}")
    if isinstance(max_ngram_size, bool) or not isinstance(max_ngram_size, (int, np.integer)) or max_ngram_size < 1:
        raise ValueError(f"generate: max_ngram_size; expected an int >= 1, got {max_ngram_size!r}")
    if speculative == "draft" and draft_model is None:
        raise ValueError("generate: draft_model; expected the path of a converted draft model with "
                         "speculative='draft', got None")
    if speculative != "draft" and draft_model is not None:
        raise ValueError(f"generate: draft_model; only used with speculative='draft', got it with "
                         f"speculative={speculative!r}")
    if draft_session is not None and draft_model is None:
        raise ValueError("generate: draft_session; expected it with draft_model (the session's model file), "
                         "got it without")


def prompt_lookup_drafts(ids: Sequence[int], num_draft_tokens: int, max_ngram_size: int = 3,
                         eos_token_ids: Sequence[int] = ()) -> List[int]:
    """Draft tokens by n-gram lookup in ``ids`` (prompt + generated tokens).

    Semantics of transformers' ``PromptLookupCandidateGenerator.get_candidates``
    (batch 1, no logits processor): for ``n`` from ``min(max_ngram_size,
    len(ids) - 1)`` down to 1, find the windows of ``ids`` equal to its last
    ``n`` tokens, left to right; the first whose following tokens are not
    empty gives up to ``num_draft_tokens`` of them, cut before the first
    end-of-sequence id (which may leave none; the search stops there). No
    match: no drafts.

    Args:
        ids: int token ids, oldest first.
        num_draft_tokens: int >= 1, the most drafts returned.
        max_ngram_size: int >= 1, the longest suffix looked up.
        eos_token_ids: ids a draft run stops before.

    Returns:
        list of int, ``0 <= len <= num_draft_tokens``.
    """
    from ._prepare import _is_int, check_eos, check_positive_int

    where = "prompt_lookup_drafts"
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise ValueError(f"{where}: ids; expected a sequence of integer token ids, got a {type(ids).__name__}")
    ids = list(ids)
    bad = next((t for t in ids if not _is_int(t)), None)
    if bad is not None:
        raise ValueError(f"{where}: ids; expected a sequence of integer token ids, got {bad!r}")
    num_draft_tokens = check_positive_int(num_draft_tokens, where, "num_draft_tokens")
    max_ngram_size = check_positive_int(max_ngram_size, where, "max_ngram_size")
    eos_token_ids = check_eos(eos_token_ids, where) or set()
    seq = np.asarray(ids, dtype=np.int64)
    n_ids = seq.size
    for n in range(min(int(max_ngram_size), n_ids - 1), 0, -1):
        windows = np.lib.stride_tricks.sliding_window_view(seq, n)
        for idx in np.flatnonzero((windows == seq[n_ids - n:]).all(axis=1)):
            start = int(idx) + n
            end = min(start + int(num_draft_tokens), n_ids)
            if start < end:
                out = seq[start:end].tolist()
                cut = next((i for i, t in enumerate(out) if t in eos_token_ids), None)
                return out if cut is None else out[:cut]
    return []


def check_draft_vocab(target: Prepared, draft: Prepared) -> None:
    """``ValueError`` unless the draft model's vocabulary is the target's (logits width and tokenizer size)."""
    if target.vocab is not None and draft.vocab is not None and target.vocab != draft.vocab:
        raise ValueError(f"generate: draft_model; expected a model with the target's vocabulary ({target.vocab} "
                         f"logits), got {draft.vocab} logits ({draft.path})")
    ts, ds = (p.tokenizer.vocab_size() if p.tokenizer is not None else None for p in (target, draft))
    if ts is not None and ds is not None and ts != ds:
        raise ValueError(f"generate: draft_model; expected the target's tokenizer ({ts} tokens), got a tokenizer "
                         f"of {ds} tokens next to {draft.path}")


class DraftModelProposer:
    """Greedy drafts from a second model on its own cache, kept a prefix of the accepted tokens.

    Args:
        stepper: :class:`CacheStepper` of the draft model's session.
        cache: the draft's ``KVCache`` (batch 1).
        eos: end-of-sequence ids (drafting stops after one).

    ``propose(context, k)`` feeds the accepted tokens the cache lacks
    (``context[len:]``, one run), then drafts one token per run; ``accept(n)``
    truncates the cache to at most ``n`` positions (the accepted length), so
    it never holds a rejected draft.
    """

    def __init__(self, stepper: CacheStepper, cache, eos: Set[int]):
        self.stepper, self.cache, self.eos = stepper, cache, eos

    def length(self) -> int:
        return int(self.cache.seq_lens[0])

    def propose(self, context: Sequence[int], k: int) -> List[int]:
        missing = list(context[self.length():])  # >= 1 token: the cache is a prefix of context[:-1]
        logits = self.stepper.run(self.cache, np.array([missing], dtype=np.int64), logits_to_keep=1)[0, -1]
        drafts = [int(logits.argmax())]
        while len(drafts) < k and drafts[-1] not in self.eos:
            logits = self.stepper.run(self.cache, np.array([[drafts[-1]]], dtype=np.int64))[0, -1]
            drafts.append(int(logits.argmax()))
        return drafts

    def accept(self, accepted_length: int) -> None:
        if self.length() > accepted_length:
            self.cache.truncate(accepted_length)


def _cache_options(cache_options: Optional[dict], num_draft_tokens: int, max_new_tokens: int) -> dict:
    """The run's cache options; sliding-window layers keep the positions a step may truncate back over.

    A step drafts at most ``min(num_draft_tokens, max_new_tokens - 2)`` tokens (see the module docstring),
    so that many positions are kept, never more than the cache's length (``KVCache`` refuses more).
    """
    opts = dict(cache_options or {})
    drops = min(int(num_draft_tokens), max(int(max_new_tokens) - 2, 0))
    opts["rollback_tokens"] = max(int(opts.get("rollback_tokens") or 0), drops)
    return opts


def run_speculative(prep: Prepared, *, speculative: str, num_draft_tokens: int, max_ngram_size: int = 3,
                    draft: Optional[Prepared] = None, max_new_tokens: int,
                    stream: Optional[Callable[[str], None]] = None, progress: bool = False,
                    cache_options: Optional[dict] = None) -> GenerateResult:
    """Greedy speculative decoding of every :class:`Prepared` row (see the module docstring and ``generate``).

    ``draft``: the draft model's :class:`Prepared` (``speculative="draft"``).
    Returns a :class:`GenerateResult` with ``draft_tokens`` (drafts verified),
    ``accepted_tokens`` (drafts accepted) and ``decode_tokens`` (tokens the
    verification runs gave) set; ``decode_steps`` counts verification runs
    and ``decode_seconds`` includes the draft model's runs.
    """
    from .. import KVCache, KVPool

    session, tok, eos = prep.session, prep.tokenizer, prep.eos
    where = f"generate (speculative={speculative!r})"
    stepper = CacheStepper(session, prep.meta, where)
    dstepper = CacheStepper(draft.session, draft.meta, where + " draft_model") if draft is not None else None
    opts = _cache_options(cache_options, num_draft_tokens, max_new_tokens)
    own_pool = None
    if draft is not None and opts.get("pool") is None:
        own_pool = opts["pool"] = KVPool()
    generated: List[List[int]] = [[] for _ in prep.rows]
    finished = [False] * len(prep.rows)
    prefill_s = decode_s = 0.0
    steps = drafted = accepted = decode_tokens = 0
    shown = ""

    def result():
        return GenerateResult(token_ids=[list(g) for g in generated],
                              texts=[tok.decode(g) for g in generated] if tok is not None else None,
                              prompt_lengths=[len(r) for r in prep.rows], finished=list(finished),
                              prefill_seconds=prefill_s, decode_seconds=decode_s, decode_steps=steps,
                              providers=session.get_providers(), draft_tokens=drafted, accepted_tokens=accepted,
                              decode_tokens=decode_tokens)

    def emit(b: int, tokens) -> bool:
        """Append ``tokens`` to row ``b`` up to an end-of-sequence id; True when the row is done."""
        nonlocal shown
        for t in tokens:
            if int(t) in eos:
                finished[b] = True
                break
            generated[b].append(int(t))
            tick(len(generated[b]) - 1)
        if b == 0 and stream is not None and tok is not None:
            text = tok.decode(generated[0])
            if text.startswith(shown) and len(text) > len(shown) and not text.endswith("\ufffd"):
                stream(text[len(shown):])
                shown = text
        return finished[b] or len(generated[b]) >= max_new_tokens

    try:
        for b, row in enumerate(prep.rows):
            tick = Progress(max_new_tokens, progress and stream is None and b == 0)
            length = len(row) + max_new_tokens
            ids = np.array([row], dtype=np.int64)
            with KVCache.for_model(session, 1, length, **opts) as cache, \
                    (KVCache.for_model(draft.session, 1, length, **opts) if draft is not None
                     else _NoCache()) as dcache:
                proposer = DraftModelProposer(dstepper, dcache, eos) if draft is not None else None
                t0 = time.perf_counter()
                try:
                    logits = stepper.prefill(cache, ids)
                    if proposer is not None:
                        dlogits = dstepper.prefill(dcache, ids)
                except Exception as e:
                    tick.close()
                    raise _failure(where, "prefill", generated, result, e) from e
                if proposer is not None and dlogits.shape[-1] != logits.shape[-1]:
                    tick.close()
                    raise ValueError(f"generate: draft_model; expected a model with the target's vocabulary "
                                     f"({logits.shape[-1]} logits), got {dlogits.shape[-1]} logits ({draft.path})")
                prefill_s += time.perf_counter() - t0
                done = emit(b, [int(logits[0].argmax())])
                while not done:
                    gen = generated[b]
                    past = len(row) + len(gen) - 1          # the cache holds the prompt and gen[:-1]
                    k = min(num_draft_tokens, max_new_tokens - len(gen) - 1)
                    t0 = time.perf_counter()
                    try:
                        if k == 0:
                            drafts = []
                        elif proposer is None:
                            drafts = prompt_lookup_drafts(row + gen, k, max_ngram_size, eos)
                        else:
                            drafts = proposer.propose(row + gen, k)
                        logits = stepper.run(cache, np.array([[gen[-1]] + drafts], dtype=np.int64))[0]
                        preds = logits.argmax(-1)
                        a = 0
                        while a < len(drafts) and drafts[a] == int(preds[a]):
                            a += 1
                        cache.truncate(past + 1 + a)
                        if proposer is not None:
                            proposer.accept(past + 1 + a)
                    except Exception as e:
                        tick.close()
                        raise _failure(where, f"step {steps + 1}", generated, result, e) from e
                    decode_s += time.perf_counter() - t0
                    steps += 1
                    drafted += len(drafts)
                    accepted += a
                    before = len(gen)
                    done = emit(b, preds[:a + 1])
                    decode_tokens += len(generated[b]) - before
            tick.close()
    finally:
        if own_pool is not None:
            own_pool.close()
    res = result()
    if stream is not None and res.texts and res.texts[0].startswith(shown) and len(res.texts[0]) > len(shown):
        stream(res.texts[0][len(shown):])
    return res


class _NoCache:
    """Stands in for the draft cache in prompt-lookup mode."""

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def _failure(where: str, what: str, generated, result, e: Exception) -> GenerateError:
    return GenerateError(f"{where}: the run of {what} failed after {sum(map(len, generated))} generated token(s): "
                         f"{e}", result())
