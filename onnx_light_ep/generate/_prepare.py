"""What every generation loop does before its first run: arguments, model, tokenizer, prompts, session.

:func:`prepare` checks the arguments common to every loop, converts an
unconverted export into a temporary file, finds the tokenizer and the
end-of-sequence ids next to the model, encodes the prompts (or checks the
given ids against the model's vocabulary and positions) and opens the EP
session; :class:`Prepared` holds the result and is a context manager that
removes the temporary conversion.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass
from typing import List, Optional, Sequence, Set

import numpy as np

__all__ = ["CACHE_OPTIONS", "Prepared", "check_cache_options", "check_eos", "check_positive_int", "check_sampling",
           "check_threads", "prepare", "token_rows"]

# KVCache.for_model keywords generate passes through (batch size and length come from the run).
CACHE_OPTIONS = ("pool", "page_tokens", "sliding_window", "rollback_tokens", "kv_quant", "recent_tokens",
                 "sink_tokens", "memory_limit_bytes")


def check_cache_options(cache_options) -> None:
    if cache_options is None:
        return
    if not isinstance(cache_options, dict):
        raise ValueError(f"generate: cache_options; expected a dict of KVCache options ({', '.join(CACHE_OPTIONS)}), "
                         f"got {type(cache_options).__name__}")
    bad = sorted(k for k in cache_options if k not in CACHE_OPTIONS)
    if bad:
        raise ValueError(f"generate: cache_options; unknown key(s) {', '.join(map(repr, bad))}: expected any of "
                         f"{', '.join(CACHE_OPTIONS)} (batch size and length are set by the run)")


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_real(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def check_sampling(temperature: float, top_k: int, top_p: float, seed=None, where: str = "generate") -> None:
    """``ValueError`` naming the argument unless temperature/top_k/top_p/seed are what :func:`sample_next` takes.

    ``temperature``: a finite number >= 0; ``top_k``: an int >= 0; ``top_p``: a
    number in (0, 1]; ``seed``: an int >= 0 or None (``numpy.random.default_rng``).
    Bools are refused where numbers are expected (True is not a temperature).
    """
    if not (_is_real(temperature) and math.isfinite(temperature) and temperature >= 0.0):
        raise ValueError(f"{where}: temperature; expected a finite number >= 0 (0 = greedy), got {temperature!r}")
    if not (_is_int(top_k) and top_k >= 0):
        raise ValueError(f"{where}: top_k; expected an int >= 0 (0 = no top-k), got {top_k!r}")
    if not (_is_real(top_p) and 0.0 < top_p <= 1.0):
        raise ValueError(f"{where}: top_p; expected a number in (0, 1], got {top_p!r}")
    if seed is not None and not (_is_int(seed) and seed >= 0):
        raise ValueError(f"{where}: seed; expected an int >= 0 or None, got {seed!r}")


def check_positive_int(value, where: str, arg: str) -> int:
    """``value`` as an int >= 1 (``ValueError`` naming ``arg`` for bools, floats, text, None, values < 1)."""
    if not _is_int(value):
        raise ValueError(f"{where}: {arg}; expected an int >= 1, got {value!r}")
    if value < 1:
        raise ValueError(f"{where}: {arg}; expected >= 1, got {value}")
    return int(value)


def check_threads(threads, where: str = "generate") -> None:
    if threads is not None and not (_is_int(threads) and threads >= 0):
        raise ValueError(f"{where}: threads; expected an int >= 0 or None (0 or None: ONNX Runtime's default), "
                         f"got {threads!r}")


def token_rows(prompt_ids, where: str = "generate", arg: str = "prompt_ids") -> List[List[int]]:
    """Rows of int token ids from a list of rows (lists, tuples or 1-D arrays of ints) or a 2-D int array.

    Raises:
        ValueError: a flat list of ids (a single prompt is ``[[...]]``), text,
            or ids that are not integers (floats would be truncated, bools are
            not ids).
    """
    if prompt_ids is None:
        return []
    if isinstance(prompt_ids, (str, bytes)) or not hasattr(prompt_ids, "__iter__"):
        raise ValueError(f"{where}: {arg}; expected a list of rows (each a list of token ids), got a "
                         f"{type(prompt_ids).__name__}")
    rows = []
    for i, row in enumerate(prompt_ids):
        if isinstance(row, (str, bytes)) or not hasattr(row, "__iter__"):
            shown = list(prompt_ids)[:8]
            raise ValueError(f"{where}: {arg}; expected a list of rows (each a list of token ids), got {row!r} as "
                             f"row {i}: a single prompt is [{shown!r}]")
        out = []
        for t in row:
            if not _is_int(t):
                raise ValueError(f"{where}: {arg}[{i}]; expected integer token ids, got {t!r}")
            out.append(int(t))
        rows.append(out)
    return rows


def check_eos(eos_token_ids, where: str = "generate") -> Optional[Set[int]]:
    """``eos_token_ids`` (an int or a sequence of ints, or None) as a set; ``ValueError`` otherwise."""
    if eos_token_ids is None:
        return None
    if _is_int(eos_token_ids):
        return {int(eos_token_ids)}
    items = list(eos_token_ids) if hasattr(eos_token_ids, "__iter__") and not isinstance(
        eos_token_ids, (str, bytes)) else None
    if items is None or not all(_is_int(t) for t in items):
        raise ValueError(f"{where}: eos_token_ids; expected an int or a sequence of ints, got {eos_token_ids!r}")
    return {int(t) for t in items}


@dataclass
class Prepared:
    """A converted model's session with its metadata, tokenizer, prompt rows and end-of-sequence ids."""

    path: str
    meta: dict
    tokenizer: object  # onnx_light_ep._text.TextTokenizer or None
    rows: List[List[int]]
    eos: Set[int]
    session: object
    vocab: Optional[int]
    _tmp: Optional[tempfile.TemporaryDirectory] = None
    #: a prefill/decode pair: the decode graph's session (step 0 runs ``session``, later steps this)
    decode_session: object = None

    @property
    def step_sessions(self):
        """``(prefill session, decode session)``: the same session twice for one model."""
        return self.session, self.decode_session if self.decode_session is not None else self.session

    def decode(self, ids: Sequence[int]) -> Optional[str]:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else None

    @property
    def max_position(self) -> Optional[int]:
        m = self.meta.get("max_position")
        return int(m) if m else None

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "Prepared":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def prepare(model, prompt=None, *, prompt_ids=None, chat: bool = False, max_new_tokens: int = 128,
            eos_token_ids=None, tokenizer_dir=None, session=None, threads=None, provider_options=None,
            extra_positions: int = 0, prompt_required: bool = True) -> Prepared:
    """Check and load everything a loop needs (see :func:`onnx_light_ep.generate.generate` for the arguments).

    ``model`` is one ONNX file, or a prefill/decode pair (transformers'
    exporter): a folder holding ``prefill.onnx`` and ``decode.onnx``, or the
    two paths; both graphs get a session (``decode_session``) and run on one
    cache. ``session`` reuses open sessions: one, or ``(prefill, decode)`` for a pair.

    ``extra_positions``: positions a loop may use beyond prompt + ``max_new_tokens``
    (speculative verification writes drafts it may later drop).
    ``prompt_required=False``: no prompt is fine (``rows`` is then empty: a
    loop that receives its tokens later, such as ``onnx_light_ep.chat``).

    Raises:
        ValueError: bad arguments, text without a tokenizer, token ids outside
            the vocabulary, prompt + ``max_new_tokens`` beyond the model's
            positions (``onnx_light.max_position``), a pair whose graphs
            disagree, one graph of a pair given alone, or prompt rows of
            unequal length for a model without ``attention_mask``.
        FileNotFoundError: ``model`` is not a file (nor a folder holding a pair).
    """
    from .. import InferenceSession
    from .._text import TextTokenizer, eos_token_ids as _eos_ids
    from ..rewrite import convert as _convert
    from ..rewrite import read_metadata
    from ..rewrite._pair import check_pair_metadata, convert_stages, model_files

    max_new_tokens = check_positive_int(max_new_tokens, "generate", "max_new_tokens")
    check_threads(threads)
    eos_given = check_eos(eos_token_ids)
    if tokenizer_dir is not None and not os.path.isdir(os.fspath(tokenizer_dir)):
        raise ValueError(f"generate: tokenizer_dir; expected a folder with tokenizer.json, got "
                         f"{os.fspath(tokenizer_dir)!r} (not a folder)")
    path, decode = model_files(model, "generate")
    src_dir = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        meta = read_metadata(path)
    except ValueError:
        tmp = tempfile.TemporaryDirectory(prefix="onnx_light_generate_")
        converted = os.path.join(tmp.name, "prefill.onnx" if decode else "model.onnx")
        if decode:  # each graph of the pair in its role, as convert does for a folder
            dec = os.path.join(tmp.name, "decode.onnx")
            convert_stages({"prefill": path, "decode": decode}, {"prefill": converted, "decode": dec},
                           logits_to_keep=True)
            decode = dec
        else:
            _convert(path, converted, logits_to_keep=True)
        path, meta = converted, read_metadata(converted)
    try:
        if decode is not None:
            check_pair_metadata(meta, read_metadata(decode), "generate")
        elif meta.get("stage"):
            raise ValueError(f"generate: model; {path!r} is the {meta['stage']} graph of a prefill/decode pair "
                             f"(onnx_light.stage); expected the folder holding prefill.onnx and decode.onnx, or "
                             f"both paths")
        tok = TextTokenizer.find([tokenizer_dir, src_dir])
        if prompt is not None:
            if tok is None:
                raise ValueError("generate: prompt; expected token ids (no tokenizer.json usable with the "
                                 "tokenizers package next to the model), got text")
            if not isinstance(prompt, (str, list, tuple)):
                raise ValueError(f"generate: prompt; expected text or a list of texts, got {type(prompt).__name__}")
            texts = [prompt] if isinstance(prompt, str) else list(prompt)
            if not texts:
                raise ValueError("generate: prompt; expected text or a non-empty list of texts, got []")
            for i, t in enumerate(texts):
                if not isinstance(t, str) or not t:
                    raise ValueError(f"generate: prompt[{i}]; expected non-empty text, got {t!r}")
            if chat:
                texts = [tok.chat_prompt(t) or t for t in texts]
            prompt_ids = [tok.encode(t) for t in texts]
        if prompt_ids is None or (not isinstance(prompt_ids, np.ndarray) and not prompt_ids) or (
                isinstance(prompt_ids, np.ndarray) and prompt_ids.size == 0):
            prompt_ids = None
            if prompt_required:
                raise ValueError("generate: expected a prompt or prompt_ids")
        rows = token_rows(prompt_ids)
        for i, r in enumerate(rows):
            if not r:
                raise ValueError(f"generate: prompt_ids[{i}]; expected at least one token id, got []")
        limit = meta.get("max_position")
        longest = max((len(r) for r in rows), default=0)
        if rows and limit and longest + max_new_tokens + extra_positions > int(limit):
            raise ValueError(f"generate: max_new_tokens; the prompt ({longest} tokens) plus {max_new_tokens} new "
                             f"tokens{f' (+{extra_positions} for drafts)' if extra_positions else ''} exceeds the "
                             f"model's {int(limit)} positions (onnx_light.max_position); expected max_new_tokens "
                             f"<= {int(limit) - longest - extra_positions}")
        eos = eos_given if eos_given is not None else (
            tok.eos_token_ids if tok is not None else _eos_ids(tokenizer_dir or "", src_dir))
        decode_session = None
        if decode is not None and session is not None:
            if not (isinstance(session, (list, tuple)) and len(session) == 2):
                raise ValueError("generate: session; expected (prefill session, decode session) for a "
                                 f"prefill/decode pair, got {type(session).__name__}")
            session, decode_session = session
        if session is None:
            import onnxruntime as ort

            def open_session(p):
                so = ort.SessionOptions()
                so.log_severity_level = 3
                if threads:
                    so.intra_op_num_threads = int(threads)
                return InferenceSession(p, so, provider_options)

            session = open_session(path)
            decode_session = open_session(decode) if decode is not None else None
        logits_shape = next((o.shape for o in session.get_outputs()
                             if o.name == (meta.get("logits_output") or session.get_outputs()[0].name)), None)
        vocab = logits_shape[-1] if logits_shape and isinstance(logits_shape[-1], int) else None
        for i, r in enumerate(rows):
            bad = [t for t in r if t < 0 or (vocab is not None and t >= vocab)]
            if bad:
                raise ValueError(f"generate: prompt_ids[{i}]; expected token ids in [0, {vocab}) (the model's "
                                 f"vocabulary), got {bad[0]}")
        bad = sorted(t for t in eos_given or () if t < 0 or (vocab is not None and t >= vocab))
        if bad:   # an id the model never gives: a row would never stop on it
            raise ValueError(f"generate: eos_token_ids; expected ids in [0, {vocab}) (the model's vocabulary), got "
                             f"{bad[0]}")
        if "attention_mask" not in {i.name for i in session.get_inputs()} and len({len(r) for r in rows}) > 1:
            raise ValueError(f"generate: prompt_ids; the model has no attention_mask input (no padding), so a "
                             f"batch needs prompts of equal length (in tokens), got {[len(r) for r in rows]}")
    except BaseException:
        if tmp is not None:
            tmp.cleanup()
        raise
    return Prepared(path=path, meta=meta, tokenizer=tok, rows=rows, eos=eos, session=session, vocab=vocab,
                    _tmp=tmp, decode_session=decode_session)
