"""Stateful property test of the paged arena against a pure-numpy model.

Random sequences of: caches created in shared pools (with and without pool budgets and
cache quotas) or private ones, runs through real CacheAttention sessions (steps that cross
page boundaries, ragged steps), fork with indices (repeats, other batch sizes), reorder with
repeats, truncate / rollback (also below the sliding-window earliest length: refused),
checkpoint / restore (also into another cache of the same geometry and pool), save / load
(into the same, another or a private pool), sliding-window eviction with rollback_tokens, and
close of caches, checkpoints and pools in any order.

Invariants after every rule: content bit-exact (float32) and seq_lens equal the model (evicted
positions read back as zeros, at the model's first positions); cache stats consistent
(fragmentation = committed - live, nothing reserved between runs); for every pool, every page's
reference count equals the number of live page tables (caches and checkpoints) holding it, and
committed = live + free + overhead; runs copy at most the valid rows of the shared tail pages
they write into (0 into private pages). At the end, once everything is closed, the process
holds no slab memory beyond what it held before.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvcache_util import RefCache, assert_cache_matches, build_model, feeds_for, make_session  # noqa: E402
from reference import assert_close  # noqa: E402

from onnx_light_ep import KVCache, KVCacheMemoryError, KVPool, _core  # noqa: E402

# Two geometries: plain, and layer 1 a sliding-window layer (attended with the same window).
GEOMS = [
    dict(L=2, Hq=2, Hkv=1, D=8, windows=None, rollback=0, mode="ep"),
    dict(L=2, Hq=2, Hkv=2, D=4, windows=[None, 40], rollback=8, mode="cpu"),
    # int8 cold pages (recent 16 positions and the first page native), layer 1 windowed
    dict(L=2, Hq=2, Hkv=1, D=8, windows=[None, 48], rollback=8, mode="ep", quant=dict(recent=16, sink=4)),
    # int4 cold pages (head_dim a multiple of 32), layer 1 windowed
    dict(L=2, Hq=2, Hkv=1, D=32, windows=[None, 48], rollback=8, mode="ep",
         quant=dict(recent=16, sink=4, kv_quant="int4")),
]


def quant_kw(G):
    q = G.get("quant")
    return {} if q is None else dict(kv_quant=q.get("kv_quant", "int8"), recent_tokens=q["recent"],
                                     sink_tokens=q["sink"])
P = 32  # page_tokens
MSL = 256
POISON = 1e4
_SESSIONS: dict = {}


def sessions(g):
    if g not in _SESSIONS:
        G = GEOMS[g]
        w = [x or -1 for x in G["windows"]] if G["windows"] else None
        _SESSIONS[g] = (make_session(build_model(G["L"], is_causal=1, windows=w), G["mode"]),
                        make_session(build_model(G["L"], is_causal=1, seqlens_k=True, windows=w), G["mode"]))
    return _SESSIONS[g]


def qkv_for(G, B, S, seed, n=None):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(G["L"]):
        q = rng.standard_normal((B, G["Hq"], S, G["D"])).astype(np.float32)
        k = rng.standard_normal((B, G["Hkv"], S, G["D"])).astype(np.float32)
        v = rng.standard_normal((B, G["Hkv"], S, G["D"])).astype(np.float32)
        if n is not None:
            for b, nb in enumerate(n):
                q[b, :, nb:] = k[b, :, nb:] = v[b, :, nb:] = POISON
        out.append((q, k, v))
    return out


def new_ref(G, B):
    q = G.get("quant") or {}
    return RefCache(G["L"], B, G["Hkv"], G["D"], capacity=MSL, windows=G["windows"],
                    rollback_tokens=G["rollback"], page_tokens=P, kv_quant=q.get("kv_quant", "int8") if q else None,
                    recent_tokens=q.get("recent", 128), sink_tokens=q.get("sink", 4))


class Entry:
    """A live cache and its model. `key` identifies the native pool: the KVPool, or for a private
    pool an object shared by the cache and its forks."""

    def __init__(self, cache, ref, g, pool, key=None):
        self.cache, self.ref, self.g, self.pool = cache, ref, g, pool
        self.key = pool if pool is not None else (key if key is not None else object())


class Snap:
    def __init__(self, cp, ref, g, key, B):
        self.cp, self.ref, self.g, self.key, self.B = cp, ref, g, key, B


class PagedArena(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.start_committed = _core.process_committed_bytes()
        # pool 0 keeps at most two empty 2 MiB slabs (the cap is hit), pool 1 the default under a budget
        self.pools = [KVPool(page_tokens=P, keep_free_bytes=4 << 20),
                      KVPool(memory_limit_bytes=48 * P * 16 * 4, page_tokens=P)]
        self.live: list[Entry] = []
        self.snaps: list[Snap] = []
        self.dir = tempfile.mkdtemp(prefix="olep_arena_")

    # ------------------------------------------------------------ helpers

    def pick(self, data, label="cache") -> Entry:
        return self.live[data.draw(st.integers(0, len(self.live) - 1), label=label)]

    def pool_of(self, i, g=0):
        # int8 caches stay out of the budgeted pool: quantization is best effort under a budget
        # (a page the pool refuses stays native), which the model does not follow
        if GEOMS[g].get("quant") and i == 1:
            i = 0
        return None if i == 2 or self.pools[i].closed else self.pools[i]

    # ------------------------------------------------------------ creation

    @initialize(g=st.integers(0, len(GEOMS) - 1), B=st.integers(1, 3), pool=st.integers(0, 2))
    def first(self, g, B, pool):
        self.create(g, B, pool, None)

    @precondition(lambda self: len(self.live) < 5)
    @rule(g=st.integers(0, len(GEOMS) - 1), B=st.integers(1, 3), pool=st.integers(0, 2),
          quota=st.one_of(st.none(), st.integers(4, 40)))
    def create(self, g, B, pool, quota):
        G = GEOMS[g]
        p = self.pool_of(pool, g)
        page = P * 2 * G["D"] * 4
        c = KVCache(G["L"], B, G["Hkv"], G["D"], max_sequence_length=MSL, pool=p, page_tokens=P,
                    memory_limit_bytes=None if quota is None else quota * page,
                    sliding_window=G["windows"], rollback_tokens=G["rollback"], **quant_kw(G))
        self.live.append(Entry(c, new_ref(G, B), g, p))

    # ------------------------------------------------------------ runs

    def _run(self, e, S, seed, n=None):
        G = GEOMS[e.g]
        B = e.cache.batch_size
        plain, ragged = sessions(e.g)
        nn = [S] * B if n is None else n
        qkv = qkv_for(G, B, S, seed, n)
        seqlens = None if n is None else (e.ref.seq_lens + np.asarray(n) - 1).astype(np.int32)
        before = e.cache.stats()
        cow_bound = sum(G["L"] * G["Hkv"] * (int(x) % P) * 2 * G["D"] * 4
                        for x, m in zip(e.ref.seq_lens, nn) if m > 0)
        if not e.ref.fits(nn):
            return
        try:
            got = (plain if n is None else ragged).run(None, feeds_for(e.cache.handle, qkv, seqlens))
        except Exception as ex:  # noqa: BLE001 - ORT classes; only a memory limit may refuse a run
            limited = e.cache.memory_limit_bytes is not None or (e.pool is not None and e.pool.memory_limit_bytes)
            assert limited and "KVCacheMemoryError" in f"{type(ex).__name__}: {ex}", str(ex)
            after = e.cache.stats()
            after.pop("bytes_copied"), before.pop("bytes_copied")
            assert after == before, (before, after)
            return
        want = e.ref.step(qkv, nn)
        for l, (y, w) in enumerate(zip(got, want)):
            assert_close(y, w, np.float32, f"Y_{l}", extra_atol=e.ref.pv_atol[l])
        after = e.cache.stats()
        copied = after["bytes_copied"] - before["bytes_copied"]
        if before["shared_bytes"] == 0:
            assert copied == 0, "a run into private pages copied cached rows"
        assert 0 <= copied <= cow_bound, (copied, cow_bound)
        assert after["num_appends"] == before["num_appends"] + 1

    @precondition(lambda self: self.live)
    @rule(data=st.data(), S=st.sampled_from([1, 2, 7, 31, 33]), seed=st.integers(0, 2**31))
    def run(self, data, S, seed):
        self._run(self.pick(data), S, seed)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), S=st.integers(1, 40), seed=st.integers(0, 2**31))
    def run_ragged(self, data, S, seed):
        e = self.pick(data)
        lens = e.ref.seq_lens
        n = [data.draw(st.integers(0 if lens[b] > 0 else 1, S), label=f"n_{b}") for b in range(len(lens))]
        self._run(e, S, seed, n)

    # ------------------------------------------------------------ generation ops

    @precondition(lambda self: self.live and len(self.live) < 6)
    @rule(data=st.data())
    def fork(self, data):
        e = self.pick(data)
        B = e.cache.batch_size
        idx = data.draw(st.one_of(st.none(), st.lists(st.integers(0, B - 1), min_size=1, max_size=4)), label="idx")
        try:
            f = e.cache.fork(idx)
        except KVCacheMemoryError:
            assert e.cache.memory_limit_bytes is not None
            return
        assert f.stats()["bytes_copied"] == 0
        ref = e.ref.copy()
        ref.reorder(list(range(B)) if idx is None else idx)
        self.live.append(Entry(f, ref, e.g, e.pool, e.key))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def reorder(self, data):
        e = self.pick(data)
        B = e.cache.batch_size
        idx = data.draw(st.lists(st.integers(0, B - 1), min_size=B, max_size=B), label="indices")
        before = e.cache.stats()["bytes_copied"]
        e.cache.reorder(idx)
        e.ref.reorder(idx)
        assert e.cache.stats()["bytes_copied"] == before

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def truncate(self, data):
        e = self.pick(data)
        lens = e.ref.seq_lens
        n = [data.draw(st.integers(0, int(x)), label=f"n_{b}") for b, x in enumerate(lens)]
        allowed = all(m in (0, int(x)) or m >= e.ref.earliest(b) for b, (m, x) in enumerate(zip(n, lens)))
        if allowed:
            if data.draw(st.booleans(), label="as rollback"):
                e.cache.rollback(lens - np.asarray(n))
            else:
                e.cache.truncate(n)
            e.ref.truncate(n)
        else:
            try:
                e.cache.truncate(n)
            except ValueError as ex:
                assert "earliest length" in str(ex), str(ex)
            else:
                raise AssertionError(f"truncate({n}) below the earliest length was accepted")

    @precondition(lambda self: self.live and len(self.snaps) < 4)
    @rule(data=st.data())
    def checkpoint(self, data):
        e = self.pick(data)
        cp = e.cache.checkpoint()
        assert cp.seq_lens.tolist() == e.ref.seq_lens.tolist()
        self.snaps.append(Snap(cp, e.ref.copy(), e.g, e.key, e.cache.batch_size))

    @precondition(lambda self: self.live and self.snaps)
    @rule(data=st.data())
    def restore(self, data):
        s = self.snaps[data.draw(st.integers(0, len(self.snaps) - 1), label="checkpoint")]
        e = self.pick(data)
        compatible = e.g == s.g and e.key is s.key and e.cache.batch_size == s.B
        try:
            e.cache.restore(s.cp)
        except ValueError as ex:
            assert not compatible, str(ex)
            return
        except KVCacheMemoryError:
            assert e.cache.memory_limit_bytes is not None
            return
        assert compatible, "a restore across geometries or pools was accepted"
        e.ref = s.ref.copy()

    @precondition(lambda self: self.snaps)
    @rule(data=st.data())
    def close_checkpoint(self, data):
        s = self.snaps.pop(data.draw(st.integers(0, len(self.snaps) - 1), label="checkpoint"))
        s.cp.close()
        s.cp.close()

    @precondition(lambda self: self.live and len(self.live) < 6)
    @rule(data=st.data(), pool=st.integers(0, 2))
    def save_load(self, data, pool):
        e = self.pick(data)
        path = os.path.join(self.dir, "c.kv")
        e.cache.save(path)
        p = self.pool_of(pool, e.g)
        try:
            c = KVCache.load(path, pool=p)
        except KVCacheMemoryError:
            assert p is not None and p.memory_limit_bytes
            return
        assert c.page_tokens == e.cache.page_tokens and c.sliding_window == e.cache.sliding_window
        self.live.append(Entry(c, e.ref.copy(), e.g, p))

    @precondition(lambda self: len(self.live) > 1)
    @rule(data=st.data())
    def close(self, data):
        e = self.pick(data)
        e.cache.close()
        self.live.remove(e)

    @rule(i=st.integers(0, 1))
    def close_pool(self, i):
        p = self.pools[i]
        if p.closed:
            return
        users = sum(e.key is p for e in self.live) + sum(s.key is p for s in self.snaps)
        try:
            p.close()
        except ValueError as ex:
            assert users > 0 and "in use" in str(ex), str(ex)
        else:
            assert users == 0, f"a pool with {users} users closed"

    # ------------------------------------------------------------ invariants

    @invariant()
    def content_matches_model(self):
        for e in self.live:
            assert_cache_matches(e.cache, e.ref)
            fp = e.cache._first_positions()
            assert fp.tolist() == e.ref.first, (fp.tolist(), e.ref.first)

    @invariant()
    def stats_consistent(self):
        for e in self.live:
            s = e.cache.stats()
            assert s["fragmentation_bytes"] == s["committed_bytes"] - s["live_bytes"] >= 0, s
            assert s["reserved_bytes"] == 0, s
            if e.cache.memory_limit_bytes is not None:
                assert s["committed_bytes"] <= e.cache.memory_limit_bytes, s

    @invariant()
    def pool_invariant(self):
        groups = {}
        for e in self.live:
            groups.setdefault(id(e.key), []).append(e)
        for entries in groups.values():
            holders = Counter()
            for e in entries:
                G = GEOMS[e.g]
                for l in range(G["L"]):
                    for b in range(e.cache.batch_size):
                        for h in range(G["Hkv"]):
                            holders.update(e.cache._page_ids(l, b, h))
            key = entries[0].key
            pool = entries[0].pool
            for s in self.snaps:
                if s.key is key:
                    holders.update(_core.checkpoint_info(s.cp._live("test"))["page_ids"])
            refs = dict(_core.cache_pool_page_refs(int(entries[0].cache.handle[0])))
            for pid, r in refs.items():
                assert r == holders.get(pid, 0), (pid, r, holders.get(pid, 0))
            assert set(holders) <= set(refs)
            if pool is not None and not pool.closed:
                ps = pool.stats()
                assert ps["committed_bytes"] == ps["live_bytes"] + ps["free_bytes"] + ps["overhead_bytes"]
                if pool.memory_limit_bytes:
                    assert ps["live_bytes"] + ps["empty_slab_bytes"] <= pool.memory_limit_bytes, ps
                assert 0 <= ps["empty_slab_bytes"] <= min(ps["keep_free_bytes"], ps["free_bytes"] + ps["overhead_bytes"])
                if ps["num_caches"] + ps["num_checkpoints"] == 0:
                    assert ps["empty_slab_bytes"] == 0, ps

    def teardown(self):
        try:
            for s in self.snaps:
                s.cp.close()
            for e in self.live:
                e.cache.close()
            for p in self.pools:
                if not p.closed:
                    assert p.stats()["live_bytes"] == 0
                    p.close()
            assert _core.process_committed_bytes() == self.start_committed
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)  # one per example: thousands per run otherwise


PagedArena.TestCase.settings = settings(
    max_examples=60, stateful_step_count=25, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestPagedArena = PagedArena.TestCase
