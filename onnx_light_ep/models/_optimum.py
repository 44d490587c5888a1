"""optimum export of a Hugging Face decoder: ``optimum-cli export onnx --task text-generation-with-past``
run from a separate virtualenv (optimum-onnx 0.1.0 pins transformers < 4.58, this package builds its
Hugging Face folders with transformers 5).

The result has ``input_ids``, ``attention_mask`` (past + current; no ``position_ids`` for Gemma:
optimum's ``GemmaOnnxConfig`` derives them from the mask) and ``past_key_values.N.key|value``
(``[batch, kv_num_heads, past, head_dim]``), outputs ``logits`` and ``present.N.key|value``; the
attention is decomposed (MatMul/Softmax/MatMul, opset 18) with any sliding window built into the
mask, and optimum writes ``config.json`` beside ``model.onnx`` (convert reads the windows from it).
Used by ``tools/make_test_models.py`` for the tiny fixtures and by ``onnx_light_ep.models.gemma3``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

__all__ = ["transformers4_config", "transformers4_folder", "optimum_export_step", "default_optimum_venv",
           "OPTIMUM_VENV_ENV"]

OPTIMUM_VENV_ENV = "ONNX_LIGHT_OPTIMUM_VENV"


def default_optimum_venv() -> Path:
    """``$ONNX_LIGHT_OPTIMUM_VENV`` if set, else ``/tmp/venv-optimum`` (the one tools/make_test_models.py creates)."""
    return Path(os.environ.get(OPTIMUM_VENV_ENV) or "/tmp/venv-optimum").expanduser()


def transformers4_config(cfg: dict, where: str = "config.json") -> dict:
    """``cfg`` (a transformers 5 ``config.json`` dict) with the RoPE keys transformers 4.x reads added:
    ``rope_theta`` / ``rope_scaling`` from ``rope_parameters``; for Gemma-3's per-layer-type
    ``rope_parameters`` (``{"full_attention": ..., "sliding_attention": ...}``) those of the global
    layers, and ``rope_local_base_freq`` from the sliding ones (transformers 4.57 ``Gemma3TextConfig``,
    whose local layers take no scaling). Without them 4.x silently uses its default bases.
    Raises ValueError for scaled sliding-layer RoPE (4.x cannot express it)."""
    cfg = dict(cfg)
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and "full_attention" in rp:
        local = rp.get("sliding_attention", {})
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"{where}: rope_parameters['sliding_attention'] must be rope_type 'default' "
                             f"(transformers 4.x has no scaling for sliding layers), got {local}")
        if "rope_theta" in local:
            cfg["rope_local_base_freq"] = local["rope_theta"]
        rp = rp["full_attention"]
    if isinstance(rp, dict):
        cfg["rope_theta"] = rp["rope_theta"]
        cfg["rope_scaling"] = None if rp.get("rope_type", "default") == "default" else dict(rp)
    return cfg


def transformers4_folder(src, dest) -> Path:
    """A copy of the Hugging Face folder ``src`` at ``dest`` whose config.json is :func:`transformers4_config`'s."""
    src, dest = Path(src), Path(dest)
    shutil.copytree(src, dest, dirs_exist_ok=True)
    p = dest / "config.json"
    p.write_text(json.dumps(transformers4_config(json.loads(p.read_text()), str(src / "config.json")), indent=2))
    return dest


def optimum_export_step(opset: int = 18, venv=None):
    """An ``export(hf_dir, out_dir, say)`` step for ``_genai_build.GenaiModel.export``: optimum-cli from
    ``venv/bin`` (default :func:`default_optimum_venv`, read when the step runs) on a transformers-4
    copy of ``hf_dir``, then the Hugging Face side files optimum did not write (tokenizer)."""
    def export(hf_dir: Path, out_dir: Path, say) -> None:
        from ._dynamo import HF_SIDE_FILES
        from ._genai_build import run

        env_dir = Path(venv).expanduser() if venv is not None else default_optimum_venv()
        cli = env_dir / "bin" / "optimum-cli"
        if not cli.is_file():
            raise RuntimeError(f"{cli} not found: create a virtualenv with optimum-onnx==0.1.0 and "
                               f"transformers==4.57.6 there (tools/make_test_models.py ensure_optimum_venv) or "
                               f"point {OPTIMUM_VENV_ENV} at one")
        src = transformers4_folder(hf_dir, Path(out_dir).parent / "hf-transformers4")
        try:
            run([str(cli), "export", "onnx", "--model", str(src), "--task", "text-generation-with-past",
                 "--opset", str(opset), "--device", "cpu", str(out_dir)], say,
                f"export with optimum-cli (opset {opset}, {env_dir})")
        finally:
            shutil.rmtree(src, ignore_errors=True)
        for name in HF_SIDE_FILES:
            if (Path(hf_dir) / name).is_file() and not (Path(out_dir) / name).is_file():
                shutil.copy(Path(hf_dir) / name, Path(out_dir) / name)
    return export
