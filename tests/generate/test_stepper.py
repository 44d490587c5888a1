"""CacheStepper: runs of equal-length rows on one KVCache, fed from the cache's own lengths."""
import numpy as np
import pytest

import rw_graphs as G
import rw_harness as H
from onnx_light_ep import InferenceSession, KVCache
from onnx_light_ep.generate import CacheStepper
from onnx_light_ep.rewrite import read_metadata

ATOL = 1e-5  # fp32 logits of the mini decoder (|logits| < 10): same arithmetic, other row blocking


def _stepper(dst):
    sess = InferenceSession(dst, H.so())
    return sess, CacheStepper(sess, read_metadata(dst))


@pytest.mark.parametrize("block,kw", [(G.gqa_block, {"do_rotary": True, "packed": True, "d": 16}), (G.gqa_block, {})])
def test_stepper_matches_plain_ort_greedy(mini_decoder, block, kw):
    """Prefill + 6 greedy steps through the stepper give plain ORT's greedy ids."""
    src, dst = mini_decoder(block, **kw)
    from onnx_light_ep.rewrite import convert

    report = convert(src, dst)
    _, want = H.greedy_steps(src, dst, report, [[3, 4, 5, 6, 7]], 6, padding="right")
    sess, st = _stepper(dst)
    with KVCache.for_model(sess, 1, 64) as cache:
        logits = st.prefill(cache, np.array([[3, 4, 5, 6, 7]]))
        got = []
        for _ in range(6):
            t = int(logits[0].argmax())
            got.append(t)
            logits = st.run(cache, np.array([[t]]))[:, -1]
        assert cache.seq_lens.tolist() == [11]
    assert got == want[0][:6]


def test_chunked_prefill_truncate_and_rerun(mini_decoder):
    """Chunks of 3 give the one-run prefill's logits; after truncate the same tokens give the same logits."""
    _, dst = mini_decoder(do_rotary=True, d=16)
    sess, st = _stepper(dst)
    ids = np.array([[5, 9, 2, 14, 7, 3, 30, 11]] * 2)
    with KVCache.for_model(sess, 2, 64) as a, KVCache.for_model(sess, 2, 64) as b:
        one = st.prefill(a, ids)
        seen = []
        chunked = st.prefill(b, ids, chunk_tokens=3, progress=lambda d, t: seen.append((d, t)))
        assert seen == [(3, 8), (6, 8), (8, 8)]
        np.testing.assert_allclose(chunked, one, atol=ATOL)
        draft = np.array([[4, 8, 15]] * 2)
        first = st.run(a, draft)
        a.truncate(8)
        np.testing.assert_allclose(st.run(a, draft), first, atol=0)
        assert a.seq_lens.tolist() == [11, 11]


def test_stepper_refuses_bad_inputs(mini_decoder):
    _, dst = mini_decoder()
    sess, st = _stepper(dst)
    with KVCache.for_model(sess, 2, 64) as cache:
        with pytest.raises(ValueError, match=r"input_ids; expected int \[2, S >= 1\]"):
            st.run(cache, np.array([[1, 2]]))
        st.run(cache, np.array([[1, 2], [3, 4]]))
        cache.truncate([2, 1])
        with pytest.raises(ValueError, match=r"rows hold \[2, 1\] positions; expected rows of equal length"):
            st.run(cache, np.array([[1], [2]]))
        assert cache.seq_lens.tolist() == [2, 1]   # nothing changed
        with pytest.raises(ValueError, match=r"prompt ids; expected int \[B, S >= 1\]"):
            st.prefill(cache, np.zeros((2, 0), np.int64))


def _smooth_softmax_on_layer_1(g, layer, q3, k3, v3, **kw):
    return G.gqa_block(g, layer, q3, k3, v3, smooth_softmax=int(layer == 1), **kw)


def test_stepper_refuses_a_model_with_tensor_pasts(mini_decoder):
    """A layer convert left as it was (smooth_softmax) keeps its past as a tensor: refused, naming it."""
    _, dst = mini_decoder(_smooth_softmax_on_layer_1)
    meta = read_metadata(dst)
    assert meta["tensor_pairs"] == [["past_key_1", "present_key_1"], ["past_value_1", "present_value_1"]]
    sess = InferenceSession(dst, H.so())
    with pytest.raises(ValueError, match=r"past/present tensors \('past_key_1', 'present_key_1'\) outside the cache"):
        CacheStepper(sess, meta)


def test_stepper_refuses_the_prefill_graph_of_a_pair(mini_decoder):
    """Beam search, speculative decoding, prefix caching and chat run every step on one graph: the
    prefill graph of a prefill/decode pair (onnx_light.stage = prefill) is refused by name."""
    _, dst = mini_decoder()
    sess = InferenceSession(dst, H.so())
    meta = dict(read_metadata(dst), stage="prefill")
    with pytest.raises(ValueError, match="the prefill graph of a prefill/decode pair"):
        CacheStepper(sess, meta)


def test_generate_prefills_a_long_prompt_in_runs_with_progress(mini_decoder, capsys):
    """A prompt longer than PREFILL_CHUNK_TOKENS runs in chunks (progress lines on stderr without tqdm's
    terminal, or a bar) and gives plain ORT's greedy ids (one-run prefill on the original)."""
    from onnx_light_ep.generate import generate
    from onnx_light_ep.generate._greedy import PREFILL_CHUNK_TOKENS
    from onnx_light_ep.rewrite import convert

    src, dst = mini_decoder()
    report = convert(src, dst)
    prompt = [int(x) for x in (np.arange(PREFILL_CHUNK_TOKENS * 2 + 37) * 7 % 47 + 3)]
    _, want = H.greedy_steps(src, dst, report, [prompt], 5, padding="right", max_len=len(prompt) + 8)
    res = generate(dst, prompt_ids=[prompt], max_new_tokens=6, eos_token_ids=[], progress=True)
    assert res.token_ids[0] == want[0][:6]
    assert "prefill" in capsys.readouterr().err   # tqdm's bar (desc "prefill") or the stderr lines
    seen = []
    st = CacheStepper(InferenceSession(dst, H.so()), read_metadata(dst))
    with KVCache.for_model(st.session, 1, len(prompt) + 1) as cache:
        st.prefill(cache, np.array([prompt]), chunk_tokens=PREFILL_CHUNK_TOKENS, progress=lambda d, t: seen.append(d))
    assert seen == [PREFILL_CHUNK_TOKENS, 2 * PREFILL_CHUNK_TOKENS, len(prompt)]


def test_generate_summary_line_names_prompt_cached_new_and_stop(mini_decoder, capsys):
    from onnx_light_ep.cli import main

    _, dst = mini_decoder()
    assert main(["generate", dst, "--prompt-ids", "3,4,5,6", "--max-new-tokens", "5", "-q", "--no-stream"]) == 0
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("prompt 4 tokens (0 cached), 5 new tokens, stop: max-new-tokens; prefill "), last
    assert "tokens/s); decode " in last and last.endswith("on OnnxLightExecutionProvider"), last


def test_chat_without_a_position_table_names_the_capacity_flag(mini_decoder):
    """A converted model with no rotary table records no max_position: ChatSession (and the CLI) say to pass
    the capacity, naming max_sequence_length / --max-sequence-length."""
    from onnx_light_ep.chat import ChatSession

    _, dst = mini_decoder()
    assert "max_position" not in read_metadata(dst)
    with pytest.raises(ValueError, match=r"chat: max_sequence_length; .*--max-sequence-length N"):
        ChatSession(dst)
