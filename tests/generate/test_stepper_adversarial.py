"""CacheStepper (the runs under beam search, speculative decoding, prefix caching and chat) given ids a careless
caller passes: a ValueError naming input_ids (or chunk_tokens, or the cache) and the expected value, before
anything runs, and the cache holds what it held."""
import numpy as np
import pytest

import rw_harness as H
from onnx_light_ep import InferenceSession, KVCache
from onnx_light_ep.generate import CacheStepper
from onnx_light_ep.rewrite import read_metadata


def _stepper(path):
    sess = InferenceSession(path, H.so())
    return sess, CacheStepper(sess, read_metadata(path))


def _held(cache):
    return cache.seq_lens.tolist(), cache.stats()["committed_bytes"]


@pytest.mark.parametrize("ids,match", [
    ([[50, 1], [1, 1]], r"input_ids; expected token ids in \[0, 50\) \(the model's vocabulary\), got 50"),
    ([[-1, 1], [1, 1]], r"input_ids; expected token ids in \[0, 50\) \(the model's vocabulary\), got -1"),
    ([[1.7, 1], [1, 1]], r"input_ids; expected integer token ids, got an array of float64"),
    (np.array([[True, False], [True, True]]), r"input_ids; expected integer token ids, got an array of bool"),
    ([["1", "2"], ["3", "4"]], r"input_ids; expected integer token ids, got an array of <U1"),
])
def test_ids_outside_the_vocabulary_or_not_integers_are_refused(mini_decoder, ids, match):
    """ORT's Gather wraps -1 around to the last row and the float cast truncates 1.7 to 1: such ids would run
    another token than the caller's; out of range ones failed inside ORT (not a ValueError)."""
    _, dst = mini_decoder(do_rotary=True, d=16)
    sess, st = _stepper(dst)
    with KVCache.for_model(sess, 2, 64) as cache:
        st.run(cache, [[1, 2], [3, 4]])
        before = _held(cache)
        with pytest.raises(ValueError, match=match):
            st.run(cache, ids)
        with pytest.raises(ValueError, match=match):
            st.prefill(cache, ids)
        assert _held(cache) == before


def test_a_run_beyond_the_positions_is_refused(mini_decoder):
    """Past + S beyond the cache's capacity or the model's max_position (64) is a ValueError before the run
    (it was an ORT error of RotaryEmbedding), naming both numbers."""
    _, dst = mini_decoder(do_rotary=True, d=16)
    sess, st = _stepper(dst)
    with KVCache.for_model(sess, 1, 64) as cache:
        st.run(cache, np.ones((1, 60), np.int64))
        with pytest.raises(ValueError, match=r"input_ids; the cache holds 60 positions and the run adds 5: expected "
                                             r"at most 64 in all \(.*the model's 64 positions"):
            st.run(cache, np.ones((1, 5), np.int64))
        assert _held(cache)[0] == [60]
        st.run(cache, np.ones((1, 4), np.int64))   # exactly the limit runs
        assert _held(cache)[0] == [64]
    with KVCache.for_model(sess, 1, 16) as cache:
        with pytest.raises(ValueError, match=r"the run adds 17: expected at most 16 in all \(.*cache's "
                                             r"max_sequence_length 16"):
            st.prefill(cache, np.ones((1, 17), np.int64), chunk_tokens=8)
        assert _held(cache)[0] == [0]    # refused before the first chunk


@pytest.mark.parametrize("chunk", [0, -5, True, 1.5, "8"])
def test_bad_chunk_tokens_are_refused(mini_decoder, chunk):
    _, dst = mini_decoder(do_rotary=True, d=16)
    sess, st = _stepper(dst)
    with KVCache.for_model(sess, 1, 64) as cache:
        with pytest.raises(ValueError, match=r"chunk_tokens; expected an int >= 1 or None \(one run\), got"):
            st.prefill(cache, np.ones((1, 3), np.int64), chunk_tokens=chunk)
        assert _held(cache) == ([0], 0)


def test_a_cache_of_another_geometry_is_refused(mini_decoder):
    _, dst = mini_decoder(do_rotary=True, d=16)
    sess, st = _stepper(dst)
    with KVCache(3, 1, 2, 16, max_sequence_length=64) as other:
        with pytest.raises(ValueError, match=r"cache; expected a cache of this model's geometry \(num_layers 2, "
                                             r"kv_num_heads 2, head_dim 16, v_head_dim 16, float32\), got num_layers "
                                             r"3"):
            st.run(other, [[1]])


def test_bad_session_or_metadata_are_refused(mini_decoder):
    _, dst = mini_decoder(do_rotary=True, d=16)
    sess = InferenceSession(dst, H.so())
    with pytest.raises(ValueError, match=r"session; expected an onnx_light_ep.InferenceSession, got NoneType"):
        CacheStepper(None, read_metadata(dst))
    with pytest.raises(ValueError, match=r"meta; expected the model's onnx_light metadata \(read_metadata\), got "
                                         r"a dict without 'cache_input'"):
        CacheStepper(sess, {})
