"""``convert(..., logits_to_keep=True)`` on every committed real export (tests/data: each exporter x
family, one-file models and transformers' prefill/decode pairs): the LM head is found in each, and
on the EP with a KVCache a prefill that keeps the last N positions returns the full prefill's last N
rows of logits, while the cache it leaves is the same (the next decode step's logits are identical,
bit for bit). Tolerance for the kept rows: fp32 exports 1e-5 absolute + 1e-5 relative (the LM
head's MatMul on N rows instead of S may take another kernel); the int4 export (MatMulNBits, int8
activations per row) likewise.
"""
import json
import os

import numpy as np
import pytest

from onnx_light_ep import InferenceSession, KVCache
from onnx_light_ep.generate import CacheStepper, generate
from onnx_light_ep.rewrite import convert, read_metadata

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
MANIFEST = json.load(open(os.path.join(DATA, "manifest.json")))["models"]
ONE_FILE = sorted(k for k, v in MANIFEST.items() if v["exporter"] != "transformers")
PAIRS = sorted(k for k, v in MANIFEST.items() if v["exporter"] == "transformers")
ATOL = RTOL = 1e-5


def _prompt(name):
    golden = np.load(os.path.join(DATA, MANIFEST[name]["golden"]))
    return golden["prompt_ids"][:1].astype(np.int64)


@pytest.mark.parametrize("name", ONE_FILE)
def test_kept_rows_and_the_cache_they_leave(name, tmp_path):
    dst = str(tmp_path / "m.onnx")
    report = convert(os.path.join(DATA, MANIFEST[name]["file"]), dst, logits_to_keep=True)
    meta = read_metadata(dst)
    assert meta.get("logits_to_keep") == "logits_to_keep", report.notes
    assert report.metadata["logits_to_keep"] == "logits_to_keep"
    sess = InferenceSession(dst)
    st = CacheStepper(sess, meta)
    assert st.keep_input == "logits_to_keep"
    prompt = _prompt(name)
    s = prompt.shape[1]
    kept, after = {}, {}
    for n in (0, 1, 3, s + 5):
        with KVCache.for_model(sess, 1, s + 8) as cache:
            kept[n] = st.run(cache, prompt, logits_to_keep=n)
            nxt = int(kept[n][0, -1].argmax())
            after[n] = st.run(cache, np.array([[nxt]], np.int64), logits_to_keep=1)
            assert list(cache.seq_lens) == [s + 1]
    assert kept[0].shape[1] == s and kept[s + 5].shape[1] == s
    for n in (1, 3, s + 5):
        k = min(n, s)
        assert kept[n].shape == (1, k, kept[0].shape[2])
        np.testing.assert_allclose(kept[n], kept[0][:, s - k:], rtol=RTOL, atol=ATOL, err_msg=f"{name} N={n}")
        np.testing.assert_array_equal(after[n], after[0], err_msg=f"{name}: the decode step after N={n}")


def test_logits_to_keep_is_checked_and_a_model_without_it_is_cut_in_numpy(tmp_path):
    name = "genai_llama_fp32"
    dst = str(tmp_path / "m.onnx")
    convert(os.path.join(DATA, MANIFEST[name]["file"]), dst)  # default: no logits_to_keep input
    meta = read_metadata(dst)
    assert "logits_to_keep" not in meta
    sess = InferenceSession(dst)
    assert "logits_to_keep" not in {i.name for i in sess.get_inputs()}
    st = CacheStepper(sess, meta)
    prompt = _prompt(name)
    with KVCache.for_model(sess, 1, 32) as cache:
        for bad in (-1, True, 1.0, "1"):
            with pytest.raises(ValueError, match="logits_to_keep; expected an int >= 0"):
                st.run(cache, prompt, logits_to_keep=bad)
        assert list(cache.seq_lens) == [0]  # nothing ran
        last = st.run(cache, prompt, logits_to_keep=2)
    with KVCache.for_model(sess, 1, 32) as cache:
        full = st.run(cache, prompt)
    assert last.shape[1] == 2
    np.testing.assert_array_equal(last, full[:, -2:])


@pytest.mark.parametrize("name", PAIRS)
def test_pairs_take_it_in_both_graphs_and_generate_matches(name, tmp_path):
    """A prefill/decode pair converts with the input in both graphs; generate (which converts with
    it) gives the greedy ids of a conversion without it."""
    src = os.path.join(DATA, name)
    with_keep = convert(src, str(tmp_path / "keep"), logits_to_keep=True)
    for r in (with_keep.prefill, with_keep.decode):
        assert r.metadata.get("logits_to_keep") == "logits_to_keep", r.notes
    plain = convert(src, str(tmp_path / "plain"))
    prompt = _prompt(name).tolist()
    a = generate(str(tmp_path / "keep"), prompt_ids=prompt, max_new_tokens=8)
    b = generate(str(tmp_path / "plain"), prompt_ids=prompt, max_new_tokens=8)
    assert a.token_ids == b.token_ids
