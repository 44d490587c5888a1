"""Property tests (hypothesis, derandomized: the same examples every run) of the loops built on CacheStepper,
each against an independent reference on random mini decoders (2 GQA layers, rotary, vocab 50, 64 positions,
three weight seeds):

- beam search == the numpy transformers beam search on plain ORT with gathered pasts (beam_reference.py),
  random num_beams / prompts / EOS sets / max_new_tokens / length_penalty / early_stopping; the token ids
  identical, the scores within the bound test_beam.py derives (2 * 1e-5 * L / L ** length_penalty, fp32);
- speculative decoding (prompt lookup, or another seed's model / the target itself as the draft) == plain
  greedy decoding, random K (up to beyond max_new_tokens), n-gram sizes, EOS sets, page sizes, and a windowed
  model (window 8): the token ids and finished flags identical;
- chat turns == greedy decoding after one prefill of the whole conversation (random kept prefixes);
- PrefixCache requests == uncached runs over random prompt sets sharing random prefixes, random block sizes,
  page sizes, max_bytes budgets and pool limits, two models on one PrefixCache; afterwards the pool holds no
  page and no cache (live_bytes 0, num_caches 0): nothing leaks.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rw_graphs as G
import rw_harness as H
from beam_reference import GatheredPastModel, reference_beam_search
from onnx_light_ep import KVPool
from onnx_light_ep.generate import PrefixCache, generate
from onnx_light_ep.rewrite import convert

MS = (("", 21), ("com.microsoft", 1))
ATOL_LOGITS = 1e-5
SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``{key: (original, converted)}``: seeds 0-2, and "w" (seed 5, window 8)."""
    out = {}
    for key, kw in [(0, {}), (1, {}), (2, {}), ("w", dict(window=8))]:
        folder = tmp_path_factory.mktemp(f"m{key}")
        seed = 5 if key == "w" else key
        src = H.save(G.decoder(G.gqa_block, layers=2, opsets=MS, seed=seed, do_rotary=True, d=16, **kw),
                     folder / "m.onnx")
        dst = str(folder / "m.light.onnx")
        convert(src, dst)
        out[key] = (src, dst)
    return out


ids = st.integers(0, 49)


@settings(max_examples=80, **SETTINGS)
@given(seed=st.sampled_from([0, 1, 2]), n=st.integers(2, 5),
       prompt=st.lists(ids, min_size=1, max_size=20), eos=st.lists(ids, max_size=3, unique=True),
       max_new=st.integers(1, 12), lp=st.sampled_from([1.0, 0.0, 0.5, 2.0, -1.0]),
       es=st.sampled_from([False, True, "never"]))
def test_beam_search_equals_the_reference(models, seed, n, prompt, eos, max_new, lp, es):
    src, dst = models[seed]
    want, runs = reference_beam_search(GatheredPastModel(src), prompt, n, eos, max_new, lp, es)
    got = generate(dst, prompt_ids=[prompt], num_beams=n, num_return_sequences=n, max_new_tokens=max_new,
                   eos_token_ids=eos, length_penalty=lp, early_stopping=es, threads=1)
    assert list(zip(got.token_ids, got.finished)) == [(w[0], w[1]) for w in want]
    for g, f, s, w in zip(got.token_ids, got.finished, got.sequences_scores, want):
        length = len(g) + f
        assert abs(s - w[2]) <= 2 * ATOL_LOGITS * length / float(length) ** lp, (s, w[2])
    assert got.decode_steps == runs


@settings(max_examples=120, **SETTINGS)
@given(seed=st.sampled_from([0, 1, 2, "w"]), draft=st.sampled_from([None, "self", 0, 1]),
       prompt=st.lists(ids, min_size=1, max_size=20), repeat=st.integers(1, 3),
       eos=st.lists(ids, max_size=4, unique=True), max_new=st.integers(1, 40), k=st.integers(1, 45),
       ngram=st.integers(1, 5), page=st.sampled_from([None, 32, 64]))
def test_speculative_decoding_equals_greedy(models, seed, draft, prompt, repeat, eos, max_new, k, ngram, page):
    """Repeated prompts give prompt lookup drafts that are accepted; K up to beyond max_new_tokens."""
    _, dst = models[seed]
    prompt = (prompt * repeat)[:60]
    max_new = min(max_new, 64 - len(prompt))
    opts = {"page_tokens": page} if page else None
    want = generate(dst, prompt_ids=[prompt], max_new_tokens=max_new, eos_token_ids=eos, threads=1,
                    cache_options=opts)
    if draft is None:
        kw = dict(speculative="prompt-lookup", max_ngram_size=ngram)
    else:
        kw = dict(speculative="draft", draft_model=dst if draft == "self" else models[draft][1])
    got = generate(dst, prompt_ids=[prompt], max_new_tokens=max_new, eos_token_ids=eos, threads=1,
                   num_draft_tokens=k, cache_options=opts, **kw)
    assert (got.token_ids, got.finished) == (want.token_ids, want.finished)
    assert 0 <= got.accepted_tokens <= got.draft_tokens
    if draft == "self":
        assert got.accepted_tokens == got.draft_tokens


@settings(max_examples=50, **SETTINGS)
@given(data=st.data(), block=st.sampled_from([None, 32, 64]), page=st.sampled_from([None, 32, 64]),
       budget=st.sampled_from([None, 1, 300_000, 600_000, 2_000_000]),
       limit=st.sampled_from([0, 3 << 20, 6 << 20]), requests=st.integers(1, 8),
       eos=st.lists(ids, max_size=2, unique=True))
def test_prefix_cache_requests_equal_uncached_runs_and_leak_nothing(models, data, block, page, budget, limit,
                                                                     requests, eos):
    heads = data.draw(st.lists(st.lists(ids, max_size=50), min_size=1, max_size=3))
    pool = KVPool(memory_limit_bytes=limit) if limit else KVPool()
    opts = {"page_tokens": page} if page else None
    with PrefixCache(pool, block_tokens=block, max_bytes=budget) as pc:
        for _ in range(requests):
            head = data.draw(st.sampled_from(heads))
            prompt = (head + data.draw(st.lists(ids, min_size=0 if head else 1, max_size=20)))[:60]
            max_new = data.draw(st.integers(1, 64 - len(prompt)))
            dst = models[data.draw(st.sampled_from([0, 1]))][1]
            got = generate(dst, prompt_ids=[prompt], max_new_tokens=max_new, eos_token_ids=eos, threads=1,
                           prefix_cache=pc, cache_options=opts)
            want = generate(dst, prompt_ids=[prompt], max_new_tokens=max_new, eos_token_ids=eos, threads=1,
                            cache_options=opts)
            assert (got.token_ids, got.finished) == (want.token_ids, want.finished)
            assert 0 <= got.cached_tokens < len(prompt)
            stats = pc.stats()
            assert budget is None or stats["bytes"] <= budget, stats
    assert pool.stats()["live_bytes"] == 0 and pool.stats()["num_caches"] == 0, pool.stats()
    pool.close()


@settings(max_examples=60, **SETTINGS)
@given(data=st.data(), eos=st.lists(ids, max_size=3, unique=True), turns=st.integers(1, 6))
def test_chat_turns_equal_one_prefill_of_the_whole_conversation(models, data, eos, turns):
    """Each turn keeps a random prefix of what the cache holds and appends random ids (a re-rendered
    conversation truncates the cache): the answer is greedy decoding after one prefill of the whole
    conversation, and the cache holds exactly token_ids afterwards (or, past the positions, nothing changed)."""
    from onnx_light_ep.chat import ChatPositionLimitError, ChatSession

    dst = models[0][1]
    with ChatSession(dst, max_new_tokens=6, eos_token_ids=eos, threads=1) as chat:
        for _ in range(turns):
            held = chat.token_ids
            keep = data.draw(st.integers(0, len(held)))
            conversation = held[:keep] + data.draw(st.lists(ids, min_size=0 if keep else 1, max_size=10))
            max_new = data.draw(st.integers(1, 8))
            if len(conversation) >= 64:
                with pytest.raises(ChatPositionLimitError):
                    chat.send_ids(conversation, max_new_tokens=max_new)
                assert chat.token_ids == held
                continue
            turn = chat.send_ids(conversation, max_new_tokens=max_new)
            want = generate(dst, prompt_ids=[conversation], max_new_tokens=min(max_new, 64 - len(conversation)),
                            eos_token_ids=eos, threads=1)
            assert turn.token_ids == want.token_ids[0]
            assert chat.token_ids == conversation + turn.token_ids
            assert chat.cache.seq_lens.tolist() == [len(chat.token_ids)]
