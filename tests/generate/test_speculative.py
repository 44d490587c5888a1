"""Speculative decoding (generate(speculative=...)) on the mini decoders: the tokens of plain greedy decoding.

The mini decoders have random weights; over 100+ tokens their greedy output falls into short cycles, which
prompt lookup then drafts correctly, so these runs accept drafts as well as reject them (checked per test).
"""
import numpy as np
import pytest

import rw_graphs as G
from onnx_light_ep import InferenceSession, KVCache, KVPool
from onnx_light_ep.generate import GenerateError, generate, prompt_lookup_drafts
from onnx_light_ep.generate._speculative import DraftModelProposer
from onnx_light_ep.generate._stepper import CacheStepper
from onnx_light_ep.rewrite import read_metadata

ATOL = 1e-5  # fp32 K/V rows of the mini decoder (|x| < 10) computed in runs of other lengths


def _prompts(n, seed=0, length=8):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 50, length).tolist() for _ in range(n)]


class _Recording:
    """An EP session that records each run's ``total_sequence_length`` (and a pool's cache count), or fails one run."""

    def __init__(self, path, pool=None, fail_at=None):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.log_severity_level = 3
        self._s, self.pool, self.fail_at = InferenceSession(path, so), pool, fail_at
        self.totals, self.caches = [], []

    def __getattr__(self, name):
        return getattr(self._s, name)

    def run(self, names, feeds, *a, **kw):
        self.totals.append(int(feeds["attention_mask"].shape[1]))
        if self.pool is not None:
            self.caches.append(self.pool.stats()["num_caches"])
        if self.fail_at is not None and len(self.totals) == self.fail_at:
            raise RuntimeError("injected failure")
        return self._s.run(names, feeds, *a, **kw)


def _perturbed_draft(src, tmp_path, scale=0.3, seed=7):
    """A draft of other weights: the target's weight matrices plus Gaussian noise of ``scale`` times their RMS, so
    its greedy tokens agree with the target's often, not always. Returns the converted draft's path."""
    import onnx
    from onnx import numpy_helper

    from onnx_light_ep.rewrite import convert

    model = onnx.load(src)
    rng = np.random.default_rng(seed)
    for i, init in enumerate(model.graph.initializer):
        w = numpy_helper.to_array(init)
        if w.dtype == np.float32 and w.ndim == 2 and "cache" not in init.name:
            w = w + rng.standard_normal(w.shape).astype(np.float32) * scale * np.sqrt(np.mean(w * w))
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(w, init.name))
    path = str(tmp_path / "draft.onnx")
    onnx.save(model, path)
    convert(path, str(tmp_path / "draft.light.onnx"))
    return str(tmp_path / "draft.light.onnx")


def test_prompt_lookup_drafts_match_transformers():
    """The n-gram lookup gives transformers' PromptLookupCandidateGenerator candidates (batch 1)."""
    import torch
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    rng = np.random.default_rng(1)
    cases = 0
    for trial in range(400):
        n_ids = int(rng.integers(1, 40))
        ids = rng.integers(0, int(rng.integers(2, 12)), n_ids).tolist()  # small alphabets: many repeats
        k, ngram = int(rng.integers(1, 8)), int(rng.integers(1, 5))
        eos = [int(rng.integers(0, 12))] if trial % 3 == 0 else []
        ref = PromptLookupCandidateGenerator(eos_token_id=torch.tensor(eos) if eos else None, num_output_tokens=k,
                                             max_matching_ngram_size=ngram, max_length=10_000)
        cand, _ = ref.get_candidates(torch.tensor([ids]))
        want = cand[0, n_ids:].tolist()
        assert prompt_lookup_drafts(ids, k, ngram, eos) == want, (ids, k, ngram, eos)
        cases += bool(want)
    assert cases > 100  # most cases draft something


@pytest.mark.parametrize("k", [1, 3, 5])
def test_prompt_lookup_gives_the_greedy_tokens(mini_decoder, k):
    _, dst = mini_decoder()
    accepted = rejected = 0
    for p in _prompts(10, seed=k):
        want = generate(dst, prompt_ids=[p], max_new_tokens=120)
        got = generate(dst, prompt_ids=[p], max_new_tokens=120, speculative="prompt-lookup", num_draft_tokens=k)
        assert got.token_ids == want.token_ids and got.finished == want.finished
        assert got.decode_tokens == len(got.token_ids[0]) - 1 and got.decode_steps <= got.decode_tokens
        assert 0 <= got.accepted_tokens <= got.draft_tokens <= k * got.decode_steps
        assert got.decode_tokens == got.decode_steps + got.accepted_tokens   # each run: 1 + its accepted drafts
        accepted += got.accepted_tokens
        rejected += got.draft_tokens - got.accepted_tokens
    assert accepted > 100 and rejected > 0


@pytest.mark.parametrize("k", [1, 3, 5])
def test_draft_model_of_other_weights_gives_the_target_greedy_tokens(mini_decoder, tmp_path, k):
    src, dst = mini_decoder()
    drf = _perturbed_draft(src, tmp_path)
    accepted = rejected = 0
    for p in _prompts(6, seed=10 + k):
        want = generate(dst, prompt_ids=[p], max_new_tokens=100)
        got = generate(dst, prompt_ids=[p], max_new_tokens=100, speculative="draft", draft_model=drf,
                       num_draft_tokens=k)
        assert got.token_ids == want.token_ids and got.finished == want.finished
        assert got.decode_tokens == got.decode_steps + got.accepted_tokens
        accepted += got.accepted_tokens
        rejected += got.draft_tokens - got.accepted_tokens
    assert accepted > 0 and rejected > 0


def test_the_target_as_its_own_draft_accepts_every_draft(mini_decoder):
    """Same weights: the draft's one-row argmax is the target's k+1-row argmax (fp32 margins of the mini decoder)."""
    _, dst = mini_decoder()
    for p in _prompts(4, seed=3):
        want = generate(dst, prompt_ids=[p], max_new_tokens=41)
        got = generate(dst, prompt_ids=[p], max_new_tokens=41, speculative="draft", draft_model=dst, num_draft_tokens=4)
        assert got.token_ids == want.token_ids
        assert got.accepted_tokens == got.draft_tokens == 32 and got.decode_steps == 8   # 1 + 8 * (4 + 1) tokens


@pytest.mark.parametrize("mode", ["prompt-lookup", "draft"])
def test_eos_inside_the_accepted_tokens_stops_where_greedy_stops(mini_decoder, mode):
    _, dst = mini_decoder()
    checked = 0
    for p in _prompts(6, seed=5):
        free = generate(dst, prompt_ids=[p], max_new_tokens=120).token_ids[0]
        for j in sorted({free.index(t) for t in free})[1:4]:   # first occurrences past the first token
            eos = [free[j]]
            want = generate(dst, prompt_ids=[p], max_new_tokens=120, eos_token_ids=eos)
            assert want.token_ids[0] == free[:j] and want.finished == [True]
            for k in (3, 5):
                got = generate(dst, prompt_ids=[p], max_new_tokens=120, eos_token_ids=eos, speculative=mode,
                               num_draft_tokens=k, draft_model=dst if mode == "draft" else None)
                assert got.token_ids == want.token_ids and got.finished == [True]
                checked += 1
    assert checked >= 30


@pytest.mark.parametrize("mode", ["prompt-lookup", "draft"])
def test_max_new_tokens_is_exact(mini_decoder, mode):
    _, dst = mini_decoder()
    p = _prompts(1, seed=2)[0]
    free = generate(dst, prompt_ids=[p], max_new_tokens=80).token_ids[0]
    assert len(free) == 80
    for n in (1, 2, 3, 6, 7, 50, 79):
        for k in (1, 5, 8):
            got = generate(dst, prompt_ids=[p], max_new_tokens=n, speculative=mode, num_draft_tokens=k,
                           draft_model=dst if mode == "draft" else None)
            assert got.token_ids[0] == free[:n] and got.finished == [False]


@pytest.mark.parametrize("mode", ["prompt-lookup", "draft"])
def test_drafts_stay_within_the_models_positions(mini_decoder, mode):
    """Rotary table of 64 positions: prompt + max_new_tokens = 64 runs, and no run feeds more than 64 - 1 positions."""
    _, dst = mini_decoder(do_rotary=True, d=16, max_pos=64)
    assert read_metadata(dst)["max_position"] == 64
    p = _prompts(1, seed=4, length=10)[0]
    want = generate(dst, prompt_ids=[p], max_new_tokens=54)
    sess = _Recording(dst)
    got = generate(dst, prompt_ids=[p], max_new_tokens=54, speculative=mode, num_draft_tokens=8, session=sess,
                   draft_model=dst if mode == "draft" else None)
    assert got.token_ids == want.token_ids and len(got.token_ids[0]) == 54
    assert max(sess.totals) == 63 and got.draft_tokens > 0      # what plain greedy decoding's last run holds
    with pytest.raises(ValueError, match=r"max_new_tokens; the prompt \(10 tokens\) plus 55 new tokens exceeds"):
        generate(dst, prompt_ids=[p], max_new_tokens=55, speculative=mode, draft_model=dst if mode == "draft" else None)


def test_draft_model_positions_are_checked(mini_decoder):
    _, dst = mini_decoder()
    _, short = mini_decoder(name="short", do_rotary=True, d=16, max_pos=32)
    with pytest.raises(ValueError, match=r"draft_model: max_new_tokens; the prompt \(8 tokens\) plus 30 new tokens "
                                         r"exceeds the model's 32 positions"):
        generate(dst, prompt_ids=[_prompts(1)[0]], max_new_tokens=30, speculative="draft", draft_model=short)


def test_sliding_window_layers_keep_the_positions_a_rollback_needs(mini_decoder):
    """Windowed layers (window 8, pages of 32) evict as they go: truncating K drafts needs rollback_tokens >= K."""
    _, dst = mini_decoder(window=8)
    for p in _prompts(3, seed=6):
        want = generate(dst, prompt_ids=[p], max_new_tokens=150, cache_options={"page_tokens": 32})
        got = generate(dst, prompt_ids=[p], max_new_tokens=150, cache_options={"page_tokens": 32},
                       speculative="prompt-lookup", num_draft_tokens=8)
        assert got.token_ids == want.token_ids and got.draft_tokens > got.accepted_tokens


def test_batch_rows_are_decoded_one_by_one(mini_decoder):
    _, dst = mini_decoder()
    rows = _prompts(3, seed=8) + [[1, 2, 3]]
    got = generate(dst, prompt_ids=rows, max_new_tokens=60, speculative="prompt-lookup", num_draft_tokens=3)
    for b, r in enumerate(rows):
        assert got.token_ids[b] == generate(dst, prompt_ids=[r], max_new_tokens=60).token_ids[0]
    assert got.prompt_lengths == [8, 8, 8, 3]


def test_draft_and_target_caches_share_one_pool(mini_decoder):
    _, dst = mini_decoder()
    _, drf = mini_decoder(name="draft", seed=7)
    with KVPool() as pool:
        sess, dsess = _Recording(dst, pool=pool), _Recording(drf, pool=pool)
        got = generate(dst, prompt_ids=[_prompts(1)[0]], max_new_tokens=30, speculative="draft", draft_model=drf,
                       session=sess, draft_session=dsess, cache_options={"pool": pool})
        assert set(sess.caches) == set(dsess.caches) == {2}   # every run saw both caches in the given pool
        assert len(dsess.caches) == 1 + got.draft_tokens        # its prefill, then one run per draft
        assert pool.stats()["num_caches"] == 0 and pool.stats()["live_bytes"] == 0


def test_draft_cache_holds_only_accepted_tokens(mini_decoder, tmp_path):
    """Before each proposal the draft cache is a prefix of the accepted tokens: its rows are those of a fresh
    prefill of that prefix (a rejected draft left in it would differ)."""
    src, dst = mini_decoder()
    drf = _perturbed_draft(src, tmp_path)
    seen = []
    real = DraftModelProposer.propose

    def checked(self, context, k):
        held = self.length()
        assert 0 < held < len(context)
        with KVCache.for_model(self.stepper.session, 1, 256) as fresh:
            self.stepper.prefill(fresh, np.array([context[:held]]))
            for layer in range(self.cache.num_layers):
                for got, want in zip(self.cache.export(layer), fresh.export(layer)):
                    np.testing.assert_allclose(got, want, atol=ATOL)
        seen.append(held)
        return real(self, context, k)

    DraftModelProposer.propose = checked
    try:
        got = generate(dst, prompt_ids=[_prompts(1, seed=9)[0]], max_new_tokens=60, speculative="draft",
                       draft_model=drf, num_draft_tokens=4)
    finally:
        DraftModelProposer.propose = real
    assert got.decode_steps - 1 <= len(seen) <= got.decode_steps   # every run but a last one without drafts
    assert got.draft_tokens > got.accepted_tokens > 0


def test_a_failed_run_raises_with_the_tokens_so_far(mini_decoder):
    _, dst = mini_decoder()
    p = _prompts(1)[0]
    want = generate(dst, prompt_ids=[p], max_new_tokens=60).token_ids[0]
    sess = _Recording(dst, fail_at=6)
    with pytest.raises(GenerateError, match=r"run of step 5 failed after \d+ generated token\(s\): injected") as e:
        generate(dst, prompt_ids=[p], max_new_tokens=60, speculative="prompt-lookup", session=sess)
    part = e.value.partial.token_ids[0]
    assert 5 <= len(part) < 60 and part == want[:len(part)]


def test_speculative_arguments_are_checked(mini_decoder):
    _, dst = mini_decoder()
    p = [[1, 2, 3]]
    cases = [
        (dict(speculative="lookup"), r"speculative; expected one of 'prompt-lookup', 'draft' or None, got 'lookup'"),
        (dict(speculative="prompt-lookup", temperature=0.7), r"temperature; speculative decoding is greedy only"),
        (dict(speculative="prompt-lookup", num_draft_tokens=0), r"num_draft_tokens; expected an int >= 1, got 0"),
        (dict(speculative="prompt-lookup", num_draft_tokens=2.5), r"num_draft_tokens; expected an int >= 1, got 2.5"),
        (dict(speculative="prompt-lookup", max_ngram_size=0), r"max_ngram_size; expected an int >= 1, got 0"),
        (dict(speculative="draft"), r"draft_model; expected the path of a converted draft model"),
        (dict(speculative="prompt-lookup", draft_model=dst), r"draft_model; only used with speculative='draft'"),
        (dict(speculative="prompt-lookup", draft_session=object()), r"draft_session; expected it with draft_model"),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            generate(dst, prompt_ids=p, max_new_tokens=4, **kw)
    with pytest.raises(FileNotFoundError, match=r"generate: draft_model: model; expected an ONNX file"):
        generate(dst, prompt_ids=p, max_new_tokens=4, speculative="draft", draft_model=dst + ".missing")


def test_a_draft_model_of_another_vocabulary_is_refused(mini_decoder):
    _, dst = mini_decoder()
    _, other = mini_decoder(name="v60", vocab=60)
    with pytest.raises(ValueError, match=r"draft_model; expected a model with the target's vocabulary \(50 logits\), "
                                         r"got 60 logits"):
        generate(dst, prompt_ids=[[1, 2, 3]], max_new_tokens=4, speculative="draft", draft_model=other)


def test_plain_decoding_reports_no_drafts(mini_decoder):
    _, dst = mini_decoder()
    res = generate(dst, prompt_ids=[[1, 2, 3]], max_new_tokens=5)
    assert res.draft_tokens == res.accepted_tokens == 0 and res.decode_tokens is None
    assert np.isnan(res.acceptance_rate)
