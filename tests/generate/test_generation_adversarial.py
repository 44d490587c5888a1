"""Hostile and careless arguments to the generation loops (greedy, beam search, speculative decoding, prefix
caching) on the mini GroupQueryAttention decoder: each is a ValueError naming the argument and the expected
value (or runs as documented), and a refused call leaves a PrefixCache as it was."""
import numpy as np
import pytest

from onnx_light_ep.generate import generate

KW = dict(do_rotary=True, d=16)   # layers=2 (conftest), hkv=2, head_dim 16, vocab 50, 64 positions
PROMPT = [3, 4, 5, 6, 7]


@pytest.mark.parametrize("k,max_new", [(50, 3), (10 ** 9, 4), (3, 1), (8, 2)])
def test_more_drafts_than_new_tokens_gives_the_greedy_tokens(mini_decoder, k, max_new):
    """num_draft_tokens beyond max_new_tokens (or the cache's length) is allowed: a step drafts at most
    max_new_tokens - generated - 1 tokens, so the run is plain greedy decoding's, on a windowed model too."""
    for kw in (KW, dict(window=8)):
        _, dst = mini_decoder(name=f"m{len(kw)}", **kw)
        want = generate(dst, prompt_ids=[PROMPT * 3], max_new_tokens=max_new, threads=1)
        got = generate(dst, prompt_ids=[PROMPT * 3], max_new_tokens=max_new, threads=1,
                       speculative="prompt-lookup", num_draft_tokens=k)
        assert got.token_ids == want.token_ids and len(got.token_ids[0]) == max_new


@pytest.mark.parametrize("kw,match", [
    (dict(max_new_tokens=True), r"max_new_tokens; expected an int >= 1, got True"),
    (dict(max_new_tokens=2.5), r"max_new_tokens; expected an int >= 1, got 2.5"),
    (dict(max_new_tokens="3"), r"max_new_tokens; expected an int >= 1, got '3'"),
    (dict(max_new_tokens=None), r"max_new_tokens; expected an int >= 1, got None"),
    (dict(temperature=True), r"temperature; expected a finite number >= 0 \(0 = greedy\), got True"),
    (dict(temperature="a"), r"temperature; expected a finite number >= 0 \(0 = greedy\), got 'a'"),
    (dict(top_k=True, temperature=1.0), r"top_k; expected an int >= 0 \(0 = no top-k\), got True"),
    (dict(top_k=2.5, temperature=1.0), r"top_k; expected an int >= 0 \(0 = no top-k\), got 2.5"),
    (dict(top_p="x", temperature=1.0), r"top_p; expected a number in \(0, 1\], got 'x'"),
    (dict(seed="x", temperature=1.0), r"seed; expected an int >= 0 or None, got 'x'"),
    (dict(seed=-1, temperature=1.0), r"seed; expected an int >= 0 or None, got -1"),
    (dict(seed=1.5, temperature=1.0), r"seed; expected an int >= 0 or None, got 1.5"),
    (dict(threads=-1), r"threads; expected an int >= 0 or None \(0 or None: ONNX Runtime's default\), got -1"),
    (dict(threads=True), r"threads; expected an int >= 0 or None .*got True"),
    (dict(threads=2.5), r"threads; expected an int >= 0 or None .*got 2.5"),
    (dict(prompt_ids=[[3.7, 4]]), r"prompt_ids\[0\]; expected integer token ids, got 3.7"),
    (dict(prompt_ids=[[True, 4]]), r"prompt_ids\[0\]; expected integer token ids, got True"),
    (dict(prompt_ids=[["3"]]), r"prompt_ids\[0\]; expected integer token ids, got '3'"),
    (dict(prompt_ids=[3, 4, 5]), r"prompt_ids; expected a list of rows \(each a list of token ids\), got 3 "
                                 r"as row 0: a single prompt is \[\[3, 4, 5\]\]"),
    (dict(prompt_ids="345"), r"prompt_ids; expected a list of rows \(each a list of token ids\), got a str"),
    (dict(eos_token_ids="13"), r"eos_token_ids; expected an int or a sequence of ints, got '13'"),
    (dict(eos_token_ids=[13.0]), r"eos_token_ids; expected an int or a sequence of ints, got \[13.0\]"),
    (dict(eos_token_ids=[-5]), r"eos_token_ids; expected ids in \[0, 50\) \(the model's vocabulary\), got -5"),
    (dict(eos_token_ids=[50]), r"eos_token_ids; expected ids in \[0, 50\) \(the model's vocabulary\), got 50"),
    (dict(stream=5), r"stream; expected a callable taking each new piece of text, or None, got int"),
])
@pytest.mark.parametrize("loop", [{}, dict(num_beams=2), dict(speculative="prompt-lookup")])
def test_bad_generate_arguments_name_the_argument(mini_decoder, kw, match, loop):
    """Each was accepted silently (True as 1, 2.5 truncated, '13' as the ids {'1', '3'}, -1 threads) or failed
    with a TypeError or another function's message; now a ValueError naming the argument, in every loop."""
    _, dst = mini_decoder(**KW)
    args = dict(dict(prompt_ids=[PROMPT], max_new_tokens=3, threads=1), **loop)
    args.update(kw)
    with pytest.raises(ValueError, match=r"generate: " + match):
        generate(dst, **args)


def test_good_argument_forms_still_run(mini_decoder):
    """numpy ints and arrays, a single int eos id and threads=0 (ORT's default) are accepted."""
    _, dst = mini_decoder(**KW)
    want = generate(dst, prompt_ids=[PROMPT], max_new_tokens=4, threads=1)
    for kw in (dict(prompt_ids=np.array([PROMPT])), dict(prompt_ids=[np.array(PROMPT, np.int32)]),
               dict(max_new_tokens=np.int64(4)), dict(threads=0), dict(top_k=np.int64(0))):
        args = dict(dict(prompt_ids=[PROMPT], max_new_tokens=4, threads=1), **kw)
        assert generate(dst, **args).token_ids == want.token_ids, kw
    first = want.token_ids[0][0]
    for eos in (first, np.int64(first), [first]):
        got = generate(dst, prompt_ids=[PROMPT], max_new_tokens=4, threads=1, eos_token_ids=eos)
        assert got.token_ids == [[]] and got.finished == [True]


@pytest.mark.parametrize("prompt,match", [
    (5, r"prompt; expected text or a list of texts, got int"),
    (b"w6 w7", r"prompt; expected text or a list of texts, got bytes"),
    ([], r"prompt; expected text or a non-empty list of texts, got \[\]"),
    (["w6 w7", 5], r"prompt\[1\]; expected non-empty text, got 5"),
    (["w6", ""], r"prompt\[1\]; expected non-empty text, got ''"),
])
def test_bad_text_prompts_are_refused(mini_decoder, tmp_path, prompt, match):
    from test_chat import PLAIN, write_tokenizer

    _, dst = mini_decoder(**KW)
    write_tokenizer(str(tmp_path), PLAIN)
    assert generate(dst, "w6 w7", max_new_tokens=2, threads=1).texts is not None   # the tokenizer is found
    with pytest.raises(ValueError, match=r"generate: " + match):
        generate(dst, prompt, max_new_tokens=2, threads=1)


@pytest.mark.parametrize("args,kw,match", [
    ((0, [1], 5), {}, r"BeamSearch: num_beams; expected an integer >= 1, got 0"),
    ((True, [1], 5), {}, r"BeamSearch: num_beams; expected an integer >= 1, got True"),
    ((2, [1], 0), {}, r"BeamSearch: max_new_tokens; expected >= 1, got 0"),
    ((2, [1], 2.5), {}, r"BeamSearch: max_new_tokens; expected an int >= 1, got 2.5"),
    ((2, "12", 5), {}, r"BeamSearch: eos_token_ids; expected an int or a sequence of ints, got '12'"),
    ((2, [1], 5), dict(length_penalty=float("nan")), r"BeamSearch: length_penalty; expected a finite number"),
    ((2, [1], 5), dict(early_stopping="x"), r"BeamSearch: early_stopping; expected True, False or 'never'"),
])
def test_beam_search_bookkeeping_refuses_bad_settings(args, kw, match):
    """BeamSearch is public: num_beams=0 was an IndexError at the first step, max_new_tokens=0 and eos '12'
    (the ids '1', '2') were taken."""
    from onnx_light_ep.generate import BeamSearch

    with pytest.raises(ValueError, match=match):
        BeamSearch(*args, **kw)


def test_beam_search_step_refuses_bad_log_probs():
    """NaN log-probabilities were ranked as scores, a 1-D first step and a vocabulary that changes between
    steps were taken; -inf (a masked token) is fine."""
    from onnx_light_ep.generate import BeamSearch

    lp = np.log(np.full((1, 10), 0.1))
    for bad, match in [(np.full((1, 10), np.nan), r"log_probs; expected no NaN"),
                       (np.zeros(10), r"log_probs; expected float \[N or 1, vocab\] at the first step, got shape "
                                      r"\[10\]"),
                       (np.zeros((1, 1, 10)), r"got shape \[1, 1, 10\]")]:
        with pytest.raises(ValueError, match=match):
            BeamSearch(2, [1], 3).step(bad)
    b = BeamSearch(2, [1], 3)
    b.step(lp)
    with pytest.raises(ValueError, match=r"log_probs; expected float \[2, 10\] \(the first step's vocabulary\), got "
                                         r"shape \[2, 12\]"):
        b.step(np.zeros((2, 12)))
    masked = np.where(np.arange(10) < 5, -np.inf, 0.0)[None]
    b = BeamSearch(2, [1], 3)
    b.step(masked)
    assert sorted(b.next_tokens.tolist()) == [5, 6]   # the first two unmasked ids, by index on a tie


def test_every_token_an_eos_id_is_refused_before_the_prefill(mini_decoder):
    """K = max(2, 1 + len(eos)) * N candidates need more tokens than eos ids: the error named
    BeamSearch.step and came after the prefill; now it names eos_token_ids before anything runs."""
    _, dst = mini_decoder(**KW)
    with pytest.raises(ValueError, match=r"generate: eos_token_ids; beam search keeps 1 \+ len\(eos_token_ids\) = 51 "
                                         r"candidates per beam: expected fewer than 50 ids \(the vocabulary\)"):
        generate(dst, prompt_ids=[PROMPT], num_beams=2, max_new_tokens=3, eos_token_ids=list(range(50)))


@pytest.mark.parametrize("args,match", [
    (([1, 2, 1, 2], 0), r"num_draft_tokens; expected >= 1, got 0"),
    (([1, 2, 1, 2], True), r"num_draft_tokens; expected an int >= 1, got True"),
    (([1, 2, 1, 2], 3, 0), r"max_ngram_size; expected >= 1, got 0"),
    (([1.5, 2, 1.5], 3), r"ids; expected a sequence of integer token ids, got 1.5"),
    (([[1, 2], [1, 2]], 3), r"ids; expected a sequence of integer token ids, got \[1, 2\]"),
    (("abcab", 3), r"ids; expected a sequence of integer token ids, got a str"),
    (([1, 2, 3, 1, 2], 3, 3, 3), None),   # a single eos id is fine
])
def test_prompt_lookup_drafts_refuses_bad_arguments(args, match):
    from onnx_light_ep.generate import prompt_lookup_drafts

    if match is None:
        assert prompt_lookup_drafts(*args) == []   # the draft after [1, 2] is 3, an eos id
        return
    with pytest.raises(ValueError, match=r"prompt_lookup_drafts: " + match):
        prompt_lookup_drafts(*args)
