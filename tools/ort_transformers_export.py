#!/usr/bin/env python3
"""Llama export the way ONNX Runtime's transformer tooling made it (for ``tools/make_test_models.py``).

Runs inside the transformers-4.36 virtualenv ``make_test_models.py`` creates (``--ort-venv``):
ORT's fusions (``onnxruntime.transformers.optimizer``) match the graphs the TorchScript exporter
wrote for transformers of that era (eager attention, ``Div`` by sqrt(head_dim), the 4-D additive
mask of ``_prepare_4d_causal_attention_mask``), not those of transformers 4.5x/5.x.

The recipe is that of ``onnxruntime.transformers.models.llama.convert_to_onnx`` (separate
decoder-with-past export, then ``optimize_export``), without its Llama-2 checkpoint handling:

1. ``torch.onnx.export(dynamo=False, opset_version=14)`` of ``LlamaForCausalLM`` (eager attention)
   taking ``input_ids``, ``attention_mask``, ``position_ids`` and the legacy tuple past
   ``past_key_values.N.key/value`` [batch, kv_heads, past, head_dim]; outputs ``logits`` and
   ``present.N.key/value``;
2. ``optimize_model(model_type="gpt2", opt_level=0, FusionOptions("gpt2"))``: rotary attention
   fusion into ``com.microsoft.MultiHeadAttention`` (+ ``RotaryEmbedding``) with past/present;
3. ``onnxruntime.tools.symbolic_shape_infer --auto_merge`` on the result, as the tool does.

Usage: ``python tools/ort_transformers_export.py HF_DIR OUT.onnx``
"""
import os
import subprocess
import sys
import tempfile

import torch
from transformers import AutoModelForCausalLM

OPSET = 14  # onnxruntime.transformers.models.llama.convert_to_onnx: torch_export_onnx_opset_version


def export_llama(hf_dir: str, out_path: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    cfg = model.config
    n_layers, hkv = cfg.num_hidden_layers, cfg.num_key_value_heads
    d = cfg.hidden_size // cfg.num_attention_heads
    b, s, p = 2, 8, 8  # the tool's sample sizes (batch 2, sequence 8, past 8)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (b, s), generator=g)
    mask = torch.ones(b, p + s, dtype=torch.int64)
    pos = torch.arange(p, p + s).expand(b, s).contiguous()
    past = [(torch.randn(b, hkv, p, d, generator=g), torch.randn(b, hkv, p, d, generator=g))
            for _ in range(n_layers)]
    ins = ["input_ids", "attention_mask", "position_ids"] + [
        f"past_key_values.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]
    outs = ["logits"] + [f"present.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]
    dyn = {"input_ids": {0: "batch_size", 1: "sequence_length"},
           "attention_mask": {0: "batch_size", 1: "total_sequence_length"},
           "position_ids": {0: "batch_size", 1: "sequence_length"},
           "logits": {0: "batch_size", 1: "sequence_length"}}
    dyn.update({n: {0: "batch_size", 2: "past_sequence_length"} for n in ins[3:]})
    dyn.update({n: {0: "batch_size", 2: "total_sequence_length"} for n in outs[1:]})
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "decoder_with_past.onnx")
        with torch.no_grad():
            torch.onnx.export(model, args=(ids, mask, pos, past), f=raw, export_params=True, input_names=ins,
                              output_names=outs, dynamic_axes=dyn, opset_version=OPSET, do_constant_folding=True,
                              dynamo=False)
        from onnxruntime.transformers.fusion_options import FusionOptions
        from onnxruntime.transformers.optimizer import optimize_model

        opt = optimize_model(raw, model_type="gpt2", num_heads=cfg.num_attention_heads,
                             hidden_size=cfg.hidden_size, opt_level=0, optimization_options=FusionOptions("gpt2"),
                             only_onnxruntime=False)
        opt.save_model_to_file(out_path)
    subprocess.run([sys.executable, "-m", "onnxruntime.tools.symbolic_shape_infer", "--input", out_path,
                    "--output", out_path, "--auto_merge"], check=True)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: ort_transformers_export.py HF_DIR OUT.onnx")
    export_llama(sys.argv[1], sys.argv[2])
