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

``num_beams >= 2`` selects beam search (``_beam``: transformers' semantics,
one prefill forked into the beams, ``reorder`` per step).

Modules: ``_prepare`` (arguments, model, tokenizer, session), ``_greedy``
(the padded batch loop), ``_beam`` (beam search), ``_stepper`` (runs of equal-length rows on one
cache, for the loops built on fork/reorder/truncate), ``_sampling``,
``_result``, ``_progress``; ``_prefix`` (:class:`PrefixCache`: K/V of prompt
prefixes reused across requests) and ``_prefix_loop`` (its batch-1 loop);
``_beam`` (beam search on fork + reorder); ``_speculative`` (greedy
speculative decoding: prompt-lookup or draft-model drafts verified in one run,
rolled back with ``KVCache.truncate``).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

from ._beam import BeamSearch, check_beam_arguments, run_beam
from ._greedy import run_batch
from ._prefix import PrefixCache, PrefixMatch
from ._prepare import CACHE_OPTIONS, check_cache_options, check_sampling, prepare
from ._result import GenerateError, GenerateResult
from ._sampling import sample_next
from ._speculative import SPECULATIVE_MODES, prompt_lookup_drafts
from ._stepper import CacheStepper

__all__ = ["BeamSearch", "CACHE_OPTIONS", "CacheStepper", "GenerateError", "GenerateResult", "PrefixCache",
           "PrefixMatch", "SPECULATIVE_MODES", "generate", "prompt_lookup_drafts", "sample_next"]


def generate(model, prompt: Union[str, Sequence[str], None] = None, *,
             prompt_ids: Optional[Sequence[Sequence[int]]] = None, chat: bool = False, max_new_tokens: int = 128,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = None,
             eos_token_ids: Optional[Sequence[int]] = None, tokenizer_dir: Optional[str] = None,
             stream: Optional[Callable[[str], None]] = None, progress: bool = False, session=None,
             threads: Optional[int] = None, provider_options=None,
             cache_options: Optional[dict] = None, prefix_cache: Optional[PrefixCache] = None,
             num_beams: int = 1, length_penalty: float = 1.0, early_stopping: Union[bool, str] = False,
             num_return_sequences: int = 1, speculative: Optional[str] = None, num_draft_tokens: int = 5,
             max_ngram_size: int = 3, draft_model=None, draft_session=None) -> GenerateResult:
    """Generate from a converted model (``onnx_light_ep.convert``) on the EP.

    Args:
        model: path of the converted model (an unconverted export is converted
            into a temporary file first), or a prefill/decode pair (a folder
            holding ``prefill.onnx`` and ``decode.onnx``, or the two paths): step
            0 runs the prefill graph, later steps the decode graph, one cache.
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
        prefix_cache: a :class:`PrefixCache`: the prompt (one; batch 1) reuses
            the K/V of its longest cached whole-block prefix, prefills the rest
            (``CacheStepper``, in runs with prefill progress) and leaves its new
            full blocks in the PrefixCache; ``GenerateResult.cached_tokens``
            says how many positions were reused. The tokens equal an uncached
            run's (the same arithmetic on the same K/V; logits may differ in
            the last bits, as a chunked prefill's do). ``cache_options`` must
            not name another pool or ``kv_quant``.
        num_beams: 1 = the greedy/sampled loop; ``N >= 2`` = beam search with
            transformers' ``generate(num_beams=N, do_sample=False)`` semantics
            (``onnx_light_ep.generate._beam``; greedy only: ``temperature`` must be 0,
            no ``stream``); each prompt is searched in turn on its own cache.
        length_penalty: beam search: a finished hypothesis scores
            ``sum_logprobs / generated_length ** length_penalty``.
        early_stopping: beam search: True (stop once ``num_beams`` hypotheses are
            finished), False (transformers' heuristic) or ``"never"``.
        num_return_sequences: beam search: the best hypotheses returned per prompt
            (1 <= n <= num_beams), as rows of the result.
        speculative: None (one token per run), ``"prompt-lookup"`` (n-gram
            drafts from the prompt and the generated tokens) or ``"draft"``
            (drafts from ``draft_model``): greedy speculative decoding, the
            drafts verified in one run of the target and the rejected ones
            truncated from its cache; the tokens are plain greedy decoding's
            (``_speculative``; docs/API.md "Speculative decoding"). Needs
            ``temperature == 0``; rows are decoded one after the other.
        num_draft_tokens: int >= 1, the most drafts per verification run (K).
        max_ngram_size: int >= 1, prompt-lookup: the longest suffix looked up.
        draft_model: ``speculative="draft"``: path of a converted model with
            the target's vocabulary (a smaller or quantized model); its cache
            shares the target cache's ``KVPool``.
        draft_session: an existing EP session of ``draft_model`` to reuse.

    Returns:
        :class:`GenerateResult`.

    Raises:
        ValueError: bad arguments, text without a tokenizer, or model inputs
            this loop cannot feed.
        GenerateError: a run failed after generation started (``partial``
            holds what was generated).
    """
    if stream is not None and not callable(stream):
        raise ValueError(f"generate: stream; expected a callable taking each new piece of text, or None, got "
                         f"{type(stream).__name__}")
    check_cache_options(cache_options)
    if prefix_cache is not None and not isinstance(prefix_cache, PrefixCache):
        raise ValueError(f"generate: prefix_cache; expected a PrefixCache or None, got {type(prefix_cache).__name__}")
    check_sampling(temperature, top_k, top_p, seed)
    # -- beam search (num_beams >= 2): onnx_light_ep.generate._beam --------------------------------
    beam = check_beam_arguments(num_beams, length_penalty, early_stopping, num_return_sequences,
                                temperature=temperature, stream=stream)
    if sum((prefix_cache is not None, bool(beam), speculative is not None)) > 1:
        raise ValueError("generate: prefix_cache, num_beams >= 2 and speculative; expected at most one of them "
                         "(each runs its own loop)")
    if beam:
        with prepare(model, prompt, prompt_ids=prompt_ids, chat=chat, max_new_tokens=max_new_tokens,
                     eos_token_ids=eos_token_ids, tokenizer_dir=tokenizer_dir, session=session, threads=threads,
                     provider_options=provider_options) as prep:
            return run_beam(prep, num_beams=num_beams, max_new_tokens=max_new_tokens,
                            length_penalty=length_penalty, early_stopping=early_stopping,
                            num_return_sequences=num_return_sequences, progress=progress,
                            cache_options=cache_options)
    # -- end of beam search ---------------------------------------------------------------------------
    # -- speculative decoding (_speculative) --
    if speculative is not None:
        return _generate_speculative(model, prompt, prompt_ids=prompt_ids, chat=chat, max_new_tokens=max_new_tokens,
                                     temperature=temperature, eos_token_ids=eos_token_ids,
                                     tokenizer_dir=tokenizer_dir, stream=stream, progress=progress, session=session,
                                     threads=threads, provider_options=provider_options,
                                     cache_options=cache_options, speculative=speculative,
                                     num_draft_tokens=num_draft_tokens, max_ngram_size=max_ngram_size,
                                     draft_model=draft_model, draft_session=draft_session)
    with prepare(model, prompt, prompt_ids=prompt_ids, chat=chat, max_new_tokens=max_new_tokens,
                 eos_token_ids=eos_token_ids, tokenizer_dir=tokenizer_dir, session=session, threads=threads,
                 provider_options=provider_options) as prep:
        if prefix_cache is not None:  # prefix caching across requests: _prefix, _prefix_loop
            from ._prefix_loop import run_prefixed

            return run_prefixed(prep, prefix_cache, model=model, max_new_tokens=max_new_tokens,
                                temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stream=stream,
                                progress=progress, cache_options=cache_options)
        return run_batch(prep, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                         seed=seed, stream=stream, progress=progress, cache_options=cache_options)


def _generate_speculative(model, prompt, *, prompt_ids, chat, max_new_tokens, temperature, eos_token_ids,
                          tokenizer_dir, stream, progress, session, threads, provider_options, cache_options,
                          speculative, num_draft_tokens, max_ngram_size, draft_model,
                          draft_session) -> GenerateResult:
    """``generate(speculative=...)``: check, prepare the target (and the draft model), run ``_speculative``."""
    from ._speculative import check_draft_vocab, check_speculative, run_speculative

    check_speculative(speculative, num_draft_tokens=num_draft_tokens, max_ngram_size=max_ngram_size,
                      draft_model=draft_model, temperature=temperature, draft_session=draft_session)
    with prepare(model, prompt, prompt_ids=prompt_ids, chat=chat, max_new_tokens=max_new_tokens,
                 eos_token_ids=eos_token_ids, tokenizer_dir=tokenizer_dir, session=session, threads=threads,
                 provider_options=provider_options) as prep:
        if draft_model is None:
            return run_speculative(prep, speculative=speculative, num_draft_tokens=num_draft_tokens,
                                   max_ngram_size=max_ngram_size, max_new_tokens=max_new_tokens, stream=stream,
                                   progress=progress, cache_options=cache_options)
        longest = max(len(r) for r in prep.rows)
        try:  # placeholder ids of the longest row's length: positions are checked here, the vocabulary below
            draft = prepare(draft_model, prompt_ids=[[0] * longest], max_new_tokens=max_new_tokens,
                            session=draft_session, threads=threads, provider_options=provider_options)
        except (ValueError, FileNotFoundError) as e:
            raise type(e)(f"generate: draft_model: {str(e).removeprefix('generate: ')}") from e
        with draft:
            check_draft_vocab(prep, draft)
            return run_speculative(prep, speculative=speculative, num_draft_tokens=num_draft_tokens,
                                   max_ngram_size=max_ngram_size, draft=draft, max_new_tokens=max_new_tokens,
                                   stream=stream, progress=progress, cache_options=cache_options)
