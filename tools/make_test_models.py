#!/usr/bin/env python3
"""Regenerate the exported decoder fixtures in ``tests/data/`` (fixed seed, fully offline).

Small random-weight decoders (Llama with GQA, Qwen2 with QKV bias, GPT-2 with learned
positions and MHA) are built with transformers from tiny configs and exported with the
exporters people really use:

* ``genai``   -- onnxruntime-genai model builder (``python -m onnxruntime_genai.models.builder``),
                 fp32 and int4, CPU: ``com.microsoft.GroupQueryAttention``.
* ``dynamo``  -- ``torch.onnx.export(dynamo=True)`` through a thin wrapper module that takes flat
                 ``past_key_values.N.key/value`` tensors and returns ``logits`` + flat
                 ``present.N.key/value``: opset 23 (ONNX ``Attention``) and opset 18
                 (MatMul/Softmax/MatMul).
* ``optimum`` -- ``optimum-cli export onnx --task text-generation-with-past --opset 18``, run in
                 a separate virtualenv because optimum-onnx pins transformers < 4.58.
* ``transformers`` -- transformers' own exporter (``transformers.exporters.OnnxExporter``,
                 ``export_for_generation``): a prefill/decode pair, written as the folder
                 ``tests/data/NAME/`` holding ``prefill.onnx`` and ``decode.onnx``.
* ``ortopt``  -- ONNX Runtime's transformer tooling (``onnxruntime.transformers``): GPT-2 through
                 ``models.gpt2.convert_to_onnx -o`` (``com.microsoft.Attention`` with the stacked
                 ``past`` [2, batch, heads, past, head_dim]) and an MHA Llama through the
                 ``models.llama`` recipe (TorchScript export, then ``optimize_model(model_type="gpt2")``:
                 ``com.microsoft.MultiHeadAttention`` with past_key/past_value), run in a virtualenv
                 with transformers 4.36: the optimizer's fusions match only the graphs of that era.
                 On the other fixtures (transformers 4.57 / 5.x graphs) the optimizer of ORT 1.32
                 fuses no attention at all (see tests/data/README.md).

All models of one family share the same weights (same seed, same Hugging Face folder), so their
fp32 goldens agree; each fp32 export is checked against a PyTorch reference (full recompute
without a cache) before it is written.

For each fixture ``NAME`` it writes ``tests/data/NAME.onnx`` (weights embedded, one file; a pair:
``tests/data/NAME/prefill.onnx`` and ``decode.onnx``),
``tests/data/NAME.npz`` (golden: ``prompt_ids`` [1, 8], ``generated_ids`` [1, 32] from 32 greedy
steps on plain ONNX Runtime CPUExecutionProvider feeding ``present`` back as ``past``,
``prefill_logits`` [1, 8, vocab], ``min_margin`` = smallest top-1/top-2 logit gap over the 32
steps), and one entry of ``tests/data/manifest.json``.

Usage (see tests/data/README.md for the versions it was run with)::

    HF_HUB_OFFLINE=1 python tools/make_test_models.py            # everything, into tests/data
    python tools/make_test_models.py --only genai_llama_fp32 dynamo_op23_gpt2
    python tools/make_test_models.py --list

Needs torch, transformers 5.x, onnxscript, onnxruntime-genai, onnx and onnxruntime in the running
interpreter; the optimum exports need a virtualenv with optimum-onnx (``--optimum-venv``,
created with pinned versions when missing unless ``--no-create-venv``), the ortopt exports one with
transformers 4.36 over the main environment's torch and onnxruntime (``--ort-venv``, likewise).
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "tests" / "data"
DEFAULT_VENV = Path("/tmp/venv-optimum")
DEFAULT_ORT_VENV = Path("/tmp/venv-ort-transformers")

SEED = 0
# batch 1, 8 tokens. Picked once among 24 seeded random prompts: with it every family's 32 greedy
# steps keep a top-1/top-2 logit gap >= 0.05 (fp32 exporter noise is ~1e-5) and do not collapse
# into a 1-2 token loop, so the goldens are robust and still exercise the cache.
PROMPT_IDS = [1, 601, 960, 908, 177, 937, 725, 692]
GREEDY_STEPS = 32

# Pinned for the optimum virtualenv. torch first, from its own command, so pip never pulls another
# (CUDA) build; it is pinned again on the second command line.
TORCH_PIN = "torch==2.13.0"
OPTIMUM_PINS = ["optimum-onnx==0.1.0", "optimum==2.1.0", "transformers==4.57.6", "accelerate==1.15.0",
                "onnxruntime==1.32.0", "onnx==1.23.2"]
# The ortopt virtualenv (--system-site-packages: torch, onnx and onnxruntime of the main environment)
# gets the transformers of the era ORT's fusions were written for, and the tokenizers/hub it needs.
ORT_TOOLING_PINS = ["transformers==4.36.2", "tokenizers==0.15.2", "huggingface-hub==0.36.2"]

# The final norm's weight is multiplied by LOGIT_SCALE: logits with a std of ~5 give greedy
# top-1/top-2 margins well above fp32 noise, while attention (init 0.2) stays soft.
LOGIT_SCALE = 3.0
FINAL_NORM_WEIGHTS = {"model.norm.weight", "transformer.ln_f.weight", "transformer.ln_f.bias"}

# ---------------------------------------------------------------------------------------------
# Tiny configs. hidden 64, 2 layers, vocab 1000; no linear layer other than the LM head is 1000
# wide (the genai builder takes any linear of vocab width for the LM head). Embeddings are tied,
# as in SmolLM2 / small Qwen2 / GPT-2. Non-default RoPE bases so a wrong rotary base shows.
# initializer_range 0.2 (not 0.02): attention scores far from uniform (yet not one-hot), so the
# goldens are sensitive to attention/cache bugs.
# ---------------------------------------------------------------------------------------------
VOCAB = 1000
COMMON = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
              initializer_range=0.2)

FAMILIES = {
    "llama": dict(cls="LlamaConfig", kwargs=dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, **COMMON)),
    "qwen2": dict(cls="Qwen2Config", kwargs=dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
        use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **COMMON)),
    # Llama with as many kv heads as query heads: com.microsoft.MultiHeadAttention has no GQA (ORT's
    # optimizer fuses a GQA Llama into an MHA node that ORT then rejects at session creation).
    "llama_mha": dict(cls="LlamaConfig", kwargs=dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=512, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, **COMMON)),
    "gpt2": dict(cls="GPT2Config", kwargs=dict(
        n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=512,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **COMMON)),
    # Gemma-3 style: sliding window 16 on 3 of 4 layers (the 8-token prompt + 32 steps run 2.5
    # windows past it), local/global RoPE bases, q/k norms, query_pre_attn_scalar.
    "gemma3": dict(cls="Gemma3TextConfig", kwargs=dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
        sliding_window=16, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}, **COMMON)),
}

# name -> (exporter, family, options)
FIXTURES = {
    "genai_llama_fp32": ("genai", "llama", {"precision": "fp32"}),
    "genai_llama_int4": ("genai", "llama", {"precision": "int4"}),
    "genai_qwen2_fp32": ("genai", "qwen2", {"precision": "fp32"}),
    # the builder's default for sliding-window layers: window-sized past/present buffers
    # (GroupQueryAttention sliding_window_cache=1)
    "genai_gemma3_window": ("genai", "gemma3", {"precision": "fp32"}),
    "dynamo_op23_llama": ("dynamo", "llama", {"opset": 23}),
    "dynamo_op23_qwen2": ("dynamo", "qwen2", {"opset": 23}),
    "dynamo_op23_gpt2": ("dynamo", "gpt2", {"opset": 23}),
    "dynamo_op23_gemma3": ("dynamo", "gemma3", {"opset": 23}),
    "dynamo_op18_llama": ("dynamo", "llama", {"opset": 18}),
    "optimum_op18_llama": ("optimum", "llama", {"opset": 18}),
    "optimum_op18_gpt2": ("optimum", "gpt2", {"opset": 18}),
    # sliding window 16 on 3 of 4 layers; optimum writes config.json (with the window) beside it
    "optimum_op18_gemma3": ("optimum", "gemma3", {"opset": 18}),
    # prefill/decode pairs; the export traces model.generate on a batch-2 sample (rows of equal
    # length: no attention_mask input; "padded": the second row left-padded, so the graphs take one)
    "transformers_llama": ("transformers", "llama", {}),
    "transformers_llama_mask": ("transformers", "llama", {"padded": True}),
    "transformers_gpt2": ("transformers", "gpt2", {}),
    "transformers_llama_op23": ("transformers", "llama", {"opset": 23}),  # ONNX Attention
    # onnxruntime.transformers: com.microsoft.Attention with past [2, B, H, P, D] (GPT-2 tool, opset 11)
    # and com.microsoft.MultiHeadAttention with past_key/past_value (Llama recipe, opset 14)
    "ortopt_op11_gpt2": ("ortopt", "gpt2", {"opset": 11}),
    "ortopt_op14_llama_mha": ("ortopt", "llama_mha", {"opset": 14}),
}

TOKENIZER_TEXT = [
    "The capital of France is Paris.",
    "Hello world, this is a tiny tokenizer for test models.",
    "ONNX Runtime runs decoder models on the CPU with a key value cache.",
    "A persistent cache keeps every layer's keys and values between runs.",
]


def log(msg):
    print(f"[make_test_models] {msg}", flush=True)


def run(cmd, env=None, cwd=None):
    log("$ " + " ".join(str(c) for c in cmd))
    t0 = time.time()
    proc = subprocess.run([str(c) for c in cmd], env=env, cwd=cwd, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        sys.stdout.write(proc.stdout[-20000:])
        raise RuntimeError(f"command failed ({proc.returncode}): {' '.join(map(str, cmd))}")
    log(f"  done in {time.time() - t0:.1f}s")
    return proc.stdout


def offline_env():
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


# ---------------------------------------------------------------------------------------------
# Hugging Face folders
# ---------------------------------------------------------------------------------------------
def make_tokenizer():
    """A byte-level BPE trained on a few sentences (the genai builder needs a tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(TOKENIZER_TEXT, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", model_max_length=512)


def build_hf_folder(family, dest):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    spec = FAMILIES[family]
    cfg = getattr(transformers, spec["cls"])(**spec["kwargs"])
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    # transformers initialises biases to 0 and norm weights to 1, which would hide a dropped
    # bias (Qwen2's QKV bias, GPT-2's) or a misapplied norm weight: give every 1-D parameter
    # random values (seeded) so they matter.
    g = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim == 1:
                noise = torch.randn(p.shape, generator=g)
                p.copy_((1.0 + 0.1 * noise) if pname.endswith("weight") else 0.5 * noise)
                if pname in FINAL_NORM_WEIGHTS:
                    p.mul_(LOGIT_SCALE)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest)
    make_tokenizer().save_pretrained(dest)
    log(f"built {family} ({sum(p.numel() for p in model.parameters())} params) in {dest}")
    return dest


def optimum_hf_folder(src, dest):
    """A copy whose config.json also has the old-style RoPE keys that transformers 4.x reads
    (``rope_theta``, ``rope_scaling``; Gemma-3: ``rope_local_base_freq`` too); without them 4.x
    silently uses its default bases (onnx_light_ep.models._optimum.transformers4_config)."""
    sys.path.insert(0, str(REPO))
    from onnx_light_ep.models._optimum import transformers4_folder

    return transformers4_folder(src, dest)


def model_dims(hf_dir):
    sys.path.insert(0, str(REPO))
    from onnx_light_ep.models._dynamo import model_dims as dims_of_config

    return dims_of_config(json.loads((hf_dir / "config.json").read_text()))


# ---------------------------------------------------------------------------------------------
# Exporters
# ---------------------------------------------------------------------------------------------
def export_genai(hf_dir, work, precision):
    out = work / "out"
    builder = ["-m", "onnxruntime_genai.models.builder"]
    if json.loads((hf_dir / "config.json").read_text())["model_type"].startswith("gemma3"):
        sys.path.insert(0, str(REPO))
        from onnx_light_ep.models.gemma3 import BUILDER_WITH_GEMMA3_ROPE  # transformers 5 rope_parameters

        builder = ["-c", BUILDER_WITH_GEMMA3_ROPE]
    run([sys.executable, *builder, "-i", hf_dir, "-o", out,
         "-p", precision, "-e", "cpu", "-c", work / "cache"], env=offline_env())
    extra = {"genai_config": json.loads((out / "genai_config.json").read_text())}
    return out / "model.onnx", extra


def export_dynamo(hf_dir, work, opset):
    """torch.onnx dynamo export with the flat past/present interface (onnx_light_ep.models._dynamo)."""
    sys.path.insert(0, str(REPO))
    from onnx_light_ep.models._dynamo import export_dynamo as _export

    log(f"torch.onnx.export(dynamo=True, opset_version={opset}) of {hf_dir.name}")
    path = _export(hf_dir, work / "model.onnx", opset, seed=SEED)
    return path, {"wrapper": "FlatCacheWrapper(input_ids, attention_mask, position_ids, past) "
                             "-> (logits, *present)"}


def export_transformers(hf_dir, work, padded=False, opset=None):
    """transformers.exporters.OnnxExporter().export_for_generation on a batch-2 sample of 8 tokens
    (a batch of 1 would fix the batch axis to 1). Returns the folder holding prefill.onnx and
    decode.onnx (weights in *.onnx.data files, inlined by finalize_pair)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.exporters import OnnxConfig, OnnxExporter

    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    ids = torch.tensor([PROMPT_IDS, PROMPT_IDS[4:] + PROMPT_IDS[:4]])
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :3] = 0  # left padding, as generate pads a batch
    out = work / "out"
    log(f"transformers OnnxExporter().export_for_generation({hf_dir.name}, padded={padded}, opset={opset})")
    with torch.no_grad():
        exported = OnnxExporter().export_for_generation(model, {"input_ids": ids, "attention_mask": mask},
                                                        OnnxConfig(dynamic=True, opset_version=opset))
    exported.save_pretrained(str(out))
    return out, {"export_json": json.loads((out / "export.json").read_text())["components"]["decode"][
        "metadata"]["export_config"]}


def ensure_optimum_venv(venv, create):
    py = venv / "bin" / "python"
    cli = venv / "bin" / "optimum-cli"
    if cli.exists():
        return py, cli
    if not create:
        raise RuntimeError(f"{cli} not found (create the venv or pass --optimum-venv)")
    log(f"creating optimum virtualenv {venv}")
    run([sys.executable, "-m", "venv", venv])
    run([py, "-m", "pip", "install", TORCH_PIN])
    run([py, "-m", "pip", "install", TORCH_PIN, *OPTIMUM_PINS])
    return py, cli


def export_optimum(hf_dir, work, opset, venv, create_venv):
    py, cli = ensure_optimum_venv(venv, create_venv)
    src = optimum_hf_folder(hf_dir, work / "hf")
    out = work / "out"
    run([cli, "export", "onnx", "--model", src, "--task", "text-generation-with-past",
         "--opset", str(opset), "--device", "cpu", out], env=offline_env())
    versions = run([py, "-c", "import importlib.metadata as m; print(' '.join(p + '==' + m.version(p) "
                    "for p in ('optimum-onnx', 'optimum', 'transformers', 'torch', 'onnx')))"])
    return out / "model.onnx", {"optimum_env": versions.strip().splitlines()[-1]}


def ensure_ort_venv(venv, create):
    py = venv / "bin" / "python"
    if py.exists():
        return py
    if not create:
        raise RuntimeError(f"{py} not found (create the venv or pass --ort-venv)")
    log(f"creating ortopt virtualenv {venv} (over this interpreter's site-packages)")
    run([sys.executable, "-m", "venv", "--system-site-packages", venv])
    run([py, "-m", "pip", "install", *ORT_TOOLING_PINS])
    return py


def export_ortopt(hf_dir, work, family, venv, create_venv):
    """ONNX Runtime's transformer tooling, in the transformers-4.36 virtualenv (module docstring)."""
    py = ensure_ort_venv(venv, create_venv)
    src = optimum_hf_folder(hf_dir, work / "hf")   # transformers 4.x reads rope_theta, not rope_parameters
    path = work / "model.onnx"
    if family == "gpt2":
        # -o: onnxruntime.transformers.optimizer (model_type gpt2); -t/-r: a one-case parity run
        run([py, "-m", "onnxruntime.transformers.models.gpt2.convert_to_onnx", "-m", src, "--output", path,
             "-p", "fp32", "-o", "-t", "1", "-r", "1", "--cache_dir", work / "cache"], env=offline_env(), cwd=work)
        recipe = "onnxruntime.transformers.models.gpt2.convert_to_onnx -p fp32 -o"
    else:
        run([py, REPO / "tools" / "ort_transformers_export.py", src, path], env=offline_env(), cwd=work)
        recipe = ("tools/ort_transformers_export.py: torch.onnx.export(dynamo=False, opset 14) + "
                  "optimize_model(model_type='gpt2', opt_level=0) + symbolic_shape_infer")
    versions = run([py, "-c", "import importlib.metadata as m; print(' '.join(p + '==' + m.version(p) "
                    "for p in ('transformers', 'torch', 'onnxruntime', 'onnx')))"])
    return path, {"ortopt_env": versions.strip().splitlines()[-1], "recipe": recipe}


def optimizer_fusions_on_other_fixtures(out_dir):
    """Attention nodes ``onnxruntime.transformers.optimizer`` (model_type gpt2, the type ORT's own GPT-2 and
    Llama tools use) adds to each committed non-ortopt fixture; recorded in the manifest."""
    import logging

    import onnx
    from onnxruntime.transformers.optimizer import optimize_model

    logging.getLogger("onnxruntime.transformers").setLevel(logging.ERROR)

    def attention_ops(graph):
        return collections.Counter(n.op_type for n in graph.node if n.domain == "com.microsoft"
                                   and n.op_type in ("Attention", "MultiHeadAttention", "GroupQueryAttention"))

    found = {}
    for name, (exporter, family, _) in FIXTURES.items():
        path = out_dir / f"{name}.onnx"
        if exporter == "ortopt" or not path.exists():
            continue
        cfg = FAMILIES[family]["kwargs"]
        hidden, heads = cfg.get("hidden_size") or cfg["n_embd"], cfg.get("num_attention_heads") or cfg["n_head"]
        before = attention_ops(onnx.load(str(path)).graph)
        m = optimize_model(str(path), model_type="gpt2", num_heads=heads, hidden_size=hidden, opt_level=0)
        found[name] = dict(attention_ops(m.model.graph) - before)
    return found


# ---------------------------------------------------------------------------------------------
# Analysis, goldens, reference check
# ---------------------------------------------------------------------------------------------
def _vi(v):
    import onnx

    t = v.type.tensor_type
    return {"name": v.name, "dtype": np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)).name,
            "shape": [d.dim_param if d.dim_param else d.dim_value for d in t.shape.dim]}


def attention_pattern(model, past_prefix="past", present_prefix="present"):
    """Counts of the nodes that make up attention and the cache in the main graph."""
    g = model.graph
    past = {i.name for i in g.input if i.name.startswith(past_prefix)}
    present = {o.name for o in g.output if o.name.startswith(present_prefix)}
    ops = collections.Counter((n.domain + "." if n.domain not in ("", "ai.onnx") else "") + n.op_type
                              for n in g.node)
    producers = collections.Counter()
    concat_on_past = 0
    for n in g.node:
        if n.op_type == "Concat" and any(i in past for i in n.input):
            concat_on_past += 1
        for o in n.output:
            if o in present:
                producers[n.op_type] += 1
    keep = ("com.microsoft.GroupQueryAttention", "com.microsoft.MultiHeadAttention", "Attention",
            "com.microsoft.Attention", "Softmax", "RotaryEmbedding", "com.microsoft.RotaryEmbedding",
            "com.microsoft.MatMulNBits", "com.microsoft.GatherBlockQuantized", "MatMul")
    pat = {k: ops[k] for k in keep if ops.get(k)}
    pat["Concat_on_past"] = concat_on_past
    pat["present_producers"] = dict(producers)
    return pat, dict(sorted(ops.items()))


def finalize_onnx(src, dst):
    """Load with external data and save as one self-contained file."""
    import onnx

    m = onnx.load(str(src), load_external_data=True)
    dst.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(m, str(dst))
    return m


def onnx_checker_result(model):
    """None when onnx.checker accepts the model, else its first error line (the genai builder puts
    ORT's contrib SimplifiedLayerNormalization in the default domain, which the checker rejects)."""
    import onnx

    try:
        onnx.checker.check_model(model)
        return None
    except Exception as e:  # noqa: BLE001 -- reported in the manifest, not fatal
        return str(e).strip().splitlines()[0]


def past_names(sess):
    """Loop-carried inputs: ``past_key_values.N.key/value`` (BNSH) or ``past_N`` (ORT's GPT-2 tool:
    key and value stacked, [2, batch, heads, past, head_dim])."""
    return [i.name for i in sess.get_inputs() if i.name.startswith("past")]


def present_name(past):
    return past.replace("past_key_values.", "present.") if past.startswith("past_key_values.") else \
        past.replace("past", "present", 1)


def io_dtypes(sess):
    """Input name -> numpy integer type (ORT's GPT-2 tool exports int32 ids, positions and mask)."""
    return {i.name: np.int32 if i.type == "tensor(int32)" else np.int64 for i in sess.get_inputs()}


def window_buffer_capacity(path):
    """Past input -> positions, for GroupQueryAttention layers with window-sized buffers
    (``sliding_window_cache=1``): plain ORT needs them allocated at the window's size."""
    import onnx

    out = {}
    for n in onnx.load(str(path)).graph.node:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        if n.op_type == "GroupQueryAttention" and attrs.get("sliding_window_cache", 0):
            for name in n.input[3:5]:
                out[name] = int(attrs["local_window_size"])
    return out


def ort_greedy_pair(folder, prompt=PROMPT_IDS, steps=GREEDY_STEPS):
    """Plain ORT greedy decode of a prefill/decode pair: step 0 on prefill.onnx (no past), later
    steps on decode.onnx, each run's presents (layer by layer, in output order) fed back as the
    decode graph's pasts (in input order)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    pre = ort.InferenceSession(str(folder / "prefill.onnx"), so, providers=["CPUExecutionProvider"])
    dec = ort.InferenceSession(str(folder / "decode.onnx"), so, providers=["CPUExecutionProvider"])
    pasts = [i.name for i in dec.get_inputs() if i.name.startswith("input.cache.")]
    ids = np.array([prompt], dtype=np.int64)
    total, generated, margins, prefill, cache = 0, [], [], None, {}
    for step in range(steps):
        sess = pre if step == 0 else dec
        names = {i.name for i in sess.get_inputs()}
        s = ids.shape[1]
        feeds = {"input_ids": ids, "position_ids": np.arange(total, total + s, dtype=np.int64)[None], **cache}
        if "attention_mask" in names:
            feeds["attention_mask"] = np.ones((1, total + s), np.int64)
        if names - set(feeds):
            raise RuntimeError(f"{folder.name}: unhandled inputs {sorted(names - set(feeds))}")
        outs = [o.name for o in sess.get_outputs()]
        res = dict(zip(outs, sess.run(None, {k: v for k, v in feeds.items() if k in names})))
        logits = res["logits"]
        if step == 0:
            prefill = logits.copy()
        last = logits[0, -1]
        top2 = np.partition(last, -2)[-2:]
        margins.append(float(top2[1] - top2[0]))
        nxt = int(np.argmax(last))
        generated.append(nxt)
        total += s
        presents = [o for o in outs if ".cache.layers." in f".{o}"]
        cache = dict(zip(pasts, (res[o] for o in presents)))
        assert all(v.shape[2] == total for v in cache.values()), "present length != past + new"
        ids = np.array([[nxt]], dtype=np.int64)
    return dict(prompt_ids=np.array([prompt], np.int64), generated_ids=np.array([generated], np.int64),
                prefill_logits=prefill.astype(np.float32), min_margin=np.float32(min(margins)))


def ort_greedy(path, dims, prompt=PROMPT_IDS, steps=GREEDY_STEPS):
    """Plain ORT (CPUExecutionProvider) greedy decode feeding present back as past."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    in_names = {i.name for i in sess.get_inputs()}
    out_names = [o.name for o in sess.get_outputs()]
    ranks = {i.name: len(i.shape) for i in sess.get_inputs()}
    ints = io_dtypes(sess)
    pasts = past_names(sess)
    capacity = window_buffer_capacity(path)
    kv_shape = (1, dims["kv_num_heads"])
    cache = {n: np.zeros(((2,) if ranks[n] == 5 else ()) + kv_shape + (capacity.get(n, 0), dims["head_dim"]),
                         np.float32) for n in pasts}
    ids = np.array([prompt], dtype=np.int64)
    total, generated, margins, prefill = 0, [], [], None
    for step in range(steps):
        s = ids.shape[1]
        feeds = {"input_ids": ids.astype(ints["input_ids"]),
                 "attention_mask": np.ones((1, total + s), ints["attention_mask"]), **cache}
        if "position_ids" in in_names:
            feeds["position_ids"] = np.arange(total, total + s, dtype=ints["position_ids"])[None]
        unknown = in_names - set(feeds)
        if unknown:
            raise RuntimeError(f"{path.name}: unhandled inputs {sorted(unknown)}")
        res = dict(zip(out_names, sess.run(None, feeds)))
        logits = res["logits"]
        if step == 0:
            prefill = logits.copy()
        last = logits[0, -1]
        top2 = np.partition(last, -2)[-2:]
        margins.append(float(top2[1] - top2[0]))
        nxt = int(np.argmax(last))
        generated.append(nxt)
        total += s
        cache = {n: res[present_name(n)] for n in pasts}
        assert all(v.shape[-2] == capacity.get(n, total) for n, v in cache.items()), "present length != past + new"
        ids = np.array([[nxt]], dtype=np.int64)
    return dict(prompt_ids=np.array([prompt], np.int64), generated_ids=np.array([generated], np.int64),
                prefill_logits=prefill.astype(np.float32), min_margin=np.float32(min(margins)))


_TORCH_REF = {}


def torch_reference(hf_dir, prompt=PROMPT_IDS, steps=GREEDY_STEPS):
    """Greedy decode in PyTorch recomputing the whole sequence each step (no cache)."""
    key = str(hf_dir)
    if key not in _TORCH_REF:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
        ids = torch.tensor([prompt])
        gen, prefill = [], None
        with torch.no_grad():
            for step in range(steps):
                out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
                if step == 0:
                    prefill = out.logits.numpy().copy()
                nxt = int(out.logits[0, -1].argmax())
                gen.append(nxt)
                ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
        _TORCH_REF[key] = (np.array([gen]), prefill)
    return _TORCH_REF[key]


# ---------------------------------------------------------------------------------------------
# Versions
# ---------------------------------------------------------------------------------------------
def versions():
    import importlib.metadata as md

    out = {"python": sys.version.split()[0]}
    for p in ("torch", "transformers", "onnxscript", "onnxruntime-genai", "onnxruntime", "onnx",
              "tokenizers", "numpy"):
        try:
            out[p] = md.version(p)
        except md.PackageNotFoundError:
            out[p] = None
    return out


def exporter_version(exporter, extra, vers):
    if exporter == "genai":
        return f"onnxruntime-genai=={vers['onnxruntime-genai']} (transformers=={vers['transformers']})"
    if exporter in ("dynamo", "transformers"):
        return f"torch=={vers['torch']} onnxscript=={vers['onnxscript']} transformers=={vers['transformers']}"
    if exporter == "ortopt":
        return extra["ortopt_env"]
    return extra.get("optimum_env", "optimum")


def kv_names(ins):
    """The manifest's cache layout and past/present name patterns, from the graph inputs."""
    if any(i["name"] == "past_0" for i in ins):   # ORT's GPT-2 tool: key and value stacked on axis 0
        return {"kv_layout": "[2, batch, kv_num_heads, seq, head_dim] (key, value)",
                "past_key": "past_{layer}", "past_value": "past_{layer}",
                "present_key": "present_{layer}", "present_value": "present_{layer}"}
    return {"kv_layout": "[batch, kv_num_heads, seq, head_dim]",
            "past_key": "past_key_values.{layer}.key", "past_value": "past_key_values.{layer}.value",
            "present_key": "present.{layer}.key", "present_value": "present.{layer}.value"}


# ---------------------------------------------------------------------------------------------
def make_fixture(name, hf_dirs, out_dir, work_root, args, vers):
    import onnx

    exporter, family, opts = FIXTURES[name]
    hf_dir = hf_dirs[family]
    work = work_root / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0 = time.time()
    if exporter == "genai":
        raw, extra = export_genai(hf_dir, work, opts["precision"])
    elif exporter == "dynamo":
        raw, extra = export_dynamo(hf_dir, work, opts["opset"])
    elif exporter == "ortopt":
        raw, extra = export_ortopt(hf_dir, work, family, args.ort_venv, not args.no_create_venv)
    else:
        raw, extra = export_optimum(hf_dir, work, opts["opset"], args.optimum_venv, not args.no_create_venv)
    dst = out_dir / f"{name}.onnx"
    model = finalize_onnx(raw, dst)
    dims = model_dims(hf_dir)
    golden = ort_greedy(dst, dims)
    weights = opts.get("precision", "fp32")

    ref_ids, ref_prefill = torch_reference(hf_dir)
    ref_check = {"generated_ids_equal": bool(np.array_equal(ref_ids, golden["generated_ids"])),
                 "prefill_logits_max_abs_diff": float(np.abs(ref_prefill - golden["prefill_logits"]).max())}
    if weights == "fp32" and not (ref_check["generated_ids_equal"]
                                  and ref_check["prefill_logits_max_abs_diff"] < 1e-3):
        raise RuntimeError(f"{name}: plain-ORT golden disagrees with the PyTorch reference: {ref_check}; "
                           f"ort={golden['generated_ids'].tolist()} torch={ref_ids.tolist()}")
    np.savez(out_dir / f"{name}.npz", **golden)

    opsets = {(o.domain or "ai.onnx"): o.version for o in model.opset_import}
    pattern, op_counts = attention_pattern(model)
    ins = [_vi(v) for v in model.graph.input]
    outs = [_vi(v) for v in model.graph.output]
    entry = {
        "file": dst.name,
        "golden": f"{name}.npz",
        "exporter": exporter,
        "exporter_version": exporter_version(exporter, extra, vers),
        "family": family,
        "architecture": json.loads((hf_dir / "config.json").read_text())["architectures"][0],
        "weights": weights,
        "opset": opsets.get("ai.onnx"),
        "opsets": opsets,
        "ir_version": model.ir_version,
        **dims,
        **kv_names(ins),
        "has_position_ids": any(i["name"] == "position_ids" for i in ins),
        "inputs": ins,
        "outputs": outs,
        "attention_pattern": pattern,
        "op_counts": op_counts,
        "reference_check": ref_check,
        "onnx_checker_error": onnx_checker_result(model),
        "min_margin": float(golden["min_margin"]),
        "size_bytes": dst.stat().st_size,
        "sha256": hashlib.sha256(dst.read_bytes()).hexdigest(),
    }
    entry.update({k: v for k, v in extra.items() if k not in ("optimum_env", "ortopt_env")})
    log(f"{name}: {dst.stat().st_size} bytes, {pattern}, ref {ref_check}, "
        f"margin {entry['min_margin']:.3f}, {time.time() - t0:.1f}s")
    return entry


def make_pair_fixture(name, hf_dirs, out_dir, work_root, vers):
    """A prefill/decode pair (transformers' exporter) as ``out_dir/NAME/{prefill,decode}.onnx``."""
    exporter, family, opts = FIXTURES[name]
    hf_dir = hf_dirs[family]
    work = work_root / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0 = time.time()
    raw, extra = export_transformers(hf_dir, work, padded=opts.get("padded", False), opset=opts.get("opset"))
    folder = out_dir / name
    shutil.rmtree(folder, ignore_errors=True)
    graphs = {}
    for stage in ("prefill", "decode"):
        graphs[stage] = finalize_onnx(raw / f"{stage}.onnx", folder / f"{stage}.onnx")
    dims = model_dims(hf_dir)
    golden = ort_greedy_pair(folder)
    ref_ids, ref_prefill = torch_reference(hf_dir)
    ref_check = {"generated_ids_equal": bool(np.array_equal(ref_ids, golden["generated_ids"])),
                 "prefill_logits_max_abs_diff": float(np.abs(ref_prefill - golden["prefill_logits"]).max())}
    if not (ref_check["generated_ids_equal"] and ref_check["prefill_logits_max_abs_diff"] < 1e-3):
        raise RuntimeError(f"{name}: plain-ORT golden disagrees with the PyTorch reference: {ref_check}; "
                           f"ort={golden['generated_ids'].tolist()} torch={ref_ids.tolist()}")
    np.savez(out_dir / f"{name}.npz", **golden)
    entry = {
        "file": f"{name}/",
        "files": {stage: f"{name}/{stage}.onnx" for stage in graphs},
        "golden": f"{name}.npz",
        "exporter": exporter,
        "exporter_version": exporter_version(exporter, extra, vers),
        "export_config": extra["export_json"],
        "family": family,
        "architecture": json.loads((hf_dir / "config.json").read_text())["architectures"][0],
        "weights": "fp32",
        **dims,
        "kv_layout": "[batch, kv_num_heads, seq, head_dim]",
        "past_key": "input.cache.layers.{layer}.keys (decode only)",
        "past_value": "input.cache.layers.{layer}.values (decode only)",
        "present_key": "cache.layers.{layer}.keys (prefill), output.cache.layers.{layer}.keys (decode)",
        "present_value": "cache.layers.{layer}.values (prefill), output.cache.layers.{layer}.values (decode)",
        "reference_check": ref_check,
        "min_margin": float(golden["min_margin"]),
        "graphs": {},
    }
    for stage, model in graphs.items():
        path = folder / f"{stage}.onnx"
        pattern, op_counts = attention_pattern(model, "input.cache.",
                                               "cache." if stage == "prefill" else "output.cache.")
        ins = [_vi(v) for v in model.graph.input]
        entry["graphs"][stage] = {
            "opset": {(o.domain or "ai.onnx"): o.version for o in model.opset_import}.get("ai.onnx"),
            "ir_version": model.ir_version,
            "has_attention_mask": any(i["name"] == "attention_mask" for i in ins),
            "inputs": ins,
            "outputs": [_vi(v) for v in model.graph.output],
            "attention_pattern": pattern,
            "op_counts": op_counts,
            "onnx_checker_error": onnx_checker_result(model),
            "size_bytes": path.stat().st_size,
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        }
    log(f"{name}: {sum(g['size_bytes'] for g in entry['graphs'].values())} bytes, ref {ref_check}, "
        f"margin {entry['min_margin']:.3f}, {time.time() - t0:.1f}s")
    return entry


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default tests/data)")
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temp dir)")
    ap.add_argument("--only", nargs="+", choices=sorted(FIXTURES), help="fixtures to (re)build")
    ap.add_argument("--optimum-venv", type=Path, default=DEFAULT_VENV,
                    help=f"virtualenv with optimum-onnx (default {DEFAULT_VENV})")
    ap.add_argument("--ort-venv", type=Path, default=DEFAULT_ORT_VENV,
                    help=f"virtualenv with transformers 4.36 for the ortopt fixtures (default {DEFAULT_ORT_VENV})")
    ap.add_argument("--no-create-venv", action="store_true", help="fail instead of creating the venvs")
    ap.add_argument("--keep-work", action="store_true", help="keep the scratch folder")
    ap.add_argument("--list", action="store_true", help="list fixture names and exit")
    args = ap.parse_args(argv)
    if args.list:
        for n, (e, f, o) in FIXTURES.items():
            print(n, e, f, o)
        return 0

    names = args.only or list(FIXTURES)
    args.out.mkdir(parents=True, exist_ok=True)
    work_root = args.work or Path(tempfile.mkdtemp(prefix="make_test_models."))
    work_root.mkdir(parents=True, exist_ok=True)
    vers = versions()
    log(f"versions: {vers}")
    manifest_path = args.out / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() and args.only else {}
    models = dict(manifest.get("models", {}))
    try:
        hf_dirs = {f: build_hf_folder(f, work_root / f"hf_{f}")
                   for f in sorted({FIXTURES[n][1] for n in names})}
        for n in names:
            if FIXTURES[n][0] == "transformers":
                models[n] = make_pair_fixture(n, hf_dirs, args.out, work_root, vers)
            else:
                models[n] = make_fixture(n, hf_dirs, args.out, work_root, args, vers)
    finally:
        if not args.keep_work:
            shutil.rmtree(work_root, ignore_errors=True)
        else:
            log(f"scratch kept in {work_root}")

    manifest = {
        "generator": "tools/make_test_models.py",
        "command": "HF_HUB_OFFLINE=1 python tools/make_test_models.py",
        "seed": SEED,
        "prompt_ids": PROMPT_IDS,
        "greedy_steps": GREEDY_STEPS,
        "golden_keys": {"prompt_ids": "int64 [1, 8]", "generated_ids": "int64 [1, 32]",
                        "prefill_logits": "float32 [1, 8, vocab]",
                        "min_margin": "float32 scalar, min top1-top2 logit gap over the steps"},
        # a package missing now (onnxscript when only genai fixtures are rebuilt) keeps its recorded version
        "versions": {**manifest.get("versions", {}), **{k: v for k, v in vers.items() if v is not None}},
        "hf_configs": {f: {"class": FAMILIES[f]["cls"], **FAMILIES[f]["kwargs"]} for f in FAMILIES},
        "models": {k: models[k] for k in FIXTURES if k in models},
    }
    for m in manifest["models"].values():
        if m["exporter"] in ("optimum", "ortopt"):
            manifest["versions"][f"{m['exporter']}_env"] = m["exporter_version"]
    manifest["ort_optimizer_on_other_fixtures"] = {
        "what": "com.microsoft Attention/MultiHeadAttention/GroupQueryAttention nodes that "
                "onnxruntime.transformers.optimizer (model_type gpt2, opt_level 0) adds to each non-ortopt fixture",
        "found": optimizer_fusions_on_other_fixtures(args.out)}
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    log(f"wrote {manifest_path} ({len(manifest['models'])} models)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
