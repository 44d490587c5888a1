"""Quality of quantized KV pages on a real model and real text.

    python tools/eval_kv_quant.py [--model PATH] [--tokens 4096] [--modes int8] [--out-dir bench_out]
                                  [--benchmarks-md BENCHMARKS.md]

Model: the main job's converted SmolLM2-135M-Instruct (``onnx_light_ep.models.smollm2``; built
on first use) unless ``--model`` names another converted model (its ``model.onnx`` or the folder
holding it) with a tokenizer beside it, e.g. Gemma-3-270M (opt-in, Gemma terms:
``ONNX_LIGHT_ACCEPT_GEMMA_TERMS=1 python -m onnx_light_ep.models.gemma3`` prints its converted
folder). The special ids the tokenizer puts before a text (Gemma-3's ``<bos>``; none for SmolLM2)
start the text and every prompt.
Text: the English prose of CPython's ``pydoc_data/topics.py`` (the Python language reference
topics that ship with every CPython), its first ``--tokens`` tokens.

Teacher-forced: the text is fed in chunks of ``--chunk`` tokens (each chunk's queries see the
cache's quantized pages as a decode step at that position would, up to the chunk's own rows),
to a native (float32) cache and to one cache per mode, chunk by chunk; per position the next-token
distributions are compared: mean KL(native || quantized), perplexity of the text under each,
top-1 agreement. Greedy: 10 prompts, each a different ``--prompt-tokens`` excerpt of the same
text followed by a request to summarize it, 128 new tokens each; the fraction of generated
tokens identical to the native cache's (position by position, up to the first difference
counted as all different after it).

Writes ``bench_out/eval_kv_quant.json`` and, with ``--benchmarks-md``, the BENCHMARKS.md
block ``eval_kv_quant``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import onnx_light_ep as olep  # noqa: E402
from onnx_light_ep.generate import generate  # noqa: E402
from onnx_light_ep._text import TextTokenizer  # noqa: E402
from onnx_light_ep.bench import report  # noqa: E402
from onnx_light_ep.bench.machine import machine_info  # noqa: E402
from onnx_light_ep.rewrite import read_metadata  # noqa: E402


NATIVE = "(native)"  # the reference run's key: not a kv_quant mode


def real_text() -> str:
    import pydoc_data.topics as topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def teacher_forced(session, meta, ids, chunk, runs):
    """Feed ids [N] in chunks to one cache per entry of ``runs`` (name -> cache_options, the first
    the reference), chunk by chunk in lockstep. Per position i (predicting ids[i + 1]) and per
    non-reference run: KL(reference || run), the negative log-likelihood of ids[i + 1] under each,
    whether the argmaxes agree. Only these per-position numbers are kept, not the [N, vocab]
    log-probabilities (4 GiB per run at Gemma-3's 262144 vocabulary). Returns
    ({name: per-position arrays}, {name: cache stats})."""
    n = len(ids)
    logits_name = meta.get("logits_output") or session.get_outputs()[0].name
    types = {i.name: i.type for i in session.get_inputs()}
    names = list(runs)
    ref_name, others = names[0], names[1:]
    tgt_all = np.asarray(ids[1:] + [0])
    acc = {m: {"kld": [], "nll_ref": [], "nll": [], "top1": []} for m in others}
    with contextlib.ExitStack() as stack:
        caches = {m: stack.enter_context(olep.KVCache.for_model(session, 1, n + 1, **runs[m])) for m in names}
        for s in range(0, n, chunk):
            c = ids[s:s + chunk]
            e = s + len(c)
            lps = {}
            for m in names:
                feeds = {"input_ids": np.asarray([c], np.int64), meta["cache_input"]: caches[m].handle}
                if "attention_mask" in types:
                    feeds["attention_mask"] = np.ones((1, e), np.int64)
                if "position_ids" in types:
                    feeds["position_ids"] = np.arange(s, e, dtype=np.int64)[None]
                if "seqlens_k" in types:
                    feeds["seqlens_k"] = np.asarray([e - 1], np.int32)
                if "total_sequence_length" in types:
                    feeds["total_sequence_length"] = np.asarray(e, np.int32)
                (logits,) = session.run([logits_name], feeds)
                lps[m] = log_softmax(logits[0]).astype(np.float32)
            ref_lp = lps.pop(ref_name).astype(np.float64)
            p = np.exp(ref_lp)
            tgt = tgt_all[s:e]
            rows = np.arange(len(c))
            for m, lp in lps.items():
                a = acc[m]
                a["kld"].append((p * (ref_lp - lp.astype(np.float64))).sum(-1))
                a["nll_ref"].append(-ref_lp[rows, tgt])
                a["nll"].append(-lp[rows, tgt].astype(np.float64))
                a["top1"].append(ref_lp.argmax(-1) == lp.argmax(-1))
        stats = {m: caches[m].stats() for m in names}
    return {m: {k: np.concatenate(v) for k, v in a.items()} for m, a in acc.items()}, stats


def summarize(per_pos):
    """mean/max KL, perplexities and top-1 agreement over positions 0 .. N-2 (those with a target)."""
    kld, nll_ref, nll, top1 = (per_pos[k][:-1] for k in ("kld", "nll_ref", "nll", "top1"))
    ppl_ref, ppl = float(np.exp(nll_ref.mean())), float(np.exp(nll.mean()))
    return {"mean_kld": float(kld.mean()), "max_kld": float(kld.max()), "ppl_native": ppl_ref, "ppl": ppl,
            "ppl_delta_pct": 100.0 * (ppl / ppl_ref - 1.0), "top1_agreement": float(top1.mean())}


def greedy_agreement(path, session, prompts, new_tokens, cache_options):
    ref = generate(path, prompt_ids=prompts[:1], max_new_tokens=1, session=session)  # warm-up
    del ref
    same = total = 0
    rows = []
    for p in prompts:
        a = generate(path, prompt_ids=[p], max_new_tokens=new_tokens, session=session,
                                   eos_token_ids=[]).token_ids[0]
        b = generate(path, prompt_ids=[p], max_new_tokens=new_tokens, session=session,
                                   eos_token_ids=[], cache_options=cache_options).token_ids[0]
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        same += k
        total += len(a)
        rows.append({"prompt_tokens": len(p), "identical_prefix": k, "new_tokens": len(a)})
    return {"identical_fraction": same / max(total, 1), "prompts": rows}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="converted model.onnx or its folder, tokenizer beside it "
                                 "(default: the main job's SmolLM2-135M-Instruct)")
    ap.add_argument("--tokens", type=int, default=4096, help="teacher-forced tokens of the text (default 4096)")
    ap.add_argument("--chunk", type=int, default=16, help="tokens per teacher-forced run (default 16)")
    ap.add_argument("--modes", default="int8", help="comma-separated kv_quant modes (default int8)")
    ap.add_argument("--recent-tokens", type=int, default=128)
    ap.add_argument("--sink-tokens", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out-dir", default="bench_out")
    ap.add_argument("--benchmarks-md")
    args = ap.parse_args(argv)

    t_start = time.time()
    if args.model:
        path = os.path.join(args.model, "model.onnx") if os.path.isdir(args.model) else args.model
    else:
        from onnx_light_ep.models.smollm2 import ensure_smollm2_onnx

        folder = ensure_smollm2_onnx()  # the genai builder's export (a folder with model.onnx)
        path = str(folder.parent / (folder.name + "-onnx-light") / "model.onnx")
        if not os.path.exists(path):
            olep.convert(str(folder / "model.onnx"), path)
    meta = read_metadata(path)
    tok = TextTokenizer.find([os.path.dirname(os.path.abspath(path))])
    if tok is None:
        raise SystemExit(f"eval_kv_quant: no tokenizer next to {path}")
    bos = tok.prefix_ids()  # what the tokenizer puts before a text (Gemma-3: <bos>; SmolLM2: nothing)
    ids = tok.encode(real_text())
    if len(bos) + len(ids) < args.tokens + 1:
        raise SystemExit(f"eval_kv_quant: the text has {len(ids)} tokens, fewer than --tokens {args.tokens}")
    text_ids = (bos + ids)[:args.tokens]
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    session = olep.InferenceSession(path, so)
    modes = [m for m in args.modes.split(",") if m]
    runs = {NATIVE: {}}
    for mode in modes:
        runs[mode] = {"kv_quant": mode, "recent_tokens": args.recent_tokens, "sink_tokens": args.sink_tokens}
    per_pos, stats = teacher_forced(session, meta, text_ids, args.chunk, runs)
    ref_stats = stats[NATIVE]
    ask = tok.encode("\n\nSummarize the text above in a few sentences.\n")
    step = (len(ids) - args.prompt_tokens) // max(args.prompts, 1)
    prompts = [bos + ids[i * step:i * step + args.prompt_tokens] + ask for i in range(args.prompts)]
    result = {"machine": machine_info(), "model": path, "text": "CPython pydoc_data/topics.py",
              "settings": vars(args), "prefix_ids": bos, "native_stats": ref_stats, "modes": {}}
    for mode in modes:
        opts = runs[mode]
        r = summarize(per_pos[mode])
        st = stats[mode]
        r["stats"] = st
        r["greedy"] = greedy_agreement(path, session, prompts, args.new_tokens, opts)
        result["modes"][mode] = r
        print(f"{mode}: mean KLD {r['mean_kld']:.2e} (max {r['max_kld']:.2e}), perplexity {r['ppl']:.4f} vs "
              f"{r['ppl_native']:.4f} native ({r['ppl_delta_pct']:+.3f}%), top-1 agreement {r['top1_agreement']:.4f}, "
              f"greedy identical {r['greedy']['identical_fraction']:.3f}; committed KV "
              f"{st['committed_bytes'] / 2**20:.1f} MiB vs {ref_stats['committed_bytes'] / 2**20:.1f} MiB native")
    result["seconds"] = time.time() - t_start
    os.makedirs(args.out_dir, exist_ok=True)
    out = os.path.join(args.out_dir, "eval_kv_quant.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")
    if args.benchmarks_md:
        report.update_block(args.benchmarks_md, "eval_kv_quant", markdown(result, argv), machine=result["machine"])
        print(f"updated {args.benchmarks_md}")


def markdown(result, argv):
    s = result["settings"]
    args = sys.argv[1:] if argv is None else argv
    cmd = "python tools/eval_kv_quant.py" + ("" if not args else " " + " ".join(args))
    lines = ["## Quantized KV pages: quality on real text", ""] + report.machine_lines(result["machine"]) + [
        "",
        f"Command: `{cmd}`; model `{os.path.basename(os.path.dirname(result['model']))}`; text: the first "
        f"{s['tokens']} tokens of {result['text']} (English prose that ships with CPython), teacher-forced in "
        f"chunks of {s['chunk']} tokens against the native float32 cache; greedy: {s['prompts']} prompts of "
        f"{s['prompt_tokens']} tokens of the same text plus a request to summarize, {s['new_tokens']} new tokens "
        f"each; recent_tokens {s['recent_tokens']}, sink_tokens {s['sink_tokens']}. Run took "
        f"{result['seconds'] / 60:.1f} min.",
        "",
        "| mode | mean KLD | max KLD | perplexity (native) | Δ perplexity | top-1 agreement | greedy identical | "
        "committed KV (native) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    nat = result["native_stats"]["committed_bytes"] / 2**20
    for mode, r in result["modes"].items():
        lines.append(f"| {mode} | {r['mean_kld']:.2e} | {r['max_kld']:.2e} | {r['ppl']:.4f} ({r['ppl_native']:.4f}) | "
                     f"{r['ppl_delta_pct']:+.3f}% | {r['top1_agreement']:.4f} | "
                     f"{r['greedy']['identical_fraction']:.3f} | {r['stats']['committed_bytes'] / 2**20:.1f} MiB "
                     f"({nat:.1f} MiB) |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
