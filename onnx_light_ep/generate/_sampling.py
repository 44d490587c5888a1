"""Choosing the next token from logits: greedy, temperature, top-k, top-p."""

from __future__ import annotations

from typing import Optional

import numpy as np

__all__ = ["sample_next"]


def sample_next(logits: np.ndarray, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                rng: Optional[np.random.Generator] = None) -> np.ndarray:
    """Next token per row from ``logits`` ``[B, vocab]``.

    ``temperature <= 0``: argmax. Otherwise softmax(logits / temperature),
    keeping the ``top_k`` largest (0 = all) and then the smallest set whose
    probability reaches ``top_p`` (the token that crosses it included).
    Returns int64 ``[B]``.
    """
    logits = np.asarray(logits, dtype=np.float64)
    if temperature <= 0:
        return logits.argmax(-1).astype(np.int64)
    if rng is None:
        rng = np.random.default_rng()
    out = np.empty(logits.shape[0], dtype=np.int64)
    for b, row in enumerate(logits):
        x = row / temperature
        if 0 < top_k < x.size:
            kth = np.partition(x, -top_k)[-top_k]
            x = np.where(x < kth, -np.inf, x)
        p = np.exp(x - x.max())
        p /= p.sum()
        if top_p < 1.0:
            order = np.argsort(-p)
            cum = np.cumsum(p[order])
            keep = order[: int(np.searchsorted(cum, top_p) + 1)]
            q = np.zeros_like(p)
            q[keep] = p[keep]
            p = q / q.sum()
        out[b] = rng.choice(p.size, p=p)
    return out
