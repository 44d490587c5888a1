"""Argument conversion shared by the arena wrappers (cache.py, pool.py)."""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

__all__ = ["as_int", "as_int64_vector"]


def as_int(value: Any, where: str, arg: str) -> int:
    """An exact Python int (rejects floats, strings and bools)."""
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{where}: {arg}; expected an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{where}: {arg}; expected an integer, got {value!r}") from None


def as_int64_vector(value: Any, where: str, arg: str) -> np.ndarray:
    """A C-contiguous 1-D int64 array from an int sequence/array (no float truncation)."""
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
