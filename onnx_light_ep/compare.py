"""Side-by-side run: the original model on plain ORT vs the converted model on the EP.

``compare(original, converted=None, ...)`` feeds both models the same
inputs: a prompt (token ids, or text through the tokenizer found next to the
model), a prefill, then ``steps`` greedy decode steps (the next token is the
original's argmax, so both sides always see identical inputs). The original
runs on ``CPUExecutionProvider`` with its presents fed back as pasts; the
converted model runs on ``OnnxLightExecutionProvider`` with a
``KVCache.for_model`` cache. A batch (``batch_size >= 1``) is padded on the
side the model's exporter expects (see ``onnx_light_ep._runner``). A
prefill/decode pair (transformers' exporter: a folder holding ``prefill.onnx``
and ``decode.onnx``, or two paths) runs its prefill graph for the prefill and
its decode graph for every later step, on both sides.

Per step it records the max abs and relative logits error over the real
(non-padding) positions, argmax agreement per row, the latency of each side
(``time.perf_counter`` around ``session.run``, interleaved, same thread
count) and their ratio, and the bytes copied: plain ORT returns the whole
present K/V each step; the EP's ``KVCache.stats()["bytes_copied"]`` delta
(0 for a decode step) and ``bytes_appended`` delta.

A step fails when some real position has ``|Δ| > atol + rtol·|original|``
(numpy ``allclose`` style; defaults per dtype in :data:`DEFAULT_TOL`) or when
the argmax differs while the original's top-2 gap exceeds twice the error (a
true disagreement rather than a tie). ``onnxruntime`` is imported here, never by the rewrite.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from ._runner import DecodeState, PastFeeds, check_inputs, layer_pairs, past_capacities, prefill_pairs

__all__ = ["CompareError", "CompareResult", "StepRecord", "compare", "DEFAULT_TOL"]


class CompareError(RuntimeError):
    """A run of either model failed during :func:`compare` (the message names the model, the step and ORT's reason)."""

#: (atol, rtol) on logits per cache dtype: a position fails when |Δ| > atol + rtol·|original|.
DEFAULT_TOL = {"float32": (1e-4, 1e-5), "float16": (5e-2, 1e-2), "bfloat16": (1e-1, 2e-2)}
#: Models that quantize activations at run time (MatMulNBits accuracy_level 4, dynamic int8):
#: a 1e-7 difference upstream can flip an int8 rounding step, so logits are compared loosely
#: and the verdict rests on the argmax (ties excepted).
QUANTIZED_TOL = (1.0, 5e-2)
_QUANTIZED_OPS = {"MatMulNBits", "GatherBlockQuantized", "DynamicQuantizeMatMul", "MatMulInteger",
                  "MatMulIntegerToFloat", "QLinearMatMul", "QAttention", "DynamicQuantizeLinear"}


@dataclass
class StepRecord:
    """One run of both models. Times in ms, bytes per step."""

    step: int
    kind: str
    new_tokens: int
    context_length: int
    max_abs: float
    max_rel: float
    argmax_original: List[int]
    argmax_converted: List[int]
    agree: bool
    ort_ms: float
    ep_ms: float
    ratio: float
    ort_bytes_copied: int
    ep_bytes_copied: int
    ep_bytes_appended: int
    ok: bool


def format_bytes(n: float) -> str:
    """Bytes in one unit family (B, KiB, MiB, GiB), as every compare figure prints them."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


@dataclass
class CompareResult:
    """Everything :func:`compare` measured; ``ok`` is the verdict."""

    original: str
    converted: str
    batch_size: int
    prompt_lengths: List[int]
    padding_side: str
    dtype: str
    atol: float
    rtol: float
    steps: List[StepRecord] = field(default_factory=list)
    tokens: List[List[int]] = field(default_factory=list)
    texts: Optional[List[str]] = None
    providers: Dict[str, List[str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.steps)

    @property
    def max_abs(self) -> float:
        return max((s.max_abs for s in self.steps), default=0.0)

    @property
    def max_rel(self) -> float:
        return max((s.max_rel for s in self.steps), default=0.0)

    def _median(self, attr: str) -> float:
        vals = [getattr(s, attr) for s in self.steps if s.kind == "decode"]
        return statistics.median(vals) if vals else float("nan")

    @property
    def ort_decode_ms(self) -> float:
        return self._median("ort_ms")

    @property
    def ep_decode_ms(self) -> float:
        return self._median("ep_ms")

    def summary(self) -> str:
        agree = sum(s.agree for s in self.steps)
        dec = [s for s in self.steps if s.kind == "decode"]
        ort_copy = statistics.median([s.ort_bytes_copied for s in dec]) if dec else 0
        ep_copy = max((s.ep_bytes_copied for s in dec), default=0)
        verdict = "OK" if self.ok else "MISMATCH"
        return (f"compare {verdict}: batch {self.batch_size}, prefill {max(self.prompt_lengths)} + {len(dec)} greedy "
                f"steps; max |dlogits| {self.max_abs:.3g} (rel {self.max_rel:.3g}; atol {self.atol:g}, rtol "
                f"{self.rtol:g}); argmax agree "
                f"{agree}/{len(self.steps)}; decode step plain ORT {self.ort_decode_ms:.2f} ms vs EP "
                f"{self.ep_decode_ms:.2f} ms (ORT/EP {self.ort_decode_ms / self.ep_decode_ms:.2f}x); bytes copied "
                f"per decode step: plain ORT {format_bytes(ort_copy)}, EP {format_bytes(ep_copy)}")

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d.update(ok=self.ok, max_abs=self.max_abs, max_rel=self.max_rel, ort_decode_ms=self.ort_decode_ms,
                 ep_decode_ms=self.ep_decode_ms, summary=self.summary())
        return d


def _session_options(ort, threads: Optional[int]):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = int(threads)
    return so


def make_prompts(prompt_ids: Optional[Sequence[Sequence[int]]], batch_size: int, prefill: int,
                 vocab: int, seed: int, equal_lengths: bool = False) -> List[List[int]]:
    """Rows of token ids: the given ones, or seeded random ids; extra rows are shortened copies
    (row ``b`` drops ``2*b`` leading tokens) so a batch exercises padding, or, with
    ``equal_lengths`` (a model without ``attention_mask`` has no padding), copies rotated by ``b``
    tokens."""
    if prompt_ids:
        rows = [list(map(int, p)) for p in prompt_ids]
    else:
        rng = np.random.default_rng(seed)
        rows = [rng.integers(1, max(2, vocab), size=prefill).tolist()]
    while len(rows) < batch_size:
        base = rows[0]
        if equal_lengths:
            k = len(rows) % len(base)
            rows.append(base[k:] + base[:k])
        else:
            cut = min(2 * len(rows), len(base) - 1)
            rows.append(base[cut:])
    return rows[:batch_size]


def _run(session, feeds, which: str, step: int) -> dict:
    names = [o.name for o in session.get_outputs()]
    try:
        return dict(zip(names, session.run(None, feeds)))
    except Exception as e:  # ORT raises its own exception types; keep its text, name the side and step
        raise CompareError(f"compare: the run of {which} failed at step {step} "
                           f"({'prefill' if step == 0 else 'decode'}): {e}") from e


def compare(original, converted=None, *, prompt: Optional[str] = None,
            prompt_ids: Optional[Sequence[Sequence[int]]] = None, batch_size: int = 1, prefill: int = 16,
            steps: int = 32, atol: Optional[float] = None, rtol: Optional[float] = None, threads: Optional[int] = None,
            provider_options: Optional[Dict[str, str]] = None, tokenizer_dir: Optional[str] = None,
            seed: int = 0, progress: bool = False, chat: bool = False) -> CompareResult:
    """Run ``original`` (plain ORT) and ``converted`` (EP + KVCache) side by side.

    Args:
        original: path of the exported model (past/present tensors); or a
            prefill/decode pair (transformers' exporter): a folder holding
            ``prefill.onnx`` and ``decode.onnx``, or the two paths. A pair runs
            the prefill on its prefill graph and every decode step on its
            decode graph, on both sides (one ``KVCache`` for the converted pair).
        converted: path of ``convert(original)`` (a folder or two paths for a
            pair); None converts into a temporary directory first.
        prompt: text (needs ``tokenizer.json`` next to a model or in
            ``tokenizer_dir``); or ``prompt_ids``: list of token id lists, one
            per row. Neither: ``prefill`` seeded random ids.
        batch_size: rows (>= 1); rows beyond the given prompts are shortened
            copies, so the batch is padded; for a model without an
            ``attention_mask`` input (no padding) they are rotated copies of
            equal length, and given rows must have equal lengths.
        steps: greedy decode steps after the prefill.
        atol, rtol: pass when ``|Δ| <= atol + rtol·|original|`` at every real
            position; defaults by dtype (:data:`DEFAULT_TOL`), or :data:`QUANTIZED_TOL`
            for models with run-time activation quantization.
        threads: ``intra_op_num_threads`` for both sessions (None = ORT default).
        provider_options: options for ``OnnxLightExecutionProvider``.
        chat: wrap ``prompt`` in the tokenizer's chat template as one user turn
            (as ``generate(chat=True)``).

    Returns:
        :class:`CompareResult` (``.ok``, ``.summary()``, ``.to_dict()``).

    Raises:
        ValueError: bad arguments, a model input this loop cannot feed, text
            without a tokenizer, a pair whose graphs disagree, or rows of
            unequal length for a model without ``attention_mask``.
        FileNotFoundError: a missing model (the message names the argument).
        RuntimeError: the EP did not start.
        CompareError: a run of either model failed (ORT's reason, the model
            and the step in the message).
    """
    import onnxruntime as ort

    from . import InferenceSession, KVCache
    from ._text import TextTokenizer
    from .rewrite import convert as _convert
    from .rewrite import read_metadata
    from .rewrite._pair import check_pair_metadata, model_files

    if batch_size < 1:
        raise ValueError(f"compare: batch_size; expected >= 1, got {batch_size}")
    if steps < 0:
        raise ValueError(f"compare: steps; expected >= 0 (decode steps after the prefill), got {steps}")
    if prefill < 1:
        raise ValueError(f"compare: prefill; expected >= 1 (prompt tokens), got {prefill}")
    if tokenizer_dir is not None and not os.path.isdir(os.fspath(tokenizer_dir)):
        raise ValueError(f"compare: tokenizer_dir; expected a folder with tokenizer.json, got "
                         f"{os.fspath(tokenizer_dir)!r} (not a folder)")
    orig, orig_dec = model_files(original, "compare", "original")
    if converted is not None:
        conv, conv_dec = model_files(converted, "compare", "converted")
        if (orig_dec is None) != (conv_dec is None):
            raise ValueError(f"compare: converted; expected {'a prefill/decode pair' if orig_dec else 'one model'} "
                             f"as the original is, got {'a pair' if conv_dec else 'one model'}")
    for path in (orig, orig_dec):
        if path is None:
            continue
        try:
            read_metadata(path)
            already = True
        except ValueError:
            already = False
        if already:
            raise ValueError(f"compare: original; {path!r} is already converted by onnx_light_ep.convert; pass "
                             "the exported model first (and the converted one second, or nothing)")
    tmp = None
    if converted is None:
        tmp = tempfile.TemporaryDirectory(prefix="onnx_light_compare_")
        if orig_dec is None:
            conv, conv_dec = os.path.join(tmp.name, "model.onnx"), None
            _convert(orig, conv)
        else:  # each graph of the pair in its role, as convert does for a folder
            conv, conv_dec = os.path.join(tmp.name, "prefill.onnx"), os.path.join(tmp.name, "decode.onnx")
            _convert(orig, conv, stage="prefill")
            _convert(orig_dec, conv_dec, stage="decode")
    try:
        meta = read_metadata(conv)
        if conv_dec is not None:
            check_pair_metadata(meta, read_metadata(conv_dec), "compare")
        tok = TextTokenizer.find([tokenizer_dir, os.path.dirname(os.path.abspath(orig)),
                                  os.path.dirname(os.path.abspath(conv))])
        if prompt is not None:
            if tok is None:
                raise ValueError("compare: prompt; expected token ids (no tokenizer.json with the tokenizers "
                                 "package next to the model), got text")
            prompt_ids = [tok.encode((tok.chat_prompt(prompt) or prompt) if chat else prompt)]
        # plain ORT: CPU EP only, no custom-op library
        so = _session_options(ort, threads)
        sess_a = ort.InferenceSession(orig, so, providers=["CPUExecutionProvider"])
        sess_b = InferenceSession(conv, _session_options(ort, threads), provider_options)
        dec_a = sess_a if orig_dec is None else ort.InferenceSession(orig_dec, so, providers=["CPUExecutionProvider"])
        dec_b = sess_b if conv_dec is None else InferenceSession(conv_dec, _session_options(ort, threads),
                                                                  provider_options)
        vocab = _vocab(sess_a)
        unpadded = "attention_mask" not in {i.name for i in sess_a.get_inputs()}
        rows = make_prompts(prompt_ids, batch_size, prefill, vocab, seed, equal_lengths=unpadded)
        if unpadded and len({len(r) for r in rows}) > 1:
            raise ValueError(f"compare: prompt_ids; the model has no attention_mask input (no padding), so a batch "
                             f"needs rows of equal length, got lengths {[len(r) for r in rows]}")
        dtype = meta["dtype"]
        d_atol, d_rtol = QUANTIZED_TOL if _quantized(orig) else DEFAULT_TOL.get(dtype, (1e-4, 1e-5))
        tol = (d_atol if atol is None else float(atol), d_rtol if rtol is None else float(rtol))
        result = CompareResult(original=_describe(orig, orig_dec), converted=_describe(conv, conv_dec),
                               batch_size=batch_size,
                               prompt_lengths=[len(r) for r in rows], padding_side=meta["padding_side"],
                               dtype=dtype, atol=tol[0], rtol=tol[1],
                               providers={"original": sess_a.get_providers(), "converted": sess_b.get_providers()})
        dmeta = meta if conv_dec is None else read_metadata(conv_dec)
        pairs = layer_pairs(dmeta) + [tuple(p) for p in dmeta.get("tensor_pairs", [])]
        pasts = PastFeeds(dec_a, pairs, batch_size, meta["head_dim"], meta["v_head_dim"], past_capacities(dmeta))
        # A pair's prefill graph starts the cache: its presents are the decode graph's first pasts.
        first = prefill_pairs(meta, dmeta) if conv_dec is not None else None
        known = ["input_ids", "attention_mask", "position_ids", "seqlens_k", "total_sequence_length"]
        if dec_a is not sess_a:
            check_inputs(sess_a, known, "compare (original prefill)")
        check_inputs(dec_a, known + [p for p, _ in pasts.pairs], "compare (original)")
        for sb in {id(sess_b): sess_b, id(dec_b): dec_b}.values():
            check_inputs(sb, known + [meta["cache_input"]] + [p for p, _ in pairs if p in _inputs(sb)]
                         + [x for x in [meta.get("logits_to_keep")] if x],
                         "compare (converted)")
        state_pairs = [(p, q) for p, q in pairs if p in _inputs(sess_b)]
        eb = PastFeeds(sess_b, state_pairs, batch_size, meta["head_dim"], meta["v_head_dim"]) if state_pairs else None
        state = DecodeState(rows, meta["padding_side"], pad_token_id=_pad_id(tok))
        logits_a_name = meta.get("logits_output") or sess_a.get_outputs()[0].name
        generated: List[List[int]] = [[] for _ in rows]
        with KVCache.for_model(sess_b, batch_size, state.total_length + steps + 1) as cache:
            bar = _progress(steps + 1, progress)
            for step in range(steps + 1):
                sa, sb = (sess_a, sess_b) if step == 0 else (dec_a, dec_b)
                fa = dict(state.feeds(sa), **{k: v for k, v in pasts.values.items() if k in _inputs(sa)})
                t0 = time.perf_counter()
                out_a = _run(sa, fa, "the original model (plain ORT)", step)
                t1 = time.perf_counter()
                ort_copied = pasts.update(out_a, first if step == 0 else None)
                before = cache.stats()
                fb = dict(state.feeds(sb), **{meta["cache_input"]: cache.handle})
                if meta.get("logits_to_keep") in _inputs(sb):  # every position, as the original computes
                    fb[meta["logits_to_keep"]] = np.array(0, dtype=np.int64)
                if eb is not None:
                    fb.update(eb.values)
                t2 = time.perf_counter()
                out_b = _run(sb, fb, "the converted model (EP)", step)
                t3 = time.perf_counter()
                if eb is not None:
                    eb.update(out_b)
                after = cache.stats()
                la, lb = out_a[logits_a_name], out_b[logits_a_name]
                rec = _record(step, state, la, lb, (t1 - t0) * 1e3, (t3 - t2) * 1e3, ort_copied,
                              after["bytes_copied"] - before["bytes_copied"],
                              after["bytes_appended"] - before["bytes_appended"], tol)
                result.steps.append(rec)
                nxt = rec.argmax_original
                for b, t in enumerate(nxt):
                    generated[b].append(int(t))
                state.advance(nxt)
                bar(step)
        result.tokens = generated
        if tok is not None:
            result.texts = [tok.decode(g) for g in generated]
        return result
    finally:
        if tmp is not None:
            tmp.cleanup()


def _inputs(session) -> set:
    return {i.name for i in session.get_inputs()}


def _describe(path: str, decode: Optional[str]) -> str:
    return path if decode is None else f"{path} + {decode}"


def _quantized(path: str) -> bool:
    import onnx

    model = onnx.load(path, load_external_data=False)
    return any(n.op_type in _QUANTIZED_OPS for n in model.graph.node)


def _vocab(session) -> int:
    shape = session.get_outputs()[0].shape
    return shape[-1] if shape and isinstance(shape[-1], int) else 32000


def _pad_id(tok) -> int:
    if tok is not None and tok.eos_token_ids:
        return min(tok.eos_token_ids)
    return 0


def _record(step, state: DecodeState, la, lb, ort_ms, ep_ms, ort_copied, ep_copied, ep_appended, tol) -> StepRecord:
    la64, lb64 = la.astype(np.float64), lb.astype(np.float64)
    atol, rtol = tol
    max_abs, ref, ok = 0.0, 0.0, True
    for b, cols in state.valid_positions():
        if len(cols) == 0:
            continue
        a, c = la64[b, cols], lb64[b, cols]
        if not np.all(np.isfinite(c)):
            max_abs, ok = float("inf"), False
        else:
            diff = np.abs(a - c)
            max_abs = max(max_abs, float(diff.max()))
            ok = ok and bool(np.all(diff <= atol + rtol * np.abs(a)))
        ref = max(ref, float(np.abs(a).max()))
    last_a, last_b = state.last_logits(la64), state.last_logits(lb64)
    am_a, am_b = last_a.argmax(-1), last_b.argmax(-1)
    agree = bool(np.all(am_a == am_b))
    if not agree:
        for b in np.nonzero(am_a != am_b)[0]:
            top2 = np.sort(last_a[b])[-2:]
            if top2[1] - top2[0] > 2 * max_abs:
                ok = False
    return StepRecord(step=step, kind="prefill" if step == 0 else "decode", new_tokens=int(state.ids.shape[1]),
                      context_length=state.total_length, max_abs=max_abs, max_rel=max_abs / ref if ref else 0.0,
                      argmax_original=[int(x) for x in am_a], argmax_converted=[int(x) for x in am_b], agree=agree,
                      ort_ms=ort_ms, ep_ms=ep_ms, ratio=ort_ms / ep_ms if ep_ms else float("inf"),
                      ort_bytes_copied=int(ort_copied), ep_bytes_copied=int(ep_copied),
                      ep_bytes_appended=int(ep_appended), ok=ok)


def _progress(total: int, enabled: bool):
    if not enabled:
        return lambda i: None
    try:
        from tqdm import tqdm

        bar = tqdm(total=total, desc="compare", unit="step")

        def tick(i):
            bar.update(1)
            if i == total - 1:
                bar.close()
        return tick
    except ImportError:
        import sys

        def tick(i):
            if (i + 1) % 16 == 0 or i == total - 1:
                print(f"compare: step {i + 1}/{total}", file=sys.stderr, flush=True)
        return tick


def write_json(result: CompareResult, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result.to_dict(), f, indent=1)


def plot(result: CompareResult, path: str) -> None:
    """PNG of per-step latency against context length for both sides (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("compare --plot needs matplotlib: python -m pip install matplotlib") from e
    dec = [s for s in result.steps if s.kind == "decode"]
    x = [s.context_length for s in dec]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, [s.ort_ms for s in dec], label="plain ORT (past/present tensors)")
    ax.plot(x, [s.ep_ms for s in dec], label="onnx_light EP (KVCache)")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode step latency (ms)")
    ax.set_title(f"{os.path.basename(result.original)} (plain ORT) vs {os.path.basename(result.converted)} (EP)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
