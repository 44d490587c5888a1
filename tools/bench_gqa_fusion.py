#!/usr/bin/env python3
"""SmolLM2-135M decode: the fused GroupQueryAttention conversion vs the unfused one, interleaved.

``convert(fuse_gqa=True)`` writes one ``CacheAttention`` per layer taking the packed QKV and
the rotary caches; ``fuse_gqa=False`` keeps a QKV ``Split`` and two ``RotaryEmbedding`` nodes
per layer in front of it. Both conversions of the same genai export run on
``OnnxLightExecutionProvider`` with a ``KVCache`` in one process: the same random prompt of
each context length is prefilled by both, then decode steps alternate between them (order
flipped every step, warm-up steps discarded), greedy tokens checked equal. Every context is
measured twice, once with each form's session created first, and the samples pooled: the
session created first ran its MatMuls measurably slower here (ORT profile: the gap followed
the creation order when it was swapped), which would otherwise read as a difference of forms. Reports per context
the median step time and tokens/s of each, their interquartile range, and the median of the
per-step ratio unfused/fused (> 1: the fused form is faster). Absolute rates on a shared
machine are noise; the interleaved ratio is the figure.

    python tools/bench_gqa_fusion.py --contexts 256,4096 --steps 60 --threads 1 --out-dir bench_out
"""

import argparse
import json
import os
import time

import numpy as np


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="256,4096", help="prompt lengths (comma separated)")
    p.add_argument("--steps", type=int, default=60, help="measured decode steps per form and creation order")
    p.add_argument("--warmup", type=int, default=3, help="discarded decode steps per form")
    p.add_argument("--threads", type=int, default=1, help="intra_op_num_threads")
    p.add_argument("--out-dir", default="bench_out", help="converted models and bench_gqa_fusion.json go here")
    args = p.parse_args(argv)

    import onnxruntime as ort

    import onnx_light_ep as ole
    from onnx_light_ep.bench.machine import machine_info
    from onnx_light_ep.models.smollm2 import ensure_smollm2_onnx

    src = os.path.join(str(ensure_smollm2_onnx(progress=False)), "model.onnx")
    paths = {}
    for form, fuse in (("fused", True), ("unfused", False)):
        paths[form] = os.path.join(args.out_dir, f"smollm2_gqa_{form}", "model.onnx")
        if not os.path.isfile(paths[form]):
            ole.convert(src, paths[form], fuse_gqa=fuse)
    so = ort.SessionOptions()
    so.intra_op_num_threads = args.threads
    so.log_severity_level = 3
    rng = np.random.default_rng(0)
    result = {"machine": machine_info(measure_bandwidth=False), "threads": args.threads, "steps": args.steps,
              "warmup": args.warmup, "models": paths, "contexts": {}}
    for ctx in (int(c) for c in args.contexts.split(",")):
        prompt = rng.integers(100, 40000, size=(1, ctx), dtype=np.int64)
        ms = {k: [] for k in paths}
        ratios, agree = [], True
        for first in ("fused", "unfused"):
            forms = [first] + [k for k in paths if k != first]
            sessions = {k: ole.InferenceSession(paths[k], so) for k in forms}  # created in this order
            caches = {k: ole.KVCache.for_model(paths[k], 1, ctx + args.warmup + args.steps + 8) for k in forms}
            tokens = {k: [] for k in forms}
            got = {k: [] for k in forms}
            try:
                for k in forms:
                    lg = sessions[k].run(["logits"], {"input_ids": prompt, "attention_mask": np.ones_like(prompt),
                                                      "kv_cache": caches[k].handle})[0]
                    tokens[k].append(int(lg[0, -1].argmax()))
                for i in range(args.warmup + args.steps):
                    for k in (forms if i % 2 == 0 else forms[::-1]):
                        feeds = {"input_ids": np.array([[tokens[k][-1]]], np.int64),
                                 "attention_mask": np.ones((1, ctx + i + 1), np.int64),
                                 "kv_cache": caches[k].handle}
                        t0 = time.perf_counter_ns()
                        lg = sessions[k].run(["logits"], feeds)[0]
                        tokens[k].append(int(lg[0, -1].argmax()))
                        if i >= args.warmup:
                            got[k].append((time.perf_counter_ns() - t0) / 1e6)
            finally:
                for c in caches.values():
                    c.close()
                del sessions
            agree = agree and tokens["fused"] == tokens["unfused"]
            ratios += list(np.array(got["unfused"]) / np.array(got["fused"]))
            for k in forms:
                ms[k] += got[k]
        row = {k: {"median_ms": float(np.median(v)), "p25_ms": float(np.quantile(v, 0.25)),
                   "p75_ms": float(np.quantile(v, 0.75)), "tokens_per_s": 1000.0 / float(np.median(v))}
               for k, v in ms.items()}
        row["unfused_over_fused"] = {"median": float(np.median(ratios)), "p25": float(np.quantile(ratios, 0.25)),
                                     "p75": float(np.quantile(ratios, 0.75))}
        row["tokens_agree"] = agree
        result["contexts"][str(ctx)] = row
        print(f"C={ctx}: fused {row['fused']['tokens_per_s']:.2f} tok/s ({row['fused']['median_ms']:.1f} ms, IQR "
              f"{row['fused']['p25_ms']:.1f}-{row['fused']['p75_ms']:.1f}), unfused "
              f"{row['unfused']['tokens_per_s']:.2f} tok/s ({row['unfused']['median_ms']:.1f} ms, IQR "
              f"{row['unfused']['p25_ms']:.1f}-{row['unfused']['p75_ms']:.1f}); step ratio unfused/fused "
              f"{row['unfused_over_fused']['median']:.3f} (IQR {row['unfused_over_fused']['p25']:.3f}-"
              f"{row['unfused_over_fused']['p75']:.3f}); tokens agree: {row['tokens_agree']}", flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    out = os.path.join(args.out_dir, "bench_gqa_fusion.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
