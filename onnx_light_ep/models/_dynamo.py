"""torch.onnx (dynamo) export of a Hugging Face decoder with a flat past/present interface.

``export_dynamo(hf_dir, out_path, opset)`` loads the model with transformers
(``attn_implementation="sdpa"``) and exports a thin wrapper whose inputs are
``input_ids``, ``attention_mask`` (past + current), ``position_ids`` and
``past_key_values.N.key|value`` (``[batch, kv_num_heads, past, head_dim]``) and
whose outputs are ``logits`` and ``present.N.key|value`` — the interface the
other exporters (onnxruntime-genai, optimum) use, which ``onnx_light_ep.convert``
pairs by structure. Opset 23 gives ONNX ``Attention`` (sliding windows and causal
structure built into the mask), opset 18 the MatMul/Softmax/MatMul form. Needs
torch, transformers and onnxscript (the ``models`` extra plus onnxscript); used by
``tools/make_test_models.py`` for the tiny fixtures and by
``onnx_light_ep.models.gemma3`` for the real model.
"""

from __future__ import annotations

import inspect
from pathlib import Path

__all__ = ["export_dynamo", "model_dims"]


def model_dims(config: dict) -> dict:
    """Layer count, heads, head_dim, vocab and positions from a Hugging Face ``config.json`` dict."""
    cfg = config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config
    if cfg["model_type"] == "gpt2":
        hq = cfg["n_head"]
        return dict(num_layers=cfg["n_layer"], q_num_heads=hq, kv_num_heads=hq, head_dim=cfg["n_embd"] // hq,
                    hidden_size=cfg["n_embd"], vocab_size=cfg["vocab_size"], rope_theta=None,
                    max_position_embeddings=cfg["n_positions"])
    hq = cfg["num_attention_heads"]
    return dict(num_layers=cfg["num_hidden_layers"], q_num_heads=hq,
                kv_num_heads=cfg.get("num_key_value_heads") or hq,
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // hq,
                hidden_size=cfg["hidden_size"], vocab_size=cfg["vocab_size"],
                rope_theta=(cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta")),
                max_position_embeddings=cfg["max_position_embeddings"])


def export_dynamo(hf_dir, out_path, opset: int = 23, *, external_data: bool = False, seed: int = 0) -> Path:
    """Export ``hf_dir`` to ``out_path`` with ``torch.onnx.export(dynamo=True, opset_version=opset)``.

    ``external_data``: weights in ``out_path + ".data"`` (needed above 2 GB;
    a real model's export). Returns ``Path(out_path)``.
    """
    import json

    import torch
    from transformers import AutoModelForCausalLM, DynamicCache
    from transformers.cache_utils import DynamicLayer

    hf_dir = Path(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa", dtype=torch.float32).eval()
    params = inspect.signature(model.forward).parameters
    cache_kw = "cache" if "cache" in params else "past_key_values"
    dims = model_dims(json.loads((hf_dir / "config.json").read_text()))
    n_layers, hkv, d = dims["num_layers"], dims["kv_num_heads"], dims["head_dim"]

    class FlatCacheWrapper(torch.nn.Module):
        """forward(input_ids, attention_mask, position_ids, past) -> (logits, *present), where
        ``past`` is a tuple (k0, v0, k1, v1, ...) of [batch, kv_heads, past_seq, head_dim]."""

        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask, position_ids, past):
            # Fill DynamicLayers directly: DynamicCache(ddp_cache_data=...) concatenates onto an
            # empty 1-D tensor, which torch.export does not trace cleanly.
            cache = DynamicCache()
            for i in range(n_layers):
                layer = DynamicLayer()
                layer.keys, layer.values = past[2 * i], past[2 * i + 1]
                layer.device = past[2 * i].device
                layer.is_initialized = True
                cache.layers.append(layer)
            out = self.m(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, use_cache=True, **{cache_kw: cache})
            new_cache = getattr(out, "cache", None)
            if new_cache is None:
                new_cache = out.past_key_values
            flat = []
            for layer in new_cache.layers:
                flat += [layer.keys, layer.values]
            return (out.logits, *flat)

    wrapper = FlatCacheWrapper(model).eval()
    b, s, p = 2, 3, 4   # sample sizes: distinct and > 1 so none gets specialized
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, dims["vocab_size"], (b, s), generator=g)
    mask = torch.ones(b, p + s, dtype=torch.int64)
    pos = torch.arange(p, p + s).expand(b, s).contiguous()
    past = tuple(torch.randn(b, hkv, p, d, generator=g) for _ in range(2 * n_layers))
    in_names = ["input_ids", "attention_mask", "position_ids"] + [
        f"past_key_values.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]
    out_names = ["logits"] + [f"present.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]
    dyn = [{0: "batch_size", 1: "sequence_length"},
           {0: "batch_size", 1: "total_sequence_length"},
           {0: "batch_size", 1: "sequence_length"},
           tuple({0: "batch_size", 2: "past_sequence_length"} for _ in range(2 * n_layers))]
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        torch.onnx.export(wrapper, (ids, mask, pos, past), str(out_path), dynamo=True,
                          opset_version=opset, input_names=in_names, output_names=out_names,
                          dynamic_shapes=dyn, external_data=external_data, verbose=False)
    return out_path


DYNAMO_EXPORT = """
import sys
from onnx_light_ep.models._dynamo import export_dynamo
export_dynamo(sys.argv[1], sys.argv[2], int(sys.argv[3]), external_data=True)
"""

# Hugging Face files copied next to the export: the config names the sliding windows (convert reads it),
# the tokenizer files make generate/compare work on text.
HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "chat_template.jinja")


def dynamo_export_step(opset: int = 23):
    """An ``export(hf_dir, out_dir, say)`` step for ``_genai_build.GenaiModel.export``: the dynamo export in a
    subprocess (its torch memory is freed), weights in ``model.onnx.data``, then the side files."""
    def export(hf_dir: Path, out_dir: Path, say) -> None:
        import shutil
        import sys

        from ._genai_build import run

        run([sys.executable, "-c", DYNAMO_EXPORT, str(hf_dir), str(out_dir / "model.onnx"), str(opset)], say,
            f"export with torch.onnx (dynamo, opset {opset})")
        for name in HF_SIDE_FILES:
            if (Path(hf_dir) / name).is_file():
                shutil.copy(Path(hf_dir) / name, out_dir / name)
    return export
