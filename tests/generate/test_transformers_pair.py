"""transformers' own exporter (OnnxExporter.export_for_generation): a prefill.onnx + decode.onnx pair
(tests/data/transformers_*/, tools/make_test_models.py) converts into a pair that runs on one KVCache
and matches plain ORT on the original pair.

- transformers_llama, transformers_gpt2: exported from rows of equal length, so the graphs have no
  attention_mask; the causal mask is built from Shape(past) (Llama) or Shape(present) (GPT-2), which
  the converted graphs read from the cache (CacheShape). Batch 2 means rows of equal length.
- transformers_llama_mask: exported from a left-padded batch, so the graphs take attention_mask;
  batch 2 is left-padded.
- transformers_llama_op23: exported at opset 23, where attention is ONNX Attention (stateless, over
  the new rows in the prefill graph, over Concat(past, new) in the decode graph); no attention_mask.

fp32 tolerance: compare's DEFAULT_TOL["float32"], |dlogits| <= 1e-4 + 1e-5 * |logit| at every real
position, and equal argmax (ties excepted), over a prefill and 16 greedy steps.
"""
import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest

from onnx_light_ep.compare import DEFAULT_TOL, compare
from onnx_light_ep.generate import generate
from onnx_light_ep.rewrite import convert, read_metadata

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
ROOT = os.path.dirname(os.path.dirname(DATA))
MANIFEST = json.load(open(os.path.join(DATA, "manifest.json")))["models"]
PAIRS = ["transformers_llama", "transformers_llama_mask", "transformers_gpt2", "transformers_llama_op23"]
PATTERNS = {"prefill": "decomposed (no past)", "decode": "Concat+decomposed"}
PATTERNS_OP23 = {"prefill": "stateless Attention (no past)", "decode": "Concat+Attention"}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """name -> (report, output folder): each fixture pair converted once."""
    out = {}

    def get(name):
        if name not in out:
            dst = str(tmp_path_factory.mktemp(name) / "light")
            out[name] = (convert(os.path.join(DATA, name), dst), dst)
        return out[name]
    return get


def _graph(path):
    return onnx.load(path, load_external_data=False).graph


@pytest.mark.parametrize("name", PAIRS)
def test_the_pair_converts_every_layer(converted, name):
    report, dst = converted(name)
    entry = MANIFEST[name]
    for stage, r in (("prefill", report.prefill), ("decode", report.decode)):
        assert r.num_layers == entry["num_layers"] == 2 and not r.refused, r
        assert r.metadata["stage"] == stage and read_metadata(r.output_path)["stage"] == stage
        g = _graph(r.output_path)
        assert not [i.name for i in g.input if ".cache." in i.name], stage    # no past left
        assert not [o.name for o in g.output if ".cache." in o.name], stage   # no present left
    want = PATTERNS_OP23 if name.endswith("_op23") else PATTERNS
    assert report.prefill.patterns == [want["prefill"]] and report.decode.patterns == [want["decode"]]
    assert len(report.decode.removed_inputs) == 4 and len(report.prefill.removed_outputs) == 4
    has_mask = entry["graphs"]["decode"]["has_attention_mask"]
    assert has_mask == (name == "transformers_llama_mask")
    shapes = [n for n in _graph(report.decode.output_path).node if n.op_type == "CacheShape"]
    # without attention_mask the Shape(past)/Shape(present) the mask is built from reads the cache
    assert bool(shapes) == (not has_mask)
    assert sorted(os.listdir(dst)) == ["decode.onnx", "prefill.onnx"]


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("name", PAIRS)
def test_the_converted_pair_matches_plain_ort(converted, name, batch):
    _, dst = converted(name)
    res = compare(os.path.join(DATA, name), dst, batch_size=batch, prefill=12, steps=16)
    assert (res.atol, res.rtol) == DEFAULT_TOL["float32"] == (1e-4, 1e-5)
    assert res.ok, res.summary()
    assert len(res.steps) == 17 and all(s.agree for s in res.steps)
    assert all(s.ep_bytes_copied == 0 for s in res.steps)
    if batch == 2:
        padded = name == "transformers_llama_mask"
        assert (res.prompt_lengths[0] != res.prompt_lengths[1]) == padded, res.prompt_lengths


@pytest.mark.parametrize("name", PAIRS)
def test_generate_on_the_pair_reproduces_the_golden(converted, name):
    """Step 0 on the prefill graph, 31 steps on the decode graph: the plain-ORT golden's 32 ids
    (which equal PyTorch's), for the row alone and as row 0 of a batch of two."""
    _, dst = converted(name)
    golden = np.load(os.path.join(DATA, f"{name}.npz"))
    prompt = golden["prompt_ids"][0].tolist()
    want = golden["generated_ids"][0].tolist()
    res = generate(dst, prompt_ids=[prompt], max_new_tokens=32, eos_token_ids=[])
    assert res.token_ids == [want] and res.decode_steps == 31
    other = prompt[3:] + prompt[:3]
    res2 = generate(dst, prompt_ids=[prompt, other], max_new_tokens=32, eos_token_ids=[])
    assert res2.token_ids[0] == want


class _Counting:
    """A session that counts its runs and the input lengths it saw."""

    def __init__(self, session):
        self.session, self.lengths = session, []

    def run(self, names, feeds, *a, **k):
        self.lengths.append(int(feeds["input_ids"].shape[1]))
        return self.session.run(names, feeds, *a, **k)

    def __getattr__(self, name):
        return getattr(self.session, name)


def test_step_0_runs_the_prefill_graph_and_later_steps_the_decode_graph(converted):
    import onnx_light_ep as ole

    _, dst = converted("transformers_llama")
    pre, dec = (_Counting(ole.InferenceSession(os.path.join(dst, f"{s}.onnx"))) for s in ("prefill", "decode"))
    res = generate(dst, prompt_ids=[[1, 601, 960, 908, 177]], max_new_tokens=6, eos_token_ids=[], session=(pre, dec))
    assert pre.lengths == [5] and dec.lengths == [1] * 5 and len(res.token_ids[0]) == 6
    with pytest.raises(ValueError, match="session; expected \\(prefill session, decode session\\)"):
        generate(dst, prompt_ids=[[1, 2]], max_new_tokens=2, eos_token_ids=[], session=pre)


def test_rows_of_unequal_length_need_an_attention_mask(converted):
    _, dst = converted("transformers_llama")
    with pytest.raises(ValueError, match="no attention_mask input .* equal length"):
        generate(dst, prompt_ids=[[1, 2, 3], [4, 5]], max_new_tokens=2, eos_token_ids=[])
    with pytest.raises(ValueError, match="no attention_mask input .* equal length"):
        compare(os.path.join(DATA, "transformers_llama"), dst, prompt_ids=[[1, 2, 3], [4, 5]], batch_size=2,
                steps=1)
    _, dst_mask = converted("transformers_llama_mask")
    res = generate(dst_mask, prompt_ids=[[1, 2, 3], [4, 5]], max_new_tokens=2, eos_token_ids=[])
    assert [len(t) for t in res.token_ids] == [2, 2]


def test_one_graph_at_a_time_gives_the_same_metadata(converted, tmp_path):
    report, dst = converted("transformers_gpt2")
    src = os.path.join(DATA, "transformers_gpt2")
    for stage in ("prefill", "decode"):
        r = convert(os.path.join(src, f"{stage}.onnx"), tmp_path / f"{stage}.onnx", stage=stage)
        assert read_metadata(r.output_path) == read_metadata(os.path.join(dst, f"{stage}.onnx"))
    golden = np.load(os.path.join(DATA, "transformers_gpt2.npz"))
    prompt = golden["prompt_ids"][0].tolist()
    res = generate((tmp_path / "prefill.onnx", tmp_path / "decode.onnx"), prompt_ids=[prompt], max_new_tokens=8,
                   eos_token_ids=[])
    assert res.token_ids[0] == golden["generated_ids"][0, :8].tolist()


def test_graphs_of_two_exports_do_not_pair(converted):
    _, llama = converted("transformers_llama")
    _, gpt2 = converted("transformers_gpt2")
    with pytest.raises(ValueError, match="cannot share one KVCache.*kv_num_heads: prefill 2, decode 4"):
        generate((os.path.join(llama, "prefill.onnx"), os.path.join(gpt2, "decode.onnx")), prompt_ids=[[1, 2]],
                 max_new_tokens=2)
    with pytest.raises(ValueError, match="stage='decode'; expected 'prefill'"):
        generate((os.path.join(llama, "decode.onnx"), os.path.join(llama, "prefill.onnx")), prompt_ids=[[1, 2]],
                 max_new_tokens=2)
    with pytest.raises(ValueError, match="is the decode graph of a prefill/decode pair"):
        generate(os.path.join(llama, "decode.onnx"), prompt_ids=[[1, 2]], max_new_tokens=2)


def test_cli_converts_compares_and_generates_the_folder(tmp_path):
    src = os.path.join(DATA, "transformers_llama")
    dst = str(tmp_path / "light")

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "onnx_light_ep", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=300)

    r = cli("convert", src, "-o", dst)
    assert r.returncode == 0, r.stderr
    assert "prefill/decode pair" in r.stdout and r.stdout.count("2 layer(s)") == 2
    r = cli("compare", src, dst, "--batch-size", "2", "--steps", "16", "-q")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("compare OK: batch 2") and "16 greedy steps" in r.stdout
    r = cli("generate", os.path.join(dst, "prefill.onnx"), "--decode", os.path.join(dst, "decode.onnx"),
            "--prompt-ids", "1,601,960,908,177,937,725,692", "--max-new-tokens", "4", "-q")
    assert r.returncode == 0, r.stderr
    want = np.load(os.path.join(DATA, "transformers_llama.npz"))["generated_ids"][0, :4].tolist()
    assert f"[0] ids: {want}" in r.stdout
    r = cli("generate", os.path.join(dst, "decode.onnx"), "--prompt-ids", "1,2", "-q")
    assert r.returncode == 2 and r.stderr.startswith("error: generate: model;") and "Traceback" not in r.stderr
