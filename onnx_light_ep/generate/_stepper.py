"""Running the next tokens of equal-length rows through a converted model on one ``KVCache``.

The loops built on the cache's generation operations (beam search: ``fork`` +
``reorder``; speculative decoding: ``truncate``; prefix caching: ``fork`` of a
stored prefix; multi-turn chat: one cache across turns) keep every row of a
cache at the same length ``L``, so no padding is involved: a run of ``S`` new
tokens per row feeds ``attention_mask`` = ones ``[B, L + S]``, ``position_ids``
= ``L + arange(S)`` (what both padding conventions of
``onnx_light_ep._runner`` give without padding), ``seqlens_k`` = ``L + S - 1``
and ``total_sequence_length`` = ``L + S`` where the model takes them, and the
cache handle. ``L`` is read from the cache itself (``KVCache.seq_lens``), so a
``truncate``/``restore``/``fork`` between runs needs no bookkeeping here.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import numpy as np

from .._runner import _ORT_INT, _input_types, check_inputs

__all__ = ["CacheStepper"]

_INT64_MAX = int(np.iinfo(np.int64).max)


class CacheStepper:
    """Feeds a converted model's session for caches whose rows all hold the same number of positions.

    Args:
        session: an ``onnx_light_ep.InferenceSession`` of a model written by
            ``onnx_light_ep.convert``.
        meta: its ``onnx_light.*`` metadata (``onnx_light_ep.rewrite.read_metadata``).
        where: the caller's name for error messages.

    Raises:
        ValueError: the model keeps a past as a tensor input (a layer
            ``convert`` left as it was: these loops cannot fork, reorder or
            truncate it), or has an input this loop cannot feed.
    """

    def __init__(self, session, meta: dict, where: str = "generate"):
        if not callable(getattr(session, "get_inputs", None)) or not callable(getattr(session, "run", None)):
            raise ValueError(f"{where}: session; expected an onnx_light_ep.InferenceSession, got "
                             f"{type(session).__name__}")
        if not isinstance(meta, dict) or "cache_input" not in meta:
            raise ValueError(f"{where}: meta; expected the model's onnx_light metadata (read_metadata), got "
                             f"{'a dict without ' + repr('cache_input') if isinstance(meta, dict) else type(meta).__name__}")
        pairs = [tuple(p) for p in meta.get("tensor_pairs", [])]
        if pairs:
            raise ValueError(f"{where}: the model still carries past/present tensors {pairs[0]} outside the cache "
                             f"(onnx_light.tensor_pairs: a layer convert left as it was, see its report); expected a "
                             f"model whose every past lives in the cache")
        if meta.get("stage") == "prefill":
            raise ValueError(f"{where}: model; the prefill graph of a prefill/decode pair, and this loop runs every "
                             f"step on one graph: expected a one-graph model (generate's greedy/sampled loop runs "
                             f"pairs)")
        check_inputs(session, ["input_ids", "attention_mask", "position_ids", "seqlens_k", "total_sequence_length",
                               meta["cache_input"]] + [x for x in [meta.get("logits_to_keep")] if x], where)
        self.session, self.meta, self.where = session, meta, where
        self._types = _input_types(session)
        self._out_names = [o.name for o in session.get_outputs()]
        self._logits = meta.get("logits_output") or self._out_names[0]
        shape = next((o.shape for o in session.get_outputs() if o.name == self._logits), None)
        #: logits width (the vocabulary) when the graph states it, else None
        self.vocab: Optional[int] = shape[-1] if shape and isinstance(shape[-1], int) else None
        self._geometry = tuple(meta.get(k) for k in ("num_layers", "kv_num_heads", "head_dim", "v_head_dim", "dtype"))
        limit = meta.get("max_position")
        self._max_position = int(limit) if limit else None
        keep = meta.get("logits_to_keep")
        #: the model's ``logits_to_keep`` input (its LM head runs on the kept rows only), or None
        self.keep_input: Optional[str] = keep if keep and keep in self._types else None

    def check_ids(self, cache, ids) -> np.ndarray:
        """``ids`` as int64 ``[B, S]`` after checking them against the model and ``cache`` (nothing runs).

        See :meth:`_checked` for what is checked.
        """
        return self._checked(cache, ids)[0]

    def _checked(self, cache, ids) -> Tuple[np.ndarray, int]:
        """:meth:`check_ids` plus the past length ``L`` it read (one ``seq_lens`` read per run).

        Raises:
            ValueError: not integers (floats would be truncated, bools and text
                are not ids), not ``[cache.batch_size, S >= 1]``, outside
                ``[0, vocab)`` (ORT's Gather would wrap -1 around to another
                token), ``cache`` of another geometry, or ``past + S`` beyond
                the cache's ``max_sequence_length`` or the model's
                ``onnx_light.max_position``.
        """
        arr = np.asarray(ids)
        if arr.dtype.kind not in "iu" and not (arr.size == 0 and arr.dtype.kind == "f"):
            raise ValueError(f"{self.where}: input_ids; expected integer token ids, got an array of {arr.dtype}")
        arr = arr.astype(np.int64, copy=False)
        if arr.ndim != 2 or arr.shape[0] != cache.batch_size or arr.shape[1] < 1:
            raise ValueError(f"{self.where}: input_ids; expected int [{cache.batch_size}, S >= 1] (the cache's "
                             f"batch), got shape {list(arr.shape)}")
        if self.vocab is not None and arr.size and (arr.min() < 0 or arr.max() >= self.vocab):
            bad = int(arr.min()) if arr.min() < 0 else int(arr.max())
            raise ValueError(f"{self.where}: input_ids; expected token ids in [0, {self.vocab}) (the model's "
                             f"vocabulary), got {bad}")
        got = (cache.num_layers, cache.kv_num_heads, cache.head_dim, cache.v_head_dim, cache.dtype)
        if None not in self._geometry and got != self._geometry:
            names = ("num_layers", "kv_num_heads", "head_dim", "v_head_dim")
            want = ", ".join(f"{n} {v}" for n, v in zip(names, self._geometry)) + f", {self._geometry[4]}"
            diff = ", ".join(f"{n} {g}" for n, g, w in zip(names + ("dtype",), got, self._geometry) if g != w)
            raise ValueError(f"{self.where}: cache; expected a cache of this model's geometry ({want}), got {diff} "
                             f"(KVCache.for_model makes one)")
        past = self.past_length(cache)
        limits = [(int(cache.max_sequence_length), f"the cache's max_sequence_length {cache.max_sequence_length}")]
        if self._max_position:
            limits.append((self._max_position, f"the model's {self._max_position} positions, onnx_light.max_position"))
        room = min(n for n, _ in limits)
        if past + arr.shape[1] > room:
            why = "; ".join(w for n, w in limits if n == room)
            raise ValueError(f"{self.where}: input_ids; the cache holds {past} positions and the run adds "
                             f"{arr.shape[1]}: expected at most {room} in all ({why})")
        return arr, past

    def past_length(self, cache) -> int:
        """``L``: the positions every row of ``cache`` holds (``ValueError`` if the rows differ)."""
        lens = np.asarray(cache.seq_lens)
        if lens.size and not (lens == lens[0]).all():
            raise ValueError(f"{self.where}: the cache's rows hold {lens.tolist()} positions; expected rows of "
                             f"equal length")
        return int(lens[0]) if lens.size else 0

    def feeds(self, cache, ids: np.ndarray, logits_to_keep: int = 0) -> Dict[str, np.ndarray]:
        """The inputs of one run of ``ids`` (int ``[B, S]``) after the positions ``cache`` holds.

        ``logits_to_keep`` is fed to a model that has the input (see :meth:`run`).
        """
        keep = self._check_keep(logits_to_keep)
        ids, past = self._checked(cache, ids)
        b, s = ids.shape
        t = self._types

        def as_type(name, value):
            return value.astype(_ORT_INT.get(t[name], np.int64))

        out = {"input_ids": as_type("input_ids", ids), self.meta["cache_input"]: cache.handle}
        if "attention_mask" in t:
            out["attention_mask"] = as_type("attention_mask", np.ones((b, past + s), np.int64))
        if "position_ids" in t:
            out["position_ids"] = as_type("position_ids", np.broadcast_to(past + np.arange(s), (b, s)).copy())
        if "seqlens_k" in t:
            out["seqlens_k"] = np.full(b, past + s - 1, dtype=_ORT_INT.get(t["seqlens_k"], np.int32))
        if "total_sequence_length" in t:
            out["total_sequence_length"] = np.array(past + s, dtype=_ORT_INT.get(t["total_sequence_length"],
                                                                                np.int32))
        if self.keep_input is not None:
            out[self.keep_input] = np.array(keep, dtype=np.int64)
        return out

    def _check_keep(self, n) -> int:
        """``logits_to_keep`` as an int in [0, 2**63 - 1] (the input is int64), else ``ValueError``."""
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or not 0 <= n <= _INT64_MAX:
            raise ValueError(f"{self.where}: logits_to_keep; expected an int in [0, {_INT64_MAX}] (0 = every "
                             f"position), got {n!r}")
        return int(n)

    def run(self, cache, ids: np.ndarray, *, logits_to_keep: int = 0) -> np.ndarray:
        """Append ``ids`` (``[B, S]``) to every row of ``cache``; returns float32 logits ``[B, K, vocab]``.

        ``logits_to_keep``: ``0`` returns every position (``K = S``), ``N >= 1``
        the last ``min(N, S)`` (transformers' argument of that name). A model
        with the ``logits_to_keep`` input (``onnx_light_ep.convert`` adds it in
        front of the LM head) computes those rows only; for one without, the
        rows are cut from the full output.

        The run is a transaction (``onnx_light_ep.InferenceSession``): if it
        raises, the cache holds what it held before.
        """
        keep = self._check_keep(logits_to_keep)
        feeds = self.feeds(cache, ids, keep)
        outs = dict(zip(self._out_names, self.session.run(None, feeds)))
        logits = np.asarray(outs[self._logits])
        s = feeds["input_ids"].shape[1]
        k = min(keep, s) if keep else s
        if self.keep_input is None and logits.ndim == 3 and logits.shape[1] == s:
            logits = logits[:, s - k:]
        if logits.ndim != 3 or logits.shape[1] != k:
            raise ValueError(f"{self.where}: logits output {self._logits!r} has shape {list(logits.shape)}; "
                             f"expected [B, {k}, vocab] (the last {k} of the {s} input tokens)")
        return logits.astype(np.float32, copy=False)

    def prefill(self, cache, ids: np.ndarray, *, chunk_tokens: Optional[int] = None,
                progress: Optional[Callable[[int, int], None]] = None) -> np.ndarray:
        """Append a long ``ids`` ``[B, S]`` in runs of at most ``chunk_tokens`` (None = one run).

        Returns the logits ``[B, vocab]`` of the last token (each run keeps
        only its last row's logits: ``logits_to_keep=1``); ``progress(done,
        total)`` is called after each run.
        """
        arr = np.asarray(ids)
        if arr.ndim != 2 or arr.shape[1] < 1:
            raise ValueError(f"{self.where}: prompt ids; expected int [B, S >= 1], got shape {list(arr.shape)}")
        if chunk_tokens is not None and (isinstance(chunk_tokens, (bool, np.bool_))
                                         or not isinstance(chunk_tokens, (int, np.integer)) or chunk_tokens < 1):
            raise ValueError(f"{self.where}: chunk_tokens; expected an int >= 1 or None (one run), got "
                             f"{chunk_tokens!r}")
        ids = self.check_ids(cache, arr)   # the whole prompt, before its first chunk runs
        total = ids.shape[1]
        step = total if chunk_tokens is None else int(chunk_tokens)
        logits = None
        for start in range(0, total, step):
            logits = self.run(cache, ids[:, start:start + step], logits_to_keep=1)
            if progress is not None:
                progress(min(start + step, total), total)
        return logits[:, -1]
