"""End-to-end decode speed on SmolLM2-135M (part of ``run_bench``, option ``e2e``).

Two exports of SmolLM2-135M-Instruct by the onnxruntime-genai builder (CPU,
``com.microsoft.GroupQueryAttention``): fp32 weights, and int4 ``MatMulNBits`` weights
(``ensure_smollm2_onnx(precision="int4")``). Three runners of each, batch 1, greedy:

- ``ep_kvcache``: the model converted by ``onnx_light_ep.convert`` on
  ``OnnxLightExecutionProvider`` with a ``KVCache``;
- ``ort_past_present``: the original model on plain ORT, ``present.N.*``
  OrtValues bound as the next step's ``past_key_values.N.*`` (IOBinding, no
  numpy round trip);
- ``genai``: ``onnxruntime_genai.Generator`` (its own loop, past and present
  in one shared buffer of ``max_length`` rows: ``past_present_share_buffer``).

For each model, thread count and context length ``C`` the runners take turns (order
rotated per point): a runner prefills the ``C`` prompt tokens and picks the first token
(timed: ``ttft_s``, time to first token) and decodes ``warmup + reps`` tokens; the ``warmup``
steps are discarded and the median of ``reps`` steps gives tokens/s. At 1 thread the decode
steps are interleaved, one step of each runner in turn (on a shared machine whose memory
bandwidth drifts by tens of percent over minutes, back-to-back blocks handed whichever runner
ran in a quiet spell a 10% lead); with more threads each runner decodes back to back right
after its prefill, as ORT's intra-op threads spin on after a run and would slow the next
runner's step.
A context whose measured steps would leave the model's positions (its rotary table) is
clamped to the largest that fits, with a note. Beside each rate: the physical limit at that
context, ``decode_limit_tokens_per_s`` (the weights a step reads + ``C`` positions of K/V, at
the best ``stream_read`` bandwidth of that thread count in the run, measured after every point). Every session keeps ORT's
default intra-op spinning, as an application running one model would (genai offers no switch
for it). A step is one model run plus the argmax over the vocabulary. The greedy tokens of
the runners are compared (``tokens_agree``): same model, same prompt, so they should match.

Prefill profile: at ``profile_context`` (4096) one prefill of the EP and of plain ORT runs
with ORT's session profiling; its node time is split into attention, weight MatMuls and the
rest (``e2e_model.split_profile``).

Failures: a model that cannot be built, a runner that cannot be created, a prefill or a
decode step that raises are recorded with the reason; the other points go on, and
``on_point`` gets the partial result after every point (the caller writes it to disk).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from .candidates import CPU_EP, session_options
from .e2e_model import (decode_limit_tokens_per_s, decode_read_bytes, kv_bytes_per_token,
                        matmul_nbits_accuracy_level, split_profile)

RUNNERS = ("ep_kvcache", "ort_past_present", "genai")
PRECISIONS = ("fp32", "int4")
_NAMES = {"ep_kvcache": "EP KVCache", "ort_past_present": "plain ORT (past/present)",
          "genai": "onnxruntime-genai (shared buffer)"}


@dataclass
class E2EModel:
    """One export and the facts the benchmark needs about it."""

    name: str               # e.g. "SmolLM2-135M-Instruct fp32"
    precision: str
    src_dir: str            # the genai builder's folder (model.onnx, genai_config.json)
    converted: str          # the converted model.onnx
    positions: Optional[int]  # max positions (rotary table rows)
    vocab_size: int
    num_layers: int
    kv_num_heads: int
    head_dim: int
    weight_bytes: int       # read per decode step (decode_read_bytes)
    accuracy_level: Optional[int] = None  # MatMulNBits accuracy_level (int4 exports)

    @property
    def kv_token_bytes(self) -> int:
        return kv_bytes_per_token(self.num_layers, self.kv_num_heads, self.head_dim)


def clamp_context(context: int, positions: Optional[int], steps: int) -> tuple:
    """(context to run, note or None): ``context`` + ``steps`` + 1 must fit in ``positions``."""
    if positions and int(context) + steps + 1 > int(positions):
        fit = int(positions) - steps - 1
        return fit, (f"context {context} clamped to {fit}: {steps} measured steps + 1 must fit in the "
                     f"model's {positions} positions")
    return int(context), None


class _EpRunner:
    key = "ep_kvcache"

    def __init__(self, converted: str, threads: int, so_patch=None):
        from .. import InferenceSession

        so = session_options(threads, allow_spinning=True)
        if so_patch:
            so_patch(so)
        self.sess = InferenceSession(converted, so)
        self.path = converted
        # the LM head on the last position only (convert's logits_to_keep input, when it found the head)
        self.keep = ({"logits_to_keep": np.array(1, np.int64)}
                     if "logits_to_keep" in {i.name for i in self.sess.get_inputs()} else {})

    def start(self, prompt: np.ndarray, capacity: int) -> int:
        from ..cache import KVCache

        self.cache = KVCache.for_model(self.path, 1, capacity)
        self.total = prompt.shape[1]
        logits = self.sess.run(["logits"], {"input_ids": prompt, "attention_mask": np.ones_like(prompt),
                                            "kv_cache": self.cache.handle, **self.keep})[0]
        self.token = int(logits[0, -1].argmax())
        return self.token

    def step(self) -> int:
        self.total += 1
        logits = self.sess.run(["logits"], {"input_ids": np.array([[self.token]], np.int64),
                                            "attention_mask": np.ones((1, self.total), np.int64),
                                            "kv_cache": self.cache.handle, **self.keep})[0]
        self.token = int(logits[0, -1].argmax())
        return self.token

    def stop(self) -> None:
        self.cache.close()


class _OrtRunner:
    key = "ort_past_present"

    def __init__(self, model: str, threads: int, kv_num_heads: int, head_dim: int, so_patch=None):
        import onnxruntime as ort

        self.ort = ort
        so = session_options(threads, allow_spinning=True)
        if so_patch:
            so_patch(so)
        self.sess = ort.InferenceSession(model, so, providers=[CPU_EP])
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

    out = os.path.join(work_dir, os.path.basename(os.path.normpath(src_dir)) + "_onnx_light", "model.onnx")
    src = os.path.join(src_dir, "model.onnx")
    stamp = os.path.join(os.path.dirname(out), "source.json")
    key = {"src": src, "mtime": os.path.getmtime(src), "size": os.path.getsize(src), "logits_to_keep": True}
    if not (os.path.isfile(out) and os.path.isfile(stamp) and json.load(open(stamp)) == key):
        os.makedirs(os.path.dirname(out), exist_ok=True)
        progress(f"  converting {src} -> {out}")
        convert(src, out, logits_to_keep=True)  # the EP runner's prefill keeps the last position's logits
        with open(stamp, "w") as f:
            json.dump(key, f)
    return out


def load_model(precision: str, work_dir: str, progress: Callable[[str], None] = print) -> E2EModel:
    """SmolLM2-135M-Instruct of ``precision`` (built once by ``ensure_smollm2_onnx``), converted."""
    from ..models.smollm2 import ensure_smollm2_onnx
    from ..rewrite import read_metadata

    src_dir = str(ensure_smollm2_onnx(progress=False, precision=precision))
    converted = _converted_model(src_dir, work_dir, progress)
    cfg = json.load(open(os.path.join(src_dir, "genai_config.json")))["model"]
    positions = read_metadata(converted).get("max_position") or cfg.get("context_length")
    dec = cfg["decoder"]
    return E2EModel(name=f"SmolLM2-135M-Instruct {precision}", precision=precision, src_dir=src_dir,
                    converted=converted, positions=int(positions) if positions else None,
                    vocab_size=int(cfg["vocab_size"]), num_layers=int(dec["num_hidden_layers"]),
                    kv_num_heads=int(dec["num_key_value_heads"]), head_dim=int(dec["head_size"]),
                    weight_bytes=decode_read_bytes(os.path.join(src_dir, "model.onnx"))["weights"],
                    accuracy_level=matmul_nbits_accuracy_level(os.path.join(src_dir, "model.onnx")))


def default_makers(model: E2EModel, threads: int):
    """[(key, make(so_patch=None) -> runner)] for the three runners of ``model``."""
    return [("ep_kvcache", lambda so_patch=None: _EpRunner(model.converted, threads, so_patch)),
            ("ort_past_present", lambda so_patch=None: _OrtRunner(os.path.join(model.src_dir, "model.onnx"),
                                                                  threads, model.kv_num_heads, model.head_dim,
                                                                  so_patch)),
            ("genai", lambda so_patch=None: _GenaiRunner(model.src_dir, threads))]


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:300]}"


def _measure_point(runners, prompt, capacity, warmup, reps, rot, interleave=False) -> Dict:
    """One (model, threads, context) point. Every runner prefills in turn (timed: ttft_s). Then
    ``interleave``: one decode step of each runner in turn, ``warmup + reps`` rounds, so that a
    shared machine's slow spells fall on every runner alike; else each runner decodes its steps
    back to back right after its prefill."""
    run: Dict = {"runners": {}}
    tokens: Dict[str, List[int]] = {}
    order = runners[rot:] + runners[:rot]
    live = []

    def finish(r) -> None:
        try:
            r.stop()
        except Exception:  # noqa: BLE001 - nothing left to measure on it
            pass
        entry = run["runners"][r.key]
        if r.key in tokens:
            ms = entry["samples_ms"]
            med = statistics.median(ms)
            entry.update({"median_ms": med, "p25_ms": float(np.quantile(ms, 0.25)),
                          "p75_ms": float(np.quantile(ms, 0.75)), "tokens_per_s": 1000.0 / med})

    def step(r, i) -> bool:
        entry = run["runners"][r.key]
        try:
            t0 = time.perf_counter_ns()
            tokens[r.key].append(r.step())
            entry["samples_ms" if i >= warmup else "warmup_ms"].append((time.perf_counter_ns() - t0) / 1e6)
            return True
        except Exception as e:  # a failing decode is reported; the others go on
            run["runners"][r.key] = {"status": f"error at decode step {i}: {_err(e)}", "ttft_s": entry["ttft_s"]}
            tokens.pop(r.key, None)
            return False

    for r in order:
        t0 = time.perf_counter()
        try:
            tokens[r.key] = [r.start(prompt, capacity)]
        except Exception as e:  # a failing prefill is reported; the others go on
            run["runners"][r.key] = {"status": f"error in prefill: {_err(e)}"}
            continue
        run["runners"][r.key] = {"status": "ok", "ttft_s": time.perf_counter() - t0, "samples_ms": [],
                                 "warmup_ms": []}
        if interleave:
            live.append(r)
            continue
        for i in range(warmup + reps):
            if not step(r, i):
                break
        finish(r)
    for i in range(warmup + reps):
        for r in list(live):
            if not step(r, i):
                live.remove(r)
                finish(r)
    for r in live:
        finish(r)
    ref = tokens.get("ort_past_present")
    run["tokens_agree"] = {k: v == ref for k, v in tokens.items() if ref and k != "ort_past_present"}
    run["generated_tokens"] = tokens
    run["interleaved"] = bool(interleave)
    return run


def _profile(makers, keys, prompt, profile_dir) -> Dict:
    """Prefill profile of the runners ``keys``: a 32-token prefill, then ``prompt``'s, profiled."""
    out: Dict = {}
    os.makedirs(profile_dir, exist_ok=True)
    for key, make in makers:
        if key not in keys:
            continue
        try:
            def patch(so, key=key):
                so.enable_profiling = True
                so.profile_file_prefix = os.path.join(profile_dir, f"prefill_{key}")

            r = make(so_patch=patch)
            r.start(prompt[:, :32], 40)
            r.stop()
            t0 = time.perf_counter()
            r.start(prompt, prompt.shape[1] + 8)
            wall = time.perf_counter() - t0
            r.stop()
            path = r.sess.end_profiling()
            with open(path) as f:
                out[key] = split_profile(json.load(f))
            out[key].update({"profile_file": path, "wall_s": wall})
            del r
        except Exception as e:  # noqa: BLE001 - reported; the benchmark goes on
            out[key] = {"status": f"error: {_err(e)}"}
    return out


def _set_limits(runs: List[Dict], model: E2EModel, best_bw: Dict[str, float]) -> None:
    """(Re)compute every point's limit with the best bandwidth of its thread count so far."""
    for point in runs:
        bw = best_bw.get(str(point["threads"])) or best_bw.get("1")
        point["limit_read_gb_per_s"] = bw
        point["limit_tokens_per_s"] = decode_limit_tokens_per_s(model.weight_bytes, model.kv_token_bytes,
                                                                point["context_length"], bw)
        for v in point.get("runners", {}).values():
            if v.get("tokens_per_s") and point["limit_tokens_per_s"]:
                v["x_limit"] = point["limit_tokens_per_s"] / v["tokens_per_s"]


def run_model(model: E2EModel, contexts: Sequence[int], threads: Sequence[int], *, warmup: int, reps: int,
              bandwidth: Optional[Dict[str, float]] = None, seed: int = 0, profile_context: Optional[int] = 4096,
              profile_dir: Optional[str] = None, makers=default_makers,
              progress: Callable[[str], None] = print, on_point: Optional[Callable[[Dict], None]] = None,
              out: Optional[Dict] = None,
              measure_bandwidth: Optional[Callable[[int], float]] = None) -> Dict:
    """Every (threads, context) point of one model; ``out`` (the model's record) is filled in
    place and ``on_point()`` called after each point. See the module docstring.

    Limits use the best read bandwidth of the run per thread count: ``bandwidth`` ({threads:
    GB/s}, e.g. the machine's at the start) and ``measure_bandwidth(threads)`` taken after every
    point (default ``machine.read_bandwidth_gb_per_s`` with 3 passes; on a shared machine a
    single early measurement can be low enough to put a runner above its "limit")."""
    if measure_bandwidth is None:
        from .machine import read_bandwidth_gb_per_s

        def measure_bandwidth(t):
            return read_bandwidth_gb_per_s(t, repeats=3)
    best_bw = {str(k): float(v) for k, v in (bandwidth or {}).items() if v}
    out = {} if out is None else out
    out.update({"model": model.name, "precision": model.precision, "source_dir": model.src_dir,
                "converted": model.converted, "facts": asdict(model), "kv_bytes_per_token": model.kv_token_bytes,
                "runs": []})
    rng = np.random.default_rng(seed)
    steps = warmup + reps
    n_points = 0
    for t in threads:
        runners = []
        for key, make in makers(model, t):
            try:
                r = make()
                r.key = key
                runners.append(r)
            except Exception as e:  # e.g. onnxruntime_genai missing: that runner is out, the rest go on
                out.setdefault("errors", {})[f"{key}@{t}"] = _err(e)
        for ctx in contexts:
            run_ctx, note = clamp_context(ctx, model.positions, steps)
            point = {"threads": t, "context_length": run_ctx, "requested_context": int(ctx)}
            if note:
                point["note"] = note
                progress(f"  e2e {model.precision} t={t}: {note}")
            if run_ctx < 1:
                point["runners"] = {r.key: {"status": f"skipped: {note}"} for r in runners}
            else:
                prompt = rng.integers(100, model.vocab_size - 100, size=(1, run_ctx), dtype=np.int64)
                capacity = min(run_ctx + steps + 8, model.positions or 1 << 62)
                # 1 thread: decode steps interleaved (no intra-op threads that could spin into the
                # next runner's step); more: each runner's steps back to back (ORT's spinning pool)
                point.update(_measure_point(runners, prompt, capacity, warmup, reps, n_points % max(1, len(runners)),
                                            interleave=int(t) == 1))
            out["runs"].append(point)
            try:
                best_bw[str(t)] = max(best_bw.get(str(t), 0.0), float(measure_bandwidth(t)))
            except Exception as e:  # noqa: BLE001 - the limits fall back to what was measured before
                out.setdefault("errors", {})[f"bandwidth@{t}"] = _err(e)
            _set_limits(out["runs"], model, best_bw)
            out["read_gb_per_s_best"] = dict(best_bw)
            n_points += 1
            progress(f"  e2e {model.precision} t={t} C={run_ctx}: " + " ".join(
                f"{k}={v['tokens_per_s']:.1f} tok/s" for k, v in point["runners"].items() if "tokens_per_s" in v))
            if on_point:
                on_point()
        del runners
        if profile_context:
            run_ctx, note = clamp_context(profile_context, model.positions, 0)
            prompt = rng.integers(100, model.vocab_size - 100, size=(1, run_ctx), dtype=np.int64)
            prof = _profile(makers(model, t), ("ep_kvcache", "ort_past_present"), prompt,
                            profile_dir or os.path.join("bench_out", "profiles"))
            out.setdefault("prefill_profile", []).append({"threads": t, "context_length": run_ctx,
                                                          "runners": prof, **({"note": note} if note else {})})
            progress(f"  e2e {model.precision} t={t} prefill profile at {run_ctx}: " + " ".join(
                f"{k} attention {v['attention_share']:.0%} / MatMul {v['matmul_share']:.0%}"
                for k, v in prof.items() if v.get("attention_share") is not None))
            if on_point:
                on_point()
    return out


def run_e2e(contexts: Sequence[int] = (256, 4096, 8192), threads: Sequence[int] = (1, 2), warmup: int = 3,
            reps: int = 16, work_dir: str = "bench_out", seed: int = 0,
            progress: Callable[[str], None] = print, on_point: Optional[Callable[[Dict], None]] = None,
            machine: Optional[Dict] = None, quick: bool = False, precisions: Sequence[str] = PRECISIONS,
            profile_context: Optional[int] = 4096) -> Dict:
    """SmolLM2-135M decode tokens/s, TTFT and limits per model and runner; see the module docstring.

    ``contexts`` beyond the model's positions minus the measured steps are clamped (noted);
    ``machine`` supplies the read bandwidth of the limits (``stream_read_gb_per_s``);
    ``on_point(partial)`` is called with the result so far after every point. ``quick``: no
    prefill profile. Returns a JSON-able dict {``models``: [per model: ``runs``,
    ``prefill_profile``, ``failed`` if it could not be built], ``warmup``, ``reps``}."""
    out: Dict = {"batch_size": 1, "warmup": warmup, "reps": reps, "contexts": [int(c) for c in contexts],
                 "threads": [int(t) for t in threads], "models": []}
    bandwidth = (machine or {}).get("stream_read_gb_per_s")
    for precision in precisions:
        rec: Dict = {"model": f"SmolLM2-135M-Instruct {precision}", "precision": precision, "runs": []}
        out["models"].append(rec)
        try:
            model = load_model(precision, work_dir, progress)
            run_model(model, contexts, threads, warmup=warmup, reps=reps, bandwidth=bandwidth, seed=seed,
                      profile_context=None if quick else profile_context,
                      profile_dir=os.path.join(work_dir, "profiles"), makers=default_makers, progress=progress,
                      on_point=(lambda: on_point(out)) if on_point else None, out=rec)
        except Exception as e:  # this model failed; the other model and the grid are kept
            rec["failed"] = _err(e)
            progress(f"  e2e {precision} FAILED: {rec['failed']}")
        if on_point:
            on_point(out)
    return out


def _rate_cell(v: Dict) -> str:
    if "tokens_per_s" not in v:
        return v.get("status", "")[:160]
    pct = f", {1 / v['x_limit']:.0%} of limit" if v.get("x_limit") else ""
    return f"{v['tokens_per_s']:.1f} ({v['median_ms']:.1f} [{v['p25_ms']:.1f}–{v['p75_ms']:.1f}] ms{pct})"


def markdown_lines(e2e: Dict) -> List[str]:
    """Tables of ``run_e2e``'s result: per model, decode tokens/s with the limit, TTFT, the prefill profile."""
    lines: List[str] = [f"End to end FAILED: {e2e['failed']}", ""] if e2e.get("failed") else []
    for m in e2e.get("models", []):
        lines += [f"### End to end: {m['model']} (onnxruntime-genai builder, CPU), batch 1, greedy", ""]
        if m.get("failed"):
            lines += [f"FAILED: {m['failed']}", ""]
            if not m.get("runs"):
                continue
        facts = m.get("facts") or {}
        if facts:
            lines += [f"A decode step reads {facts['weight_bytes'] / 2**20:.1f} MiB of weights (every initializer "
                      f"once, one row of the embedding table) + {m['kv_bytes_per_token'] / 1024:.1f} KiB of K/V "
                      f"per context position; limit = those bytes at the best `stream_read` bandwidth of the "
                      f"thread count in the run ({', '.join(f'{k} thread(s) {v:.1f} GB/s' for k, v in sorted((m.get('read_gb_per_s_best') or {}).items()))}, "
                      f"measured after every point). Decode: tokens/s (median [p25–p75] ms per token, share of the limit); "
                      f"TTFT = prefill of the context + the first token, one run.", ""]
            if facts.get("accuracy_level"):
                lines += [f"`MatMulNBits` runs with `accuracy_level={facts['accuracy_level']}`: it quantizes its "
                          "activations to int8 per block, so a last-bit difference of the attention output (the "
                          "EP's kernel rounds differently from ORT's GQA) can flip a code and move the logits by "
                          "~1: greedy tokens may part. With `accuracy_level=0` the EP's and plain ORT's prefill "
                          "logits of this export agree to 1.2e-4 (16 tokens, checked by hand).", ""]
        lines += ["| threads | context | limit tok/s | " + " | ".join(_NAMES[k] + " tok/s" for k in RUNNERS)
                  + " | EP vs ORT | EP vs genai | TTFT s (EP / ORT / genai) | greedy tokens agree |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        notes = []
        for run in m.get("runs", []):
            r = run["runners"]

            def ratio(a, b):
                x, y = (r.get(a) or {}).get("tokens_per_s"), (r.get(b) or {}).get("tokens_per_s")
                return f"{x / y:.2f}x" if x and y else ""

            ttft = " / ".join(f"{(r.get(k) or {})['ttft_s']:.2f}" if (r.get(k) or {}).get("ttft_s") is not None
                              else "–" for k in RUNNERS)
            agree = ", ".join(f"{k}: {'yes' if v else 'no'}" for k, v in run.get("tokens_agree", {}).items())
            lim = run.get("limit_tokens_per_s")
            ctx = f"{run['context_length']}" + ("*" if run.get("note") else "")
            lines.append(f"| {run['threads']} | {ctx} | {'' if lim is None else f'{lim:.1f}'} | "
                         + " | ".join(_rate_cell(r.get(k) or {}) for k in RUNNERS)
                         + f" | {ratio('ep_kvcache', 'ort_past_present')} | {ratio('ep_kvcache', 'genai')} | "
                         f"{ttft} | {agree} |")
            if run.get("note"):
                notes.append(run["note"])
        lines.append("")
        for n in sorted(set(notes)):
            lines.append(f"\\* {n}.")
        for k, v in (m.get("errors") or {}).items():
            lines.append(f"{k}: {v}")
        if notes or m.get("errors"):
            lines.append("")
        if m.get("prefill_profile"):
            lines += ["Prefill profile (ORT session profiling, one prefill after a 32-token warm-up; node kernel "
                      "time, share of the summed node time):", "",
                      "| threads | context | runner | prefill ms (run) | attention ms (share) | weight MatMuls ms "
                      "(share) | other ms | top ops |", "|---|---|---|---|---|---|---|---|"]
            for p in m["prefill_profile"]:
                for k, v in p["runners"].items():
                    if v.get("attention_share") is None:
                        lines.append(f"| {p['threads']} | {p['context_length']} | {_NAMES[k]} | "
                                     f"{v.get('status', 'no node events')} | | | | |")
                        continue
                    top = ", ".join(f"{op} {ms:.0f}" for op, ms in list(v["by_op"].items())[:4])
                    lines.append(f"| {p['threads']} | {p['context_length']} | {_NAMES[k]} | {v['run_ms']:.0f} | "
                                 f"{v['attention_ms']:.0f} ({v['attention_share']:.0%}) | {v['matmul_ms']:.0f} "
                                 f"({v['matmul_share']:.0%}) | {v['other_ms']:.0f} | {top} |")
            lines.append("")
    return lines
