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
