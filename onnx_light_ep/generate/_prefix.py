"""Prefix caching across requests: token blocks of earlier prompts kept as copy-on-write forks.

A :class:`PrefixCache` keeps, for every full block of ``block_tokens`` prompt
tokens it has seen, a ``KVCache`` holding the K/V of the prompt up to the end
of that block: a ``fork`` of the request's cache truncated to that length, so
it shares the request's pages and costs no K/V copy. A block is found again by
a chained key, ``sha256(parent key + its token ids)``, whose root names the
model (file, size, modification time, geometry) and the cache options; the
token ids are stored and compared on every hit, so a hash collision is a
miss, never another prompt's K/V. A new request forks the entry of its longest
cached prefix and prefills only the rest (vLLM's automatic prefix caching,
``vllm/v1/core/kv_cache_utils.py`` and ``block_pool.py``, follows the same
chain-of-block-hashes scheme over its paged blocks).

Entries are forks: releasing one never changes a request's cache (its pages
are reference counted), so eviction is always safe for a live request; only
pages no one else holds go back to the pool.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import Counter
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from .._args import as_int
from ._prepare import check_cache_options

__all__ = ["PrefixCache", "PrefixMatch"]

_KEY_VERSION = "onnx_light_ep.PrefixCache/1"
_NO_LIMIT_POSITIONS = 1 << 24  # KVCache's largest max_sequence_length (a limit: nothing is reserved)


class PrefixMatch(NamedTuple):
    """What :meth:`PrefixCache.match` returns.

    ``cache``: a new batch-1 ``KVCache`` (the caller owns and closes it) whose
    sequence holds the K/V of ``prompt_ids[:cached_tokens]``; ``cached_tokens``:
    positions reused (0 when nothing matched: then the cache is empty);
    ``block_tokens``: the block size of this model's entries.
    """

    cache: Any
    cached_tokens: int
    block_tokens: int


class _Entry:
    """One cached block: K/V of the prompt up to ``length`` = the end of this block."""

    __slots__ = ("key", "parent", "tokens", "length", "cache", "children", "last_used", "pages")

    def __init__(self, key: bytes, parent: bytes, tokens: Tuple[int, ...], length: int, cache, tick: int,
                 pages: List[Tuple[int, int]]):
        self.key, self.parent, self.tokens, self.length, self.cache = key, parent, tokens, length, cache
        self.children, self.last_used, self.pages = 0, tick, pages


class _Namespace(NamedTuple):
    root: bytes
    block_tokens: int
    geometry: Tuple[int, int, int, int, str]
    cache_kwargs: Dict[str, Any]


class PrefixCache:
    """Reusable K/V of prompt prefixes shared by requests of one or more models (``generate(prefix_cache=...)``).

    Args:
        pool: the open ``KVPool`` every request cache and every entry takes
            its pages from (a fork stays in its cache's pool). Its
            ``memory_limit_bytes`` bounds requests and entries together: when a
            request's run of ``generate`` raises ``KVCacheMemoryError``, the
            least recently used entries are released until it fits.
        block_tokens: prompt tokens per block, a multiple of 32 in [32, 65536],
            or None (default) for the page size of the caches (the pool's
            ``page_tokens``, else ``default_page_tokens`` of the model). Only
            whole blocks are cached, so a request reuses
            ``block_tokens * floor(shared / block_tokens)`` of the tokens it
            shares with an earlier prompt. Blocks that are a multiple of the
            page size share whole pages: neither the entry nor a request that
            forks it ever writes into a page the other holds, so nothing is
            copied. Smaller blocks (finer matches) end inside a page: the first
            write of a request into that shared page copies it, one page per
            layer and kv head (``KVCache.stats()["bytes_copied"]``).
        max_bytes: int >= 1 or None: budget of ``stats()["bytes"]``; after an
            insertion, least recently used leaf entries are released until the
            entries fit.

    Keys: the root of each chain is a sha256 of the model file (real path,
    size, modification time; also its ``.data`` file), its cache geometry
    (layers, kv heads, head sizes, dtype), the page and block size, the
    capacity and the ``cache_options``; a block's key is
    ``sha256(parent key + int64 token ids)``. Entries store their token ids and
    parent key and a hit compares them, so one PrefixCache serves several
    models and option sets without mixing them, and a collision is a miss.

    Refused (``ValueError``): ``kv_quant`` (entries share pages that the
    request's commit quantizes: the reused prefix would be attended in int8/int4
    while an uncached prefill attends the native rows) and sliding-window layers
    (an entry must hold every position of its prefix; pass
    ``cache_options={"sliding_window": None}`` to keep them all).

    Eviction: least recently used first, leaves before their parents (a parent
    is never released while a longer entry depends on it). Releasing an entry
    never affects a request's cache; its pages go back to the pool only when
    nothing else holds them.

    Thread safety: every method takes one lock; requests on other threads may
    match, insert and evict concurrently (each runs on its own cache); a
    request of ``generate`` that matched before another thread's
    :meth:`clear` or :meth:`close` finishes on its own cache (after a close
    its blocks are not inserted).
    Lifetime: :meth:`close` / ``with`` releases every entry (the pool can then
    be closed); :meth:`clear` releases them and keeps the object usable.
    """

    def __init__(self, pool, *, block_tokens: Optional[int] = None, max_bytes: Optional[int] = None) -> None:
        from ..pool import KVPool

        where = "PrefixCache"
        if not isinstance(pool, KVPool):
            raise ValueError(f"{where}: pool; expected a KVPool, got {type(pool).__name__}")
        pool._live(where)
        if block_tokens is not None:
            block_tokens = as_int(block_tokens, where, "block_tokens")
            if block_tokens < 32 or block_tokens % 32 or block_tokens > 65536:
                raise ValueError(f"{where}: block_tokens; expected a multiple of 32 in [32, 65536] (best a "
                                 f"multiple of the page size) or None (the page size), got {block_tokens}")
        if max_bytes is not None:
            max_bytes = as_int(max_bytes, where, "max_bytes")
            if max_bytes < 1:
                raise ValueError(f"{where}: max_bytes; expected an int >= 1 or None (no budget), got {max_bytes}")
        self._pool, self._block_tokens, self._max_bytes = pool, block_tokens, max_bytes
        self._entries: Dict[bytes, _Entry] = {}
        self._page_refs: Counter = Counter()   # page id -> entries holding it
        self._page_bytes: Dict[int, int] = {}  # page id -> its bytes
        self._tick = 0
        self._counts = Counter()
        self._lock = threading.RLock()
        self._closed = False

    # -- properties ---------------------------------------------------------

    @property
    def pool(self):
        """The ``KVPool`` of the entries and of the request caches."""
        return self._pool

    @property
    def block_tokens(self) -> Optional[int]:
        """Tokens per block as given (None: the page size of each model's caches)."""
        return self._block_tokens

    @property
    def max_bytes(self) -> Optional[int]:
        """Budget of ``stats()["bytes"]``, or None."""
        return self._max_bytes

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        return len(self._entries)

    # -- keys ---------------------------------------------------------------

    @staticmethod
    def _block_key(parent: bytes, tokens: np.ndarray) -> bytes:
        """``sha256(parent + int64 little-endian token ids)`` (a method so tests can force collisions)."""
        return hashlib.sha256(parent + np.asarray(tokens, dtype="<i8").tobytes()).digest()

    def _namespace(self, model, meta: dict, cache_options: Optional[dict], where: str) -> _Namespace:
        """Root key, block size, geometry and KVCache keywords for ``model`` with ``cache_options``."""
        from ..cache import default_page_tokens

        check_cache_options(cache_options)
        opts = dict(cache_options or {})
        pool = opts.pop("pool", None)
        if pool is not None and pool is not self._pool:
            raise ValueError(f"{where}: cache_options['pool']; expected the PrefixCache's pool (entries are forks, "
                             f"which stay in their cache's pool), got another KVPool")
        if opts.get("kv_quant") is not None:
            raise ValueError(f"{where}: cache_options['kv_quant']; expected None with a prefix cache (the reused "
                             f"prefix would be attended in its quantized form, an uncached prefill attends native "
                             f"rows), got {opts['kv_quant']!r}")
        windows = [int(x.get("local_window_size") or -1) for x in meta.get("layers") or []]
        if "sliding_window" in opts:
            sw = opts["sliding_window"]
            if sw is not None and any(int(w or 0) > 0 for w in (sw if np.ndim(sw) else [sw])):
                raise ValueError(f"{where}: cache_options['sliding_window']; expected None with a prefix cache (an "
                                 f"entry must hold every position of its prefix), got {sw!r}")
        elif any(w > 0 for w in windows):
            raise ValueError(f"{where}: the model has sliding-window layers (local_window_size "
                             f"{max(windows)}), whose caches evict old positions; expected "
                             f"cache_options={{'sliding_window': None}} (keep every position) with a prefix cache")
        geometry = (int(meta["num_layers"]), int(meta["kv_num_heads"]), int(meta["head_dim"]),
                    int(meta["v_head_dim"]), str(meta["dtype"]))
        page = opts.get("page_tokens") or self._pool.page_tokens or default_page_tokens(
            geometry[2], geometry[4], geometry[3])
        opts["page_tokens"] = int(page)
        block = self._block_tokens or int(page)
        capacity = int(meta.get("max_position") or _NO_LIMIT_POSITIONS)
        path = os.path.realpath(os.fspath(model))
        files = []
        for p in (path, path + ".data"):
            if os.path.exists(p):
                st = os.stat(p)
                files.append([p, st.st_size, st.st_mtime_ns])
        ident = json.dumps([_KEY_VERSION, files, geometry, block, capacity,
                            sorted((k, repr(v)) for k, v in opts.items())])
        kwargs = dict(opts, max_sequence_length=capacity)
        return _Namespace(hashlib.sha256(ident.encode()).digest(), block, geometry, kwargs)

    def _chain(self, ns: _Namespace, ids: np.ndarray, num_blocks: int) -> Tuple[List[_Entry], bytes]:
        """Entries of the longest cached prefix of ``num_blocks`` blocks, and the key after the last one."""
        chain, parent, b = [], ns.root, ns.block_tokens
        for i in range(num_blocks):
            block = ids[i * b:(i + 1) * b]
            key = self._block_key(parent, block)
            e = self._entries.get(key)
            if e is None:
                break
            if e.parent != parent or e.tokens != tuple(block.tolist()):
                self._counts["collisions"] += 1
                break
            chain.append(e)
            parent = key
        return chain, parent

    # -- requests -----------------------------------------------------------

    def match(self, model, prompt_ids: Sequence[int], *, meta: Optional[dict] = None,
              cache_options: Optional[dict] = None) -> PrefixMatch:
        """A new request cache holding the longest cached prefix of ``prompt_ids``.

        Args:
            model: path of the converted model the request runs (part of the key).
            prompt_ids: the request's token ids (ints, at least one).
            meta: the model's ``onnx_light.*`` metadata (``read_metadata(model)`` if None).
            cache_options: ``KVCache`` keywords of the request (``generate``'s
                ``cache_options``; part of the key).

        Returns:
            :class:`PrefixMatch`: a fork of the entry of the longest matching
            whole-block prefix, truncated to at most ``len(prompt_ids) - 1``
            positions (at least one token is left to run, for its logits), or
            an empty cache of the model's geometry in :attr:`pool`. Capacity:
            the model's ``onnx_light.max_position`` (else the largest a cache takes).

        Raises:
            ValueError: closed, empty ``prompt_ids``, or refused ``cache_options``.
            KVCacheMemoryError: the pool cannot hold a new cache's metadata.
        """
        from ..cache import KVCache

        where = "PrefixCache.match"
        ids, meta = self._ids(prompt_ids, where), self._meta(model, meta)
        with self._lock:
            self._check_open(where)
            ns = self._namespace(model, meta, cache_options, where)
            chain, _ = self._chain(ns, ids, ids.size // ns.block_tokens)
            cached = min(len(chain) * ns.block_tokens, ids.size - 1)
            self._tick += 1
            for e in chain:
                e.last_used = self._tick
            self._counts["lookups"] += 1
            self._counts["hits"] += len(chain)
            self._counts["misses"] += ids.size // ns.block_tokens - len(chain)
            self._counts["reused_tokens"] += cached
            if chain:
                cache = chain[-1].cache.fork()
                try:
                    if cached < chain[-1].length:
                        cache.truncate(cached)
                except BaseException:
                    cache.close()
                    raise
            else:
                nl, hkv, d, dv, dtype = ns.geometry
                cache = KVCache(nl, 1, hkv, d, v_head_dim=dv, dtype=dtype, pool=self._pool, **ns.cache_kwargs)
        return PrefixMatch(cache, cached, ns.block_tokens)

    def insert(self, model, prompt_ids: Sequence[int], cache, *, meta: Optional[dict] = None,
               cache_options: Optional[dict] = None) -> int:
        """Keep the full blocks of ``prompt_ids`` that ``cache`` holds and the PrefixCache does not yet.

        Args:
            model, meta, cache_options: as in :meth:`match` (the same values).
            prompt_ids: token ids whose K/V ``cache`` holds in its first
                ``len(prompt_ids)`` positions (the caller's contract: usually
                right after the prefill of the request :meth:`match` started).
            cache: an open batch-1 ``KVCache`` of the model in :attr:`pool`
                holding at least ``len(prompt_ids)`` positions; unchanged.

        Each new block becomes ``cache.fork()`` truncated to the end of that
        block (pages shared, no K/V copied). Then ``max_bytes`` is enforced.

        Returns:
            the number of blocks inserted.

        Raises:
            ValueError: closed, or ``cache`` of another pool, batch, geometry or
                page size, or holding fewer positions than ``prompt_ids``.
        """
        where = "PrefixCache.insert"
        ids, meta = self._ids(prompt_ids, where), self._meta(model, meta)
        with self._lock:
            self._check_open(where)
            ns = self._namespace(model, meta, cache_options, where)
            self._check_cache(cache, ns, ids.size, where)
            b = ns.block_tokens
            chain, parent = self._chain(ns, ids, ids.size // b)
            self._tick += 1
            added = 0
            for i in range(len(chain), ids.size // b):
                block = ids[i * b:(i + 1) * b]
                key = self._block_key(parent, block)
                if key in self._entries:  # a collision (_chain stopped here): this chain stays uncached
                    break
                fork = cache.fork()
                try:
                    fork.truncate((i + 1) * b)
                    pages = self._pages_of(fork)
                except BaseException:
                    fork.close()
                    raise
                e = _Entry(key, parent, tuple(block.tolist()), (i + 1) * b, fork, self._tick, pages)
                if parent in self._entries:
                    self._entries[parent].children += 1
                self._entries[key] = e
                for pid, nbytes in pages:
                    self._page_refs[pid] += 1
                    self._page_bytes[pid] = nbytes
                parent, added = key, added + 1
            self._counts["inserted"] += added
            if self._max_bytes is not None:
                while self._bytes() > self._max_bytes and self._evict_one():
                    pass
            return added

    # -- memory -------------------------------------------------------------

    def evict(self) -> bool:
        """Release the least recently used leaf entry; False when there is none.

        The released fork's pages return to the pool if nothing else (a
        request, another entry) holds them; a request's cache is never changed.
        """
        with self._lock:
            return self._evict_one()

    def clear(self) -> None:
        """Release every entry (statistics counters are kept). Live request caches are unaffected."""
        with self._lock:
            for e in self._entries.values():
                e.cache.close()
            self._counts["evicted"] += len(self._entries)
            self._entries.clear()
            self._page_refs.clear()
            self._page_bytes.clear()

    def close(self) -> None:
        """:meth:`clear`, then refuse further use. Idempotent."""
        with self._lock:
            self.clear()
            self._closed = True

    def __enter__(self) -> "PrefixCache":
        self._check_open("PrefixCache.__enter__")
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> Dict[str, int]:
        """Counters, a dict of int (bytes unless named otherwise).

        ``entries``; ``cached_tokens`` (tokens of the blocks held);
        ``bytes``: pages the entries hold, each page once (shared with a live
        request or not); ``exclusive_bytes``: of those, pages only entries hold
        (what :meth:`clear` returns to the pool now); ``lookups`` (calls of
        :meth:`match`), ``hits`` / ``misses`` (full prompt blocks found / not
        found), ``reused_tokens`` (positions handed to requests),
        ``inserted``, ``evicted`` (entries), ``collisions`` (a key found with
        other tokens or parent: treated as a miss).
        """
        from .. import _core

        with self._lock:
            exclusive = 0
            if self._page_refs and not self._pool.closed:
                refs = dict(_core.pool_page_refs(self._pool.handle))
                exclusive = sum(self._page_bytes[p] for p, n in self._page_refs.items() if refs.get(p) == n)
            out = {"entries": len(self._entries),
                   "cached_tokens": sum(len(e.tokens) for e in self._entries.values()),
                   "bytes": self._bytes(), "exclusive_bytes": exclusive}
            for k in ("lookups", "hits", "misses", "reused_tokens", "inserted", "evicted", "collisions"):
                out[k] = int(self._counts[k])
            return out

    def __repr__(self) -> str:
        if self._closed:
            return "PrefixCache(closed)"
        return (f"PrefixCache(entries={len(self._entries)}, block_tokens={self._block_tokens}, "
                f"bytes={self._bytes()}, max_bytes={self._max_bytes})")

    # -- internals ------------------------------------------------------------

    def _bytes(self) -> int:
        return sum(self._page_bytes[p] for p in self._page_refs)

    def _evict_one(self) -> bool:
        leaves = [e for e in self._entries.values() if e.children == 0]
        if not leaves:
            return False
        e = min(leaves, key=lambda x: x.last_used)
        del self._entries[e.key]
        if e.parent in self._entries:
            self._entries[e.parent].children -= 1
        for pid, _ in e.pages:
            self._page_refs[pid] -= 1
            if self._page_refs[pid] == 0:
                del self._page_refs[pid]
                del self._page_bytes[pid]
        e.cache.close()
        self._counts["evicted"] += 1
        return True

    @staticmethod
    def _pages_of(cache) -> List[Tuple[int, int]]:
        """(page id, bytes) of every page ``cache`` (batch 1, native pages of one size) holds."""
        s = cache.stats()
        nbytes = s["committed_bytes"] // s["num_pages"] if s["num_pages"] else 0
        ids = {p for layer in range(cache.num_layers) for h in range(cache.kv_num_heads)
               for p in cache._page_ids(layer, 0, h)}
        return [(p, nbytes) for p in sorted(ids)]

    def _check_open(self, where: str) -> None:
        if self._closed:
            raise ValueError(f"{where}: the PrefixCache is closed; expected an open PrefixCache")

    @staticmethod
    def _ids(prompt_ids, where: str) -> np.ndarray:
        try:
            ids = np.asarray([as_int(t, where, "prompt_ids") for t in prompt_ids], dtype=np.int64)
        except TypeError:
            raise ValueError(f"{where}: prompt_ids; expected a sequence of token ids, got "
                             f"{type(prompt_ids).__name__}") from None
        if ids.size == 0:
            raise ValueError(f"{where}: prompt_ids; expected at least one token id, got []")
        return ids

    @staticmethod
    def _meta(model, meta):
        if meta is not None:
            return meta
        from ..rewrite import read_metadata

        return read_metadata(os.fspath(model))

    def _check_cache(self, cache, ns: _Namespace, length: int, where: str) -> None:
        from ..cache import KVCache

        if not isinstance(cache, KVCache):
            raise ValueError(f"{where}: cache; expected a KVCache, got {type(cache).__name__}")
        cache._live(where)
        if cache.pool is not self._pool:
            raise ValueError(f"{where}: cache; expected a cache in the PrefixCache's pool (entries are its forks)")
        got = (cache.num_layers, cache.kv_num_heads, cache.head_dim, cache.v_head_dim, cache.dtype)
        if cache.batch_size != 1 or got != ns.geometry or cache.page_tokens != ns.cache_kwargs["page_tokens"] \
                or cache.kv_quant is not None or cache.sliding_window is not None:
            raise ValueError(f"{where}: cache; expected batch 1, geometry {ns.geometry}, page_tokens "
                             f"{ns.cache_kwargs['page_tokens']}, no kv_quant and no sliding window (what match "
                             f"creates), got batch {cache.batch_size}, geometry {got}, page_tokens "
                             f"{cache.page_tokens}")
        held = int(cache.seq_lens[0])
        if held < length:
            raise ValueError(f"{where}: cache; expected at least len(prompt_ids) = {length} positions, got {held}")
