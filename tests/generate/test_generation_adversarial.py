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
