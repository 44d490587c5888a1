"""Stateful property test of the cache arena: random create / from_past / run /
ragged run / fork / reorder / truncate / reset / export / close sequences
against a pure-numpy model of every cache (tests/kvcache_util.RefCache).

Runs go through real CacheAttention ORT sessions (built once per geometry).
Invariants after every rule: seq_lens and export bit-exact (float32), stats
consistent (live_bytes exact, committed_bytes >= live_bytes, reserved >=
committed), closed caches raise ValueError.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: kvcache_util, reference
from kvcache_util import (  # noqa: E402
    RefCache,
    assert_cache_matches,
    assert_snapshot_equal,
    build_model,
    feeds_for,
    make_session,
    names,
    snapshot,
)
from reference import FP32_ATOL, FP32_RTOL  # noqa: E402

from onnx_light_ep import KVCache  # noqa: E402

# num_layers, batch, q heads, kv heads, head_dim, v_head_dim, which session kind
GEOMS = [
    dict(L=1, B=2, Hq=2, Hkv=1, D=4, Dv=4, mode="cpu"),
    dict(L=2, B=3, Hq=4, Hkv=2, D=8, Dv=8, mode="ep"),
    dict(L=2, B=1, Hq=2, Hkv=2, D=4, Dv=6, mode="ep"),
]
MAX_LIVE = 4
POISON = 1e4  # padding rows beyond n_b: large finite values, visible if appended or read

_SESSIONS: dict = {}


def sessions(g):
    """(plain, ragged) sessions for geometry g, built once per module."""
    if g not in _SESSIONS:
        G = GEOMS[g]
        _SESSIONS[g] = (make_session(build_model(G["L"], is_causal=1), G["mode"]),
                        make_session(build_model(G["L"], is_causal=1, seqlens_k=True), G["mode"]))
    return _SESSIONS[g]


def qkv_for(G, S, seed, n=None):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(G["L"]):
        q = rng.standard_normal((G["B"], G["Hq"], S, G["D"])).astype(np.float32)
        k = rng.standard_normal((G["B"], G["Hkv"], S, G["D"])).astype(np.float32)
        v = rng.standard_normal((G["B"], G["Hkv"], S, G["Dv"])).astype(np.float32)
        if n is not None:
            for b, nb in enumerate(n):
                q[b, :, nb:] = POISON
                k[b, :, nb:] = POISON
                v[b, :, nb:] = POISON
        out.append((q, k, v))
    return out


def row_bytes(G):
    return G["L"] * G["Hkv"] * (G["D"] + G["Dv"]) * 4


class Entry:
    def __init__(self, cache, ref, g):
        self.cache, self.ref, self.g = cache, ref, g


class ArenaMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.live: list[Entry] = []
        self.closed: list[tuple[KVCache, np.ndarray, int]] = []

    # ------------------------------------------------------------ helpers

    def pick(self, data) -> Entry:
        return self.live[data.draw(st.integers(0, len(self.live) - 1), label="cache")]

    def add(self, cache, ref, g):
        self.live.append(Entry(cache, ref, g))

    # ------------------------------------------------------------ creation

    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(g=st.integers(0, len(GEOMS) - 1), msl=st.integers(1, 32))
    def create(self, g, msl):
        G = GEOMS[g]
        c = KVCache(G["L"], G["B"], G["Hkv"], G["D"], v_head_dim=G["Dv"], max_sequence_length=msl)
        st_ = c.stats()
        assert st_["committed_bytes"] == 0 and st_["bytes_appended"] == 0
        self.add(c, RefCache(G["L"], G["B"], G["Hkv"], G["D"], G["Dv"], capacity=msl), g)

    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(g=st.integers(0, len(GEOMS) - 1), T=st.integers(0, 8),
          msl=st.one_of(st.none(), st.integers(1, 32)), seed=st.integers(0, 2**31))
    def create_from_past(self, g, T, msl, seed):
        G = GEOMS[g]
        if T == 0 and msl is None:
            msl = 4
        rng = np.random.default_rng(seed)
        keys = [rng.standard_normal((G["B"], G["Hkv"], T, G["D"])).astype(np.float32) for _ in range(G["L"])]
        values = [rng.standard_normal((G["B"], G["Hkv"], T, G["Dv"])).astype(np.float32) for _ in range(G["L"])]
        c = KVCache.from_past(keys, values, max_sequence_length=msl)
        cap = max(T, msl or 0)
        assert c.max_sequence_length == cap
        assert c.stats()["bytes_appended"] == G["B"] * T * row_bytes(G)
        self.add(c, RefCache.from_past(keys, values, capacity=cap), g)

    @initialize(g=st.integers(0, len(GEOMS) - 1), T=st.integers(1, 6),
                msl=st.one_of(st.none(), st.integers(1, 32)), seed=st.integers(0, 2**31))
    def start_with_content(self, g, T, msl, seed):
        """Every example starts with one non-empty cache."""
        self.create_from_past(g, T, msl, seed)

    @precondition(lambda self: 0 < len(self.live) < MAX_LIVE + 1)
    @rule(data=st.data())
    def fork(self, data):
        e = self.pick(data)
        f = e.cache.fork()
        assert int(f.handle[0]) != int(e.cache.handle[0])
        assert f.max_sequence_length == e.cache.max_sequence_length
        self.add(f, e.ref.copy(), e.g)

    # ------------------------------------------------------------ runs

    def _run(self, e, S, seed, n=None):
        G = GEOMS[e.g]
        plain, ragged = sessions(e.g)
        nn = [S] * G["B"] if n is None else n
        qkv = qkv_for(G, S, seed, n)
        seqlens_k = None if n is None else (e.ref.seq_lens + np.asarray(n) - 1).astype(np.int32)
        sess = plain if n is None else ragged
        before = e.cache.stats()
        # Copy-on-write bound: at most the valid rows of each shared tail page the run writes into.
        P = e.cache.page_tokens
        cow_bound = sum(G["L"] * G["Hkv"] * (int(x) % P) * (G["D"] + G["Dv"]) * 4
                        for x, m in zip(e.ref.seq_lens, nn) if m > 0)
        if e.ref.fits(nn):
            want = e.ref.step(qkv, nn)
            got = sess.run(None, feeds_for(e.cache.handle, qkv, seqlens_k))
            for l, (y, w) in enumerate(zip(got, want)):
                np.testing.assert_allclose(y, w, atol=FP32_ATOL, rtol=FP32_RTOL, err_msg=f"Y_{l}")
            after = e.cache.stats()
            copied = after["bytes_copied"] - before["bytes_copied"]
            if before["shared_bytes"] == 0:
                assert copied == 0, "a run into private pages copied cached rows"
            assert 0 <= copied <= cow_bound, (copied, cow_bound)
            assert after["bytes_appended"] - before["bytes_appended"] == sum(nn) * row_bytes(G)
            assert after["num_appends"] == before["num_appends"] + 1
        else:
            snap = snapshot(e.cache)
            try:
                sess.run(None, feeds_for(e.cache.handle, qkv, seqlens_k))
            except Exception as ex:  # noqa: BLE001 - ORT raises its own classes
                assert names(str(ex), "max_sequence_length", "capacity"), str(ex)
            else:
                raise AssertionError(f"run beyond max_sequence_length={e.ref.capacity} succeeded "
                                     f"(seq_lens {e.ref.seq_lens}, adding {nn})")
            assert_snapshot_equal(e.cache, snap, "after over-capacity run")
            after = e.cache.stats()
            assert after["bytes_appended"] == before["bytes_appended"]
            assert after["num_appends"] == before["num_appends"]

    @precondition(lambda self: self.live)
    @rule(data=st.data(), S=st.integers(1, 4), seed=st.integers(0, 2**31))
    def run(self, data, S, seed):
        self._run(self.pick(data), S, seed)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), S=st.integers(1, 4), seed=st.integers(0, 2**31))
    def run_ragged(self, data, S, seed):
        """seqlens_k: sequence b appends n_b in [0, S] rows (>= 1 for an empty sequence)."""
        e = self.pick(data)
        lens = e.ref.seq_lens
        n = [data.draw(st.integers(0 if lens[b] > 0 else 1, S), label=f"n_{b}") for b in range(len(lens))]
        self._run(e, S, seed, n)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), seed=st.integers(0, 2**31))
    def run_wrong_geometry(self, data, seed):
        """Feeding a cache to a session of another geometry fails and changes nothing."""
        e = self.pick(data)
        g2 = data.draw(st.sampled_from([g for g in range(len(GEOMS)) if g != e.g]), label="other geometry")
        snap = snapshot(e.cache)
        try:
            sessions(g2)[0].run(None, feeds_for(e.cache.handle, qkv_for(GEOMS[g2], 1, seed)))
        except Exception:  # noqa: BLE001
            pass
        else:
            raise AssertionError(f"geometry {GEOMS[g2]} accepted a cache of geometry {GEOMS[e.g]}")
        assert_snapshot_equal(e.cache, snap, "after wrong-geometry run")

    @precondition(lambda self: self.closed)
    @rule(data=st.data(), seed=st.integers(0, 2**31))
    def run_closed(self, data, seed):
        c, h, g = self.closed[data.draw(st.integers(0, len(self.closed) - 1), label="closed")]
        try:
            sessions(g)[0].run(None, feeds_for(h, qkv_for(GEOMS[g], 1, seed)))
        except Exception as ex:  # noqa: BLE001
            assert names(str(ex), "cache", "handle"), str(ex)
        else:
            raise AssertionError("a run with a closed cache's handle succeeded")

    # ------------------------------------------------------------ generation ops

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def reorder(self, data):
        e = self.pick(data)
        B = GEOMS[e.g]["B"]
        idx = data.draw(st.lists(st.integers(0, B - 1), min_size=B, max_size=B), label="indices")
        before = e.cache.stats()["bytes_copied"]
        e.cache.reorder(idx)
        e.ref.reorder(idx)
        assert e.cache.stats()["bytes_copied"] == before, "reorder copied rows"

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def reorder_invalid(self, data):
        e = self.pick(data)
        B = GEOMS[e.g]["B"]
        idx = data.draw(st.one_of(
            st.lists(st.integers(0, B - 1), min_size=B + 1, max_size=B + 2),
            st.lists(st.integers(0, B - 1), min_size=0, max_size=B - 1),
            st.lists(st.integers(0, B - 1), min_size=B, max_size=B).map(lambda x: x[:-1] + [B]),
            st.lists(st.integers(0, B - 1), min_size=B, max_size=B).map(lambda x: [-1] + x[1:]),
        ), label="bad indices")
        snap = snapshot(e.cache)
        try:
            e.cache.reorder(idx)
        except ValueError:
            pass
        else:
            raise AssertionError(f"reorder({idx}) accepted with batch_size={B}")
        assert_snapshot_equal(e.cache, snap, "after invalid reorder")

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def truncate(self, data):
        e = self.pick(data)
        lens = e.ref.seq_lens
        if data.draw(st.booleans(), label="scalar"):
            n = data.draw(st.integers(0, int(lens.min())), label="n")
            e.cache.truncate(n)
            e.ref.truncate(n)
        else:
            n = [data.draw(st.integers(0, int(x)), label=f"n_{b}") for b, x in enumerate(lens)]
            e.cache.truncate(n)
            e.ref.truncate(n)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def truncate_invalid(self, data):
        e = self.pick(data)
        lens = e.ref.seq_lens
        b = data.draw(st.integers(0, len(lens) - 1), label="b")
        n = [int(x) for x in lens]
        n[b] = data.draw(st.one_of(st.integers(int(lens[b]) + 1, int(lens[b]) + 5), st.integers(-3, -1)),
                         label="bad n")
        snap = snapshot(e.cache)
        try:
            e.cache.truncate(n)
        except ValueError:
            pass
        else:
            raise AssertionError(f"truncate({n}) accepted with seq_lens={list(lens)}")
        assert_snapshot_equal(e.cache, snap, "after invalid truncate")

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def reset(self, data):
        e = self.pick(data)
        e.cache.reset()
        e.ref.reset()
        assert e.cache.stats()["committed_bytes"] == 0

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def export(self, data):
        e = self.pick(data)
        layer = data.draw(st.integers(0, GEOMS[e.g]["L"] - 1), label="layer")
        before = e.cache.stats()["bytes_copied"]
        k, v = e.cache.export(layer)
        rk, rv = e.ref.export(layer)
        np.testing.assert_array_equal(k, rk)
        np.testing.assert_array_equal(v, rv)
        assert e.cache.stats()["bytes_copied"] >= before

    @precondition(lambda self: len(self.live) > 1)  # keep one live: every rule stays enabled
    @rule(data=st.data())
    def close(self, data):
        e = self.pick(data)
        h = e.cache.handle.copy()
        e.cache.close()
        e.cache.close()  # idempotent
        self.live.remove(e)
        self.closed.append((e.cache, h, e.g))

    # ------------------------------------------------------------ invariants

    @invariant()
    def content_matches_model(self):
        for e in self.live:
            assert_cache_matches(e.cache, e.ref)

    @invariant()
    def stats_consistent(self):
        for e in self.live:
            s = e.cache.stats()
            # live_bytes counts each page's valid rows once: equal to the model's rows unless
            # sequences share pages (reorder with repeats)
            if s["shared_bytes"] == 0:
                assert s["live_bytes"] == e.ref.live_bytes(), (s, e.ref.seq_lens)
            assert s["live_bytes"] <= e.ref.live_bytes(), (s, e.ref.seq_lens)
            assert s["committed_bytes"] >= s["live_bytes"], s
            assert s["fragmentation_bytes"] == s["committed_bytes"] - s["live_bytes"], s
            assert s["reserved_bytes"] == 0, s
            assert min(s.values()) >= 0, s

    @invariant()
    def closed_caches_raise(self):
        for c, _, _ in self.closed:
            for call in (lambda: c.seq_lens, c.stats, lambda: c.export(0), c.fork):
                try:
                    call()
                except ValueError:
                    continue
                raise AssertionError("a closed cache was usable")

    def teardown(self):
        for e in self.live:
            e.cache.close()


ArenaMachine.TestCase.settings = settings(
    max_examples=25, stateful_step_count=15, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestArena = ArenaMachine.TestCase
