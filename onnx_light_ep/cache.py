"""``KVCache``: the persistent key/value cache shared by Python and ORT.

A thin wrapper over the native module ``onnx_light_ep._core``: the arena,
validation and locking live in C++ (``libonnx_light.so``, the same library ORT
loads), this module only converts Python arguments (ints, sequences, dtype
names) into what ``_core`` takes and back.
"""

from __future__ import annotations

import operator
import sys
from typing import Any, Dict, Iterable, Optional, Sequence, Tuple, Union

import ml_dtypes
import numpy as np

from . import _core

__all__ = ["KVCache"]

_DTYPE_NAMES = ("float32", "float16", "bfloat16")
_NP_DTYPES = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}


def _dtype_name(dtype: Any, where: str = "KVCache", arg: str = "dtype") -> str:
    """Map a dtype name or numpy dtype to "float32" / "float16" / "bfloat16"."""
    if isinstance(dtype, str) and dtype in _DTYPE_NAMES:
        return dtype
    try:
        np_dtype = np.dtype(dtype)
    except TypeError:
        np_dtype = None
    for name, candidate in _NP_DTYPES.items():
        if np_dtype == candidate:
            return name
    raise ValueError(
        f"{where}: {arg}; expected one of 'float32', 'float16', 'bfloat16' "
        f"(or numpy.float32, numpy.float16, ml_dtypes.bfloat16), got {dtype!r}"
    )


def _as_int(value: Any, where: str, arg: str) -> int:
    """An exact Python int (rejects floats, strings and bools)."""
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{where}: {arg}; expected an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{where}: {arg}; expected an integer, got {value!r}") from None


def _as_int64_vector(value: Any, where: str, arg: str) -> np.ndarray:
    """A C-contiguous 1-D int64 array from an int sequence/array (no float truncation)."""
    arr = np.asarray(value)
    if arr.size == 0:
        arr = arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise ValueError(
            f"{where}: {arg}; expected integers, got an array of {arr.dtype}"
        )
    if arr.ndim != 1:
        raise ValueError(
            f"{where}: {arg}; expected a 1-D sequence of integers, got shape {arr.shape}"
        )
    if arr.dtype.kind == "u" and arr.size and arr.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{where}: {arg}; expected values that fit int64, got {arr.max()}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _to_core_array(arr: np.ndarray) -> np.ndarray:
    """C-contiguous array in the form ``_core`` takes (bfloat16 as uint16 bits)."""
    arr = np.ascontiguousarray(arr)
    if arr.dtype == _NP_DTYPES["bfloat16"]:
        arr = arr.view(np.uint16)
    return arr


class KVCache:
    """Persistent K/V cache for one request group of one decoder model.

    One cache holds ``num_layers`` attention layers for ``batch_size``
    sequences. Storage is contiguous per (layer, sequence, kv head):
    ``max_sequence_length`` rows of address space are reserved up front and
    committed as rows are written. Feed :attr:`handle` to the model's cache
    input; the ``ai.onnx_light`` ops append to and read from the cache in
    place, so a decode step costs time proportional to the new tokens only.

    Args:
        num_layers: int > 0, attention layers of the model.
        batch_size: int > 0, sequences in the request group (``B``).
        kv_num_heads: int > 0, key/value heads per layer (``Hkv``).
        head_dim: int > 0, key head size (``D``), in elements.
        v_head_dim: int > 0, value head size (``Dv``); ``None`` means ``head_dim``.
        dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"``, or the numpy
            dtypes ``numpy.float32``, ``numpy.float16``, ``ml_dtypes.bfloat16``.
            Must equal the model's attention dtype ``T``.
        max_sequence_length: int > 0, capacity in tokens per sequence.
        memory_limit_bytes: int >= 1, cap on committed K/V bytes of this cache;
            ``None`` means no limit (0 is refused: it would be a cache that can
            hold nothing).

    Errors:
        ``ValueError`` for a bad argument (the text names it and the expected
        value; nothing is changed), for a limit reached
        (``max_sequence_length``, ``memory_limit_bytes``; the cache is left as
        it was) and for any use after :meth:`close`.

    Thread safety:
        every method takes the cache's own lock (in C++), so concurrent calls on
        one cache are serialized, and so are calls racing with ORT runs that use
        the cache. Two runs appending to the same cache at the same time are
        rejected ("is being appended by another run"). :meth:`close` must not
        race with other use of the same object.

    Lifetime:
        the memory is released by :meth:`close`, by leaving a ``with`` block,
        or when the object is garbage collected. A closed handle is never
        reused, so a stale handle fed to a model fails the run.
    """

    __slots__ = ("_h", "_info", "__weakref__")

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        kv_num_heads: int,
        head_dim: int,
        *,
        v_head_dim: Optional[int] = None,
        dtype: Any = "float32",
        max_sequence_length: int,
        memory_limit_bytes: Optional[int] = None,
    ) -> None:
        self._h: Optional[int] = None
        self._info: Dict[str, Any] = {}
        where = "KVCache"
        num_layers = _as_int(num_layers, where, "num_layers")
        batch_size = _as_int(batch_size, where, "batch_size")
        kv_num_heads = _as_int(kv_num_heads, where, "kv_num_heads")
        head_dim = _as_int(head_dim, where, "head_dim")
        v_head_dim = head_dim if v_head_dim is None else _as_int(v_head_dim, where, "v_head_dim")
        dtype_name = _dtype_name(dtype, where, "dtype")
        max_sequence_length = _as_int(max_sequence_length, where, "max_sequence_length")
        if memory_limit_bytes is None:
            memory_limit_bytes = 0  # _core: 0 = no limit
        else:
            memory_limit_bytes = _as_int(memory_limit_bytes, where, "memory_limit_bytes")
            if memory_limit_bytes < 1:
                raise ValueError(
                    f"{where}: memory_limit_bytes must be >= 1 or None (no limit), got {memory_limit_bytes}"
                )
        h = _core.create(
            num_layers,
            batch_size,
            kv_num_heads,
            head_dim,
            v_head_dim,
            dtype_name,
            max_sequence_length,
            memory_limit_bytes,
        )
        self._adopt(h)

    # -- construction helpers ---------------------------------------------

    def _adopt(self, h: int) -> None:
        """Take ownership of native handle ``h`` and cache its geometry."""
        self._h = int(h)
        try:
            self._info = dict(_core.info(self._h))
        except BaseException:
            _core.release(self._h)
            self._h = None
            raise

    @classmethod
    def _from_handle(cls, h: int) -> "KVCache":
        obj = cls.__new__(cls)
        obj._h = None
        obj._info = {}
        obj._adopt(h)
        return obj

    @classmethod
    def from_past(
        cls,
        keys: Sequence[np.ndarray],
        values: Sequence[np.ndarray],
        *,
        max_sequence_length: Optional[int] = None,
        memory_limit_bytes: Optional[int] = None,
    ) -> "KVCache":
        """Build a cache holding existing per-layer past tensors.

        Args:
            keys: sequence indexed by layer of BNSH arrays ``[B, Hkv, L, D]``.
            values: sequence indexed by layer of BNSH arrays ``[B, Hkv, L, Dv]``.
                All arrays share one dtype (float32, float16 or
                ``ml_dtypes.bfloat16``); every layer has the same shapes.
            max_sequence_length: capacity in tokens; the cache gets
                ``max(L, max_sequence_length)`` (``None``: ``L``).
            memory_limit_bytes: as in the constructor.

        Returns:
            A new ``KVCache`` with ``num_layers = len(keys)``, geometry taken
            from the arrays, and ``seq_lens == [L] * B``. The arrays are
            copied; the caller keeps ownership of them.

        Raises:
            ValueError: ``keys``/``values`` are not equal-length non-empty
                sequences of 4-D arrays with consistent shapes and one
                supported dtype (the text names the argument), or a limit is
                exceeded.
        """
        where = "KVCache.from_past"
        keys = _layer_list(keys, where, "keys")
        values = _layer_list(values, where, "values")
        if len(keys) != len(values):
            raise ValueError(
                f"{where}: values; expected one array per layer like keys "
                f"({len(keys)}), got {len(values)}"
            )
        for arg, arrays in (("keys", keys), ("values", values)):
            first = arrays[0]
            for i, a in enumerate(arrays):
                if a.ndim != 4:
                    raise ValueError(
                        f"{where}: {arg}[{i}]; expected a 4-D BNSH array, got shape {a.shape}"
                    )
                if a.shape != first.shape:
                    raise ValueError(
                        f"{where}: {arg}[{i}]; expected shape {first.shape} like {arg}[0], got {a.shape}"
                    )
                if a.dtype != keys[0].dtype:
                    raise ValueError(
                        f"{where}: {arg}[{i}]; expected dtype {keys[0].dtype} like keys[0], got {a.dtype}"
                    )
        dtype_name = _dtype_name(keys[0].dtype, where, "keys dtype")
        batch_size, kv_num_heads, length, head_dim = keys[0].shape
        vb, vh, vl, v_head_dim = values[0].shape
        if (vb, vh, vl) != (batch_size, kv_num_heads, length):
            raise ValueError(
                f"{where}: values; expected [B, Hkv, L] = {[batch_size, kv_num_heads, length]} "
                f"like keys, got {[vb, vh, vl]}"
            )
        capacity = length
        if max_sequence_length is not None:
            capacity = max(length, _as_int(max_sequence_length, where, "max_sequence_length"))
        cache = cls(
            len(keys),
            batch_size,
            kv_num_heads,
            head_dim,
            v_head_dim=v_head_dim,
            dtype=dtype_name,
            max_sequence_length=capacity,
            memory_limit_bytes=memory_limit_bytes,
        )
        try:
            _core.import_past(
                cache._live(where),
                [_to_core_array(a) for a in keys],
                [_to_core_array(a) for a in values],
            )
        except BaseException:
            cache.close()
            raise
        return cache

    @classmethod
    def for_model(
        cls,
        model: Any,
        batch_size: int,
        max_sequence_length: Optional[int] = None,
        *,
        memory_limit_bytes: Optional[int] = None,
    ) -> "KVCache":
        """A cache sized for a model written by ``onnx_light_ep.convert``.

        Reads ``num_layers``, ``kv_num_heads``, ``head_dim``, ``v_head_dim``
        and ``dtype`` from the model's ``onnx_light.*`` metadata
        (``onnx_light_ep.rewrite._metadata``).

        Args:
            model: path of the converted model (weights are not loaded), an
                ``onnx.ModelProto``, or an ``onnxruntime.InferenceSession`` of it.
            batch_size: int > 0, sequences per run.
            max_sequence_length: capacity in tokens; None uses the model's
                ``onnx_light.max_position`` (rotary table length) when recorded.
            memory_limit_bytes: as in the constructor.

        Raises:
            ValueError: not a converted model, or ``max_sequence_length`` is None
                and the model records no ``max_position``.
        """
        from .rewrite._metadata import read_metadata

        meta = read_metadata(model)
        if max_sequence_length is None:
            max_sequence_length = meta.get("max_position")
            if max_sequence_length is None:
                raise ValueError(
                    "KVCache.for_model: max_sequence_length; expected an int (the model records no "
                    "onnx_light.max_position), got None"
                )
        return cls(
            meta["num_layers"],
            batch_size,
            meta["kv_num_heads"],
            meta["head_dim"],
            v_head_dim=meta["v_head_dim"],
            dtype=meta["dtype"],
            max_sequence_length=max_sequence_length,
            memory_limit_bytes=memory_limit_bytes,
        )

    # -- handle and geometry ----------------------------------------------

    def _live(self, where: str) -> int:
        h = self._h
        if h is None:
            raise ValueError(f"{where}: the cache is closed; expected an open KVCache")
        return h

    @property
    def handle(self) -> np.ndarray:
        """int64 array of shape ``[1]``: the value to feed as the model's ``kv_cache`` input.

        An opaque id, never a pointer; not reused after :meth:`close`.
        A new array each time. Raises ``ValueError`` once closed.
        """
        return np.array([self._live("KVCache.handle")], dtype=np.int64)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run."""
        return self._h is None

    @property
    def num_layers(self) -> int:
        """Attention layers held (int)."""
        return int(self._info["num_layers"])

    @property
    def batch_size(self) -> int:
        """Sequences in the request group, ``B`` (int)."""
        return int(self._info["batch_size"])

    @property
    def kv_num_heads(self) -> int:
        """Key/value heads per layer, ``Hkv`` (int)."""
        return int(self._info["kv_num_heads"])

    @property
    def head_dim(self) -> int:
        """Key head size ``D``, in elements (int)."""
        return int(self._info["head_dim"])

    @property
    def v_head_dim(self) -> int:
        """Value head size ``Dv``, in elements (int)."""
        return int(self._info["v_head_dim"])

    @property
    def dtype(self) -> str:
        """Element type: ``"float32"``, ``"float16"`` or ``"bfloat16"``."""
        return str(self._info["dtype"])

    @property
    def max_sequence_length(self) -> int:
        """Capacity in tokens per sequence (int)."""
        return int(self._info["max_sequence_length"])

    @property
    def memory_limit_bytes(self) -> Optional[int]:
        """Cap on committed K/V bytes, or ``None`` for no limit."""
        limit = int(self._info["memory_limit_bytes"])
        return None if limit == 0 else limit

    @property
    def seq_lens(self) -> np.ndarray:
        """int64 array ``[batch_size]``: valid (committed) tokens per sequence.

        A snapshot (a new array); raises ``ValueError`` once closed.
        """
        return np.asarray(_core.seq_lens(self._live("KVCache.seq_lens")), dtype=np.int64)

    # -- operations -------------------------------------------------------

    def stats(self) -> Dict[str, int]:
        """Memory and traffic counters, a dict of int.

        Keys: ``committed_bytes`` (pages of K/V storage touched, page-rounded
        per (layer, sequence, head) row block), ``live_bytes`` (bytes of valid
        rows), ``reserved_bytes`` (address space), ``bytes_appended``
        (cumulative bytes of new K/V rows written by runs and imports),
        ``bytes_copied`` (cumulative bytes of cached content moved by fork,
        reorder or export; a decode step adds 0), ``num_appends`` (committed
        steps).
        """
        return dict(_core.stats(self._live("KVCache.stats")))

    def reset(self) -> None:
        """Set every sequence length to 0 and release the storage (committed bytes drop to 0)."""
        _core.reset(self._live("KVCache.reset"))

    def truncate(self, lengths: Union[int, Sequence[int], np.ndarray]) -> None:
        """Shorten sequences (speculative-decoding rollback). O(1) per sequence, no copy.

        Args:
            lengths: int (applied to every sequence) or integers ``[batch_size]``,
                each ``0 <= lengths[b] <= seq_lens[b]``.

        Raises:
            ValueError: wrong length, non-integers or out of range; nothing changes.
        """
        h = self._live("KVCache.truncate")
        if np.ndim(lengths) == 0:
            n = _as_int(lengths, "KVCache.truncate", "lengths")
            arr = np.full(self.batch_size, n, dtype=np.int64)
        else:
            arr = _as_int64_vector(lengths, "KVCache.truncate", "lengths")
        _core.truncate(h, arr)

    def fork(self) -> "KVCache":
        """A new, independent cache with a copy of the valid rows and the same geometry.

        Cost: copies ``live_bytes`` (counted in ``bytes_copied``).
        Raises ``ValueError`` if the copy would exceed ``memory_limit_bytes``.
        """
        return KVCache._from_handle(_core.fork(self._live("KVCache.fork")))

    def reorder(self, indices: Union[Sequence[int], np.ndarray]) -> None:
        """Beam reorder: new sequence ``i`` becomes old sequence ``indices[i]``.

        Args:
            indices: integers ``[batch_size]``, each in ``[0, batch_size)``;
                duplicates allowed.

        Raises:
            ValueError: wrong length, non-integers or out of range; nothing changes.
        """
        h = self._live("KVCache.reorder")
        _core.reorder(h, _as_int64_vector(indices, "KVCache.reorder", "indices"))

    def export(self, layer: int) -> Tuple[np.ndarray, np.ndarray]:
        """Copy out one layer as ``(key, value)`` BNSH arrays.

        Args:
            layer: int in ``[0, num_layers)``.

        Returns:
            ``key`` ``[B, Hkv, L, D]`` and ``value`` ``[B, Hkv, L, Dv]`` of the
            cache dtype (bfloat16 as ``ml_dtypes.bfloat16``), new arrays owned
            by the caller, ``L = max(seq_lens)``; rows ``>= seq_lens[b]`` of a
            shorter sequence are zeros.

        Raises:
            ValueError: ``layer`` out of range.
        """
        h = self._live("KVCache.export")
        key, value = _core.export(h, _as_int(layer, "KVCache.export", "layer"))
        key, value = np.asarray(key), np.asarray(value)
        if self.dtype == "bfloat16":
            key = key.view(ml_dtypes.bfloat16)
            value = value.view(ml_dtypes.bfloat16)
        return key, value

    # -- lifetime ---------------------------------------------------------

    def close(self) -> None:
        """Release the handle and its memory. Idempotent; later use raises ``ValueError``."""
        h, self._h = self._h, None
        if h is not None:
            try:
                _core.release(h)
            except ValueError:
                pass  # already gone: the state close() wants

    def __enter__(self) -> "KVCache":
        self._live("KVCache.__enter__")
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_h", None) is None or sys is None or sys.is_finalizing():
            return
        try:
            self.close()
        except Exception:
            pass

    def __reduce__(self):
        raise TypeError("KVCache cannot be pickled or copied: it owns a process-local handle; use fork()")

    def __repr__(self) -> str:
        if self._h is None:
            return "KVCache(closed)"
        fields = [f"handle={self._h}"]
        for key in ("num_layers", "batch_size", "kv_num_heads", "head_dim", "v_head_dim"):
            fields.append(f"{key}={self._info.get(key)}")
        fields.append(f"dtype={self._info.get('dtype')!r}")
        fields.append(f"max_sequence_length={self._info.get('max_sequence_length')}")
        try:
            fields.append(f"seq_lens={self.seq_lens.tolist()}")
        except Exception:
            pass
        return f"KVCache({', '.join(fields)})"


def _layer_list(arrays: Any, where: str, arg: str) -> list:
    """A non-empty list of numpy arrays from a per-layer sequence."""
    if isinstance(arrays, (str, bytes)) or not isinstance(arrays, Iterable):
        raise ValueError(f"{where}: {arg}; expected a list of arrays (one per layer), got {type(arrays).__name__}")
    result = [np.asarray(a) for a in arrays]
    if not result:
        raise ValueError(f"{where}: {arg}; expected at least one layer, got an empty list")
    return result
