"""Argument conversion shared by the arena wrappers (cache.py, pool.py)."""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

__all__ = ["as_int", "as_int64_vector"]


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def as_int(value: Any, where: str, arg: str) -> int:
    """An exact Python int that fits int64 (rejects floats, strings, bools and larger ints)."""
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{where}: {arg}; expected an integer, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise ValueError(f"{where}: {arg}; expected an integer, got {value!r}") from None
    if not INT64_MIN <= v <= INT64_MAX:
        raise ValueError(f"{where}: {arg}; expected an integer that fits int64, got {v}")
    return v


def as_int64_vector(value: Any, where: str, arg: str) -> np.ndarray:
    """A C-contiguous 1-D int64 array from an int sequence/array (no float truncation)."""
    if not isinstance(value, np.ndarray):
        try:
            items = list(value)
        except TypeError:
            raise ValueError(f"{where}: {arg}; expected a 1-D sequence of integers, got {value!r}") from None
        if all(isinstance(x, int) and not isinstance(x, bool) for x in items):
            for x in items:
                as_int(x, where, arg)  # python ints beyond int64 get a clear error, not an overflow
    arr = np.asarray(value)
    if arr.size == 0:
        arr = arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{where}: {arg}; expected integers, got an array of {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{where}: {arg}; expected a 1-D sequence of integers, got shape {arr.shape}")
    if arr.dtype.kind == "u" and arr.size and arr.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{where}: {arg}; expected values that fit int64, got {arr.max()}")
    return np.ascontiguousarray(arr, dtype=np.int64)
