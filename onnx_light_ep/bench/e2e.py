"""End-to-end decode speed on SmolLM2-135M (part of ``run_bench``, option ``e2e``).

Three runners of the same onnxruntime-genai export (fp32, CPU,
``com.microsoft.GroupQueryAttention``), batch 1, greedy:

- ``ep_kvcache``: the model converted by ``onnx_light_ep.convert`` on
  ``OnnxLightExecutionProvider`` with a ``KVCache``;
- ``ort_past_present``: the original model on plain ORT, ``present.N.*``
  OrtValues bound as the next step's ``past_key_values.N.*`` (IOBinding, no
  numpy round trip);
- ``genai``: ``onnxruntime_genai.Generator`` (its own loop, past and present
  in one shared buffer of ``max_length`` rows: ``past_present_share_buffer``).

For each context length ``C`` and thread count, the runners take turns (order
rotated per context): a runner prefills the ``C`` prompt tokens (timed once,
``prefill_s``), then decodes ``warmup + reps`` tokens back to back; the
``warmup`` steps are discarded and the median of ``reps`` steps gives tokens/s.
Every session keeps ORT's default intra-op spinning, as an application running
one model would (genai offers no switch for it; interleaving sessions step by
step with spinning on would let one runner's spinning workers take the cores
from the next). A step is one model run plus the argmax over the vocabulary.
The greedy tokens of the runners are compared (``tokens_agree``): same model,
same prompt, so they should match.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Callable, Dict, List, Sequence

import numpy as np

from .candidates import CPU_EP, session_options

RUNNERS = ("ep_kvcache", "ort_past_present", "genai")


class _EpRunner:
    key = "ep_kvcache"

    def __init__(self, converted: str, threads: int):
        from .. import InferenceSession

        self.sess = InferenceSession(converted, session_options(threads, allow_spinning=True))
        self.path = converted

    def start(self, prompt: np.ndarray, capacity: int) -> int:
        from ..cache import KVCache

        self.cache = KVCache.for_model(self.path, 1, capacity)
        self.total = prompt.shape[1]
        logits = self.sess.run(["logits"], {"input_ids": prompt, "attention_mask": np.ones_like(prompt),
                                            "kv_cache": self.cache.handle})[0]
        self.token = int(logits[0, -1].argmax())
        return self.token

    def step(self) -> int:
        self.total += 1
        logits = self.sess.run(["logits"], {"input_ids": np.array([[self.token]], np.int64),
                                            "attention_mask": np.ones((1, self.total), np.int64),
                                            "kv_cache": self.cache.handle})[0]
        self.token = int(logits[0, -1].argmax())
        return self.token

    def stop(self) -> None:
        self.cache.close()


class _OrtRunner:
    key = "ort_past_present"

    def __init__(self, model: str, threads: int, kv_num_heads: int, head_dim: int):
        import onnxruntime as ort

        self.ort = ort
        self.sess = ort.InferenceSession(model, session_options(threads, allow_spinning=True), providers=[CPU_EP])
        self.pasts = [i for i in self.sess.get_inputs() if i.name.startswith("past_key_values.")]
        self.presents = [p.name.replace("past_key_values.", "present.") for p in self.pasts]
        self.empty_past = (1, int(kv_num_heads), 0, int(head_dim))

    def _run(self, ids: np.ndarray) -> int:
        b = self.sess.io_binding()
        ov = self.ort.OrtValue.ortvalue_from_numpy
        b.bind_ortvalue_input("input_ids", ov(ids))
        b.bind_ortvalue_input("attention_mask", ov(np.ones((1, self.total), np.int64)))
        for p in self.pasts:
            b.bind_ortvalue_input(p.name, self.state[p.name])
        b.bind_output("logits")
        for name in self.presents:
            b.bind_output(name)
        self.sess.run_with_iobinding(b)
        outs = b.get_outputs()
        for p, o in zip(self.pasts, outs[1:]):
            self.state[p.name] = o
        self.token = int(outs[0].numpy()[0, -1].argmax())
        return self.token

    def start(self, prompt: np.ndarray, capacity: int) -> int:
        self.state = {p.name: self.ort.OrtValue.ortvalue_from_numpy(np.zeros(self.empty_past, np.float32))
                      for p in self.pasts}
        self.total = prompt.shape[1]
        return self._run(prompt)

    def step(self) -> int:
        self.total += 1
        return self._run(np.array([[self.token]], np.int64))

    def stop(self) -> None:
        self.state = {}


class _GenaiRunner:
    key = "genai"

    def __init__(self, model_dir: str, threads: int):
        import onnxruntime_genai as og

        self.og = og
        config = og.Config(model_dir)
        # genai's session_options take no config entries (its ORT threads keep the default spinning)
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": int(threads), "inter_op_num_threads": 1}}}}))
        self.model = og.Model(config)

    def start(self, prompt: np.ndarray, capacity: int) -> int:
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=int(capacity), do_sample=False)
        self.gen = self.og.Generator(self.model, params)
        self.gen.append_tokens(prompt)           # prefill: logits of the last prompt token
        self.gen.generate_next_token()           # argmax of those logits (no model run)
        return int(self.gen.get_next_tokens()[0])

    def step(self) -> int:
        self.gen.generate_next_token()           # one model run on the last token + argmax
        return int(self.gen.get_next_tokens()[0])

    def stop(self) -> None:
        self.gen = None


def _converted_model(src_dir: str, work_dir: str, progress) -> str:
    from .. import convert

    out = os.path.join(work_dir, "smollm2_onnx_light", "model.onnx")
    src = os.path.join(src_dir, "model.onnx")
    stamp = os.path.join(os.path.dirname(out), "source.json")
    key = {"src": src, "mtime": os.path.getmtime(src), "size": os.path.getsize(src)}
    if not (os.path.isfile(out) and os.path.isfile(stamp) and json.load(open(stamp)) == key):
        os.makedirs(os.path.dirname(out), exist_ok=True)
        progress(f"  converting {src} -> {out}")
        convert(src, out)
        with open(stamp, "w") as f:
            json.dump(key, f)
    return out


def run_e2e(contexts: Sequence[int] = (256, 4096), threads: Sequence[int] = (1,), warmup: int = 3,
            reps: int = 16, work_dir: str = "bench_out", seed: int = 0,
            progress: Callable[[str], None] = print) -> Dict:
    """SmolLM2-135M decode tokens/s per runner; see the module docstring. Returns a JSON-able dict."""
    from ..models.smollm2 import ensure_smollm2_onnx

    src_dir = str(ensure_smollm2_onnx(progress=False))
    converted = _converted_model(src_dir, work_dir, progress)
    cfg = json.load(open(os.path.join(src_dir, "genai_config.json")))["model"]
    vocab = int(cfg["vocab_size"])
    from ..rewrite import read_metadata

    positions = read_metadata(converted).get("max_position") or cfg.get("context_length")
    out: Dict = {"model": "SmolLM2-135M-Instruct (onnxruntime-genai builder, fp32, CPU)", "source_dir": src_dir,
                 "converted": converted, "batch_size": 1, "warmup": warmup, "reps": reps, "runs": []}
    rng = np.random.default_rng(seed)
    for t in threads:
        runners = []
        makers = ((_EpRunner, lambda: _EpRunner(converted, t)),
                  (_OrtRunner, lambda: _OrtRunner(os.path.join(src_dir, "model.onnx"), t,
                                                  cfg["decoder"]["num_key_value_heads"],
                                                  cfg["decoder"]["head_size"])),
                  (_GenaiRunner, lambda: _GenaiRunner(src_dir, t)))
        for cls, make in makers:
            try:
                runners.append(make())
            except Exception as e:  # e.g. onnxruntime_genai missing
                out.setdefault("errors", {})[f"{cls.key}@{t}"] = f"{type(e).__name__}: {str(e)[:300]}"
        for ctx in contexts:
            run = {"threads": t, "context_length": int(ctx), "runners": {}}
            need = int(ctx) + warmup + reps + 1
            if positions and need > int(positions):
                # the measured steps must stay inside the model's rotary table: skipped, named
                why = (f"skipped: context {ctx} + {warmup + reps + 1} steps exceeds the model's {positions} "
                       f"positions (largest context: {int(positions) - warmup - reps - 1})")
                run["runners"] = {r.key: {"status": why} for r in runners}
                out["runs"].append(run)
                progress(f"  e2e t={t} C={ctx}: {why}")
                continue
            prompt = rng.integers(100, vocab - 100, size=(1, int(ctx)), dtype=np.int64)
            capacity = int(ctx) + warmup + reps + 8
            tokens: Dict[str, List[int]] = {}
            live = []
            rot = len(out["runs"]) % max(len(runners), 1)
            for r in runners[rot:] + runners[:rot]:
                t0 = time.perf_counter()
                try:
                    tokens[r.key] = [r.start(prompt, capacity)]
                except Exception as e:
                    run["runners"][r.key] = {"status": f"error: {type(e).__name__}: {str(e)[:300]}"}
                    continue
                run["runners"][r.key] = {"status": "ok", "prefill_s": time.perf_counter() - t0,
                                         "samples_ms": [], "warmup_ms": []}
                try:
                    for i in range(warmup + reps):
                        t0 = time.perf_counter_ns()
                        tokens[r.key].append(r.step())
                        ms = (time.perf_counter_ns() - t0) / 1e6
                        run["runners"][r.key]["samples_ms" if i >= warmup else "warmup_ms"].append(ms)
                except Exception as e:  # a failing point is reported; the rest of the run goes on
                    run["runners"][r.key] = {"status": f"error at decode step {i}: {type(e).__name__}: "
                                                       f"{str(e)[:300]}"}
                    tokens.pop(r.key, None)
                    try:
                        r.stop()
                    except Exception:  # noqa: BLE001 - already failed
                        pass
                    continue
                live.append(r)
            for r in live:
                e = run["runners"][r.key]
                med = statistics.median(e["samples_ms"])
                e.update({"median_ms": med, "p25_ms": float(np.quantile(e["samples_ms"], 0.25)),
                          "p75_ms": float(np.quantile(e["samples_ms"], 0.75)),
                          "tokens_per_s": 1000.0 / med})
                r.stop()
            ref = tokens.get("ort_past_present")
            run["tokens_agree"] = {k: v == ref for k, v in tokens.items() if ref and k != "ort_past_present"}
            run["generated_tokens"] = tokens
            out["runs"].append(run)
            progress(f"  e2e t={t} C={ctx}: " + " ".join(
                f"{k}={v['tokens_per_s']:.1f} tok/s" for k, v in run["runners"].items() if "tokens_per_s" in v))
        del runners
    return out


def markdown_lines(e2e: Dict) -> List[str]:
    lines = [f"### End to end: {e2e['model']}, batch 1, greedy decode tokens/s (median [p25–p75] ms per token)",
             "", "| threads | context | EP KVCache | plain ORT (past/present) | onnxruntime-genai (shared buffer) "
             "| EP vs ORT | EP vs genai | greedy tokens agree |", "|---|---|---|---|---|---|---|---|"]
    for run in e2e["runs"]:
        r = run["runners"]

        def cell(k):
            v = r.get(k) or {}
            if "tokens_per_s" not in v:
                return v.get("status", "")[:120]
            return f"{v['tokens_per_s']:.1f} tok/s ({v['median_ms']:.1f} [{v['p25_ms']:.1f}–{v['p75_ms']:.1f}] ms)"

        def ratio(a, b):
            x, y = (r.get(a) or {}).get("tokens_per_s"), (r.get(b) or {}).get("tokens_per_s")
            return f"{x / y:.2f}x" if x and y else ""

        agree = ", ".join(f"{k}: {'yes' if v else 'no'}" for k, v in run.get("tokens_agree", {}).items())
        lines.append(f"| {run['threads']} | {run['context_length']} | {cell('ep_kvcache')} | "
                     f"{cell('ort_past_present')} | {cell('genai')} | {ratio('ep_kvcache', 'ort_past_present')} | "
                     f"{ratio('ep_kvcache', 'genai')} | {agree} |")
    for k, v in (e2e.get("errors") or {}).items():
        lines.append(f"\n{k}: {v}")
    lines.append("")
    return lines
