"""Feeding a decoder step by step, the way each exporter expects (used by compare and generate).

A :class:`DecodeState` tracks a batch of prompts: the ``attention_mask``
(int, ``[B, total]``, 1 = real token, spanning past + current tokens), the
per-row valid lengths and the padding side recorded by ``convert`` in
``onnx_light.padding_side``:

- ``"left"`` (decomposed / ONNX Attention exports, Hugging Face
  convention): prompts are left-padded; each step appends one column of ones;
  ``position_ids = cumsum(attention_mask) − 1`` (1 at padding, as
  transformers' ``generate``); the last column holds each row's next-token
  logits.
- ``"right"`` (GroupQueryAttention exports, onnxruntime-genai convention):
  prompts are right-padded and the valid tokens stay a prefix: the mask of a
  step has ``valid_b`` ones then zeros, ``seqlens_k = ReduceSum(mask) − 1``
  in the graph; ``position_ids`` (if the model has them) are ``valid_b + s``;
  a row's prefill logits are at column ``valid_b − 1``.

Both the original model (past/present fed back) and the converted one
(``kv_cache``) receive the same ``input_ids``/``attention_mask``/
``position_ids`` (and ``seqlens_k``/``total_sequence_length`` when a GQA
export takes them as inputs); :class:`PastFeeds` handles the original's
loop-carried tensors.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

_ORT_INT = {"tensor(int64)": np.int64, "tensor(int32)": np.int32}
_ORT_FLOAT = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


def _input_types(session) -> Dict[str, str]:
    return {i.name: i.type for i in session.get_inputs()}


class DecodeState:
    """Inputs of a batch of prompts across a prefill and decode steps.

    Args:
        prompts: token ids per row (each non-empty).
        padding_side: ``"left"`` or ``"right"`` (see module docstring).
        pad_token_id: id written at padded positions.
    """

    def __init__(self, prompts: Sequence[Sequence[int]], padding_side: str, pad_token_id: int = 0):
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("DecodeState: prompts; expected one or more non-empty token id lists")
        if padding_side not in ("left", "right"):
            raise ValueError(f"DecodeState: padding_side; expected 'left' or 'right', got {padding_side!r}")
        self.padding_side = padding_side
        self.pad = int(pad_token_id)
        self.batch_size = len(prompts)
        self.lengths = np.array([len(p) for p in prompts], dtype=np.int64)
        s = int(self.lengths.max())
        ids = np.full((self.batch_size, s), self.pad, dtype=np.int64)
        mask = np.zeros((self.batch_size, s), dtype=np.int64)
        for b, p in enumerate(prompts):
            if padding_side == "left":
                ids[b, s - len(p):] = p
                mask[b, s - len(p):] = 1
            else:
                ids[b, :len(p)] = p
                mask[b, :len(p)] = 1
        self.ids, self.mask = ids, mask
        self.valid = self.lengths.copy()
        self.step = 0

    @property
    def total_length(self) -> int:
        """Columns of ``attention_mask`` (past + current tokens, padding included)."""
        return int(self.mask.shape[1])

    def position_ids(self) -> np.ndarray:
        """int64 ``[B, S]`` positions of the current tokens."""
        s = self.ids.shape[1]
        if self.padding_side == "left":
            pos = np.cumsum(self.mask, axis=1) - 1
            pos = np.where(self.mask == 0, 1, pos)
            return pos[:, -s:].astype(np.int64)
        start = self.valid - 1 if self.step else np.zeros(self.batch_size, np.int64)
        return (start[:, None] + np.arange(s)[None, :]).astype(np.int64)

    def feeds(self, session) -> Dict[str, np.ndarray]:
        """``input_ids``, ``attention_mask`` and ``position_ids`` for ``session`` (dtypes from its inputs)."""
        types = _input_types(session)
        out = {}
        for name, value in (("input_ids", self.ids), ("attention_mask", self.mask)):
            if name in types:
                out[name] = value.astype(_ORT_INT.get(types[name], np.int64))
        if "position_ids" in types:
            out["position_ids"] = self.position_ids().astype(_ORT_INT.get(types["position_ids"], np.int64))
        # GroupQueryAttention inputs some exports take directly instead of computing from the mask
        if "seqlens_k" in types:
            out["seqlens_k"] = (self.mask.sum(axis=1) - 1).astype(_ORT_INT.get(types["seqlens_k"], np.int32))
        if "total_sequence_length" in types:
            out["total_sequence_length"] = np.array(self.total_length,
                                                    dtype=_ORT_INT.get(types["total_sequence_length"], np.int32))
        return out

    def last_logits(self, logits: np.ndarray) -> np.ndarray:
        """``[B, vocab]`` logits of each row's newest real token."""
        if self.padding_side == "right" and self.step == 0:
            return logits[np.arange(self.batch_size), self.valid - 1]
        return logits[:, -1]

    def valid_positions(self) -> List[Tuple[int, np.ndarray]]:
        """Per row, the columns of the current step's logits that belong to real tokens."""
        s = self.ids.shape[1]
        cur = self.mask[:, -s:] if self.padding_side == "left" else None
        rows = []
        for b in range(self.batch_size):
            if self.padding_side == "left":
                rows.append((b, np.nonzero(cur[b])[0]))
            elif self.step == 0:
                rows.append((b, np.arange(int(self.valid[b]))))
            else:
                rows.append((b, np.arange(s)))
        return rows

    def advance(self, next_tokens: Sequence[int]) -> None:
        """Append one token per row; the next :meth:`feeds` is a decode step (S = 1)."""
        t = np.asarray(next_tokens, dtype=np.int64).reshape(self.batch_size, 1)
        self.ids = t
        self.valid = self.valid + 1
        if self.padding_side == "left":
            self.mask = np.concatenate([self.mask, np.ones((self.batch_size, 1), np.int64)], axis=1)
        else:
            width = self.mask.shape[1] + 1
            self.mask = (np.arange(width)[None, :] < self.valid[:, None]).astype(np.int64)
        self.step += 1


class PastFeeds:
    """The original model's loop-carried tensors: empty pasts first, then the presents it returned.

    Args:
        session: the original model's ``onnxruntime.InferenceSession``.
        pairs: ``(past_input, present_output)`` names (from the converted
            model's ``onnx_light.layers`` and ``tensor_pairs`` metadata).
        batch_size: rows.
        head_dim, v_head_dim: used when a past input's last dim is symbolic.
        capacity: past input name -> positions of a fixed-size buffer (an
            original with window-sized buffers, ``past_capacity`` in the
            layer metadata): the first past is zeros of that length instead
            of empty, and the present comes back at the same size.
    """

    def __init__(self, session, pairs: Sequence[Tuple[str, str]], batch_size: int, head_dim: int,
                 v_head_dim: int, capacity: Optional[Dict[str, int]] = None):
        # a stacked past (key and value in one [2, B, H, P, D] tensor) is named by both of its layer's pairs
        self.pairs = list(dict.fromkeys((p, q) for p, q in pairs if p and q))
        info = {i.name: i for i in session.get_inputs()}
        self.values: Dict[str, np.ndarray] = {}
        for past, _ in self.pairs:
            if past not in info:
                raise ValueError(f"compare: the original model has no input {past!r} named by the converted "
                                 f"model's metadata; expected the model the conversion started from")
            # transformers' exporter names static dims symbolically ('2', '16'): read those as ints
            shape = [int(x) if isinstance(x, str) and x.isdigit() else x for x in info[past].shape]
            stacked = len(shape) == 5 and shape[0] == 2
            bnsh = shape[1:] if stacked else shape
            if len(bnsh) != 4 or not isinstance(bnsh[1], int):
                raise ValueError(f"compare: past input {past!r} has shape {shape}; expected BNSH with static heads "
                                 f"(or [2, B, H, P, D], key and value stacked)")
            d = bnsh[3] if isinstance(bnsh[3], int) else (v_head_dim if "value" in past else head_dim)
            cap = int((capacity or {}).get(past, 0))
            self.values[past] = np.zeros(((2,) if stacked else ()) + (batch_size, bnsh[1], cap, d),
                                         dtype=_ORT_FLOAT.get(info[past].type, np.float32))

    def update(self, outputs: Dict[str, np.ndarray], pairs: Optional[Sequence[Tuple[str, str]]] = None) -> int:
        """Take the presents from a run's outputs; returns their bytes (what plain ORT copied out).

        ``pairs``: ``(past, present)`` names for this run instead of :attr:`pairs` (the prefill
        graph of a pair names its presents differently, :func:`prefill_pairs`).
        """
        copied = 0
        for past, present in (self.pairs if pairs is None else pairs):
            self.values[past] = outputs[present]
            copied += outputs[present].nbytes
        return copied


def past_capacities(meta: dict) -> Dict[str, int]:
    """Past input name -> fixed buffer positions, for layers whose original keeps window-sized buffers."""
    out = {}
    for x in meta.get("layers", []):
        if x.get("past_capacity"):
            for name in (x.get("past_key"), x.get("past_value")):
                if name:
                    out[name] = int(x["past_capacity"])
    return out


def layer_pairs(meta: dict) -> List[Tuple[str, str]]:
    """(past, present) name pairs the conversion removed, then those still in the converted model."""
    pairs = []
    for x in meta.get("layers", []):
        for a, b in (("past_key", "present_key"), ("past_value", "present_value")):
            if x.get(a) and x.get(b):
                pairs.append((x[a], x[b]))
    return pairs


def prefill_pairs(prefill_meta: dict, decode_meta: dict) -> List[Tuple[str, str]]:
    """(decode past, prefill present) names, layer by layer: the prefill graph of a pair starts the
    cache, so its presents are the decode graph's first pasts (layer ``l`` of one is layer ``l`` of
    the other; both converted graphs record their original names in ``onnx_light.layers``)."""
    pairs = []
    for p, d in zip(prefill_meta.get("layers", []), decode_meta.get("layers", [])):
        for a, b in (("past_key", "present_key"), ("past_value", "present_value")):
            if d.get(a) and p.get(b):
                pairs.append((d[a], p[b]))
    return pairs


def check_inputs(session, known: Sequence[str], where: str) -> None:
    """Raise ``ValueError`` naming any input of ``session`` that the loop does not know how to feed."""
    unknown = [i.name for i in session.get_inputs() if i.name not in known]
    if unknown:
        raise ValueError(f"{where}: the model has inputs {unknown} that this loop does not know how to feed; "
                         f"expected only {sorted(known)}")


def pad_token(meta_pad: Optional[int], eos: Sequence[int]) -> int:
    if meta_pad is not None:
        return int(meta_pad)
    return int(min(eos)) if eos else 0
