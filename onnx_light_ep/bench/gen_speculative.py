"""Section ``speculative`` of ``tools/bench_generation.py``: speculative decoding against plain greedy.

Greedy vs prompt-lookup (K in ``--lookup-k``) and draft-model (SmolLM2's int4 export by the genai
builder, K in ``--draft-k``) speculative decoding on a copy task with the chat template, on the EP,
at the first of ``--threads`` (0 = ORT's default), ``--reps`` interleaved rounds after one warm-up.
The models are the genai builder's exports of ``onnx_light_ep.models.smollm2`` (built once),
converted next to them (``onnx_light_ep.demo.ensure_converted``).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import sysconfig
import time
from pathlib import Path
from typing import Dict, List, Tuple


def _session(model: Path, threads: int):
    import onnxruntime as ort

    from onnx_light_ep import InferenceSession

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
    return InferenceSession(str(model), so)


def _converted(precision: str) -> Path:
    from onnx_light_ep.demo import ensure_converted
    from onnx_light_ep.models.smollm2 import ensure_smollm2_onnx

    return Path(ensure_converted(Path(ensure_smollm2_onnx(progress=True, precision=precision)), sys.stderr))


def _spread(xs: List[float]) -> Dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "samples": xs}


# -- speculative decoding (generate(speculative=...)) -------------------------------------------

COPY_TASK = "Rewrite the following text, fixing typos:"


def copy_task_text(tokenizer, max_tokens: int = 300) -> Tuple[str, str]:
    """Real English prose that ships with Python: the paragraphs of "A. HISTORY OF THE SOFTWARE" in the
    standard library's ``LICENSE.txt``, whole paragraphs up to ``max_tokens`` tokens (lines joined).
    Returns ``(text, path of the file)``."""
    path = os.path.join(sysconfig.get_paths()["stdlib"], "LICENSE.txt")
    with open(path, encoding="utf-8") as f:
        paragraphs = [" ".join(p.split()) for p in f.read().split("\n\n")]
    start = next(i for i, p in enumerate(paragraphs) if p.startswith("A. HISTORY OF THE SOFTWARE")) + 1
    text = paragraphs[start]
    for p in paragraphs[start + 1:]:
        if not p or p.startswith("Release") or len(tokenizer.encode(text + "\n\n" + p)) > max_tokens:
            break
        text += "\n\n" + p
    return text, path


class _TimedSession:
    """An EP session that adds up the wall and CPU seconds (``time.process_time``: this process, every thread)
    of its runs of fewer than ``prefill_from`` tokens (decode and verification runs, not the prefill)."""

    def __init__(self, session, prefill_from: int):
        self._s, self.prefill_from = session, prefill_from
        self.wall = self.cpu = 0.0

    def __getattr__(self, name):
        return getattr(self._s, name)

    def run(self, names, feeds, *a, **kw):
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            return self._s.run(names, feeds, *a, **kw)
        finally:
            if feeds["input_ids"].shape[1] < self.prefill_from:
                self.wall += time.perf_counter() - t0
                self.cpu += time.process_time() - c0


def bench_speculative(args, threads: int) -> Tuple[dict, List[str]]:
    """Greedy vs prompt-lookup (K in ``args.lookup_k``) and draft-model (the int4 export, K in
    ``args.draft_k``) speculative decoding on the copy task with the chat template, ``threads``
    intra-op threads for target and draft, runs interleaved configuration by configuration,
    ``args.reps`` times after one warm-up round. Per run: decode tokens (those after the prefill's)
    per wall second of the decode phase (``GenerateResult.tokens_per_second``, draft runs included)
    and per CPU second of the decode and verification runs of both sessions (robust to other
    processes taking the cores), each also as a ratio to the greedy run of the same round; the
    acceptance rate; whether the tokens equal greedy's."""
    from onnx_light_ep._text import TextTokenizer
    from onnx_light_ep.generate import generate

    target, draft = _converted("fp32"), _converted("int4")
    tok = TextTokenizer.find([str(target.parent)])
    text, source = copy_task_text(tok, args.copy_tokens)
    prompt = f"{COPY_TASK}\n\n{text}"
    prompt_tokens = len(tok.encode(tok.chat_prompt(prompt)))
    sess = _TimedSession(_session(target, threads), prompt_tokens)
    dsess = _TimedSession(_session(draft, threads), prompt_tokens)
    configs = [("greedy", {})]
    configs += [(f"prompt-lookup K={k}", {"speculative": "prompt-lookup", "num_draft_tokens": k})
                for k in args.lookup_k]
    configs += [(f"draft int4 K={k}", {"speculative": "draft", "draft_model": str(draft), "draft_session": dsess,
                                       "num_draft_tokens": k}) for k in args.draft_k]
    runs: Dict[str, List] = {name: [] for name, _ in configs}
    for rep in range(args.reps + 1):   # round 0 warms up (page faults, weights into the caches)
        for name, kw in configs:
            for t in (sess, dsess):
                t.wall = t.cpu = 0.0
            res = generate(str(target), prompt, chat=True, max_new_tokens=args.max_new_tokens, session=sess, **kw)
            n = res.decode_tokens if res.decode_tokens is not None else res.decode_steps
            cpu = sess.cpu + dsess.cpu
            if rep:
                runs[name].append({"tokens_per_second": res.tokens_per_second, "tokens_per_cpu_second": n / cpu,
                                   "decode_seconds": res.decode_seconds, "decode_cpu_seconds": cpu,
                                   "prefill_seconds": res.prefill_seconds, "decode_steps": res.decode_steps,
                                   "draft_tokens": res.draft_tokens, "accepted_tokens": res.accepted_tokens,
                                   "token_ids": res.token_ids[0]})
            print(f"[speculative] round {rep} {name}: {res.tokens_per_second:.1f} tokens/s, {n / cpu:.1f} tokens "
                  f"per CPU second", file=sys.stderr)
    greedy = runs["greedy"]
    rows = []
    for name, kw in configs:
        rs = runs[name]
        drafted, accepted = rs[0]["draft_tokens"], rs[0]["accepted_tokens"]
        rows.append({"config": name, **{k: v for k, v in kw.items() if k not in ("draft_model", "draft_session")},
                     **{key: _spread([r[key] for r in rs]) for key in ("tokens_per_second", "tokens_per_cpu_second",
                                                                       "decode_seconds", "decode_cpu_seconds",
                                                                       "prefill_seconds")},
                     "speedup": _spread([r["tokens_per_second"] / g["tokens_per_second"] for r, g in zip(rs, greedy)]),
                     "cpu_speedup": _spread([r["tokens_per_cpu_second"] / g["tokens_per_cpu_second"]
                                             for r, g in zip(rs, greedy)]),
                     "decode_steps": rs[0]["decode_steps"], "draft_tokens": drafted, "accepted_tokens": accepted,
                     "acceptance_rate": accepted / drafted if drafted else None, "tokens": len(rs[0]["token_ids"]),
                     "same_as_greedy": all(r["token_ids"] == greedy[0]["token_ids"] for r in rs)})
    out = {"target": str(target), "draft_model": str(draft), "prompt_source": source, "prompt": prompt,
           "prompt_tokens": prompt_tokens, "max_new_tokens": args.max_new_tokens, "threads": threads,
           "reps": args.reps, "rows": rows}

    def cell(d, spec, unit=""):
        return f"{d['median']:{spec}}{unit} ({d['min']:{spec}}-{d['max']:{spec}})"

    md = [f"### Speculative decoding: SmolLM2-135M-Instruct fp32 on the EP, {threads} thread(s)", "",
          f"Copy task with `--chat`: \"{COPY_TASK}\" + the \"A. HISTORY OF THE SOFTWARE\" paragraphs of the "
          f"`LICENSE.txt` of Python {platform.python_version()}'s standard library "
          f"({prompt_tokens} prompt tokens in all), {rows[0]['tokens']} new tokens (greedy); draft model: the int4 "
          f"export of the same weights (`-p int4`). Median (min-max) of {args.reps} interleaved rounds; decode "
          f"tokens (after the prefill's) per second of wall time and per CPU second of the decode and "
          f"verification runs (target and draft), each as a ratio to greedy in the same round.", "",
          "| config | decode tokens/s (wall) | vs greedy | tokens per CPU s | vs greedy | acceptance | "
          "verification runs | same tokens as greedy |",
          "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = f"{r['acceptance_rate']:.0%} ({r['accepted_tokens']}/{r['draft_tokens']})" \
            if r["acceptance_rate"] is not None else "-"
        md.append(f"| {r['config']} | {cell(r['tokens_per_second'], '.1f')} | {cell(r['speedup'], '.2f', 'x')} | "
                  f"{cell(r['tokens_per_cpu_second'], '.1f')} | {cell(r['cpu_speedup'], '.2f', 'x')} | {acc} | "
                  f"{r['decode_steps']} | {'yes' if r['same_as_greedy'] else 'NO'} |")
    return out, md


def add_speculative_arguments(ap: argparse.ArgumentParser) -> None:
    ap = ap.add_argument_group("speculative")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per run (default 128)")
    ap.add_argument("--lookup-k", type=int, nargs="+", default=[3, 5, 8], help="prompt-lookup draft counts")
    ap.add_argument("--draft-k", type=int, nargs="+", default=[3, 5], help="draft-model draft counts")
    ap.add_argument("--copy-tokens", type=int, default=300, help="tokens of the text to rewrite (about)")


def section_speculative(args) -> Dict:
    if args.reps < 1 or args.max_new_tokens < 1:
        raise SystemExit("error: --reps and --max-new-tokens must be >= 1")
    threads = args.threads[0] if args.threads else 1
    out, md = bench_speculative(args, threads)
    out["markdown"] = md
    return out


SECTION = ("speculative", section_speculative, add_speculative_arguments)
