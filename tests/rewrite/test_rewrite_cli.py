"""The console script: convert / compare / generate subcommands (``onnx_light_ep.cli.main``)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import onnx

import rw_graphs as G
import rw_harness as H
from onnx_light_ep.cli import main

MS = (("", 21), ("com.microsoft", 1))


def _model(tmp_path, block=G.gqa_block, opsets=MS, **kw):
    return H.save(G.decoder(block, layers=2, opsets=opsets, **kw), tmp_path / "model.onnx")


def test_convert_command(tmp_path, capsys):
    src = _model(tmp_path)
    dst, rep = str(tmp_path / "out.onnx"), str(tmp_path / "report.json")
    assert main(["convert", src, "-o", dst, "--json", rep]) == 0
    out = capsys.readouterr().out
    assert "2 layer(s) -> ai.onnx_light.CacheAttention (GroupQueryAttention)" in out
    report = json.load(open(rep))
    assert report["num_layers"] == 2 and report["metadata"]["cache_input"] == "kv_cache"
    assert [i.name for i in onnx.load(dst).graph.input] == ["input_ids", "attention_mask", "kv_cache"]


@pytest.mark.parametrize("flag", [[], ["--no-fuse-gqa"]])
def test_convert_command_gqa_form(tmp_path, flag):
    """Packed QKV + rotary: one CacheAttention per layer by default; --no-fuse-gqa keeps the
    QKV Split and the RotaryEmbedding nodes in front of it."""
    src = _model(tmp_path, d=16, packed=True, do_rotary=True)
    dst = str(tmp_path / "out.onnx")
    assert main(["convert", src, "-o", dst] + flag) == 0
    ops = [n.op_type for n in onnx.load(dst).graph.node]
    assert ops.count("CacheAttention") == 2
    assert (ops.count("Split"), ops.count("RotaryEmbedding")) == ((2, 4) if flag else (0, 0))


def test_convert_command_errors(tmp_path, capsys):
    g = G.GB()
    g.inp("x", 1, ["n", 4])
    g.node("Relu", ["x"], out="y")
    g.out("y", 1, ["n", 4])
    src = H.save(g.model([("", 18)]), tmp_path / "relu.onnx")
    assert main(["convert", src, "-o", str(tmp_path / "o.onnx")]) == 2
    assert "Looked for" in capsys.readouterr().err
    assert main(["convert", src, "-o", src]) == 2


def test_compare_command(tmp_path, capsys):
    src = _model(tmp_path, G.decomposed_block, opsets=(("", 18),))
    js = str(tmp_path / "cmp.json")
    png = str(tmp_path / "cmp.png")
    code = main(["compare", src, "--prompt-ids", "3,4,5,6,7,8,9,10", "--batch-size", "2", "--steps", "8",
                 "--json", js, "--plot", png])
    out, err = capsys.readouterr()
    assert "compare OK: batch 2, prefill 8 + 8 greedy steps" in out
    data = json.load(open(js))
    assert data["ok"] and len(data["steps"]) == 9 and data["steps"][1]["ep_bytes_copied"] == 0
    assert data["steps"][1]["ort_bytes_copied"] > 0
    # matplotlib comes with the test extra (plot): --plot must write a real PNG.
    assert code == 0, err
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_compare_command_reports_mismatch(tmp_path, capsys):
    """A converted model that differs from its original: non-zero exit."""
    src = _model(tmp_path, G.concat_attention_block, opsets=(("", 23),))
    other = H.save(G.decoder(G.concat_attention_block, layers=2, seed=1), tmp_path / "other.onnx")
    dst = str(tmp_path / "other.light.onnx")
    assert main(["convert", other, "-o", dst]) == 0
    assert main(["compare", src, dst, "--steps", "2", "-q"]) == 1
    assert "MISMATCH" in capsys.readouterr().out


def test_generate_command(tmp_path, capsys):
    src = _model(tmp_path)
    dst = str(tmp_path / "g.onnx")
    assert main(["convert", src, "-o", dst]) == 0
    capsys.readouterr()
    assert main(["generate", dst, "--prompt-ids", "3,4,5;6,7", "--max-new-tokens", "6", "-q"]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if "ids:" in ln]
    assert len(lines) == 2 and len(json.loads(lines[0].split("ids: ")[1])) == 6
    # sampling is reproducible with a seed
    args = ["generate", dst, "--prompt-ids", "3,4,5", "--max-new-tokens", "8", "--temperature", "0.8",
            "--top-k", "20", "--top-p", "0.9", "--seed", "7", "-q"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first


def test_generate_with_quantized_pages(tmp_path, capsys):
    """--kv-quant int8 with every page cold (recent 0, sinks 0) on the mini decoder: greedy tokens
    as the native cache's; int4 on its head_dim 8 is a usage error naming the rule; bad
    cache_options from Python are ValueErrors naming cache_options."""
    from onnx_light_ep.generate import generate

    src = _model(tmp_path)
    dst = str(tmp_path / "q.onnx")
    assert main(["convert", src, "-o", dst]) == 0
    capsys.readouterr()
    ids = "3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31,32,33,34,35,36"
    base = ["generate", dst, "--prompt-ids", ids, "--max-new-tokens", "6", "-q", "--no-stream"]
    assert main(base) == 0
    native = capsys.readouterr().out
    assert main(base + ["--kv-quant", "int8", "--recent-tokens", "0", "--sink-tokens", "0"]) == 0
    assert capsys.readouterr().out == native  # (default pages are larger than this run: all native)
    prompt = [[int(x) for x in ids.split(",")]]
    plain = generate(dst, prompt_ids=prompt, max_new_tokens=6, cache_options={"page_tokens": 32})
    quant = generate(dst, prompt_ids=prompt, max_new_tokens=6, cache_options={
        "page_tokens": 32, "kv_quant": "int8", "recent_tokens": 0, "sink_tokens": 0})  # page 0 quantized
    assert quant.token_ids == plain.token_ids
    assert main(base + ["--kv-quant", "int4"]) == 2
    assert "multiples of 32" in capsys.readouterr().err
    for bad, words in [("int8", "expected a dict"), ({"kv_quantt": "int8"}, "unknown key(s) 'kv_quantt'"),
                       ({"batch_size": 3}, "unknown key(s) 'batch_size'")]:
        with pytest.raises(ValueError, match=r"cache_options") as e:
            generate(dst, prompt_ids=[[3, 4]], max_new_tokens=2, cache_options=bad)
        assert words in str(e.value)


def test_generate_matches_greedy_of_plain_ort(tmp_path):
    from onnx_light_ep.generate import generate

    src = _model(tmp_path)
    res = generate(src, prompt_ids=[[3, 4, 5, 6]], max_new_tokens=8)   # unconverted: converted on the fly
    report, _, dst = H.convert_model(G.decoder(G.gqa_block, layers=2, opsets=MS), tmp_path, "again")
    _, gen = H.greedy_steps(src, dst, report, [[3, 4, 5, 6]], 7, padding="right")
    assert res.token_ids[0] == gen[0]
    assert res.providers[0] == H.EP_NAME and res.decode_steps == 7


def test_sample_next_filters():
    from onnx_light_ep.generate import sample_next

    logits = np.array([[0.0, 5.0, 4.0, -1.0]])
    assert sample_next(logits).tolist() == [1]
    rng = np.random.default_rng(0)
    picks = {int(sample_next(logits, temperature=1.0, top_k=2, rng=rng)[0]) for _ in range(200)}
    assert picks == {1, 2}
    picks = {int(sample_next(logits, temperature=1.0, top_p=0.5, rng=rng)[0]) for _ in range(50)}
    assert picks == {1}


def test_module_entry_point_help():
    out = subprocess.run([sys.executable, "-m", "onnx_light_ep", "--help"], capture_output=True, text=True,
                         env=dict(os.environ), check=True).stdout
    for cmd in ("convert", "compare", "generate", "demo"):
        assert cmd in out


def test_generate_and_compare_refuse_bad_arguments(tmp_path, capsys):
    src = _model(tmp_path)
    dst = str(tmp_path / "g.onnx")
    assert main(["convert", src, "-o", dst]) == 0
    capsys.readouterr()
    base = ["generate", dst, "--max-new-tokens", "2", "-q"]
    cases = [
        (["--prompt-ids", "3,4", "--temperature", "-1"], "temperature; expected a finite number >= 0"),
        (["--prompt-ids", "3,4", "--temperature", "nan"], "temperature; expected a finite number >= 0"),
        (["--prompt-ids", "3,4", "--tokenizer", str(tmp_path / "nope")], "tokenizer_dir; expected a folder"),
        (["--prompt-ids", "1,,x"], "--prompt-ids; expected comma-separated integers"),
        (["--prompt-ids", "3,100000"], "expected token ids in [0, "),
        (["--prompt-ids", "3,-2"], "expected token ids in [0, "),
    ]
    for extra, words in cases:
        assert main(base + extra) == 2, extra
        assert words in capsys.readouterr().err, extra
    assert main(["generate", str(tmp_path / "missing.onnx"), "--prompt-ids", "3"]) == 2
    assert "generate: model; expected an ONNX file" in capsys.readouterr().err
    assert main(["generate", str(tmp_path), "--prompt-ids", "3"]) == 2
    assert "(a folder)" in capsys.readouterr().err
    assert main(["compare", src, dst, "--steps", "-1", "-q"]) == 2
    assert "steps; expected >= 0" in capsys.readouterr().err


def test_generate_refuses_more_tokens_than_positions(tmp_path):
    from onnx_light_ep.generate import generate
    from onnx_light_ep.rewrite import read_metadata

    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "genai_llama_fp32.onnx")
    dst = str(tmp_path / "g.onnx")
    assert main(["convert", src, "-o", dst]) == 0
    limit = read_metadata(dst).get("max_position")
    assert limit, "the genai builder's export records its rotary table length"
    with pytest.raises(ValueError, match=rf"exceeds the model's {limit} positions .*max_new_tokens <= {limit - 3}"):
        generate(dst, prompt_ids=[[3, 4, 5]], max_new_tokens=limit)


def test_generate_failure_keeps_what_was_generated(tmp_path, capsys):
    """A run failing mid-generation reports the tokens generated so far and the reason."""
    from onnx_light_ep import InferenceSession
    from onnx_light_ep.generate import GenerateError, generate

    src = _model(tmp_path)
    dst = str(tmp_path / "g.onnx")
    assert main(["convert", src, "-o", dst]) == 0
    sess = InferenceSession(dst)
    real_run, calls = sess.run, []

    def run(*a, **k):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("simulated failure")
        return real_run(*a, **k)

    sess.run = run
    with pytest.raises(GenerateError, match="step 3 failed after 3 generated token") as e:
        generate(dst, prompt_ids=[[3, 4, 5]], max_new_tokens=8, session=sess, eos_token_ids=[])
    assert len(e.value.partial.token_ids[0]) == 3 and "simulated failure" in str(e.value)


def test_compare_output_units_and_quiet(tmp_path, capsys):
    src = _model(tmp_path)
    assert main(["compare", src, "--steps", "3", "--prompt-ids", "3,4,5"]) == 0
    out = capsys.readouterr().out
    step_lines = [ln for ln in out.splitlines() if ln.startswith("step")]
    assert step_lines and all("ORT/EP x" in ln for ln in step_lines)
    assert all(" B" in ln.split("copied ort ")[1] for ln in step_lines)  # B/KiB/MiB, one family
    assert "(ORT/EP " in out.splitlines()[-1] and "EP 0 B" in out.splitlines()[-1]
    assert main(["compare", src, "--steps", "3", "--prompt-ids", "3,4,5", "-q"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("compare OK")
