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
        for bad in (-1, True, np.bool_(True), 1.0, "1", 2 ** 63, np.uint64(2 ** 63)):
            with pytest.raises(ValueError, match=r"logits_to_keep; expected an int in \[0, 9223372036854775807\]"):
                st.run(cache, prompt, logits_to_keep=bad)
            with pytest.raises(ValueError, match="logits_to_keep; expected an int in"):
                st.feeds(cache, prompt, bad)
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


def test_a_pair_takes_it_in_both_graphs_or_neither(tmp_path):
    """transformers_llama_mask with the prefill graph's logits also read by an ArgMax output: the
    prefill graph's head cannot be pruned, so the decode graph is converted without the input too
    (the loops feed both graphs by the prefill graph's metadata); graphs converted one by one that
    disagree are refused by name."""
    import shutil

    import onnx
    from onnx import TensorProto, helper

    from onnx_light_ep.rewrite._pair import check_pair_metadata

    src = str(tmp_path / "src")
    shutil.copytree(os.path.join(DATA, "transformers_llama_mask"), src)
    m = onnx.load(os.path.join(src, "prefill.onnx"))
    logits = next(o.name for o in m.graph.output if "logits" in o.name)
    m.graph.node.append(helper.make_node("ArgMax", [logits], ["next_token"], axis=-1, keepdims=0))
    m.graph.output.append(helper.make_tensor_value_info("next_token", TensorProto.INT64, None))
    onnx.save(m, os.path.join(src, "prefill.onnx"))

    report = convert(src, str(tmp_path / "dst"), logits_to_keep=True)
    assert "logits_to_keep" not in report.prefill.metadata and "logits_to_keep" not in report.decode.metadata
    assert any("also read by ArgMax" in n for n in report.prefill.notes), report.prefill.notes
    assert any("converted without logits_to_keep, as the prefill graph is" in n for n in report.decode.notes)
    prompt = _prompt("transformers_llama_mask").tolist()
    want = generate(str(tmp_path / "dst"), prompt_ids=prompt, max_new_tokens=4).token_ids
    assert generate(src, prompt_ids=prompt, max_new_tokens=4).token_ids == want  # generate's own conversion

    one = convert(os.path.join(src, "decode.onnx"), str(tmp_path / "decode.onnx"), stage="decode",
                  logits_to_keep=True)
    assert one.metadata["logits_to_keep"] == "logits_to_keep"
    with pytest.raises(ValueError, match="logits_to_keep: prefill None, decode 'logits_to_keep'"):
        check_pair_metadata(report.prefill.metadata, one.metadata, "generate")
