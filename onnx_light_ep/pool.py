"""``KVPool`` (a page supply and memory budget shared by caches) and
``KVCheckpoint`` (a retained snapshot of a cache), thin wrappers over the
native arena in ``onnx_light_ep._core``.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import numpy as np

from . import _core
from ._args import as_int
from ._handle import NativeHandle

__all__ = ["KVPool", "KVCheckpoint"]


class KVPool(NativeHandle):
    """A page pool: the memory budget and page supply of one or more caches.

    Pages are ``page_tokens`` positions of one (layer, sequence, kv head) of a
    cache, K and V, carved from 2 MiB-aligned slabs backed by huge pages where
    the kernel allows. Caches of any geometry (a draft model and its target,
    say) can share one pool; pages shared between them (``KVCache.fork``) are
    counted once here.

    Args:
        memory_limit_bytes: int >= 1 or None (no limit): the budget of page
            bytes in use (``stats()["live_bytes"]``) across every cache and
            checkpoint of the pool. A step, fork-then-write, restore or load
            that would exceed it raises ``KVCacheMemoryError`` (from
            ``session.run``: an ORT error starting with ``KVCacheMemoryError:``)
            before anything changes.
        page_tokens: default page size (positions per page, a multiple of 32)
            for caches created in this pool without their own; None = the
            library default (:func:`onnx_light_ep.default_page_tokens`, by head_dim
            and dtype).
        keep_free_bytes: int >= 0 or None (``DEFAULT_KEEP_FREE_BYTES``, 64 MiB):
            bound on the bytes of empty slabs (slabs whose pages are all free)
            the pool keeps mapped for reuse, so a cache that truncates across a
            page start and appends again (a rejected speculative draft, a beam
            reorder, a chat turn re-run from a common prefix) reuses faulted-in
            memory instead of unmapping and mapping it each step. 0 unmaps an
            empty slab at once. Empty slabs are kept only while a cache or
            checkpoint uses the pool and, under a budget, only while
            ``live_bytes`` plus their bytes stay within ``memory_limit_bytes``;
            :meth:`trim`, the last cache or checkpoint closing, and a failed
            mapping unmap them all.

    Lifetime: :meth:`close` (or the ``with`` block) releases the pool; closing
    a pool that caches or checkpoints still use is a ``ValueError``. A pool
    dropped by the garbage collector while in use stays alive until its last
    cache closes. Thread safety: every method is safe from any thread.
    """

    __slots__ = ("_h", "_page_tokens", "_limit", "_keep_free", "__weakref__")
    _kind = "KVPool"

    DEFAULT_KEEP_FREE_BYTES = int(_core.DEFAULT_KEEP_FREE_BYTES)  # 64 MiB (page_pool.h)

    def __init__(self, memory_limit_bytes: Optional[int] = None, *, page_tokens: Optional[int] = None,
                 keep_free_bytes: Optional[int] = None) -> None:
        self._h: Optional[int] = None
        where = "KVPool"
        if memory_limit_bytes is None:
            limit = 0
        else:
            limit = as_int(memory_limit_bytes, where, "memory_limit_bytes")
            if limit < 1:
                raise ValueError(f"{where}: memory_limit_bytes must be >= 1 or None (no limit), got {limit}")
        if page_tokens is not None:
            page_tokens = as_int(page_tokens, where, "page_tokens")
            if page_tokens < 32 or page_tokens % 32 != 0 or page_tokens > 65536:
                raise ValueError(f"{where}: page_tokens must be a multiple of 32 in [32, 65536], got {page_tokens}")
        if keep_free_bytes is None:
            keep_free = self.DEFAULT_KEEP_FREE_BYTES
        else:
            keep_free = as_int(keep_free_bytes, where, "keep_free_bytes")
            if keep_free < 0:
                raise ValueError(f"{where}: keep_free_bytes must be >= 0 (0 = unmap empty slabs at once), got {keep_free}")
        self._page_tokens = page_tokens
        self._limit = limit
        self._keep_free = keep_free
        self._h = int(_core.pool_create(limit, keep_free))

    @property
    def handle(self) -> int:
        """The pool's opaque id (int), never a pointer."""
        return self._live("KVPool.handle")

    @property
    def page_tokens(self) -> Optional[int]:
        """Default page size of caches created in the pool (None = library default)."""
        return self._page_tokens

    @property
    def memory_limit_bytes(self) -> Optional[int]:
        """Budget of page bytes in use, or None for no limit."""
        return self._limit or None

    @property
    def keep_free_bytes(self) -> int:
        """Bound on the empty slab bytes kept mapped for reuse (0 = none kept)."""
        return self._keep_free

    def trim(self) -> int:
        """Unmap every empty slab now (``empty_slab_bytes`` becomes 0); returns the bytes unmapped."""
        return int(_core.pool_trim(self._live("KVPool.trim")))

    def stats(self) -> Dict[str, int]:
        """Pool figures, a dict of int (bytes unless ``num_``).

        ``committed_bytes`` (slab bytes the process holds) = ``live_bytes``
        (pages in use by caches, checkpoints or a run's reservation) +
        ``free_bytes`` (free pages of mapped slabs) + ``overhead_bytes`` (slab
        tails no page fits in); ``shared_bytes`` (pages with more than one
        holder, part of ``live_bytes``); ``empty_slab_bytes`` (slabs with no
        page in use, kept mapped for reuse: their pages are in ``free_bytes``,
        their tails in ``overhead_bytes``; at most ``keep_free_bytes``);
        ``memory_limit_bytes`` (0 = none); ``keep_free_bytes``; ``num_pages``,
        ``num_free_pages``, ``num_slabs``, ``num_caches``, ``num_checkpoints``.
        Each page is counted once, however many caches share it.
        """
        return dict(_core.pool_stats(self._live("KVPool.stats")))

    def close(self) -> None:
        """Release the pool. Idempotent. ``ValueError`` (nothing changes) while caches or checkpoints use it."""
        if self._h is None:
            return
        _core.pool_release(self._h)
        self._h = None

    def _release(self, handle: int) -> None:
        _core.pool_release(handle)

    def __repr__(self) -> str:
        if self._h is None:
            return "KVPool(closed)"
        s = self.stats()
        return (f"KVPool(handle={self._h}, memory_limit_bytes={self.memory_limit_bytes}, "
                f"live_bytes={s['live_bytes']}, num_caches={s['num_caches']})")


class KVCheckpoint(NativeHandle):
    """A retained snapshot of a cache's page tables and lengths (``KVCache.checkpoint()``).

    Taking one copies no rows: it pins the pages the cache holds (they count in
    the pool's ``live_bytes``; the cache's next write into a pinned tail page
    copies that one page). ``cache.restore(cp)`` makes a cache of the same
    geometry and pool hold exactly this content again. Release with
    :meth:`close` or a ``with`` block; a closed checkpoint cannot be restored.
    """

    __slots__ = ("_h", "_pool", "__weakref__")
    _kind = "KVCheckpoint"

    def __init__(self, handle: int, pool: Optional[KVPool] = None) -> None:
        self._h: Optional[int] = int(handle)
        self._pool = pool  # keeps the KVPool object (and so its handle) alive while the pages are pinned

    @property
    def seq_lens(self) -> np.ndarray:
        """int64 ``[batch_size]``: the lengths the checkpoint holds."""
        return np.asarray(_core.checkpoint_info(self._live("KVCheckpoint.seq_lens"))["seq_lens"], dtype=np.int64)

    @property
    def num_pages(self) -> int:
        """Pages the checkpoint pins."""
        return int(_core.checkpoint_info(self._live("KVCheckpoint.num_pages"))["num_pages"])

    def _release(self, handle: int) -> None:
        _core.release_checkpoint(handle)

    def __repr__(self) -> str:
        if self._h is None:
            return "KVCheckpoint(closed)"
        return f"KVCheckpoint(seq_lens={self.seq_lens.tolist()}, num_pages={self.num_pages})"
