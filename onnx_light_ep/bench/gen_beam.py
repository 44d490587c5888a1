"""Section ``beam`` of ``tools/bench_generation.py``: beam search, EP KVCache vs plain ORT gathered pasts vs genai.

    python tools/bench_generation.py --out-dir bench_out [--sections beam] [--threads 1,0] [--benchmarks-md BENCHMARKS.md]

Writes ``<out-dir>/bench_generation.json`` (machine, command, every section's raw samples) and
``<out-dir>/bench_generation.md`` (one table per section); ``--benchmarks-md`` replaces the block
``bench_generation_NAME`` of that file for each section run. A section is a function
``section_NAME(args) -> dict`` with a ``"markdown"`` list of lines, registered in ``SECTIONS``;
its own options are added to the parser by ``add_NAME_arguments``.

- ``beam``: beam search with ``--num-beams`` (4) beams after a ``--context`` (1024 and 4096) token prompt
  (random ids in [100, vocab - 100), seeded), ``--steps`` (16) measured decode steps after
  ``--warmup`` (2), per thread count (``0`` = ORT's default). Three runners, stepped in turn
  (one step each, order rotated per step), each prefilled once before the loop (timed once):

  1. ``ep_kvcache``: the converted model on ``OnnxLightExecutionProvider``; the prompt prefilled
     on a batch-1 ``KVCache``, ``fork([0] * N)``, then per step ``reorder(parent_beams)`` + one
     batch-N ``CacheStepper.run`` + the beam bookkeeping (``onnx_light_ep.generate.BeamSearch``):
     what ``generate(num_beams=N)`` does. Bytes copied: ``stats()["bytes_copied"]`` delta
     (copy-on-write of shared tail pages). Run twice: with the default pages (256 positions
     here) and with ``--small-pages`` (32) positions per page, which bounds the tail copy.
  2. ``ort_gathered``: the original model on plain ORT (CPU EP), pasts as tensors: per step one
     batch-N run with IOBinding (presents written into numpy buffers we own, no extra copy), then
     every present gathered by parent beam (``np.take``) into the next pasts, with the same
     bookkeeping. Bytes copied: the presents the model writes (GroupQueryAttention without a
     shared buffer writes the whole past + the new row) plus the gathered pasts (the whole past
     of every beam again).
  3. ``genai``: ``onnxruntime_genai`` beam search (``num_beams`` in its search options,
     ``do_sample=False``, ``min_length = max_length`` so EOS cannot end it early) on the same
     original model; per step one ``generate_next_token()``. Its copies are not observable from
     Python: by its source (``DefaultKeyValueCache``) beam search turns
     ``past_present_share_buffer`` off and ``PickPastState`` copies every present into a new past
     by beam index, so the table states the same bytes as ``ort_gathered``, marked as derived.

  No EOS id is used by the EP and ORT runners (``eos_token_ids=[]``), so all runs take the same
  number of steps. Per runner: median / p25 / p75 ms per step, tokens/s = N / median step time,
  bytes copied per step (median), committed KV bytes (EP) or the pasts' bytes (ORT) at the end;
  whether the EP's and ORT's beams chose the same tokens at every step.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Dict, List

import numpy as np



def _stats_ms(xs: List[float]) -> Dict[str, float]:
    a = np.asarray(xs, np.float64)
    return {"median_ms": float(np.median(a)), "p25_ms": float(np.quantile(a, 0.25)),
            "p75_ms": float(np.quantile(a, 0.75)), "num_samples": len(xs)}


def _mib(b) -> str:
    return "n/a" if b is None else f"{b / 2**20:.2f} MiB"


# -- beam search ---------------------------------------------------------------------------------

class _EpBeams:
    key = "ep_kvcache"

    def __init__(self, converted: str, threads: int, page_tokens=None):
        if page_tokens:
            self.key = f"ep_kvcache_p{page_tokens}"
        self.cache_options = {"page_tokens": page_tokens} if page_tokens else {}
        from onnx_light_ep import InferenceSession
        from onnx_light_ep.bench.candidates import session_options
        from onnx_light_ep.generate import CacheStepper
        from onnx_light_ep.rewrite import read_metadata

        self.sess = InferenceSession(converted, session_options(threads, allow_spinning=True))
        self.stepper = CacheStepper(self.sess, read_metadata(converted), "bench")

    def start(self, prompt: np.ndarray, num_beams: int, capacity: int) -> np.ndarray:
        from onnx_light_ep import KVCache

        with KVCache.for_model(self.sess, 1, capacity, **self.cache_options) as one:
            logits = self.stepper.prefill(one, prompt)
            self.beams = one.fork([0] * num_beams)
        return logits

    def step(self, parents: np.ndarray, tokens: np.ndarray):
        before = self.beams.stats()["bytes_copied"]
        self.beams.reorder(parents)
        logits = self.stepper.run(self.beams, tokens[:, None])[:, -1]
        return logits, self.beams.stats()["bytes_copied"] - before

    def held_bytes(self) -> int:
        return int(self.beams.stats()["committed_bytes"])

    def stop(self) -> None:
        self.beams.close()


class _OrtGathered:
    key = "ort_gathered"

    def __init__(self, model: str, threads: int, vocab: int, head_size: int):
        import onnxruntime as ort

        from onnx_light_ep.bench.candidates import CPU_EP, session_options

        self.ort = ort
        self.sess = ort.InferenceSession(model, session_options(threads, allow_spinning=True), providers=[CPU_EP])
        self.past_names = [i.name for i in self.sess.get_inputs() if i.name.startswith("past_key_values.")]
        shapes = {i.name: i.shape for i in self.sess.get_inputs()}
        self.heads_dim = {n: (int(shapes[n][1]), int(head_size)) for n in self.past_names}
        self.vocab = int(vocab)

    def _run(self, ids: np.ndarray) -> np.ndarray:
        b, s = ids.shape
        total = self.past_len + s
        io = self.sess.io_binding()
        io.bind_cpu_input("input_ids", ids.astype(np.int64))
        io.bind_cpu_input("attention_mask", np.ones((b, total), np.int64))
        for n in self.past_names:
            io.bind_cpu_input(n, self.pasts[n])
        logits = np.empty((b, s, self.vocab), np.float32)
        io.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        presents = {}
        for n in self.past_names:
            h, d = self.heads_dim[n]
            presents[n] = np.empty((b, h, total, d), np.float32)
            io.bind_output(n.replace("past_key_values.", "present."), "cpu", 0, np.float32,
                           list(presents[n].shape), presents[n].ctypes.data)
        self.sess.run_with_iobinding(io)
        self.presents, self.past_len = presents, total
        return logits[:, -1]

    def start(self, prompt: np.ndarray, num_beams: int, capacity: int) -> np.ndarray:
        self.past_len = 0
        self.pasts = {n: np.zeros((1, h, 0, d), np.float32) for n, (h, d) in self.heads_dim.items()}
        return self._run(prompt)

    def step(self, parents: np.ndarray, tokens: np.ndarray):
        written = sum(p.nbytes for p in self.presents.values())
        self.pasts = {n: np.take(p, parents, axis=0) for n, p in self.presents.items()}
        gathered = sum(p.nbytes for p in self.pasts.values())
        logits = self._run(tokens[:, None])
        return logits, written + gathered

    def held_bytes(self) -> int:
        return int(sum(p.nbytes for p in self.presents.values()))

    def stop(self) -> None:
        self.pasts = self.presents = {}


class _GenaiBeams:
    key = "genai"

    def __init__(self, model_dir: str, threads: int):
        import onnxruntime_genai as og

        self.og = og
        config = og.Config(model_dir)
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": int(threads), "inter_op_num_threads": 1}}}}))
        self.model = og.Model(config)

    def start(self, prompt: np.ndarray, num_beams: int, capacity: int) -> None:
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=int(capacity), min_length=int(capacity), num_beams=int(num_beams),
                                  do_sample=False, early_stopping=False, length_penalty=1.0)
        self.gen = self.og.Generator(self.model, params)
        self.gen.append_tokens(prompt.astype(np.int32))
        self.gen.generate_next_token()  # picks the first tokens from the prefill's logits (no model run)

    def step(self) -> None:
        self.gen.generate_next_token()  # one batch-N run, the beam scorer, the past picked by beam

    def stop(self) -> None:
        self.gen = None


def add_beam_arguments(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("beam")
    g.add_argument("--num-beams", type=int, default=4)
    g.add_argument("--context", default="1024,4096", help="prompt tokens, comma-separated (one table each)")
    g.add_argument("--steps", type=int, default=16, help="measured decode steps")
    g.add_argument("--warmup", type=int, default=2, help="decode steps before the measured ones")
    g.add_argument("--small-pages", type=int, default=32, help="page_tokens of the second EP runner (0 = none)")


def section_beam(args) -> Dict:
    """Beam search tokens/s and bytes copied per step at each ``--context``: EP KVCache vs plain ORT
    gathered pasts vs genai."""
    try:
        contexts = [int(x) for x in str(args.context).split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"error: --context; expected comma-separated integers, got {args.context!r}") from None
    if not contexts or min(contexts) < 1:
        raise SystemExit(f"error: --context; expected positive prompt lengths, got {args.context!r}")
    per = [_beam_at(args, c) for c in contexts]
    return {"contexts": per, "markdown": [line for r in per for line in r["markdown"] + [""]]}


def _beam_at(args, ctx: int) -> Dict:
    """One prompt length of :func:`section_beam`."""
    from onnx_light_ep.generate import BeamSearch
    from onnx_light_ep.generate._beam import log_softmax
    from onnx_light_ep.models.smollm2 import ensure_smollm2_onnx
    from onnx_light_ep.rewrite import convert

    src_dir = str(ensure_smollm2_onnx(progress=False))
    converted = os.path.join(args.out_dir, "smollm2_onnx_light", "model.onnx")
    if not os.path.isfile(converted):
        convert(os.path.join(src_dir, "model.onnx"), converted, logits_to_keep=True)
    cfg = json.load(open(os.path.join(src_dir, "genai_config.json")))["model"]
    dec = cfg["decoder"]
    row_bytes = dec["num_hidden_layers"] * dec["num_key_value_heads"] * 2 * dec["head_size"] * 4
    n, total = args.num_beams, args.warmup + args.steps
    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(100, int(cfg["vocab_size"]) - 100, size=(1, ctx), dtype=np.int64)
    capacity = ctx + total + 1
    out = {"model": "SmolLM2-135M-Instruct (onnxruntime-genai builder, fp32, CPU)", "num_beams": n,
           "context_length": ctx, "warmup": args.warmup, "steps": args.steps, "kv_bytes_per_position": row_bytes,
           "runs": []}
    for t in args.threads:
        run = {"threads": t, "runners": {}}
        runners = []
        makers = [(_EpBeams, lambda: _EpBeams(converted, t))]
        if args.small_pages:
            makers.append((_EpBeams, lambda: _EpBeams(converted, t, args.small_pages)))
        for cls, make in makers + [(_OrtGathered, lambda: _OrtGathered(os.path.join(src_dir, "model.onnx"), t, cfg["vocab_size"],
                                                          dec["head_size"])),
                          (_GenaiBeams, lambda: _GenaiBeams(src_dir, t))]:
            try:
                runners.append(make())
            except Exception as e:  # noqa: BLE001 - reported, the others go on
                run["runners"][cls.key] = {"status": f"error: {type(e).__name__}: {str(e)[:300]}"}
        searches, logits, rec = {}, {}, {}
        for r in runners:
            t0 = time.perf_counter()
            try:
                lg = r.start(prompt, n, capacity)
            except Exception as e:  # noqa: BLE001
                run["runners"][r.key] = {"status": f"error at prefill: {type(e).__name__}: {str(e)[:300]}"}
                continue
            rec[r.key] = {"status": "ok", "prefill_s": time.perf_counter() - t0, "samples_ms": [], "warmup_ms": [],
                          "bytes_copied": []}
            if lg is not None:
                searches[r.key] = BeamSearch(n, [], capacity - ctx)
                searches[r.key].step(log_softmax(lg))
        live = [r for r in runners if r.key in rec]
        chosen: Dict[str, List[List[int]]] = {k: [] for k in searches}
        for i in range(total):
            rot = i % max(len(live), 1)
            for r in live[rot:] + live[:rot]:
                e = rec[r.key]
                if e["status"] != "ok":
                    continue
                try:
                    t0 = time.perf_counter_ns()
                    if r.key in searches:
                        s = searches[r.key]
                        lg, copied = r.step(s.parent_beams, s.next_tokens)
                        chosen[r.key].append(s.next_tokens.tolist())
                        s.step(log_softmax(lg))
                    else:
                        r.step()
                        copied = None
                    ms = (time.perf_counter_ns() - t0) / 1e6
                except Exception as ex:  # noqa: BLE001
                    e["status"] = f"error at step {i}: {type(ex).__name__}: {str(ex)[:300]}"
                    continue
                e["samples_ms" if i >= args.warmup else "warmup_ms"].append(ms)
                if i >= args.warmup and copied is not None:
                    e["bytes_copied"].append(int(copied))
        mid_past = ctx + args.warmup + args.steps // 2   # past length at the middle measured step
        for r in live:
            e = rec[r.key]
            if e["status"] == "ok":
                e.update(_stats_ms(e["samples_ms"]))
                e["tokens_per_s"] = n * 1000.0 / e["median_ms"]
                if e["bytes_copied"]:
                    e["bytes_copied_per_step"] = float(statistics.median(e["bytes_copied"]))
                else:  # genai: derived from its design, see the module docstring
                    e["bytes_copied_per_step"] = None
                    e["bytes_copied_per_step_derived"] = float(2 * n * mid_past * row_bytes)
                if hasattr(r, "held_bytes"):
                    e["kv_bytes_held"] = r.held_bytes()
            r.stop()
            run["runners"][r.key] = e
        if "ep_kvcache" in chosen and "ort_gathered" in chosen:
            run["tokens_agree"] = chosen["ep_kvcache"] == chosen["ort_gathered"]
        run["gather_bytes_per_step_formula"] = float(n * mid_past * row_bytes)
        out["runs"].append(run)
        print(f"  beam t={t}: " + " ".join(f"{k}={v.get('tokens_per_s', 0):.1f} tok/s"
                                          for k, v in run["runners"].items()), file=sys.stderr)
        del runners
    out["markdown"] = beam_markdown(out)
    return out


def beam_markdown(res: Dict) -> List[str]:
    names = {"ep_kvcache": "EP KVCache (fork + reorder), default pages", "ort_gathered": "plain ORT, pasts gathered per beam",
             "genai": "onnxruntime-genai beam search"}
    lines = [f"### Beam search: {res['model']}, {res['num_beams']} beams, {res['context_length']}-token prompt, "
             f"{res['steps']} steps", "",
             "| threads | runner | ms per step (median [p25–p75]) | tokens/s (beams x steps/s) | KV bytes copied per "
             "step | KV bytes held at the end | prefill s |", "|---|---|---|---|---|---|---|"]
    for run in res["runs"]:
        for key, e in run["runners"].items():
            t = run["threads"] or "default"
            name = names.get(key) or (f"EP KVCache (fork + reorder), {key.split('_p')[-1]}-token pages"
                                      if key.startswith("ep_kvcache_p") else key)
            if e.get("status") != "ok":
                lines.append(f"| {t} | {name} | {e.get('status')} | | | | |")
                continue
            copied = (_mib(e["bytes_copied_per_step"]) if e.get("bytes_copied_per_step") is not None
                      else f"{_mib(e.get('bytes_copied_per_step_derived'))} (by its design, not measured)")
            lines.append(f"| {t} | {name} | {e['median_ms']:.1f} [{e['p25_ms']:.1f}–{e['p75_ms']:.1f}] "
                         f"| {e['tokens_per_s']:.1f} | {copied} | {_mib(e.get('kv_bytes_held'))} "
                         f"| {e['prefill_s']:.2f} |")
        if "tokens_agree" in run:
            lines.append(f"| {run['threads'] or 'default'} | EP and ORT chose the same beams at every step: "
                         f"{run['tokens_agree']} | | | | | |")
    return lines

SECTION = ("beam", section_beam, add_beam_arguments)
