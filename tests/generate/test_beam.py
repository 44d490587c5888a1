"""Beam search on the paged KVCache (generate(num_beams=N)) against transformers' algorithm written out in
numpy (beam_reference.py) on plain ONNX Runtime with per-beam gathered pasts, on the mini GQA decoder.

Tolerance: the two sides run the same weights, the EP with a KVCache and plain ORT with tensor pasts,
whose logits agree within ATOL_LOGITS = 1e-5 (fp32, |logits| < 10; test_stepper.py). A log-softmax moves
by at most twice the largest logit change, so a hypothesis of L tokens (EOS included) has
|d score| <= 2 * ATOL_LOGITS * L / L ** length_penalty: that bound is the score tolerance per hypothesis.
The token ids must be identical.
"""
import numpy as np
import pytest

import rw_graphs as G
from beam_reference import GatheredPastModel, reference_beam_search
from onnx_light_ep import InferenceSession, KVCache
from onnx_light_ep.cli import main as cli_main
from onnx_light_ep.generate import BeamSearch, generate
from onnx_light_ep.generate._beam import run_beam
from onnx_light_ep.generate._greedy import run_batch
from onnx_light_ep.generate._prepare import prepare

ATOL_LOGITS = 1e-5
KW = dict(do_rotary=True, d=16)        # layers=2 (conftest), hkv=2, head_dim 16, vocab 50, 64 positions
PROMPT = [3, 4, 5, 6, 7]
LONG_PROMPT = [(7 * i + 3) % 50 for i in range(40)]


def _score_tol(n_tokens, length_penalty):
    return 2 * ATOL_LOGITS * n_tokens / float(n_tokens) ** length_penalty


def _check_against_reference(src, dst, prompt, n, eos, max_new, lp, es, **kw):
    want, runs = reference_beam_search(GatheredPastModel(src), prompt, n, eos, max_new, lp, es)
    got = generate(dst, prompt_ids=[prompt], num_beams=n, num_return_sequences=n, max_new_tokens=max_new,
                   eos_token_ids=eos, length_penalty=lp, early_stopping=es, **kw)
    assert [(g, f) for g, f in zip(got.token_ids, got.finished)] == [(w[0], w[1]) for w in want]
    for g, f, s, w in zip(got.token_ids, got.finished, got.sequences_scores, want):
        assert abs(s - w[2]) <= _score_tol(len(g) + f, lp), (s, w[2])
    assert got.decode_steps == runs and len(got.bytes_copied_per_step) == runs
    return want, got


# (num_beams, eos ids, length_penalty, early_stopping): on this model eos 13 finishes hypotheses after a few
# tokens, two eos ids make K = 3N candidates; pairs differing in one setting give different results
CASES = [(2, [13], 1.0, False), (3, [13], 1.0, False), (3, [13], 1.0, True), (3, [13], 1.0, "never"),
         (3, [13], 0.5, False), (3, [13], 0.0, "never"), (3, [13, 47], 1.0, False), (2, [13, 47], 2.0, False),
         (2, [13, 47], 2.0, "never"), (2, [13, 47], -1.0, False), (2, [4, 46], 1.0, False),
         (2, [4, 46], 1.0, "never"), (3, [4, 46], 2.0, True), (3, [47], 2.0, True)]


@pytest.mark.parametrize("n,eos,lp,es", CASES)
def test_beam_matches_reference_on_gathered_pasts(mini_decoder, n, eos, lp, es):
    src, dst = mini_decoder(**KW)
    _check_against_reference(src, dst, PROMPT, n, eos, 12, lp, es)


@pytest.mark.parametrize("max_new", [1, 2])
def test_beam_few_new_tokens(mini_decoder, max_new):
    """At max_new_tokens every candidate finishes: one token = the N best first tokens, no decode run."""
    src, dst = mini_decoder(**KW)
    _check_against_reference(src, dst, PROMPT, 3, [13], max_new, 1.0, False)


def test_reference_cases_exercise_eos_and_early_stop(mini_decoder):
    """The cases above are not vacuous: some hypotheses end on EOS, some searches stop before max_new_tokens,
    early_stopping changes the result, and so does the length penalty."""
    src, _ = mini_decoder(**KW)
    runs = {}
    for n, eos, lp, es in CASES:
        runs[(n, tuple(eos), lp, es)] = reference_beam_search(GatheredPastModel(src), PROMPT, n, eos, 12, lp, es)
    assert sum(h[1] for hyps, _ in runs.values() for h in hyps) >= 8
    assert any(r < 11 for _, r in runs.values())
    def ids(key):
        return [h[0] for h in runs[key][0]]

    assert ids((3, (13,), 1.0, False)) != ids((3, (13,), 1.0, True))
    assert ids((2, (4, 46), 1.0, False)) != ids((2, (4, 46), 1.0, "never"))
    assert ids((2, (13, 47), 2.0, False)) != ids((2, (13, 47), 2.0, "never"))
    assert ids((2, (13, 47), 2.0, False)) != ids((2, (13, 47), -1.0, False))


def test_beam_long_prompt_copies_tail_pages_only(mini_decoder):
    """40-token prompt, 32-token pages: each step copies exactly the shared tail pages' valid rows
    (the arena copies a page for every writer that finds it shared when the step reserves its pages:
    each child of a parent with two or more children), never a whole past, and far less than the
    gather the reference performs (every past row of every beam)."""
    src, dst = mini_decoder(**KW)
    n, page = 3, 32
    ref = GatheredPastModel(src)
    want, _ = reference_beam_search(ref, LONG_PROMPT, n, [13], 12)
    got = generate(dst, prompt_ids=[LONG_PROMPT], num_beams=n, num_return_sequences=n, max_new_tokens=12,
                   eos_token_ids=[13], cache_options={"page_tokens": page})
    assert got.token_ids == [w[0] for w in want]
    # replay the bookkeeping to know each step's parents and the past length
    search = BeamSearch(n, [13], 12)
    row_bytes = 2 * 2 * (16 + 16) * 4                        # layers * kv heads * (K + V) * fp32, per position
    expected = []
    sess = InferenceSession(dst)
    from onnx_light_ep.generate import CacheStepper
    from onnx_light_ep.rewrite import read_metadata

    st = CacheStepper(sess, read_metadata(dst))
    with KVCache.for_model(sess, 1, 64, page_tokens=page) as one:
        logits = st.prefill(one, np.array([LONG_PROMPT]))
        beams = one.fork([0] * n)
    with beams:
        from onnx_light_ep.generate._beam import log_softmax

        while not search.step(log_softmax(logits)):
            past = int(beams.seq_lens[0])
            children = np.bincount(search.parent_beams, minlength=n)
            expected.append(int(children[children >= 2].sum()) * (past % page) * row_bytes)
            beams.reorder(search.parent_beams)
            logits = st.run(beams, search.next_tokens[:, None])[:, -1]
    assert got.bytes_copied_per_step == expected
    assert max(expected) > 0
    tail_bound = n * (page - 1) * row_bytes
    gathers = ref.gathered_bytes[1:]                          # the per-step gathers (not the prompt's expansion)
    assert len(gathers) == len(expected)
    for c, g in zip(got.bytes_copied_per_step, gathers):
        assert c <= tail_bound < g
    assert got.committed_bytes_per_step[-1] >= (len(LONG_PROMPT) + 11) * row_bytes


def test_beam_with_several_prompts_is_each_prompt_alone(mini_decoder):
    _, dst = mini_decoder(**KW)
    both = generate(dst, prompt_ids=[PROMPT, LONG_PROMPT[:9]], num_beams=3, num_return_sequences=2,
                    max_new_tokens=10, eos_token_ids=[13])
    a = generate(dst, prompt_ids=[PROMPT], num_beams=3, num_return_sequences=2, max_new_tokens=10, eos_token_ids=[13])
    b = generate(dst, prompt_ids=[LONG_PROMPT[:9]], num_beams=3, num_return_sequences=2, max_new_tokens=10,
                 eos_token_ids=[13])
    assert both.token_ids == a.token_ids + b.token_ids
    assert both.prompt_lengths == [5, 5, 9, 9]
    np.testing.assert_allclose(both.sequences_scores, a.sequences_scores + b.sequences_scores, atol=1e-6)
    assert both.decode_steps == a.decode_steps + b.decode_steps


def test_one_beam_with_early_stopping_is_greedy(mini_decoder):
    """num_beams=1, early_stopping=True stops at the first finished hypothesis: the greedy sequence."""
    _, dst = mini_decoder(**KW)
    for eos in ([13], [4, 46], [49]):
        with prepare(dst, prompt_ids=[PROMPT], max_new_tokens=12, eos_token_ids=eos) as prep:
            greedy = run_batch(prep, max_new_tokens=12)
            beam = run_beam(prep, num_beams=1, max_new_tokens=12, early_stopping=True)
        assert beam.token_ids == greedy.token_ids and beam.finished == greedy.finished


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_beams=0), r"num_beams; expected an integer >= 1, got 0"),
    (dict(num_beams=-1), r"num_beams; expected an integer >= 1, got -1"),
    (dict(num_beams=2.0), r"num_beams; expected an integer >= 1, got 2.0"),
    (dict(num_beams="3"), r"num_beams; expected an integer >= 1, got '3'"),
    (dict(num_beams=True), r"num_beams; expected an integer >= 1, got True"),
    (dict(num_beams=2, temperature=0.7), r"temperature; beam search is greedy here: expected temperature 0"),
    (dict(num_beams=2, num_return_sequences=3), r"num_return_sequences; expected at most num_beams \(2\)"),
    (dict(num_beams=2, num_return_sequences=0), r"num_return_sequences; expected an integer >= 1"),
    (dict(num_return_sequences=2), r"num_return_sequences; expected at most num_beams \(1\)"),
    (dict(num_beams=2, length_penalty=float("nan")), r"length_penalty; expected a finite number"),
    (dict(num_beams=2, length_penalty="1"), r"length_penalty; expected a finite number"),
    (dict(num_beams=2, early_stopping="yes"), r"early_stopping; expected True, False or 'never'"),
    (dict(num_beams=2, stream=print), r"stream; beam search picks its sequence only at the end"),
])
def test_bad_beam_arguments(mini_decoder, kwargs, match):
    _, dst = mini_decoder(**KW)
    with pytest.raises(ValueError, match=match):
        generate(dst, prompt_ids=[PROMPT], max_new_tokens=4, **kwargs)


def test_vocabulary_smaller_than_the_candidates_is_refused():
    s = BeamSearch(2, [1, 2, 3, 4], 5)                      # K = 5 * 2 candidates, 4 per beam available
    with pytest.raises(ValueError, match=r"vocab; expected at least 5 tokens"):
        s.step(np.log(np.full((1, 4), 0.25)))


def test_cli_beam(mini_decoder, capsys):
    _, dst = mini_decoder(**KW)
    assert cli_main(["generate", dst, "--prompt-ids", "3,4,5,6,7", "--max-new-tokens", "12", "--num-beams", "3",
                     "--num-return-sequences", "2", "--length-penalty", "0.5", "--early-stopping", "-q"]) == 0
    out, err = capsys.readouterr()
    want = generate(dst, prompt_ids=[PROMPT], num_beams=3, num_return_sequences=2, max_new_tokens=12,
                    length_penalty=0.5, early_stopping=True)
    for b, ids in enumerate(want.token_ids):
        assert f"[{b}] ids: {ids}" in out
    assert "score" in out and "beam search, 3 beams" in err
    assert cli_main(["generate", dst, "--prompt-ids", "3,4", "--num-beams", "2", "--early-stopping", "never",
                     "--max-new-tokens", "3", "-q"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("argv,match", [
    (["--num-beams", "0"], "error: generate: num_beams; expected an integer >= 1, got 0"),
    (["--num-beams", "-1"], "error: generate: num_beams; expected an integer >= 1, got -1"),
    (["--num-beams", "2", "--temperature", "0.5"], "error: generate: temperature; beam search is greedy"),
    (["--num-beams", "2", "--num-return-sequences", "3"], "error: generate: num_return_sequences"),
])
def test_cli_beam_usage_errors_exit_2(mini_decoder, capsys, argv, match):
    _, dst = mini_decoder(**KW)
    assert cli_main(["generate", dst, "--prompt-ids", "3,4,5", "--max-new-tokens", "4", "-q"] + argv) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [["--num-beams", "two"], ["--early-stopping", "sometimes"]])
def test_cli_beam_unparsable_flags_exit_2(mini_decoder, capsys, argv):
    _, dst = mini_decoder(**KW)
    with pytest.raises(SystemExit) as e:
        cli_main(["generate", dst, "--prompt-ids", "3,4,5"] + argv)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err
