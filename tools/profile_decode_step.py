"""Where one decode step of the converted SmolLM2-135M goes, op by op, at a long context.

Prefills ``--context`` random tokens into a ``KVCache`` (a 2-thread session), then runs
``--steps`` greedy decode steps with a ``--threads`` session on the same cache, profiled by ORT
(session profiling), and prints the median step time and each op type's time per step (the EP's
fused nodes summed as "CacheAttention (EP)"), over the steps after the first two. Profiling
itself adds ~2 ms per step; the unprofiled median is printed first (``--steps`` more steps).

    python tools/profile_decode_step.py --precision int4 --context 8150 --threads 1

The model comes from the end-to-end benchmark's builder (``onnx_light_ep.bench.e2e.load_model``:
the onnxruntime-genai builder's export of SmolLM2-135M-Instruct, converted; needs the ``models``
extra). ``--context`` + 2 x ``--steps`` must stay inside the model's 8192 positions.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from onnx_light_ep import InferenceSession
from onnx_light_ep.bench.candidates import session_options
from onnx_light_ep.bench.e2e import load_model
from onnx_light_ep.cache import KVCache


def _decode(sess, cache, token, total, steps):
    times = []
    for _ in range(steps):
        total += 1
        t0 = time.perf_counter()
        logits = sess.run(["logits"], {"input_ids": np.array([[token]], np.int64),
                                       "attention_mask": np.ones((1, total), np.int64), "kv_cache": cache.handle})[0]
        times.append((time.perf_counter() - t0) * 1e3)
        token = int(logits[0, -1].argmax())
    return token, total, times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--precision", default="int4", choices=("fp32", "int4"))
    ap.add_argument("--context", type=int, default=8150)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--work-dir", default="bench_out")
    args = ap.parse_args()
    model = load_model(args.precision, args.work_dir)
    if args.context + 2 * args.steps + 1 > (model.positions or 1 << 62):
        ap.error(f"--context {args.context} + 2 x --steps {args.steps} + 1 exceeds the model's {model.positions} positions")
    prompt = np.random.default_rng(0).integers(100, model.vocab_size - 100, size=(1, args.context), dtype=np.int64)
    cache = KVCache.for_model(model.converted, 1, args.context + 2 * args.steps + 8)
    prefill = InferenceSession(model.converted, session_options(2, allow_spinning=True))
    t0 = time.perf_counter()
    logits = prefill.run(["logits"], {"input_ids": prompt, "attention_mask": np.ones_like(prompt), "kv_cache": cache.handle})[0]
    print(f"prefill of {args.context} tokens (2 threads): {time.perf_counter() - t0:.1f} s")
    del prefill
    token, total = int(logits[0, -1].argmax()), args.context
    plain = InferenceSession(model.converted, session_options(args.threads, allow_spinning=True))
    token, total, times = _decode(plain, cache, token, total, args.steps)
    print(f"decode step, {args.threads} thread(s), unprofiled: median {np.median(times[2:]):.2f} ms "
          f"[min {min(times[2:]):.2f}]")
    del plain
    so = session_options(args.threads, allow_spinning=True)
    so.enable_profiling = True
    so.profile_file_prefix = os.path.join(args.work_dir, "profile_decode_step")
    sess = InferenceSession(model.converted, so)
    token, total, times = _decode(sess, cache, token, total, args.steps)
    with open(sess.end_profiling()) as f:
        events = json.load(f)
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"][2:]
    lo = runs[0]["ts"]
    by_op = {}
    for e in events:
        if e.get("cat") != "Node" or not str(e.get("name", "")).endswith("_kernel_time") or e["ts"] < lo:
            continue
        op = (e.get("args") or {}).get("op_name", "?")
        op = "CacheAttention (EP)" if op.startswith("OnnxLightExecutionProvider") else op
        by_op[op] = by_op.get(op, 0.0) + e["dur"] / 1e3 / len(runs)
    run_ms = float(np.median([r["dur"] for r in runs])) / 1e3
    print(f"profiled: model_run median {run_ms:.2f} ms, node time {sum(by_op.values()):.2f} ms per step "
          f"(the rest is ORT between nodes)")
    for op, ms in sorted(by_op.items(), key=lambda kv: -kv[1])[:10]:
        print(f"  {op:40s} {ms:8.3f} ms/step")
    cache.close()


if __name__ == "__main__":
    main()
