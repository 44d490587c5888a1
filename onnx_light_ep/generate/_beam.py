"""Beam search on one paged ``KVCache``: prefill once, ``fork`` into the beams, ``reorder`` each step.

Semantics: those of Hugging Face transformers 5.x ``generate(num_beams=N,
do_sample=False)`` (``GenerationMixin._beam_search`` and its helpers in
``transformers/generation/utils.py``), for a decoder-only model:

- scores are sums of ``log_softmax`` of the float32 logits (accumulated here in
  float64); before the first step only beam 0 is live (the others start at
  -1e9, so the first candidates all extend the prompt once);
- each step takes the top ``K = max(2, 1 + len(eos_token_ids)) * N``
  candidates over (beam, vocab) by accumulated score;
- a candidate "hits a stopping criterion" when its token is an end-of-sequence
  id or when it reaches ``max_new_tokens`` generated tokens; among the first
  ``N`` of the ``K`` candidates (by rank) those that hit become finished
  hypotheses with score ``sum_logprobs / generated_length ** length_penalty``,
  where ``generated_length`` counts the new tokens *including* the EOS token
  (``cur_len + 1 - decoder_prompt_len`` in transformers); the best ``N``
  finished hypotheses are kept;
- the ``N`` best candidates that did not hit continue (the beams of the next
  step, ranked by score);
- stopping: after ``max_new_tokens`` tokens; with ``early_stopping=True`` as
  soon as ``N`` hypotheses are finished; otherwise when ``N`` are finished and
  the best running beam's score divided by ``L ** length_penalty`` is not above
  the worst finished score, where ``L`` is the current generated length
  (``early_stopping=False``, transformers' heuristic, also used by ``True``) or
  ``max_new_tokens`` (``early_stopping="never"`` with ``length_penalty > 0``);
  once that test has said "no improvement" no hypothesis is added any more;
- the result is the finished hypotheses by score, best first
  (``sequences_scores`` are their scores).

Cache use: the prompt runs once through a batch-1 cache
(:class:`~onnx_light_ep.generate.CacheStepper`), ``cache.fork([0] * N)``
expands it into ``N`` beams sharing its pages (the batch-1 cache is closed),
and each step runs the ``N`` beams' new tokens as one batch-``N`` run after
``cache.reorder(parent_beams)``. No past is gathered: a reorder permutes page
tables, and the only rows copied are those of tail pages two beams share when
one of them writes (copy-on-write, ``stats()["bytes_copied"]``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import numpy as np

from ._prepare import Prepared
from ._progress import Progress
from ._result import GenerateError, GenerateResult
from ._stepper import CacheStepper

__all__ = ["BeamHypothesis", "BeamSearch", "check_beam_arguments", "log_softmax", "run_beam"]

NEG = -1.0e9  # transformers' score of a beam that must not be chosen


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 ``log_softmax`` over the last axis of float logits ``[..., vocab]``."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def check_beam_arguments(num_beams, length_penalty, early_stopping, num_return_sequences, *,
                         temperature: float = 0.0, stream=None, where: str = "generate") -> bool:
    """Validate the beam-search arguments of ``generate``; True when beam search is asked for (``num_beams >= 2``).

    Raises:
        ValueError: naming the argument and the expected value: ``num_beams`` not an
            int >= 1; ``length_penalty`` not a finite number; ``early_stopping`` not
            True/False/"never"; ``num_return_sequences`` not an int in
            ``[1, num_beams]``; ``temperature > 0`` or a ``stream`` callback with
            ``num_beams >= 2`` (beam search here is deterministic and picks its
            sequence only at the end).
    """
    for name, value in (("num_beams", num_beams), ("num_return_sequences", num_return_sequences)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{where}: {name}; expected an integer >= 1, got {value!r}")
    if num_return_sequences > num_beams:
        raise ValueError(f"{where}: num_return_sequences; expected at most num_beams ({num_beams}), got "
                         f"{num_return_sequences}")
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, (int, float, np.floating)) \
            or not math.isfinite(length_penalty):
        raise ValueError(f"{where}: length_penalty; expected a finite number (1.0 = score / length), got "
                         f"{length_penalty!r}")
    if not (early_stopping is True or early_stopping is False or early_stopping == "never"):
        raise ValueError(f"{where}: early_stopping; expected True, False or 'never', got {early_stopping!r}")
    if num_beams < 2:
        return False
    if temperature > 0:
        raise ValueError(f"generate: temperature; beam search is greedy here: expected temperature 0 with "
                         f"num_beams={num_beams}, got {temperature}")
    if stream is not None:
        raise ValueError(f"generate: stream; beam search picks its sequence only at the end: expected "
                         f"stream=None with num_beams={num_beams}")
    return True


@dataclass
class BeamHypothesis:
    """A finished beam: generated ``token_ids`` (without the EOS token), whether it ended on an
    end-of-sequence id (``eos``), ``sum_logprobs`` (EOS token's included) and its ``score``
    (``sum_logprobs / generated_length ** length_penalty``, generated_length counting the EOS)."""

    token_ids: List[int]
    eos: bool
    sum_logprobs: float
    score: float


class BeamSearch:
    """The beam bookkeeping of one prompt, driven by the log-probabilities of each step (no model).

    Args:
        num_beams: ``N`` >= 1.
        eos_token_ids: end-of-sequence ids (their count sets ``K``, as in transformers).
        max_new_tokens: generated tokens at most (>= 1).
        length_penalty, early_stopping: as in :func:`onnx_light_ep.generate.generate`.

    Use: ``step(log_probs)`` with float ``[N, vocab]`` log-probabilities of each
    running beam's next token (the first call: the prompt's, any row count, row 0
    used); it returns True when the search is over; otherwise ``parent_beams``
    (int64 ``[N]``) and ``next_tokens`` (int64 ``[N]``) say which beam each new
    beam extends and with which token: reorder the cache by ``parent_beams``,
    run ``next_tokens`` and call ``step`` again. ``hypotheses`` are the finished
    ones, best first.
    """

    def __init__(self, num_beams: int, eos_token_ids: Sequence[int], max_new_tokens: int,
                 length_penalty: float = 1.0, early_stopping: Union[bool, str] = False):
        from ._prepare import check_eos, check_positive_int

        check_beam_arguments(num_beams, length_penalty, early_stopping, 1, where="BeamSearch")
        self.num_beams = int(num_beams)
        self.eos = frozenset(check_eos(eos_token_ids, "BeamSearch") or ())
        self.max_new_tokens = check_positive_int(max_new_tokens, "BeamSearch", "max_new_tokens")
        self.vocab: Optional[int] = None  # set by the first step
        self.length_penalty = float(length_penalty)
        self.early_stopping = early_stopping
        self.beams_to_keep = max(2, 1 + len(self.eos)) * self.num_beams
        self.running_scores = np.full(self.num_beams, NEG)
        self.running_scores[0] = 0.0
        self.running_tokens: List[List[int]] = [[] for _ in range(self.num_beams)]
        self.hypotheses: List[BeamHypothesis] = []
        self.improvement_possible = True  # transformers' is_early_stop_heuristic_unsatisfied
        self.generated_length = 0
        self.parent_beams = np.zeros(self.num_beams, np.int64)
        self.next_tokens = np.zeros(self.num_beams, np.int64)
        self.done = False

    def _full(self) -> bool:
        return len(self.hypotheses) >= self.num_beams

    def step(self, log_probs: np.ndarray) -> bool:
        """Advance by one token (see the class docstring); returns True when the search is over."""
        if self.done:
            raise ValueError("BeamSearch.step: the search is over; expected no further step")
        n = self.num_beams
        lp = np.asarray(log_probs, dtype=np.float64)
        if self.generated_length == 0:
            if lp.ndim != 2 or lp.shape[0] < 1:
                raise ValueError(f"BeamSearch.step: log_probs; expected float [N or 1, vocab] at the first step, got "
                                 f"shape {list(lp.shape)}")
            lp = np.broadcast_to(lp[:1], (n, lp.shape[-1]))
        if lp.ndim != 2 or lp.shape[0] != n or (self.vocab is not None and lp.shape[1] != self.vocab):
            want = f"[{n}, {self.vocab}] (the first step's vocabulary)" if self.vocab is not None else f"[{n}, vocab]"
            raise ValueError(f"BeamSearch.step: log_probs; expected float {want}, got shape {list(lp.shape)}")
        if np.isnan(lp).any():   # a NaN would be ranked as a score; -inf (a masked token) is fine
            raise ValueError("BeamSearch.step: log_probs; expected no NaN (the model's logits hold NaN)")
        vocab = lp.shape[1]
        k = self.beams_to_keep
        if k > n * vocab:
            raise ValueError(f"BeamSearch.step: vocab; expected at least {k // n} tokens (the candidates kept per "
                             f"beam), got {vocab}")
        flat = (lp + self.running_scores[:, None]).reshape(-1)
        top = np.argpartition(-flat, k - 1)[:k] if k < flat.size else np.arange(flat.size)
        top = top[np.lexsort((top, -flat[top]))]  # by score, then (beam, token) order
        beam, token, score = top // vocab, top % vocab, flat[top]
        length = self.generated_length + 1
        hits = np.array([int(t) in self.eos for t in token]) | (length >= self.max_new_tokens)

        # finished hypotheses: only the first N candidates by rank may finish
        if self.improvement_possible and not (self._full() and self.early_stopping is True):
            denom = float(length) ** self.length_penalty
            for i in np.nonzero(hits[:n])[0]:
                t = int(token[i])
                ended = t in self.eos
                ids = self.running_tokens[beam[i]] + ([] if ended else [t])
                self.hypotheses.append(BeamHypothesis(ids, ended, float(score[i]), float(score[i]) / denom))
            self.hypotheses.sort(key=lambda h: -h.score)  # stable: earlier hypotheses first on a tie
            del self.hypotheses[n:]

        # running beams of the next step: the best N candidates that did not hit
        masked = score + np.where(hits, NEG, 0.0)
        keep = np.lexsort((np.arange(k), -masked))[:n]
        self.parent_beams = beam[keep].astype(np.int64)
        self.next_tokens = token[keep].astype(np.int64)
        self.running_tokens = [self.running_tokens[b] + [int(t)] for b, t in zip(self.parent_beams,
                                                                                  self.next_tokens)]
        self.running_scores = masked[keep]
        self.generated_length = length
        self.vocab = vocab

        # can a running beam still beat the worst finished one?
        if self.early_stopping == "never" and self.length_penalty > 0:
            best_length = self.max_new_tokens
        else:
            best_length = self.generated_length
        best_possible = self.running_scores[0] / float(best_length) ** self.length_penalty
        if self._full() and not best_possible > min(h.score for h in self.hypotheses):
            self.improvement_possible = False
        self.done = (not self.improvement_possible or (self._full() and self.early_stopping is True)
                     or bool(hits.all()))
        return self.done


def run_beam(prep: Prepared, *, num_beams: int, max_new_tokens: int, length_penalty: float = 1.0,
             early_stopping: Union[bool, str] = False, num_return_sequences: int = 1, progress: bool = False,
             cache_options: Optional[dict] = None) -> GenerateResult:
    """Beam search of each prompt row of :class:`Prepared` in turn (see the module docstring).

    Returns a :class:`GenerateResult` with ``num_return_sequences`` rows per
    prompt (best first): ``token_ids`` without the EOS token, ``finished`` True
    where the hypothesis ended on an EOS id, ``sequences_scores``,
    ``bytes_copied_per_step`` / ``committed_bytes_per_step`` (one entry per
    batch-N decode run, prompts in order), ``decode_rows = num_beams``.

    Raises:
        ValueError: the model keeps a past outside the cache (``CacheStepper``),
            or a vocabulary smaller than the candidates kept per beam.
        GenerateError: a run failed; ``partial`` holds the finished rows and, for
            the prompt that failed, its best running beam.
    """
    from .. import KVCache

    stepper = CacheStepper(prep.session, prep.meta, "generate")
    per_beam = max(2, 1 + len(prep.eos))
    if prep.vocab is not None and per_beam > prep.vocab:
        raise ValueError(f"generate: eos_token_ids; beam search keeps 1 + len(eos_token_ids) = {per_beam} candidates "
                         f"per beam: expected fewer than {prep.vocab} ids (the vocabulary)")
    tok = prep.tokenizer
    opts = dict(cache_options or {})
    out_ids: List[List[int]] = []
    out_finished: List[bool] = []
    out_scores: List[float] = []
    prompt_lengths: List[int] = []
    copied: List[int] = []
    committed: List[int] = []
    prefill_s = decode_s = 0.0
    steps = 0

    def result(extra=()):
        ids = out_ids + [list(e[0]) for e in extra]
        return GenerateResult(token_ids=ids, texts=[tok.decode(g) for g in ids] if tok is not None else None,
                              prompt_lengths=prompt_lengths + [e[1] for e in extra],
                              finished=out_finished + [False for _ in extra], prefill_seconds=prefill_s,
                              decode_seconds=decode_s, decode_steps=steps, providers=prep.session.get_providers(),
                              num_beams=num_beams, decode_rows=num_beams,
                              sequences_scores=out_scores + [float("nan") for _ in extra],
                              bytes_copied_per_step=list(copied), committed_bytes_per_step=list(committed))

    for row in prep.rows:
        search = BeamSearch(num_beams, sorted(prep.eos), max_new_tokens, length_penalty, early_stopping)
        tick = Progress(max_new_tokens, progress)
        try:
            with KVCache.for_model(prep.session, 1, len(row) + max_new_tokens, **opts) as first:
                t0 = time.perf_counter()
                logits = stepper.prefill(first, np.array([row], np.int64))
                prefill_s += time.perf_counter() - t0
                beams = first.fork([0] * num_beams)
            with beams:
                while not search.step(log_softmax(logits)):
                    tick(search.generated_length - 1)
                    before = beams.stats()["bytes_copied"]
                    t0 = time.perf_counter()
                    beams.reorder(search.parent_beams)
                    logits = stepper.run(beams, search.next_tokens[:, None])[:, -1]
                    decode_s += time.perf_counter() - t0
                    steps += 1
                    st = beams.stats()
                    copied.append(int(st["bytes_copied"] - before))
                    committed.append(int(st["committed_bytes"]))
        except (ValueError, GenerateError):
            tick.close()
            raise
        except Exception as e:
            tick.close()
            raise GenerateError(f"generate: beam search failed after {search.generated_length} step(s) of prompt "
                                f"{len(prompt_lengths) // num_return_sequences}: {e}",
                                result([(search.running_tokens[0], len(row))])) from e
        tick.close()
        for h in search.hypotheses[:num_return_sequences]:
            out_ids.append(list(h.token_ids))
            out_finished.append(h.eos)
            out_scores.append(h.score)
            prompt_lengths.append(len(row))
    return result()
