"""Safe or nothing: observed presents keep their value (CacheExport), unsupported variants and unsafe
layers are left as they were with a reason, the input file is never written, external data works."""
import functools
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP

import rw_graphs as G
import rw_harness as H
from reference import assert_close
from onnx_light_ep.rewrite import ConvertError, convert

MS = (("", 21), ("com.microsoft", 1))
PROMPT = [5, 6, 7, 8, 9, 10, 11]


def _steps(n_decode=3, rows=(PROMPT,)):
    ids, mask = H.left_padded(list(rows))
    steps = [{"input_ids": ids, "attention_mask": mask}]
    for t in range(n_decode):
        mask = np.concatenate([mask, np.ones((len(rows), 1), np.int64)], 1)
        steps.append({"input_ids": np.full((len(rows), 1), 20 + t, np.int64), "attention_mask": mask})
    return steps


def test_present_read_by_another_node_is_exported(tmp_path):
    model = G.decoder(G.decomposed_block, layers=2, extra_present_consumer=True, opsets=(("", 18),))
    report, src, dst = H.convert_model(model, tmp_path, "obs")
    assert [x["exported"] for x in report.layers] == [True, True]
    ops = [n.op_type for n in onnx.load(dst).graph.node]
    assert ops.count("CacheExport") == 2
    assert "present_key_0" in report.removed_outputs      # loop-carried output removed ...
    oa, ob, _ = H.run_pair(src, dst, report, _steps(rows=(PROMPT, PROMPT[2:])), 2)
    for a, b in zip(oa, ob):                              # ... but the node that read it sees the same value
        assert_close(b["present_checksum_0"], a["present_checksum_0"], np.float32)
        assert_close(b["logits"], a["logits"], np.float32)


def test_keep_present_output(tmp_path):
    model = G.decoder(G.concat_attention_block, layers=2)
    report, src, dst = H.convert_model(model, tmp_path, "keep", keep_present=["present_key_1"])
    assert report.kept_outputs == ["present_key_1"] and report.layers[1]["exported"]
    assert not report.layers[0]["exported"]
    outs = [o.name for o in onnx.load(dst).graph.output]
    assert sorted(outs[:-1]) == ["logits", "present_key_1"] and outs[-1] == "kv_cache_seq_lens"
    oa, ob, _ = H.run_pair(src, dst, report, _steps(rows=(PROMPT, PROMPT[2:])), 2)
    for a, b in zip(oa, ob):
        assert b["present_key_1"].shape == a["present_key_1"].shape
        assert_close(b["present_key_1"], a["present_key_1"], np.float32)


def _mixed_block(g, layer, q3, k3, v3, **kw):
    return G.gqa_block(g, layer, q3, k3, v3, smooth_softmax=int(layer == 1), **kw)


def test_unsupported_variant_is_left_as_it_was(tmp_path):
    model = G.decoder(_mixed_block, layers=2, opsets=MS)
    report, src, dst = H.convert_model(model, tmp_path, "mixed")
    assert report.num_layers == 1
    assert len(report.refused) == 1 and "smooth_softmax" in report.refused[0]["reason"]
    assert "smooth_softmax" in str(report)
    out = onnx.load(dst)
    assert [n.op_type for n in out.graph.node].count("GroupQueryAttention") == 1
    assert {"past_key_1", "past_value_1"} <= {i.name for i in out.graph.input}
    assert report.metadata["tensor_pairs"] == [["past_key_1", "present_key_1"], ["past_value_1", "present_value_1"]]
    ids, mask = H.right_padded([PROMPT])
    steps = [{"input_ids": ids, "attention_mask": mask}]
    for t in range(3):
        steps.append({"input_ids": np.array([[30 + t]]), "attention_mask": np.ones((1, len(PROMPT) + t + 1),
                                                                                   np.int64)})
    oa, ob, _ = H.run_pair(src, dst, report, steps, 1)
    for a, b in zip(oa, ob):
        assert_close(b["logits"], a["logits"], np.float32)


def test_every_layer_unsupported_is_an_error(tmp_path):
    model = G.decoder(G.gqa_block, smooth_softmax=1, opsets=MS)
    with pytest.raises(ConvertError, match="smooth_softmax"):
        H.convert_model(model, tmp_path, "smooth")


def test_past_read_elsewhere_is_not_converted(tmp_path):
    def block(g, layer, q3, k3, v3, **kw):
        y = G.decomposed_block(g, layer, q3, k3, v3, **kw)
        g.node("ReduceSum", [f"past_key_{layer}"], out="past_checksum", keepdims=0)
        g.out("past_checksum", TP.FLOAT, [])
        return y

    with pytest.raises(ConvertError, match="also read by ReduceSum"):
        H.convert_model(G.decoder(block, opsets=(("", 18),)), tmp_path, "pastread")


def test_no_pattern_says_what_was_looked_for(tmp_path):
    g = G.GB()
    g.inp("x", TP.FLOAT, ["n", 4])
    g.node("MatMul", ["x", g.weight([4, 4])], out="y")
    g.out("y", TP.FLOAT, ["n", 4])
    src = H.save(g.model([("", 18)]), tmp_path / "mlp.onnx")
    with pytest.raises(ConvertError, match="GroupQueryAttention.*Concat\\(past, new\\)"):
        convert(src, tmp_path / "out.onnx")
    assert not os.path.exists(tmp_path / "out.onnx")


def test_input_file_is_never_modified(tmp_path):
    src = H.save(G.decoder(G.attention_block), tmp_path / "in.onnx")
    before = H.file_digest(src)
    convert(src, tmp_path / "out.onnx")
    assert H.file_digest(src) == before
    with pytest.raises(ConvertError, match="output_path"):
        convert(src, src)
    assert H.file_digest(src) == before
    with pytest.raises(FileNotFoundError):
        convert(tmp_path / "missing.onnx", tmp_path / "x.onnx")


def test_external_data_in_and_out(tmp_path):
    model = G.decoder(G.gqa_block, layers=2, opsets=MS)
    src = str(tmp_path / "ext.onnx")
    onnx.save(model, src, save_as_external_data=True, all_tensors_to_one_file=True, location="ext.weights",
              size_threshold=256)
    assert os.path.getsize(tmp_path / "ext.weights") > 10000
    digests = [H.file_digest(src), H.file_digest(tmp_path / "ext.weights")]
    dst = str(tmp_path / "out" / "conv.onnx")
    report = convert(src, dst)
    assert os.path.isfile(dst + ".data")
    # the data file gets the model file's permissions (onnx writes it owner-only)
    assert os.stat(dst + ".data").st_mode & 0o777 == os.stat(dst).st_mode & 0o777
    assert [H.file_digest(src), H.file_digest(tmp_path / "ext.weights")] == digests
    H.greedy_steps(src, dst, report, [PROMPT], 4, padding="right")
    # an output whose '<output>.data' would overwrite the input's external data is refused
    other = str(tmp_path / "in2.onnx")
    onnx.save(G.decoder(G.gqa_block, layers=2, opsets=MS), other, save_as_external_data=True,
              location="out2.onnx.data", size_threshold=256)
    before = H.file_digest(tmp_path / "out2.onnx.data")
    with pytest.raises(ConvertError, match="external data file"):
        convert(other, str(tmp_path / "out2.onnx"))
    assert H.file_digest(tmp_path / "out2.onnx.data") == before
    assert not os.path.exists(tmp_path / "out2.onnx")


def test_large_models_are_written_with_external_data(tmp_path, monkeypatch):
    from onnx_light_ep.rewrite import _api

    monkeypatch.setattr(_api, "EXTERNAL_DATA_THRESHOLD", 1000)   # stands in for the 2 GB protobuf limit
    src = H.save(G.decoder(G.attention_block), tmp_path / "big.onnx")
    dst = str(tmp_path / "big.light.onnx")
    report = convert(src, dst)
    assert os.path.getsize(dst + ".data") > 1000
    onnx.checker.check_model(dst)
    H.greedy_steps(src, dst, report, [PROMPT], 3)


def test_result_passes_checker_and_declares_domain(tmp_path):
    report, src, dst = H.convert_model(G.decoder(G.concat_attention_block), tmp_path, "chk")
    m = onnx.load(dst)
    onnx.checker.check_model(m)
    assert {(o.domain, o.version) for o in m.opset_import} >= {("ai.onnx_light", 1)}
    assert not report.notes


def test_tensor_scatter_in_place_idiom(tmp_path):
    M = 16
    model = G.decoder(functools.partial(G.tensor_scatter_block, max_len=M), opsets=(("", 24),))
    report, src, dst = H.convert_model(model, tmp_path, "ts")
    assert report.patterns == ["TensorScatter+Attention"]
    assert "write_indices" in [i.name for i in onnx.load(dst).graph.input]
    z = {f"past_{k}_0": np.zeros((1, 2, M, 8), np.float32) for k in ("key", "value")}
    steps, written = [], 0
    for ids in ([5, 6, 7, 8, 9], [10], [11], [12]):
        n = len(ids)
        steps.append({"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, written + n), np.int64),
                      "write_indices": np.array([written], np.int64),
                      "nonpad_kv_seqlen": np.array([written + n], np.int64)})
        written += n
    oa, ob, lengths = H.run_pair(src, dst, report, steps, 1, init_past=z)
    assert lengths == [[5], [6], [7], [8]]
    for a, b in zip(oa, ob):
        assert_close(b["logits"], a["logits"], np.float32)


def test_tiled_expansion_before_attention_is_refused_with_reason(tmp_path):
    model = G.decoder(functools.partial(G.concat_attention_block, tile=True))
    with pytest.raises(ConvertError, match="tiles the kv heads"):
        H.convert_model(model, tmp_path, "tile")


def test_converted_model_runs_on_plain_cpu_with_the_custom_ops(tmp_path, cpu_session, olep):
    """Loads in ORT with only the custom-op library registered (no EP): same logits as on the EP."""
    report, src, dst = H.convert_model(G.decoder(G.decomposed_block, layers=2, opsets=(("", 18),)), tmp_path, "cpu")
    ids, mask = H.left_padded([PROMPT, PROMPT[2:]])
    cpu = cpu_session(onnx.load(dst))
    ep = H.sessions(src, dst)[1]
    with olep.KVCache.for_model(dst, 2, 32) as c1, olep.KVCache.for_model(dst, 2, 32) as c2:
        a = cpu.run(["logits"], {"input_ids": ids, "attention_mask": mask, "kv_cache": c1.handle})[0]
        b = ep.run(["logits"], {"input_ids": ids, "attention_mask": mask, "kv_cache": c2.handle})[0]
    assert_close(a, b, np.float32)


def test_external_data_does_not_depend_on_the_current_directory(tmp_path, monkeypatch):
    """A '<output>.data' file in the *current* directory (e.g. running from the model's own
    folder) must not break or be touched by a convert that writes elsewhere."""
    model = G.decoder(G.gqa_block, layers=2, opsets=MS)
    src = str(tmp_path / "model.onnx")
    onnx.save(model, src, save_as_external_data=True, all_tensors_to_one_file=True, location="model.onnx.data",
              size_threshold=256)
    digest = H.file_digest(tmp_path / "model.onnx.data")
    monkeypatch.chdir(tmp_path)
    dst = str(tmp_path / "out" / "model.onnx")
    report = convert(src, dst)
    assert os.path.isfile(dst + ".data")
    assert H.file_digest(tmp_path / "model.onnx.data") == digest
    H.greedy_steps(src, dst, report, [PROMPT], 3, padding="right")


def test_sliding_window_option_applies_to_every_pattern(tmp_path):
    """--sliding-window reaches the CacheAttention attribute and the metadata for the
    Attention and GroupQueryAttention patterns too, not only the decomposed chain."""
    import json

    data = os.path.join(os.path.dirname(__file__), "..", "data")
    for name in ("dynamo_op23_llama.onnx", "genai_llama_fp32.onnx", "optimum_op18_llama.onnx"):
        dst = str(tmp_path / name)
        convert(os.path.join(data, name), dst, sliding_window=8)
        m = onnx.load(dst, load_external_data=False)
        wins = [a.i for n in m.graph.node if n.op_type == "CacheAttention" for a in n.attribute
                if a.name == "local_window_size"]
        assert wins and set(wins) == {8}, (name, wins)
        meta = {p.key: p.value for p in m.metadata_props}
        layers = json.loads(meta["onnx_light.layers"])
        assert {l["local_window_size"] for l in layers} == {8}, name


def test_tokenizer_files_follow_the_converted_model(tmp_path):
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    src = H.save(G.decoder(G.gqa_block, layers=2, opsets=MS), src_dir / "model.onnx")
    (src_dir / "tokenizer.json").write_text('{"version": "1.0"}')
    (src_dir / "chat_template.jinja").write_text("{{ messages }}")
    dst = str(tmp_path / "out" / "model.onnx")
    convert(src, dst)
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"version": "1.0"}'
    assert (tmp_path / "out" / "chat_template.jinja").is_file()
