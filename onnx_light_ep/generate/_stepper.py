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

from typing import Callable, Dict, Optional

import numpy as np

from .._runner import _ORT_INT, _input_types, check_inputs

__all__ = ["CacheStepper"]


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
                               meta["cache_input"]], where)
        self.session, self.meta, self.where = session, meta, where
        self._types = _input_types(session)
        self._out_names = [o.name for o in session.get_outputs()]
        self._logits = meta.get("logits_output") or self._out_names[0]

    def past_length(self, cache) -> int:
        """``L``: the positions every row of ``cache`` holds (``ValueError`` if the rows differ)."""
        lens = np.asarray(cache.seq_lens)
        if lens.size and not (lens == lens[0]).all():
            raise ValueError(f"{self.where}: the cache's rows hold {lens.tolist()} positions; expected rows of "
                             f"equal length")
        return int(lens[0]) if lens.size else 0

    def feeds(self, cache, ids: np.ndarray) -> Dict[str, np.ndarray]:
        """The inputs of one run of ``ids`` (int ``[B, S]``) after the positions ``cache`` holds."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.ndim != 2 or ids.shape[0] != cache.batch_size or ids.shape[1] < 1:
            raise ValueError(f"{self.where}: input_ids; expected int [{cache.batch_size}, S >= 1] (the cache's "
                             f"batch), got shape {list(ids.shape)}")
        b, s = ids.shape
        past = self.past_length(cache)
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
        return out

    def run(self, cache, ids: np.ndarray) -> np.ndarray:
        """Append ``ids`` (``[B, S]``) to every row of ``cache``; returns float32 logits ``[B, S, vocab]``.

        The run is a transaction (``onnx_light_ep.InferenceSession``): if it
        raises, the cache holds what it held before.
        """
        feeds = self.feeds(cache, ids)
        outs = dict(zip(self._out_names, self.session.run(None, feeds)))
        logits = np.asarray(outs[self._logits])
        s = feeds["input_ids"].shape[1]
        if logits.ndim != 3 or logits.shape[1] != s:
            raise ValueError(f"{self.where}: logits output {self._logits!r} has shape {list(logits.shape)}; "
                             f"expected [B, {s}, vocab] (one row per input token)")
        return logits.astype(np.float32, copy=False)

    def prefill(self, cache, ids: np.ndarray, *, chunk_tokens: Optional[int] = None,
                progress: Optional[Callable[[int, int], None]] = None) -> np.ndarray:
        """Append a long ``ids`` ``[B, S]`` in runs of at most ``chunk_tokens`` (None = one run).

        Returns the logits ``[B, vocab]`` of the last token; ``progress(done,
        total)`` is called after each run.
        """
        ids = np.asarray(ids, dtype=np.int64)
        if ids.ndim != 2 or ids.shape[1] < 1:
            raise ValueError(f"{self.where}: prompt ids; expected int [B, S >= 1], got shape {list(ids.shape)}")
        total = ids.shape[1]
        step = total if not chunk_tokens else max(1, int(chunk_tokens))
        logits = None
        for start in range(0, total, step):
            logits = self.run(cache, ids[:, start:start + step])
            if progress is not None:
                progress(min(start + step, total), total)
        return logits[:, -1]
