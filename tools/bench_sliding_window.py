#!/usr/bin/env python3
"""Long context on a sliding-window model: decode rate and KV bytes, EP (converted, eviction) vs plain ORT.

One run, same machine, same threads: the unconverted export on plain ONNX
Runtime (``CPUExecutionProvider``, past/present fed back: it keeps and copies
every layer's whole past, sliding layers included) and the converted model on
``OnnxLightExecutionProvider`` with ``KVCache.for_model`` (pages beyond each
sliding layer's window released as the context grows). Both are filled with
the same real English text (CPython's ``pydoc_data/topics.py``, repeated as
needed) in prefill chunks, up to each context in ``--contexts``; at each
context ``--steps`` greedy decode steps are timed (median and quartiles of the
step times) and the bytes each side holds are recorded: the EP's committed
page bytes (``KVCache.stats()``), split into sliding-window and full-attention
layers, and plain ORT's present tensors. Also the physical floor per decode
step: (weights + K/V bytes a step reads) / measured single-core read bandwidth.

Default model: Gemma-3-270M exported with torch.onnx (opt-in, Gemma Terms of Use:
``ONNX_LIGHT_ACCEPT_GEMMA_TERMS=1``; ``onnx_light_ep.models.gemma3``), windows
(512 on 15 of 18 layers) read by convert from the config.json beside it.

    ONNX_LIGHT_ACCEPT_GEMMA_TERMS=1 python tools/bench_sliding_window.py --out-dir bench_out \\
        --benchmarks-md BENCHMARKS.md

Writes ``OUT/bench_sliding_window.json`` and ``.md`` (and the ``bench_sliding_window``
block of BENCHMARKS.md if asked).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from onnx_light_ep.bench.machine import machine_info  # noqa: E402
from onnx_light_ep.bench.report import machine_lines, update_block  # noqa: E402


def _text_ids(tok, n):
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    ids = tok.encode(text)
    while len(ids) < n:
        ids = ids + ids
    return tok.prefix_ids() + ids[: n - len(tok.prefix_ids())]


def _so(threads):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = threads
    return so


def _quartiles(xs):
    a = np.asarray(xs) * 1e3
    return {"median_ms": float(np.median(a)), "p25_ms": float(np.percentile(a, 25)),
            "p75_ms": float(np.percentile(a, 75)), "n": int(a.size)}


def run_ep(model, ids, contexts, steps, chunk, threads, windows):
    from onnx_light_ep import InferenceSession, KVCache
    from onnx_light_ep.generate import CacheStepper
    from onnx_light_ep.rewrite import read_metadata

    meta = read_metadata(model)
    sess = InferenceSession(model, _so(threads))
    st = CacheStepper(sess, meta)
    out = []
    with KVCache.for_model(sess, 1, max(contexts) + steps + 1) as cache:
        done = 0
        for c in contexts:
            while done < c:
                n = min(chunk, c - done)
                logits = st.run(cache, np.array([ids[done:done + n]]))[:, -1]
                done += n
            times = []
            tok = int(logits[0].argmax())
            for _ in range(steps):
                t0 = time.perf_counter()
                logits = st.run(cache, np.array([[tok]]))[:, -1]
                times.append(time.perf_counter() - t0)
                tok = int(logits[0].argmax())
            done += steps
            ids_c = ids  # noqa: F841 (same text on both sides)
            s = cache.stats()
            per_layer = _ep_layer_bytes(cache, windows)
            out.append({"context": c, "step": _quartiles(times), "committed_bytes": s["committed_bytes"],
                        "sliding_layer_bytes": per_layer["sliding"], "full_layer_bytes": per_layer["full"]})
            print(f"EP context {c}: {out[-1]['step']['median_ms']:.1f} ms/step, KV {s['committed_bytes'] / 2**20:.1f} "
                  f"MiB (sliding layers {per_layer['sliding'] / 2**20:.1f}, full {per_layer['full'] / 2**20:.1f})",
                  file=sys.stderr, flush=True)
    return out


def _ep_layer_bytes(cache, windows):
    """Committed bytes per layer kind from the cache's page tables (pages x page bytes)."""
    page_bytes = cache.page_tokens * (cache.head_dim + cache.v_head_dim) * np.dtype(cache.dtype).itemsize
    sliding = full = 0
    for layer, w in enumerate(windows):
        n = sum(len(cache._page_ids(layer, 0, h)) for h in range(cache.kv_num_heads))
        if w:
            sliding += n * page_bytes
        else:
            full += n * page_bytes
    return {"sliding": sliding, "full": full}


def run_ort(model, ids, contexts, steps, chunk, threads):
    import onnxruntime as ort

    sess = ort.InferenceSession(model, _so(threads), providers=["CPUExecutionProvider"])
    info = {i.name: i for i in sess.get_inputs()}
    names = [o.name for o in sess.get_outputs()]
    pasts = [n for n in info if n.startswith("past_key_values.")]
    shape = {n: info[n].shape for n in pasts}
    cache = {n: np.zeros((1, shape[n][1], 0, shape[n][3]), np.float32) for n in pasts}
    out = []
    done = 0

    def step(tokens):
        nonlocal cache, done
        feeds = {"input_ids": np.array([tokens], np.int64),
                 "attention_mask": np.ones((1, done + len(tokens)), np.int64), **cache}
        if "position_ids" in info:
            feeds["position_ids"] = np.arange(done, done + len(tokens), dtype=np.int64)[None]
        r = dict(zip(names, sess.run(None, feeds)))
        cache = {n: r[n.replace("past_key_values.", "present.")] for n in pasts}
        done += len(tokens)
        return r["logits"][0, -1]

    for c in contexts:
        while done < c:
            logits = step(ids[done:min(c, done + chunk)])
        times = []
        tok = int(logits.argmax())
        for _ in range(steps):
            t0 = time.perf_counter()
            logits = step([tok])
            times.append(time.perf_counter() - t0)
            tok = int(logits.argmax())
        held = sum(v.nbytes for v in cache.values())
        out.append({"context": c, "step": _quartiles(times), "present_bytes": held,
                    "copied_per_step_bytes": held})
        print(f"ORT context {c}: {out[-1]['step']['median_ms']:.1f} ms/step, pasts {held / 2**20:.1f} MiB",
              file=sys.stderr, flush=True)
    return out


def weight_bytes(model_dir):
    return sum(p.stat().st_size for p in Path(model_dir).iterdir()
               if p.suffix in (".data", ".onnx") or p.name.endswith(".onnx.data"))


def markdown(res):
    m = res["machine"]
    lines = ["## Sliding-window model at long context: EP (eviction) vs plain ORT", ""] + machine_lines(m) + [
        "", f"Command: `{res['command']}`; model `{res['model_name']}`, windows {res['windows_summary']}; "
        f"{res['threads']} thread(s), {res['steps']} timed decode steps per context (median [p25-p75]), "
        f"prefill chunks of {res['chunk']} tokens; text: CPython's pydoc_data/topics.py (repeated).", "",
        "| context | EP ms/step | plain ORT ms/step | ORT/EP | EP KV MiB (sliding + full layers) | plain ORT past MiB "
        "(copied every step) | floor ms/step (weights + EP KV at read BW) |",
        "|---|---|---|---|---|---|---|"]
    bw = res["read_gb_per_s"]
    for e, o in zip(res["ep"], res["ort"]):
        fmt = lambda s: f"{s['median_ms']:.1f} [{s['p25_ms']:.1f}-{s['p75_ms']:.1f}]"  # noqa: E731
        floor = (res["weight_bytes"] + e["committed_bytes"]) / (bw * 1e9) * 1e3
        lines.append(f"| {e['context']} | {fmt(e['step'])} | {fmt(o['step'])} | "
                     f"{o['step']['median_ms'] / e['step']['median_ms']:.2f}x | {e['committed_bytes'] / 2**20:.1f} "
                     f"({e['sliding_layer_bytes'] / 2**20:.1f} + {e['full_layer_bytes'] / 2**20:.1f}) | "
                     f"{o['present_bytes'] / 2**20:.0f} | {floor:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="unconverted export (default: Gemma-3-270M torch.onnx, opt-in)")
    ap.add_argument("--contexts", default="4096,16384,32000", help="comma-separated context lengths")
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps per context")
    ap.add_argument("--chunk", type=int, default=1024, help="prefill chunk (tokens)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out-dir", default="bench_out")
    ap.add_argument("--benchmarks-md", default=None)
    args = ap.parse_args(argv)
    from onnx_light_ep._text import TextTokenizer
    from onnx_light_ep.demo import ensure_converted
    from onnx_light_ep.rewrite import read_metadata

    if args.model:
        src = Path(args.model)
    else:
        from onnx_light_ep.models import gemma3

        try:
            src = gemma3.ensure_gemma3_dynamo_onnx() / "model.onnx"
        except gemma3.GemmaTermsNotAccepted as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if src.name == "model.onnx":
        conv = ensure_converted(src.parent, sys.stderr)   # next to it, in <folder>-onnx-light/, reused
    else:
        from onnx_light_ep.rewrite import convert

        conv = Path(args.out_dir) / f"{src.stem}.light.onnx"
        convert(str(src), str(conv))
    meta = read_metadata(str(conv))
    windows = [x["local_window_size"] if x["local_window_size"] > 0 else None for x in meta["layers"]]
    contexts = sorted(int(c) for c in args.contexts.split(","))
    limit = meta.get("max_position")
    if limit and contexts[-1] + args.steps + 1 > limit:
        print(f"error: --contexts; {contexts[-1]} + {args.steps} steps exceeds the model's {limit} positions",
              file=sys.stderr)
        return 2
    tok = TextTokenizer.find([str(conv.parent), str(src.parent)])
    ids = _text_ids(tok, contexts[-1] + 1)
    mach = machine_info()
    ep = run_ep(str(conv), ids, contexts, args.steps, args.chunk, args.threads, windows)
    ort_res = run_ort(str(src), ids, contexts, args.steps, args.chunk, args.threads)
    n_slide = sum(1 for w in windows if w)
    res = {"command": "python tools/bench_sliding_window.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "model": str(src), "model_name": src.parent.name, "windows": windows,
           "windows_summary": f"{sorted({w for w in windows if w})} on {n_slide} of {len(windows)} layers",
           "threads": args.threads, "steps": args.steps, "chunk": args.chunk, "machine": mach,
           "read_gb_per_s": float(mach["stream_read_gb_per_s"]["1"]), "weight_bytes": weight_bytes(src.parent),
           "ep": ep, "ort": ort_res}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_sliding_window.json").write_text(json.dumps(res, indent=1) + "\n")
    md = markdown(res)
    (out / "bench_sliding_window.md").write_text(md)
    print(md)
    print(f"wrote {out / 'bench_sliding_window.json'} and {out / 'bench_sliding_window.md'}", file=sys.stderr)
    if args.benchmarks_md:
        update_block(args.benchmarks_md, "bench_sliding_window", md, machine=mach)
        print(f"updated {args.benchmarks_md} (block bench_sliding_window)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
