"""Each source pattern, end to end: convert, then original (plain ORT) vs converted (EP + KVCache).

Mini decoders from rw_graphs (2 layers, GQA 4/2 heads), prefill of 9 tokens
plus 32 greedy steps, batch 1 and batch 2 (padded on the exporter's side),
logits within 1e-4 at every real position and identical argmax.
"""
import functools

import onnx
import pytest

import rw_graphs as G
import rw_harness as H

MS = (("", 21), ("com.microsoft", 1))
PATTERNS = {
    "gqa": (functools.partial(G.decoder, G.gqa_block, opsets=MS), "right", "GroupQueryAttention"),
    "gqa_packed_rotary": (functools.partial(G.decoder, G.gqa_block, d=16, packed=True, do_rotary=True, opsets=MS),
                          "right", "GroupQueryAttention"),
    "gqa_rotary_interleaved_softcap": (functools.partial(G.decoder, G.gqa_block, d=16, do_rotary=True, interleaved=1,
                                                         softcap=5.0, opsets=MS), "right", "GroupQueryAttention"),
    "attention_4d": (functools.partial(G.decoder, G.attention_block), "left", "Attention"),
    "attention_3d_float_mask": (functools.partial(G.decoder, G.attention_block, rank=3, mask="float"), "left",
                                "Attention"),
    "concat_attention": (functools.partial(G.decoder, G.concat_attention_block), "left", "Concat+Attention"),
    "decomposed_torchlib": (functools.partial(G.decoder, G.decomposed_block, opsets=(("", 18),)), "left",
                            "Concat+decomposed"),
    "decomposed_eager_softcap": (functools.partial(G.decoder, G.decomposed_block, style="eager", softcap=4.0,
                                                   opsets=(("", 18),)), "left", "Concat+decomposed"),
}
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13]


@pytest.mark.parametrize("name", sorted(PATTERNS))
@pytest.mark.parametrize("batch", [1, 2])
def test_pattern_matches_plain_ort(name, batch, tmp_path):
    make, padding, pattern = PATTERNS[name]
    report, src, dst = H.convert_model(make(layers=2), tmp_path, name)
    assert report.patterns == [pattern]
    assert report.num_layers == 2 and not report.refused
    assert sorted(report.removed_inputs) == sorted(f"past_{k}_{l}" for k in ("key", "value") for l in range(2))
    assert sorted(report.removed_outputs) == sorted(f"present_{k}_{l}" for k in ("key", "value") for l in range(2))
    assert report.metadata["padding_side"] == padding
    rows = [PROMPT] if batch == 1 else [PROMPT, PROMPT[3:]]
    worst, gen = H.greedy_steps(src, dst, report, rows, 32, padding=padding, atol=1e-4)
    assert len(gen[0]) == 33

    out = onnx.load(dst)
    assert [i.name for i in out.graph.input] == ["input_ids", "attention_mask", "kv_cache"]
    assert [o.name for o in out.graph.output] == ["logits", "kv_cache_seq_lens"]
    ops = [n.op_type for n in out.graph.node]
    assert ops.count("CacheAttention") == 2 and "CacheExport" not in ops
    # The commit point: one CacheCommit after every other output; the layers defer to it.
    commit = [n for n in out.graph.node if n.op_type == "CacheCommit"]
    assert len(commit) == 1 and list(commit[0].input) == ["kv_cache", "logits"]
    assert list(commit[0].output) == ["kv_cache_seq_lens"] and report.metadata["commit_output"] == "kv_cache_seq_lens"
    assert all(onnx.helper.get_attribute_value(a) == 1 for n in out.graph.node if n.op_type == "CacheAttention"
               for a in n.attribute if a.name == "commit_node")
    assert not {"GroupQueryAttention", "Attention", "Softmax"} & set(ops)
    if pattern == "GroupQueryAttention":  # one attention node per layer, as the original has
        assert not {"Split", "RotaryEmbedding"} & set(ops), ops
    layers = [onnx.helper.get_attribute_value(a) for n in out.graph.node if n.op_type == "CacheAttention"
              for a in n.attribute if a.name == "layer"]
    assert layers == [0, 1]


@pytest.mark.parametrize("name", ["gqa_packed_rotary", "gqa_rotary_interleaved_softcap"])
def test_unfused_gqa_form_matches_plain_ort(name, tmp_path):
    """convert(fuse_gqa=False) keeps QKV Split / RotaryEmbedding in front of CacheAttention."""
    make, padding, _ = PATTERNS[name]
    report, src, dst = H.convert_model(make(layers=2), tmp_path, name, fuse_gqa=False)
    H.greedy_steps(src, dst, report, [PROMPT, PROMPT[3:]], 16, padding=padding, atol=1e-4)
    ops = [n.op_type for n in onnx.load(dst).graph.node]
    assert ops.count("CacheAttention") == 2 and ops.count("RotaryEmbedding") == 4
    assert ("Split" in ops) == (name == "gqa_packed_rotary")


def test_cache_attention_runs_on_the_ep(tmp_path, providers_that_ran, olep):
    """The converted model's CacheAttention nodes are executed by OnnxLightExecutionProvider."""
    report, src, dst = H.convert_model(G.decoder(G.gqa_block, opsets=MS, layers=2), tmp_path, "ep")
    ids, mask = H.right_padded([PROMPT])
    cache = olep.KVCache.for_model(dst, 1, 32)
    feeds = {"input_ids": ids, "attention_mask": mask, "kv_cache": cache.handle}

    def factory(so):
        return olep.InferenceSession(dst, so)

    assert providers_that_ran(factory, feeds, "CacheAttention") == {H.EP_NAME}
    cache.close()


def test_position_ids_input_is_kept(tmp_path):
    """Inputs other than past/present keep their names (position_ids fed unchanged)."""
    report, src, dst = H.convert_model(G.decoder(G.attention_block, position_ids=True), tmp_path, "pos")
    names = [i.name for i in onnx.load(dst).graph.input]
    assert names == ["input_ids", "attention_mask", "position_ids", "kv_cache"]
    assert report.metadata["inputs"] == {"input_ids": "input_ids", "attention_mask": "attention_mask",
                                         "position_ids": "position_ids", "inputs_embeds": None}


def test_metadata_sizes_the_cache(tmp_path, olep):
    report, src, dst = H.convert_model(G.decoder(G.decomposed_block, layers=3, hq=6, hkv=3, d=4,
                                                 opsets=(("", 18),)), tmp_path, "meta")
    from onnx_light_ep.rewrite import read_metadata

    meta = read_metadata(dst)
    assert (meta["num_layers"], meta["kv_num_heads"], meta["head_dim"], meta["v_head_dim"], meta["dtype"]) == \
        (3, 3, 4, 4, "float32")
    assert meta["cache_input"] == "kv_cache" and meta["source_pattern"] == "Concat+decomposed"
    assert [x["past_key"] for x in meta["layers"]] == ["past_key_0", "past_key_1", "past_key_2"]
    with olep.KVCache.for_model(dst, 2, 16) as c:
        assert (c.num_layers, c.batch_size, c.kv_num_heads, c.head_dim, c.dtype, c.max_sequence_length) == \
            (3, 2, 3, 4, "float32", 16)
    sess = H.sessions(src, dst)[1]
    with olep.KVCache.for_model(sess, 1, 8) as c:
        assert c.num_layers == 3
    with pytest.raises(ValueError, match="max_sequence_length"):
        olep.KVCache.for_model(dst, 1)
    with pytest.raises(ValueError, match="onnx_light"):
        olep.KVCache.for_model(src, 1, 8)


def test_gqa_records_max_position(tmp_path, olep):
    report, src, dst = H.convert_model(G.decoder(G.gqa_block, d=16, do_rotary=True, max_pos=48, opsets=MS),
                                       tmp_path, "maxpos")
    assert report.metadata["max_position"] == 48
    with olep.KVCache.for_model(dst, 1) as c:
        assert c.max_sequence_length == 48
