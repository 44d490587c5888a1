"""Where one decode step of SmolLM2-135M goes, op by op: the EP's conversion against plain ORT.

Runs the end-to-end benchmark's two ORT runners on the same random prompt of ``--context``
tokens: ``ep_kvcache`` (the onnxruntime-genai builder's export converted, decoding into a
``KVCache``) and ``ort_past_present`` (the same export in plain ORT: its GroupQueryAttention
with past/present tensors bound by IO binding). Each runner prefills, then runs ``--steps``
greedy decode steps unprofiled (median step time printed), then again in a session with ORT's
profiling on; per op type, the kernel time per step over the profiled steps after the first two,
side by side (the EP's fused nodes summed as "CacheAttention (EP)"), and the profiled run time
per step minus the summed node time ("ORT between nodes"; means over the profiled steps).
Profiling adds ~2 ms per step.

    python tools/profile_decode_step.py --precision int4 --context 8150 --threads 1
    python tools/profile_decode_step.py --precision fp32 --context 256 --threads 1

The runners are those of ``onnx_light_ep.bench.e2e.default_makers`` (the model from ``load_model``: needs the
``models`` extra). ``--context`` + ``--steps`` + 1 must stay inside the model's positions.
onnxruntime-genai's own loop is not profiled (it runs the export ``ort_past_present`` runs,
with its own buffer management around ``Run``).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from onnx_light_ep.bench.e2e import default_makers, load_model


def timed_steps(runner, steps):
    """Seconds per decode step of ``runner`` (after its ``start``), ``steps`` steps."""
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        runner.step()
        out.append(time.perf_counter() - t0)
    return out


def _profile(make, prompt, capacity, steps, work_dir, key):
    """(unprofiled step times, {op type: ms per step}, profiled run ms per step) of one runner."""
    runner = make(None)
    runner.start(prompt, capacity)
    plain = timed_steps(runner, steps)
    runner.stop()
    prefix = os.path.join(work_dir, f"profile_decode_step_{key}")

    def patch(so):
        so.enable_profiling = True
        so.profile_file_prefix = prefix

    runner = make(patch)
    runner.start(prompt, capacity)
    timed_steps(runner, steps)
    runner.stop()
    with open(runner.sess.end_profiling()) as f:
        events = json.load(f)
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"][3:]  # prefill, 2 steps
    lo = runs[0]["ts"]
    by_op = {}
    for e in events:
        if e.get("cat") != "Node" or not str(e.get("name", "")).endswith("_kernel_time") or e["ts"] < lo:
            continue
        op = (e.get("args") or {}).get("op_name", "?")
        op = "CacheAttention (EP)" if op.startswith("OnnxLightExecutionProvider") else op
        by_op[op] = by_op.get(op, 0.0) + e["dur"] / 1e3 / len(runs)
    return plain, by_op, float(np.mean([r["dur"] for r in runs])) / 1e3  # a mean, as the node times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--precision", default="int4", choices=("fp32", "int4"))
    ap.add_argument("--context", type=int, default=8150)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--work-dir", default="bench_out")
    args = ap.parse_args()
    if args.steps < 3:
        ap.error("--steps must be >= 3 (the first two are not counted)")
    model = load_model(args.precision, args.work_dir)
    if args.context + args.steps + 1 > (model.positions or 1 << 62):
        ap.error(f"--context {args.context} + --steps {args.steps} + 1 exceeds the model's {model.positions} positions")
    os.makedirs(args.work_dir, exist_ok=True)
    prompt = np.random.default_rng(0).integers(100, model.vocab_size - 100, size=(1, args.context), dtype=np.int64)
    capacity = args.context + args.steps + 8
    makers = {key: make for key, make in default_makers(model, args.threads) if key != "genai"}
    res = {key: _profile(make, prompt, capacity, args.steps, args.work_dir, key) for key, make in makers.items()}
    print(f"{model.name}, context {args.context}, {args.threads} thread(s), {args.steps} steps (first 2 not counted)")
    for key, (plain, by_op, run_ms) in res.items():
        t = np.array(plain[2:]) * 1e3
        print(f"  {key:18s} unprofiled step: median {np.median(t):.2f} ms [min {t.min():.2f}]; profiled run mean "
              f"{run_ms:.2f} ms, node time {sum(by_op.values()):.2f} ms")
    ops = sorted({op for _, by_op, _ in res.values() for op in by_op},
                 key=lambda op: -max(r[1].get(op, 0.0) for r in res.values()))
    print(f"  {'ms per step':40s} " + " ".join(f"{k:>18s}" for k in res))
    for op in ops[:12]:
        print(f"  {op:40s} " + " ".join(f"{r[1].get(op, 0.0):18.3f}" for r in res.values()))
    print(f"  {'ORT between nodes':40s} " + " ".join(f"{r[2] - sum(r[1].values()):18.3f}" for r in res.values()))


if __name__ == "__main__":
    main()
