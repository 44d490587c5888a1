"""``KVCache``: the persistent key/value cache shared by Python and ORT.

A thin wrapper over the native module ``onnx_light_ep._core``: the arena,
validation and locking live in C++ (``libonnx_light.so``, the same library ORT
loads), this module only converts Python arguments (ints, sequences, dtype
names) into what ``_core`` takes and back.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import ml_dtypes
import numpy as np

from . import _core
from ._args import as_int, as_int64_vector
from ._handle import NativeHandle
from .pool import KVCheckpoint, KVPool

__all__ = ["KVCache", "DEFAULT_PAGE_BYTES", "default_page_tokens"]

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


def _to_core_array(arr: np.ndarray) -> np.ndarray:
    """C-contiguous array in the form ``_core`` takes (bfloat16 as uint16 bits)."""
    arr = np.ascontiguousarray(arr)
    if arr.dtype == _NP_DTYPES["bfloat16"]:
        arr = arr.view(np.uint16)
    return arr


DEFAULT_PAGE_BYTES = 128 << 10
"""Bytes of K and V a default page holds at least (see :func:`default_page_tokens`)."""


def default_page_tokens(head_dim: int, dtype: Any = "float16", v_head_dim: Optional[int] = None) -> int:
    """Positions per page a cache gets when neither it nor its pool names ``page_tokens``.

    The smallest power of two in [128, 1024] whose page (K and V rows of one
    layer, sequence and kv head) holds at least ``DEFAULT_PAGE_BYTES`` (128 KiB):
    256 for float16/bfloat16 with head_dim 128, 128 for float32, 512 for
    float16 with head_dim 64. Chosen by measurement: a page read from a new
    address costs DRAM time while the hardware prefetcher retrains, 1.12-1.14x
    a contiguous read at 64 KiB pages and 1.00-1.03x at 128 KiB on Zen 4
    (``build/bench_scattered_read``; BENCHMARKS.md, "paged vs one block"; another
    Zen 4 host: 1.06-1.08x at 128 KiB, 1.00-1.02x at 256 KiB). A prefill's pages of
    one kv head are consecutive in memory (docs/API.md), so only the pages a decode
    adds one at a time pay it.

    Args:
        head_dim: int in [1, 4096], key head size in elements.
        dtype: the cache dtype, as :class:`KVCache` takes it.
        v_head_dim: value head size; None means ``head_dim``.

    Raises:
        ValueError: a size out of range or an unknown dtype.
    """
    where = "default_page_tokens"
    head_dim = as_int(head_dim, where, "head_dim")
    v_head_dim = head_dim if v_head_dim is None else as_int(v_head_dim, where, "v_head_dim")
    return int(_core.default_page_tokens(head_dim, v_head_dim, _dtype_name(dtype, where, "dtype")))


class KVCache(NativeHandle):
    """Persistent K/V cache for one request group of one decoder model.

    One cache holds ``num_layers`` attention layers for ``batch_size``
    sequences, in pages of ``page_tokens`` positions (one page per layer,
    sequence, kv head and block of positions) taken from a :class:`KVPool`.
    Feed :attr:`handle` to the model's cache input; the ``ai.onnx_light`` ops
    append to and read from the pages in place, so a decode step costs time
    proportional to the new tokens only. Pages are reference counted:
    :meth:`fork`, :meth:`reorder` and :meth:`checkpoint` share them instead of
    copying rows, and the first write into a shared page copies that one page
    (copy-on-write, counted in ``stats()["bytes_copied"]``).

    Args:
        num_layers: int > 0, attention layers of the model.
        batch_size: int > 0, sequences in the request group (``B``).
        kv_num_heads: int > 0, key/value heads per layer (``Hkv``).
        head_dim: int > 0, key head size (``D``), in elements.
        v_head_dim: int > 0, value head size (``Dv``); ``None`` means ``head_dim``.
        dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"``, or the numpy
            dtypes ``numpy.float32``, ``numpy.float16``, ``ml_dtypes.bfloat16``.
            Must equal the model's attention dtype ``T``.
        max_sequence_length: int > 0, the most tokens a sequence may hold (a
            limit: nothing is reserved for it).
        memory_limit_bytes: int >= 1 or None: quota on the page bytes this
            cache's tables hold (``stats()["committed_bytes"]``).
        pool: a :class:`KVPool` to take pages from and count them against, or
            None for a private pool (released with the cache; of the slabs its
            truncates empty it keeps at most one page per layer, sequence and
            kv head mapped for the next steps, see ``KVPool(keep_free_bytes)``).
        page_tokens: positions per page, a multiple of 32 in [32, 65536]; None =
            the pool's ``page_tokens``, else :func:`default_page_tokens` for this
            head_dim and dtype.
        sliding_window: None (keep every position), an int W (every layer), or
            a list with one entry per layer (None or 0 = keep everything on that
            layer): positions older than ``seq_len - W - rollback_tokens`` are
            released page by page when a step commits, so such a layer holds at
            most ``W + rollback_tokens`` plus two pages of rows per (sequence,
            head). Its attention nodes must use ``local_window_size <= W``.
            Positions stay absolute.
        rollback_tokens: int >= 0, how many positions beyond the window a
            sliding-window layer keeps so :meth:`truncate` can go back that far.
        kv_quant: None (every page in ``dtype``), ``"int8"`` or ``"int4"``: pages
            whose positions all lie before ``seq_len - recent_tokens`` (and at or
            after ``sink_tokens``) are quantized once, when a step commits, with
            scales computed from the page's own rows (no calibration): int8
            symmetric, K per (page, channel), V per (page, token); int4
            asymmetric (a minimum and a step), K per (page, channel), V per
            (page, token); int4 needs ``head_dim`` and ``v_head_dim`` multiples of
            32 (docs/API.md, "Quantized pages"). Attention reads the codes inside
            its tile loads (16-bit fixed point); :meth:`export` and
            ``CacheExport`` return dequantized values. Measured (BENCHMARKS.md
            "Quantized KV pages"): int8 on SmolLM2-135M perplexity +0.014%, greedy
            tokens identical (Gemma-3-270M: +0.017%, 86% identical, short of the
            95% aim); int4 +0.26% / +0.54%, mean KL divergence 3.6e-3 / 4.0e-3.
            Speed: decode is only 0.73-0.82x the fp16 cache's time for MHA and
            about equal for GQA on Zen 4, short of the aims (int8 1.7x, int4 2.5x
            faster: the fixed-point kernel is compute-bound there); memory
            0.5x (int8) / 0.27x (int4) of fp16 pages.
        recent_tokens: int >= 0, newest positions kept in ``dtype`` (default
            128; the partly filled last page is always native).
        sink_tokens: int >= 0, first positions kept in ``dtype`` (attention
            sinks; default 4), rounded up to whole pages.

    Errors:
        ``ValueError`` for a bad argument (the text names it and the expected
        value; nothing is changed) and for any use after :meth:`close`;
        ``onnx_light_ep.KVCacheMemoryError`` when ``memory_limit_bytes`` of the
        cache or its pool would be exceeded (nothing changes);
        ``onnx_light_ep.KVCacheBusyError`` when a run on another thread is
        appending to the cache at that moment.

    Thread safety:
        every method takes the cache's own lock (in C++), so concurrent calls on
        one cache are serialized, and so are calls racing with ORT runs that use
        the cache. :meth:`close` must not race with other use of the same object.

    Lifetime:
        the pages are released by :meth:`close`, by leaving a ``with`` block,
        or when the object is garbage collected. A closed handle is never
        reused, so a stale handle fed to a model fails the run.
    """

    __slots__ = ("_h", "_info", "_pool", "__weakref__")
    _kind = "KVCache"
    _copy_hint = "; use fork()"

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
        pool: Optional[KVPool] = None,
        page_tokens: Optional[int] = None,
        sliding_window: Union[None, int, Sequence[Optional[int]]] = None,
        rollback_tokens: int = 0,
        kv_quant: Optional[str] = None,
        recent_tokens: int = 128,
        sink_tokens: int = 4,
    ) -> None:
        self._h: Optional[int] = None
        self._info: Dict[str, Any] = {}
        self._pool: Optional[KVPool] = None
        where = "KVCache"
        num_layers = as_int(num_layers, where, "num_layers")
        batch_size = as_int(batch_size, where, "batch_size")
        kv_num_heads = as_int(kv_num_heads, where, "kv_num_heads")
        head_dim = as_int(head_dim, where, "head_dim")
        v_head_dim = head_dim if v_head_dim is None else as_int(v_head_dim, where, "v_head_dim")
        dtype_name = _dtype_name(dtype, where, "dtype")
        max_sequence_length = as_int(max_sequence_length, where, "max_sequence_length")
        if memory_limit_bytes is None:
            memory_limit_bytes = 0  # _core: 0 = no limit
        else:
            memory_limit_bytes = as_int(memory_limit_bytes, where, "memory_limit_bytes")
            if memory_limit_bytes < 1:
                raise ValueError(
                    f"{where}: memory_limit_bytes must be >= 1 or None (no limit), got {memory_limit_bytes}"
                )
        if pool is not None and not isinstance(pool, KVPool):
            raise ValueError(f"{where}: pool; expected a KVPool or None, got {type(pool).__name__}")
        if page_tokens is None:
            page_tokens = (pool.page_tokens if pool is not None else None) or default_page_tokens(
                head_dim, dtype_name, v_head_dim
            )
        page_tokens = as_int(page_tokens, where, "page_tokens")
        windows = _windows(sliding_window, num_layers, where)
        rollback_tokens = as_int(rollback_tokens, where, "rollback_tokens")
        if kv_quant not in (None, "int8", "int4"):
            raise ValueError(f"{where}: kv_quant must be None, 'int8' or 'int4', got {kv_quant!r}")
        recent_tokens = as_int(recent_tokens, where, "recent_tokens")
        sink_tokens = as_int(sink_tokens, where, "sink_tokens")
        h = _core.create(
            num_layers,
            batch_size,
            kv_num_heads,
            head_dim,
            v_head_dim,
            dtype_name,
            max_sequence_length,
            memory_limit_bytes,
            page_tokens,
            pool._live(where) if pool is not None else 0,
            windows,
            rollback_tokens,
            kv_quant or "none",
            recent_tokens,
            sink_tokens,
        )
        self._adopt(h, pool)

    # -- construction helpers ---------------------------------------------

    def _adopt(self, h: int, pool: Optional[KVPool] = None) -> None:
        """Take ownership of native handle ``h`` (pages from ``pool``) and cache its geometry."""
        self._h = int(h)
        self._pool = pool
        try:
            self._info = dict(_core.info(self._h))
        except BaseException:
            _core.release(self._h)
            self._h = None
            raise

    @classmethod
    def _from_handle(cls, h: int, pool: Optional[KVPool] = None) -> "KVCache":
        obj = cls.__new__(cls)
        obj._h = None
        obj._info = {}
        obj._pool = None
        obj._adopt(h, pool)
        return obj

    @classmethod
    def from_past(
        cls,
        keys: Sequence[np.ndarray],
        values: Sequence[np.ndarray],
        *,
        max_sequence_length: Optional[int] = None,
        memory_limit_bytes: Optional[int] = None,
        **options: Any,
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
            options: ``pool``, ``page_tokens``, ``sliding_window``,
                ``rollback_tokens``, ``kv_quant``, ``recent_tokens``,
                ``sink_tokens`` as in the constructor.

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
            capacity = max(length, as_int(max_sequence_length, where, "max_sequence_length"))
        cache = cls(
            len(keys),
            batch_size,
            kv_num_heads,
            head_dim,
            v_head_dim=v_head_dim,
            dtype=dtype_name,
            max_sequence_length=capacity,
            memory_limit_bytes=memory_limit_bytes,
            **options,
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
        **options: Any,
    ) -> "KVCache":
        """A cache sized for a model written by ``onnx_light_ep.convert``.

        Reads ``num_layers``, ``kv_num_heads``, ``head_dim``, ``v_head_dim``
        and ``dtype`` from the model's ``onnx_light.*`` metadata
        (``onnx_light_ep.rewrite._metadata``), and the per-layer attention
        windows (``local_window_size`` of each layer's ``CacheAttention``): a
        model with sliding-window layers gets ``sliding_window`` set to those
        windows (None on full-attention layers), so their memory stays bounded
        without the caller passing anything; an explicit ``sliding_window``
        (None or 0 included) wins.

        Args:
            model: path of the converted model (weights are not loaded), an
                ``onnx.ModelProto``, or an ``onnxruntime.InferenceSession`` of it.
            batch_size: int > 0, sequences per run.
            max_sequence_length: capacity in tokens; None uses the model's
                ``onnx_light.max_position`` (rotary table length) when recorded.
            memory_limit_bytes: as in the constructor.
            options: ``pool``, ``page_tokens``, ``sliding_window``,
                ``rollback_tokens``, ``kv_quant``, ``recent_tokens``,
                ``sink_tokens`` as in the constructor.

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
        if "sliding_window" not in options:
            windows = [int(x.get("local_window_size") or -1) for x in meta.get("layers") or []]
            if len(windows) == meta["num_layers"] and any(w > 0 for w in windows):
                options["sliding_window"] = [w if w > 0 else None for w in windows]
        return cls(
            meta["num_layers"],
            batch_size,
            meta["kv_num_heads"],
            meta["head_dim"],
            v_head_dim=meta["v_head_dim"],
            dtype=meta["dtype"],
            max_sequence_length=max_sequence_length,
            memory_limit_bytes=memory_limit_bytes,
            **options,
        )

    @classmethod
    def load(cls, path: Any, *, pool: Optional[KVPool] = None) -> "KVCache":
        """A cache read from a file written by :meth:`save` (a system prompt surviving a restart).

        Args:
            path: str or ``os.PathLike``.
            pool: the :class:`KVPool` to hold its pages (None: a private pool).

        Returns:
            A new ``KVCache`` with the saved geometry, page size, windows,
            lengths and rows (bit-exact).

        Raises:
            ValueError: the file is missing, not a cache file (magic), of another
                format version, has a bad geometry, the wrong size (truncated),
                a checksum mismatch, or a quantized page its codec cannot have written
                (a NaN or negative scale, int8 code -128); the text names which.
                Nothing is created.
            KVCacheMemoryError: the pool's budget cannot hold it (nothing changes).
        """
        import os

        if pool is not None and not isinstance(pool, KVPool):
            raise ValueError(f"KVCache.load: pool; expected a KVPool or None, got {type(pool).__name__}")
        h = _core.load(os.fspath(path), pool._live("KVCache.load") if pool is not None else 0)
        return cls._from_handle(h, pool)

    # -- handle and geometry ----------------------------------------------

    def _geom(self, key: str):
        self._live(f"KVCache.{key}")
        return self._info[key]

    @property
    def handle(self) -> np.ndarray:
        """int64 array of shape ``[1]``: the value to feed as the model's ``kv_cache`` input.

        An opaque id, never a pointer; not reused after :meth:`close`.
        A new array each time. Raises ``ValueError`` once closed.
        """
        return np.array([self._live("KVCache.handle")], dtype=np.int64)

    @property
    def num_layers(self) -> int:
        """Attention layers held (int)."""
        return int(self._geom("num_layers"))

    @property
    def batch_size(self) -> int:
        """Sequences in the request group, ``B`` (int)."""
        return int(self._geom("batch_size"))

    @property
    def kv_num_heads(self) -> int:
        """Key/value heads per layer, ``Hkv`` (int)."""
        return int(self._geom("kv_num_heads"))

    @property
    def head_dim(self) -> int:
        """Key head size ``D``, in elements (int)."""
        return int(self._geom("head_dim"))

    @property
    def v_head_dim(self) -> int:
        """Value head size ``Dv``, in elements (int)."""
        return int(self._geom("v_head_dim"))

    @property
    def dtype(self) -> str:
        """Element type: ``"float32"``, ``"float16"`` or ``"bfloat16"``."""
        return str(self._geom("dtype"))

    @property
    def max_sequence_length(self) -> int:
        """Capacity in tokens per sequence (int)."""
        return int(self._geom("max_sequence_length"))

    @property
    def memory_limit_bytes(self) -> Optional[int]:
        """Cap on committed K/V bytes, or ``None`` for no limit."""
        limit = int(self._geom("memory_limit_bytes"))
        return None if limit == 0 else limit

    @property
    def page_tokens(self) -> int:
        """Positions per page (int)."""
        return int(self._geom("page_tokens"))

    @property
    def sliding_window(self) -> Optional[List[Optional[int]]]:
        """Per-layer eviction window (None entries: that layer keeps everything), or None."""
        w = list(self._geom("sliding_window"))
        return [int(x) if x > 0 else None for x in w] if w else None

    @property
    def kv_quant(self) -> Optional[str]:
        """Cold-page quantization: None, ``"int8"`` or ``"int4"`` (read-only)."""
        q = self._geom("kv_quant")
        return None if q == "none" else str(q)

    @property
    def recent_tokens(self) -> int:
        """Newest positions kept in the cache dtype when ``kv_quant`` is set (read-only)."""
        return int(self._geom("recent_tokens"))

    @property
    def sink_tokens(self) -> int:
        """First positions kept in the cache dtype when ``kv_quant`` is set (read-only)."""
        return int(self._geom("sink_tokens"))

    @property
    def rollback_tokens(self) -> int:
        """Positions sliding-window layers keep beyond the window, for truncate (int)."""
        return int(self._geom("rollback_tokens"))

    @property
    def pool(self) -> Optional[KVPool]:
        """The :class:`KVPool` the cache takes pages from, or None for a private pool."""
        return self._pool

    @property
    def seq_lens(self) -> np.ndarray:
        """int64 array ``[batch_size]``: valid (committed) tokens per sequence.

        A snapshot (a new array); raises ``ValueError`` once closed.
        """
        return np.asarray(_core.seq_lens(self._live("KVCache.seq_lens")), dtype=np.int64)

    # -- operations -------------------------------------------------------

    def stats(self) -> Dict[str, int]:
        """Memory and traffic counters, a dict of int (bytes unless ``num_``).

        ``committed_bytes``: the pages this cache's tables hold, each once (a
        page shared with another cache counts in both caches; the pool counts
        it once). ``live_bytes``: valid rows in those pages.
        ``fragmentation_bytes`` = committed - live (partly filled pages).
        ``shared_bytes``: its pages with more than one holder (sequences of
        this cache, other caches, checkpoints). ``checkpoint_bytes``: pages only
        its checkpoints hold. ``num_pages``, ``page_table_bytes`` (page-table
        metadata). ``reserved_bytes``: pages reserved by a run's open step, not
        yet committed (0 between runs). ``bytes_appended``: cumulative bytes of
        new K/V rows committed by runs and imports. ``bytes_copied``: cumulative
        bytes of already-cached rows copied (copy-on-write of a shared page's
        valid rows; export); fork, reorder, checkpoint and a decode step into a
        private page add 0. ``num_appends``: committed steps.
        ``quantized_bytes``: K/V code bytes of its quantized pages,
        ``scale_bytes``: their scales (and int4 minimums), ``native_bytes``: its pages in the cache
        dtype (``kv_quant``; committed = native + quantized + scales + padding).
        """
        return dict(_core.stats(self._live("KVCache.stats")))

    def pool_stats(self) -> Dict[str, int]:
        """The stats of the pool this cache takes pages from, as :meth:`KVPool.stats` gives them
        (``committed_bytes`` = live + free + overhead, ``empty_slab_bytes``, ``keep_free_bytes``,
        ...): the :class:`KVPool` given, or the cache's private pool, which no handle reaches
        otherwise (with ``pool=None`` it is the memory this cache holds in all: its pages, the free
        pages of its slabs and the emptied slabs it keeps, at most one page per layer, sequence
        and kv head of them).
        """
        return dict(_core.cache_pool_stats(self._live("KVCache.pool_stats")))

    def reset(self) -> None:
        """Set every sequence length to 0 and release the storage (committed bytes drop to 0)."""
        _core.reset(self._live("KVCache.reset"))

    def truncate(self, lengths: Union[int, Sequence[int], np.ndarray]) -> None:
        """Shorten sequences (speculative-decoding rollback). Releases whole pages, copies nothing.

        Args:
            lengths: int (applied to every sequence) or integers ``[batch_size]``,
                each ``0 <= lengths[b] <= seq_lens[b]``. On sliding-window layers a
                non-zero length must also be at least the earliest length whose
                window the layer still holds (``rollback_tokens`` past the last
                eviction point); 0 always works (the sequence restarts).

        Raises:
            ValueError: wrong length, non-integers or out of range (the text
                names the earliest length still possible); nothing changes.
        """
        h = self._live("KVCache.truncate")
        if np.ndim(lengths) == 0:
            n = as_int(lengths, "KVCache.truncate", "lengths")
            arr = np.full(self.batch_size, n, dtype=np.int64)
        else:
            arr = as_int64_vector(lengths, "KVCache.truncate", "lengths")
        _core.truncate(h, arr)

    def rollback(self, num_tokens: Union[int, Sequence[int], np.ndarray]) -> None:
        """Drop the last ``num_tokens`` positions of each sequence: ``truncate(seq_lens - num_tokens)``.

        Args:
            num_tokens: int (every sequence) or integers ``[batch_size]``, each
                ``0 <= num_tokens[b] <= seq_lens[b]``. 0 is a no-op; asking for
                more than a sequence holds is a ``ValueError`` (never clamped).
        """
        where = "KVCache.rollback"
        h = self._live(where)
        if np.ndim(num_tokens) == 0:
            n = np.full(self.batch_size, as_int(num_tokens, where, "num_tokens"), dtype=np.int64)
        else:
            n = as_int64_vector(num_tokens, where, "num_tokens")
        _core.rollback(h, n)  # one native call: atomic against concurrent runs

    def fork(self, indices: Optional[Union[Sequence[int], np.ndarray]] = None) -> "KVCache":
        """A new cache in the same pool whose sequence ``i`` shares sequence ``indices[i]``'s pages.

        Args:
            indices: integers, each in ``[0, batch_size)``, repeats allowed; their
                count is the new cache's batch size (``cache.fork([0] * 4)``
                expands a prefilled prompt into 4 beams). None = every sequence.

        Cost: O(pages) of metadata, 0 K/V bytes copied; the first write of
        either cache into a shared page copies that page. The fork has this
        cache's geometry, quota, page size and windows.

        Raises:
            ValueError: bad indices. KVCacheMemoryError: the fork's pages exceed
                its ``memory_limit_bytes``.
        """
        h = self._live("KVCache.fork")
        if indices is None:
            idx = np.arange(self.batch_size, dtype=np.int64)
        else:
            idx = as_int64_vector(indices, "KVCache.fork", "indices")
        return KVCache._from_handle(_core.fork(h, idx), self._pool)

    def reorder(self, indices: Union[Sequence[int], np.ndarray]) -> None:
        """Beam reorder: new sequence ``i`` becomes old sequence ``indices[i]``.

        A permutation of page tables: 0 bytes copied now; the first write into
        a tail page two sequences now share copies that one page.

        Args:
            indices: integers ``[batch_size]``, each in ``[0, batch_size)``;
                duplicates allowed.

        Raises:
            ValueError: wrong length, non-integers or out of range; nothing changes.
        """
        h = self._live("KVCache.reorder")
        _core.reorder(h, as_int64_vector(indices, "KVCache.reorder", "indices"))

    def checkpoint(self) -> KVCheckpoint:
        """A :class:`KVCheckpoint` of the current content (pages pinned, nothing copied)."""
        return KVCheckpoint(_core.checkpoint(self._live("KVCache.checkpoint")), self._pool)

    def restore(self, checkpoint: KVCheckpoint) -> None:
        """Make the content and ``seq_lens`` exactly those of ``checkpoint``.

        Swaps page tables (retain/release), copies no rows.

        Raises:
            ValueError: not an open KVCheckpoint, or one of another geometry or
                pool (the text names the difference); nothing changes.
            KVCacheMemoryError: the checkpoint's pages exceed this cache's quota.
        """
        where = "KVCache.restore"
        if not isinstance(checkpoint, KVCheckpoint):
            raise ValueError(f"{where}: checkpoint; expected a KVCheckpoint, got {type(checkpoint).__name__}")
        _core.restore(self._live(where), checkpoint._live(where))

    def save(self, path: Any) -> None:
        """Write the geometry, lengths and valid rows to ``path`` (``KVCache.load`` reads it back).

        A versioned file with a checksum; written to ``path + ".tmp"`` and
        renamed, so readers never see a partial file. Evicted positions of
        sliding-window layers are not stored.
        """
        import os

        _core.save(self._live("KVCache.save"), os.fspath(path))

    def _page_ids(self, layer: int, sequence: int, head: int) -> List[int]:
        """Page ids of (layer, sequence, kv head), block by block (tests, debugging)."""
        return list(_core.page_ids(self._live("KVCache._page_ids"), layer, sequence, head))

    def _first_positions(self) -> np.ndarray:
        """First position held, ``[num_layers, batch_size]`` (> 0 after eviction)."""
        fp = np.asarray(_core.first_positions(self._live("KVCache._first_positions")), dtype=np.int64)
        return fp.reshape(self.num_layers, self.batch_size)

    def export(self, layer: int) -> Tuple[np.ndarray, np.ndarray]:
        """Copy out one layer as ``(key, value)`` BNSH arrays.

        Args:
            layer: int in ``[0, num_layers)``.

        Returns:
            ``key`` ``[B, Hkv, L, D]`` and ``value`` ``[B, Hkv, L, Dv]`` of the
            cache dtype (bfloat16 as ``ml_dtypes.bfloat16``), new arrays owned
            by the caller, ``L = max(seq_lens)``; rows ``>= seq_lens[b]`` of a
            shorter sequence, and positions a sliding-window layer evicted, are
            zeros.

        Raises:
            ValueError: ``layer`` out of range.
        """
        h = self._live("KVCache.export")
        key, value = _core.export(h, as_int(layer, "KVCache.export", "layer"))
        key, value = np.asarray(key), np.asarray(value)
        if self.dtype == "bfloat16":
            key = key.view(ml_dtypes.bfloat16)
            value = value.view(ml_dtypes.bfloat16)
        return key, value

    # -- lifetime (NativeHandle: close, context manager, no pickling) ------

    def _release(self, handle: int) -> None:
        _core.release(handle)

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


def _windows(sliding_window: Any, num_layers: int, where: str) -> List[int]:
    """Per-layer windows for _core (0 = none) from None, an int or a per-layer list."""
    if sliding_window is None:
        return []
    if np.ndim(sliding_window) == 0:
        w = as_int(sliding_window, where, "sliding_window")
        if w < 1:
            raise ValueError(f"{where}: sliding_window must be >= 1 or None, got {w}")
        return [w] * num_layers
    items = list(sliding_window)
    if len(items) != num_layers:
        raise ValueError(f"{where}: sliding_window; expected one entry per layer ({num_layers}), got {len(items)}")
    out = []
    for i, x in enumerate(items):
        if x is None:
            out.append(0)
            continue
        w = as_int(x, where, f"sliding_window[{i}]")
        if w < 0:
            raise ValueError(f"{where}: sliding_window[{i}] must be >= 1, 0 or None (no window), got {w}")
        out.append(w)
    return out if any(out) else []
