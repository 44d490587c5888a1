"""Command-line entry point ``onnx-light`` (also ``python -m onnx_light_ep``).

Subcommands:

- ``info``: print the package version, the path of the loaded native library,
  the onnxruntime version and the execution-provider devices ORT offers once
  the library is registered.
- ``bench``: the decode-step benchmark (``onnx_light_ep.bench.run_bench``).
- ``convert INPUT -o OUTPUT``: rewrite an exported decoder (or a folder holding a
  prefill/decode pair) into a cache-aware model (``onnx_light_ep.rewrite.convert``);
  prints the report (``--json``).
- ``compare ORIGINAL [CONVERTED]``: original on plain ORT vs converted on the
  EP, same inputs; exit 1 on a mismatch beyond the tolerance.
- ``generate MODEL``: greedy, sampled, beam-search (``--num-beams N``) or speculative
  (``--speculative prompt-lookup|draft``, greedy) generation on the EP with a KVCache.
- ``chat MODEL``: interactive multi-turn chat on one KVCache (``onnx_light_ep.chat``).
- ``demo`` (also: no arguments): the main job on SmolLM2-135M-Instruct
  (``onnx_light_ep.demo``).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional


_ISA_LEVELS = ("scalar", "avx2", "avx512", "avx512_bf16")


def _cmd_info(args: argparse.Namespace) -> int:
    import json

    from . import EP_NAME, __version__, _core, get_library_path
    from . import _registration

    path = get_library_path()
    best = _core.detected_isa()
    info = {"version": __version__, "library": path, "attention_isa": _core.isa(),
            "isa_levels": list(_ISA_LEVELS[: _ISA_LEVELS.index(best) + 1])}
    as_json = getattr(args, "json", False)
    if not as_json:
        print(f"onnx_light_ep {__version__}")
        print(f"library: {path}")
        print(f"attention ISA: {info['attention_isa']} (this CPU supports: {', '.join(info['isa_levels'])}; "
              "ONNX_LIGHT_ISA=<level> forces one)")
    try:
        ort = _registration._import_ort()
    except RuntimeError as e:
        print(f"onnxruntime: {e}", file=sys.stderr)
        return 1
    info["onnxruntime"] = {"version": ort.__version__, "path": ort.__file__}
    try:
        _registration._ensure_ep_library(ort, path)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    devices = ort.get_ep_devices()
    info["ep_devices"] = [{"ep_name": d.ep_name, "ep_vendor": d.ep_vendor, "type": str(d.device.type),
                           "vendor": d.device.vendor, "metadata": dict(d.ep_metadata)} for d in devices]
    if as_json:
        print(json.dumps(info, indent=1))
    else:
        print(f"onnxruntime {ort.__version__} ({ort.__file__})")
        print("EP devices:")
        for d in devices:
            hw = d.device
            print(
                f"  {d.ep_name} ({d.ep_vendor}): {hw.type} vendor={hw.vendor!r} "
                f"vendor_id={hw.vendor_id} device_id={hw.device_id} metadata={dict(d.ep_metadata)}"
            )
    if not any(d.ep_name == EP_NAME for d in devices):
        print(f"error: onnxruntime offers no device for {EP_NAME}", file=sys.stderr)
        return 1
    return 0


def _ids(text: Optional[str]) -> Optional[List[List[int]]]:
    """``"1,2,3;4,5"`` -> [[1, 2, 3], [4, 5]] (one row per ``;``)."""
    if text is None:
        return None
    try:
        return [[int(x) for x in row.replace(" ", ",").split(",") if x] for row in text.split(";") if row.strip()]
    except ValueError:
        raise ValueError(f"--prompt-ids; expected comma-separated integers, got {text!r}") from None


def _cmd_convert(args: argparse.Namespace) -> int:
    import json

    from .rewrite import ConvertError, convert

    try:
        report = convert(args.input, args.output, keep_present=args.keep_present or (),
                         sliding_window=args.sliding_window, cache_input=args.cache_input, check=not args.no_check,
                         stage=args.stage, fuse_gqa=not args.no_fuse_gqa, logits_to_keep=args.logits_to_keep)
    except (ConvertError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report.to_dict(), f, indent=1)
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from .compare import CompareError, compare, format_bytes, plot, write_json
    from .rewrite import ConvertError

    original = (args.original, args.decode) if args.decode else args.original
    converted = (args.converted, args.converted_decode) if args.converted_decode else args.converted
    if args.converted_decode and not args.converted:
        print("error: --converted-decode; expected CONVERTED (the converted prefill graph) as well", file=sys.stderr)
        return 2
    try:
        result = compare(original, converted, prompt=args.prompt, prompt_ids=_ids(args.prompt_ids),
                         batch_size=args.batch_size, prefill=args.prefill, steps=args.steps, atol=args.atol,
                         rtol=args.rtol, threads=args.threads, tokenizer_dir=args.tokenizer, seed=args.seed,
                         progress=not args.quiet, chat=args.chat)
    except (ConvertError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except CompareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not args.quiet:
        for s in result.steps:
            print(f"step {s.step:3d} {s.kind:7s} S={s.new_tokens:<4d} ctx={s.context_length:<5d} "
                  f"max|d|={s.max_abs:.3g} rel={s.max_rel:.3g} argmax {'=' if s.agree else '!='} "
                  f"ort {s.ort_ms:7.2f} ms  ep {s.ep_ms:7.2f} ms  ORT/EP x{s.ratio:5.2f}  "
                  f"copied ort {format_bytes(s.ort_bytes_copied)} ep {format_bytes(s.ep_bytes_copied)}"
                  f"{'' if s.ok else '  MISMATCH'}")
    if result.texts and not args.quiet:
        for b, t in enumerate(result.texts):
            print(f"row {b}: {t!r}")
    print(result.summary())
    if args.json:
        write_json(result, args.json)
    if args.plot:
        try:
            plot(result, args.plot)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return 0 if result.ok else 1


def _cache_options(args: argparse.Namespace):
    opts = {}
    if args.kv_quant:
        opts["kv_quant"] = args.kv_quant
    for name in ("recent_tokens", "sink_tokens"):
        if getattr(args, name) is not None:
            opts[name] = getattr(args, name)
    return opts or None


def _beam_options(args: argparse.Namespace):
    return dict(num_beams=args.num_beams, length_penalty=args.length_penalty, early_stopping=args.early_stopping,
                num_return_sequences=args.num_return_sequences)


def _early_stopping(text: str):
    if text in ("never",):
        return "never"
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true, false or never, got {text!r}")


def _speculative_options(args: argparse.Namespace) -> dict:
    """generate() keywords of --speculative/--num-draft-tokens/--max-ngram-size/--draft-model
    (ValueError naming the flag)."""
    if args.speculative is None:
        for flag, value in (("--num-draft-tokens", args.num_draft_tokens), ("--max-ngram-size", args.max_ngram_size),
                            ("--draft-model", args.draft_model)):
            if value is not None:
                raise ValueError(f"{flag}; only used with --speculative, got it without")
        return {}
    if args.temperature > 0:
        raise ValueError(f"--temperature; --speculative is greedy only: expected 0, got {args.temperature}")
    if args.num_draft_tokens is not None and args.num_draft_tokens < 1:
        raise ValueError(f"--num-draft-tokens; expected an int >= 1, got {args.num_draft_tokens}")
    if args.max_ngram_size is not None and (args.max_ngram_size < 1 or args.speculative != "prompt-lookup"):
        raise ValueError(f"--max-ngram-size; expected an int >= 1 with --speculative prompt-lookup, got "
                         f"{args.max_ngram_size} with --speculative {args.speculative}")
    if (args.speculative == "draft") != (args.draft_model is not None):
        raise ValueError("--draft-model; expected the converted draft model's path with --speculative draft"
                         if args.draft_model is None else
                         f"--draft-model; only used with --speculative draft, got it with --speculative "
                         f"{args.speculative}")
    if args.draft_model is not None and not os.path.isfile(args.draft_model):
        raise ValueError(f"--draft-model; expected a converted ONNX file, got {args.draft_model!r} "
                         f"({'a folder' if os.path.isdir(args.draft_model) else 'not found'})")
    out = {"speculative": args.speculative, "draft_model": args.draft_model}
    if args.num_draft_tokens is not None:
        out["num_draft_tokens"] = args.num_draft_tokens
    if args.max_ngram_size is not None:
        out["max_ngram_size"] = args.max_ngram_size
    return out


def summary_line(res) -> str:
    """generate's last line: prompt length, cached tokens, new tokens, stop reason, rates, provider."""
    n = sum(map(len, res.token_ids))
    prompt = sum(res.prompt_lengths)
    eos = sum(1 for f in res.finished if f)
    rows = len(res.finished)
    stop = ("end of sequence" if eos == rows else "max-new-tokens" if eos == 0 else
            f"end of sequence on {eos} of {rows} rows, max-new-tokens on the others")
    prefill_rate = (prompt - res.cached_tokens) / res.prefill_seconds if res.prefill_seconds > 0 else float("nan")
    rate = f"decode {res.tokens_per_second:.1f} tokens/s" if res.decode_steps else "no decode step"
    return (f"prompt {prompt} tokens ({res.cached_tokens} cached), {n} new tokens, stop: {stop}; prefill "
            f"{res.prefill_seconds * 1e3:.1f} ms ({prefill_rate:.0f} tokens/s); {rate} on {res.providers[0]}")


def _cmd_generate(args: argparse.Namespace) -> int:
    from .generate import GenerateError, generate
    from .rewrite import ConvertError

    try:
        spec = _speculative_options(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    prompts = args.prompt if args.prompt else None
    stream = None
    if not args.no_stream and (prompts is None or len(prompts) == 1) and args.num_beams == 1:
        def stream(piece):
            print(piece, end="", flush=True)
    try:
        res = generate((args.model, args.decode) if args.decode else args.model, prompts,
                       prompt_ids=_ids(args.prompt_ids), chat=args.chat,
                       max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                       top_p=args.top_p, seed=args.seed, tokenizer_dir=args.tokenizer, stream=stream,
                       progress=not args.quiet, threads=args.threads,
                       cache_options=_cache_options(args), **_beam_options(args), **spec)
    except GenerateError as e:
        print()
        part = e.partial
        for b in range(len(part.token_ids)):
            shown = part.texts[b] if part.texts else part.token_ids[b]
            print(f"[{b}] generated before the failure: {shown!r}", file=sys.stderr)
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (ConvertError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if stream is not None and res.texts:
        print()
    elif res.texts:
        for b, t in enumerate(res.texts):
            print(f"[{b}] {t}")
    if res.texts is None or args.ids:
        for b, ids in enumerate(res.token_ids):
            print(f"[{b}] ids: {ids}")
    if res.sequences_scores is not None:
        for b, (score, fin) in enumerate(zip(res.sequences_scores, res.finished)):
            print(f"[{b}] score {score:.5f} ({'ended on EOS' if fin else 'at max-new-tokens'})")
        copied = res.bytes_copied_per_step or [0]
        print(f"beam search, {res.num_beams} beams: {res.decode_steps} batch-{res.num_beams} decode runs; KV bytes "
              f"copied per step mean {sum(copied) / len(copied):.0f}, max {max(copied)}; committed "
              f"{(res.committed_bytes_per_step or [0])[-1]} bytes at the end", file=sys.stderr)
    n = sum(map(len, res.token_ids))
    print(summary_line(res), file=sys.stderr)
    if spec:
        print(f"speculative {spec['speculative']}: {res.accepted_tokens} of {res.draft_tokens} draft tokens "
              f"accepted ({res.acceptance_rate:.0%}) in {res.decode_steps} verification runs", file=sys.stderr)
    if n == 0:
        print("note: the first token was end-of-sequence; an instruct model usually needs --chat", file=sys.stderr)
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    from ._chat_cli import run_chat
    from .chat import ChatSession
    from .rewrite import ConvertError

    def note(text):
        print(f"[debug] {text}", flush=True)

    try:
        chat = ChatSession(args.model, system=args.system, max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                           tokenizer_dir=args.tokenizer, threads=args.threads, cache_options=_cache_options(args),
                           max_sequence_length=args.max_sequence_length, log=note if args.verbose else None)
    except (ConvertError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    with chat:
        try:
            chat.render([{"role": "user", "content": "hi"}])
        except ValueError as e:
            print(f"error: {e} (chat needs the model's tokenizer and chat template; --tokenizer DIR)",
                  file=sys.stderr)
            return 2
        if sys.stdin.isatty():
            try:
                import readline  # noqa: F401  (line editing and history for input())
            except ImportError:
                pass
            # Ctrl-C stops an answer. A process started in the background of a non-interactive shell
            # (nohup, `cmd &` in a script) inherits SIGINT ignored, and Python then installs no
            # KeyboardInterrupt handler: install it, since this loop is interactive.
            import signal

            signal.signal(signal.SIGINT, signal.default_int_handler)
        return run_chat(chat, stats=args.stats)


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import DEFAULT_PROMPT, run_default

    if getattr(args, "max_new_tokens", 64) < 1:
        print(f"error: --max-new-tokens; expected >= 1, got {args.max_new_tokens}", file=sys.stderr)
        return 2

    return run_default(getattr(args, "prompt", None) or DEFAULT_PROMPT,
                       max_new_tokens=getattr(args, "max_new_tokens", 64),
                       cache_dir=getattr(args, "cache_dir", None), threads=getattr(args, "threads", None))


def _add_rewrite_commands(sub) -> None:
    p = sub.add_parser("convert", help="rewrite an exported decoder model to use a persistent KVCache")
    p.add_argument("input", help="exported ONNX model (past/present tensors), or a folder holding prefill.onnx and "
                                 "decode.onnx (both are converted)")
    p.add_argument("-o", "--output", required=True, help="converted model path (external data: OUTPUT.data); a "
                                                         "folder for a folder input")
    p.add_argument("--stage", choices=("prefill", "decode"), default=None,
                   help="INPUT is one graph of a prefill/decode pair (prefill: its presents start the cache and "
                        "are removed); what converting the folder does for each graph")
    p.add_argument("--keep-present", action="append", metavar="NAME",
                   help="keep this present output (produced by CacheExport); repeatable")
    p.add_argument("--sliding-window", type=int, default=None, metavar="N",
                   help="sliding window for attentions whose graph carries none (recorded in the metadata)")
    p.add_argument("--cache-input", default="kv_cache", help="name of the added cache-handle input")
    p.add_argument("--no-check", action="store_true", help="skip onnx.checker on the result")
    p.add_argument("--no-fuse-gqa", action="store_true",
                   help="GroupQueryAttention: keep a QKV Split and RotaryEmbedding nodes in front of CacheAttention "
                        "instead of one CacheAttention taking the packed QKV and rotary (same results)")
    p.add_argument("--logits-to-keep", action="store_true",
                   help="add the required int64 scalar input logits_to_keep: N >= 1 runs the LM head on the last N "
                        "positions of a run only (a prefill's logits [B, 1, vocab] for N = 1), 0 on every position")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON")
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser("compare", help="original on plain ORT vs converted on the EP, same inputs")
    p.add_argument("original", help="exported model, or a folder holding prefill.onnx and decode.onnx")
    p.add_argument("converted", nargs="?", default=None, help="default: convert ORIGINAL to a temporary file")
    p.add_argument("--decode", metavar="PATH", default=None,
                   help="ORIGINAL is a prefill graph and PATH its decode graph (a pair given as two files)")
    p.add_argument("--converted-decode", metavar="PATH", default=None,
                   help="CONVERTED is a converted prefill graph and PATH its converted decode graph")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--prompt", help="prompt text (needs tokenizer.json next to the model)")
    g.add_argument("--prompt-ids", metavar="IDS", help="token ids, comma separated; ';' separates rows")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--batch-size", type=int, default=1, help="rows; extra rows are shortened copies (padding)")
    p.add_argument("--prefill", type=int, default=16, help="random prompt length when no prompt is given")
    p.add_argument("--steps", type=int, default=32, help="greedy decode steps after the prefill")
    p.add_argument("--atol", type=float, default=None, help="absolute logits tolerance (default by dtype)")
    p.add_argument("--rtol", type=float, default=None, help="relative logits tolerance (default by dtype)")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads for both sessions")
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="folder with tokenizer.json")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="write every step as JSON")
    p.add_argument("--plot", metavar="PNG", help="latency against context length (needs matplotlib)")
    p.add_argument("-q", "--quiet", action="store_true", help="only the summary line")
    p.set_defaults(func=_cmd_compare)

    p = sub.add_parser("generate", help="generate text with a converted model on the EP")
    p.add_argument("model", help="converted model, or a folder holding prefill.onnx and decode.onnx (an "
                                 "unconverted export is converted to a temporary folder)")
    p.add_argument("--decode", metavar="PATH", default=None,
                   help="MODEL is a prefill graph and PATH its decode graph (a pair given as two files)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--prompt", action="append", help="prompt text; repeat for a batch")
    g.add_argument("--prompt-ids", metavar="IDS", help="token ids, comma separated; ';' separates rows")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    _add_sampling_arguments(p)
    p.add_argument("--kv-quant", choices=("int8", "int4"), default=None,
                   help="store cold KV pages quantized (docs/API.md 'Quantized pages')")
    p.add_argument("--recent-tokens", type=int, default=None, help="with --kv-quant: newest positions kept native "
                   "(default 128)")
    p.add_argument("--sink-tokens", type=int, default=None, help="with --kv-quant: first positions kept native "
                   "(default 4)")
    p.add_argument("--num-beams", type=int, default=1, metavar="N",
                   help="beam search with N >= 2 beams (transformers' semantics; greedy, one cache forked per prompt)")
    p.add_argument("--length-penalty", type=float, default=1.0, metavar="X",
                   help="beam search: a finished hypothesis scores sum_logprobs / length ** X")
    p.add_argument("--early-stopping", type=_early_stopping, nargs="?", const=True, default=False,
                   metavar="never", help="beam search: stop once N hypotheses are finished; 'never' = only when "
                   "no beam can improve at max length")
    p.add_argument("--num-return-sequences", type=int, default=1, metavar="K",
                   help="beam search: print the K best hypotheses")
    p.add_argument("--speculative", choices=("prompt-lookup", "draft"), default=None,
                   help="greedy speculative decoding: drafts from n-gram lookup in the prompt or from --draft-model, "
                        "verified in one run (the same tokens as greedy)")
    p.add_argument("--num-draft-tokens", type=int, default=None, metavar="K",
                   help="with --speculative: the most drafts per verification run (default 5)")
    p.add_argument("--max-ngram-size", type=int, default=None, metavar="N",
                   help="with --speculative prompt-lookup: the longest suffix looked up (default 3)")
    p.add_argument("--draft-model", default=None, metavar="PATH",
                   help="with --speculative draft: a converted model with the same vocabulary")
    p.add_argument("--no-stream", action="store_true")
    p.add_argument("--ids", action="store_true", help="also print the generated token ids")
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("chat", help="interactive multi-turn chat with a converted model on one KVCache")
    p.add_argument("model", help="converted model with tokenizer.json and a chat template next to it")
    p.add_argument("--system", default=None, metavar="TEXT", help="system prompt")
    p.add_argument("--max-new-tokens", type=int, default=256, help="answer tokens per turn")
    _add_sampling_arguments(p)
    p.add_argument("--max-sequence-length", type=int, default=None, metavar="N",
                   help="cache capacity (default: the model's onnx_light.max_position)")
    p.add_argument("--kv-quant", choices=("int8", "int4"), default=None,
                   help="store cold KV pages quantized (docs/API.md 'Quantized pages')")
    p.add_argument("--recent-tokens", type=int, default=None, help="with --kv-quant: newest positions kept native")
    p.add_argument("--sink-tokens", type=int, default=None, help="with --kv-quant: first positions kept native")
    p.add_argument("--stats", action="store_true", help="after each answer: tokens appended/cached/generated, "
                   "stop reason, rates")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="say when the template re-rendered earlier turns and the cache was truncated")
    p.set_defaults(func=_cmd_chat)

    p = sub.add_parser("demo", help="the main job: SmolLM2-135M-Instruct, converted, answering on the EP "
                                    "(what 'onnx-light' with no arguments runs)")
    p.add_argument("--prompt", default=None)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--cache-dir", default=None, help="where the model is built and cached")
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(func=_cmd_demo)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="onnx-light",
        description="onnx-light-ep: persistent KV cache ops and execution provider for ONNX Runtime.",
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"onnx-light {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = False
    info = sub.add_parser(
        "info", help="print the version, the native library path, the attention ISA level in use and the "
                     "levels this CPU supports, the onnxruntime version and the EP devices"
    )
    info.add_argument("--json", action="store_true", help="the same as one JSON object on stdout")
    info.set_defaults(func=_cmd_info)
    from .bench import add_arguments as _bench_arguments, main_from_args as _bench_main

    bench = sub.add_parser(
        "bench", help="decode-step benchmark: EP KVCache vs ORT attention paths vs the read limit"
    )
    _bench_arguments(bench)
    bench.set_defaults(func=_bench_main)
    _add_rewrite_commands(sub)
    parser.set_defaults(func=_cmd_demo)
    return parser


def _add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    """The sampling, tokenizer and thread flags generate and chat share."""
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="folder with tokenizer.json")
    p.add_argument("--threads", type=int, default=None)


def main(argv: Optional[List[str]] = None) -> int:
    """Run the CLI with ``argv`` (default ``sys.argv[1:]``); returns the exit status.

    With no subcommand it runs ``demo`` (the main job on defaults).
    """
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
