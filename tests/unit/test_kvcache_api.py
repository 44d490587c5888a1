"""KVCache Python API without ORT sessions (docs/API.md, "KVCache")."""
from __future__ import annotations

import gc
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: kvcache_util, reference
from kvcache_util import (  # noqa: E402
    NP_DTYPE,
    STATS_KEYS,
    RefCache,
    assert_bit_equal,
    assert_cache_matches,
    bits,
    assert_snapshot_equal,
    names,
    snapshot,
)

import onnx_light_ep  # noqa: E402
from onnx_light_ep import KVCache  # noqa: E402

GEOM = dict(num_layers=2, batch_size=3, kv_num_heads=2, head_dim=4)


def make_past(rng, L=2, B=3, H=2, T=5, D=4, Dv=None, dtype="float32"):
    Dv = D if Dv is None else Dv
    dt = NP_DTYPE[dtype]
    keys = [rng.standard_normal((B, H, T, D)).astype(np.float32).astype(dt) for _ in range(L)]
    values = [rng.standard_normal((B, H, T, Dv)).astype(np.float32).astype(dt) for _ in range(L)]
    return keys, values


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def filled(rng):
    """A 2-layer cache holding 5 rows per sequence, with its numpy model."""
    keys, values = make_past(rng)
    c = KVCache.from_past(keys, values, max_sequence_length=16)
    yield c, RefCache.from_past(keys, values, capacity=16)
    c.close()


# ---------------------------------------------------------------- construction


@pytest.mark.parametrize(
    "arg,value",
    [
        ("num_layers", 0), ("num_layers", -1),
        ("batch_size", 0), ("batch_size", -2),
        ("kv_num_heads", 0), ("kv_num_heads", -1),
        ("head_dim", 0), ("head_dim", -4),
        ("v_head_dim", 0), ("v_head_dim", -1),
        ("max_sequence_length", 0), ("max_sequence_length", -1),
        ("memory_limit_bytes", -1),
        ("dtype", "float64"), ("dtype", "int8"), ("dtype", "fp32"), ("dtype", np.int32),
    ],
)
def test_constructor_rejects_bad_argument(arg, value):
    kw = dict(GEOM, max_sequence_length=8)
    kw[arg] = value
    with pytest.raises(ValueError) as ei:
        KVCache(**kw)
    assert names(str(ei.value), arg), f"message does not name {arg!r}: {ei.value}"


def test_constructor_rejects_unreservable_capacity():
    with pytest.raises((ValueError, MemoryError, OverflowError)):
        KVCache(1, 1, 1, 8, max_sequence_length=2**62)


@pytest.mark.parametrize(
    "dtype,expect",
    [("float32", "float32"), ("float16", "float16"), ("bfloat16", "bfloat16"),
     (np.float32, "float32"), (np.dtype(np.float16), "float16"), (ml_dtypes.bfloat16, "bfloat16")],
)
def test_geometry_properties(dtype, expect):
    with KVCache(2, 3, 4, 8, v_head_dim=6, dtype=dtype, max_sequence_length=10,
                 memory_limit_bytes=1 << 20) as c:
        assert (c.num_layers, c.batch_size, c.kv_num_heads, c.head_dim, c.v_head_dim) == (2, 3, 4, 8, 6)
        assert str(np.dtype(c.dtype)) == expect
        assert c.max_sequence_length == 10
        assert c.memory_limit_bytes == 1 << 20
        s = c.seq_lens
        assert isinstance(s, np.ndarray) and s.dtype == np.int64 and s.shape == (3,)
        assert np.all(s == 0)
        k, v = c.export(1)
        assert k.shape == (3, 4, 0, 8) and v.shape == (3, 4, 0, 6)
        assert k.dtype == NP_DTYPE[expect] and v.dtype == NP_DTYPE[expect]


def test_defaults_and_read_only():
    with KVCache(1, 2, 1, 4, max_sequence_length=4) as c:
        assert c.v_head_dim == 4
        assert str(np.dtype(c.dtype)) == "float32"
        assert c.memory_limit_bytes is None
        for attr in ("num_layers", "batch_size", "kv_num_heads", "head_dim", "v_head_dim",
                     "dtype", "max_sequence_length", "memory_limit_bytes"):
            with pytest.raises(AttributeError):
                setattr(c, attr, getattr(c, attr))


# ---------------------------------------------------------------- handle


def test_handle_is_int64_shape_1_and_never_reused():
    seen = set()
    for _ in range(20):
        c = KVCache(1, 1, 1, 4, max_sequence_length=4)
        h = c.handle
        assert isinstance(h, np.ndarray) and h.dtype == np.int64 and h.shape == (1,)
        assert int(h[0]) not in seen, "handle value reused after close()"
        seen.add(int(h[0]))
        c.close()
    a = KVCache(1, 1, 1, 4, max_sequence_length=4)
    b = KVCache(1, 1, 1, 4, max_sequence_length=4)
    assert int(a.handle[0]) != int(b.handle[0])
    assert int(a.handle[0]) not in seen and int(b.handle[0]) not in seen
    a.close()
    b.close()


# ---------------------------------------------------------------- stats


def test_stats_keys_and_growth(rng):
    L, B, H, D, Dv, T = 2, 3, 2, 4, 6, 5
    c = KVCache(L, B, H, D, v_head_dim=Dv, max_sequence_length=32)
    st = c.stats()
    assert set(STATS_KEYS) <= set(st), f"missing keys: {set(STATS_KEYS) - set(st)}"
    for k in STATS_KEYS:
        assert isinstance(st[k], (int, np.integer)) and st[k] >= 0, (k, st[k])
    assert st["committed_bytes"] == 0 and st["live_bytes"] == 0
    assert st["bytes_appended"] == 0 and st["bytes_copied"] == 0 and st["num_appends"] == 0
    assert st["reserved_bytes"] == 0  # nothing is reserved up front, only by a run's open step
    c.close()

    keys, values = make_past(rng, L, B, H, T, D, Dv)
    c = KVCache.from_past(keys, values, max_sequence_length=32)
    st = c.stats()
    row_bytes = L * H * (D + Dv) * 4
    assert st["live_bytes"] == B * T * row_bytes
    page = c.page_tokens * (D + Dv) * 4
    assert st["num_pages"] == L * B * H  # T=5 positions: one page per (layer, sequence, head)
    assert st["committed_bytes"] == L * B * H * page
    assert st["fragmentation_bytes"] == st["committed_bytes"] - st["live_bytes"]
    assert st["reserved_bytes"] == 0 and st["shared_bytes"] == 0 and st["checkpoint_bytes"] == 0
    assert st["page_table_bytes"] > 0
    assert st["bytes_appended"] == B * T * row_bytes

    c.truncate([5, 2, 0])
    st2 = c.stats()
    assert st2["live_bytes"] == 7 * row_bytes
    assert st2["committed_bytes"] == L * 2 * H * page  # sequence 2 released its pages

    c.reset()
    st3 = c.stats()
    assert st3["live_bytes"] == 0
    assert st3["committed_bytes"] == 0, "reset() must release storage"
    assert np.all(c.seq_lens == 0)
    c.close()


def test_export_counts_copied_bytes_fork_and_reorder_copy_nothing(filled):
    c, _ = filled
    b0 = c.stats()["bytes_copied"]
    c.export(0)
    b1 = c.stats()["bytes_copied"]
    assert b1 > b0
    f = c.fork()
    assert c.stats()["bytes_copied"] == b1 and f.stats()["bytes_copied"] == 0
    assert f.stats()["shared_bytes"] == f.stats()["committed_bytes"] > 0  # every page is shared
    c.reorder([2, 0, 0])  # a duplicate shares pages too: no rows copied
    assert c.stats()["bytes_copied"] == b1
    f.close()


# ---------------------------------------------------------------- from_past / export


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_from_past_export_round_trip_bit_exact(rng, dtype):
    keys, values = make_past(rng, L=3, B=2, H=2, T=7, D=8, Dv=4, dtype=dtype)
    dt = NP_DTYPE[dtype]
    # special values must survive untouched: -0, +-inf, a subnormal, max finite
    sub = np.array(ml_dtypes.finfo(dt).smallest_subnormal, dt)
    keys[0][0, 0, 0, :4] = np.array([-0.0, np.inf, -np.inf, 0], np.float32).astype(dt)
    keys[0][0, 0, 0, 3] = sub
    values[1][1, 1, 6, 0] = np.array(ml_dtypes.finfo(dt).max, dt)
    with KVCache.from_past(keys, values) as c:
        assert str(np.dtype(c.dtype)) == dtype
        assert (c.num_layers, c.batch_size, c.kv_num_heads, c.head_dim, c.v_head_dim) == (3, 2, 2, 8, 4)
        assert c.max_sequence_length == 7
        np.testing.assert_array_equal(c.seq_lens, [7, 7])
        for l in range(3):
            k, v = c.export(l)
            assert_bit_equal(k, keys[l], f"layer {l} key")
            assert_bit_equal(v, values[l], f"layer {l} value")


def test_from_past_capacity(rng):
    keys, values = make_past(rng, T=5)
    with KVCache.from_past(keys, values, max_sequence_length=9) as c:
        assert c.max_sequence_length == 9
    with KVCache.from_past(keys, values, max_sequence_length=3) as c:
        assert c.max_sequence_length == 5
        np.testing.assert_array_equal(c.seq_lens, [5, 5, 5])


def test_from_past_zero_length(rng):
    keys, values = make_past(rng, T=0)
    with KVCache.from_past(keys, values, max_sequence_length=4) as c:
        np.testing.assert_array_equal(c.seq_lens, [0, 0, 0])
        assert c.max_sequence_length == 4
        assert c.export(1)[0].shape == (3, 2, 0, 4)


def test_from_past_rejects_inconsistent_input(rng):
    keys, values = make_past(rng)
    bad = [
        ("keys", [], []),
        ("values", keys, values[:1]),
        ("keys", [keys[0], keys[1][:, :, :3]], values),  # layers disagree on L
        ("values", keys, [values[0], values[1][:2]]),  # batch differs
        ("values", keys, [v.astype(np.float16) for v in values]),  # dtype differs
        ("keys", [k.astype(np.float64) for k in keys], [v.astype(np.float64) for v in values]),
        ("keys", [k[0] for k in keys], values),  # not 4-D
        ("values", keys, [v[:, :1] for v in values]),  # kv heads differ
    ]
    for arg, k, v in bad:
        with pytest.raises(ValueError) as ei:
            KVCache.from_past(k, v)
        assert names(str(ei.value), arg, "key", "value", "keys", "values", "dtype"), str(ei.value)


def test_from_past_over_memory_limit(rng):
    keys, values = make_past(rng, T=5)
    live = 2 * 3 * 2 * 5 * (4 + 4) * 4
    with pytest.raises(onnx_light_ep.KVCacheMemoryError) as ei:
        KVCache.from_past(keys, values, memory_limit_bytes=live // 2)
    assert isinstance(ei.value, MemoryError) and isinstance(ei.value, RuntimeError)
    assert names(str(ei.value), "memory_limit_bytes"), str(ei.value)
    # a generous limit is fine and is recorded
    with KVCache.from_past(keys, values, memory_limit_bytes=1 << 24) as c:
        assert c.memory_limit_bytes == 1 << 24
        assert c.stats()["committed_bytes"] <= 1 << 24


def test_export_bad_layer(filled):
    c, ref = filled
    for layer in (-1, 2, 100):
        with pytest.raises(ValueError) as ei:
            c.export(layer)
        assert names(str(ei.value), "layer"), str(ei.value)
    assert_cache_matches(c, ref)


def test_export_pads_shorter_sequences_with_zeros(filled):
    c, ref = filled
    c.truncate([2, 5, 0])
    ref.truncate([2, 5, 0])
    k, v = c.export(1)
    assert k.shape == (3, 2, 5, 4)
    assert np.all(bits(k[0, :, 2:]) == 0) and np.all(bits(v[2]) == 0)
    assert_cache_matches(c, ref)
    c.truncate([1, 1, 0])
    ref.truncate([1, 1, 0])
    assert c.export(0)[0].shape == (3, 2, 1, 4)
    assert_cache_matches(c, ref)


# ---------------------------------------------------------------- truncate


def test_truncate_valid(filled):
    c, ref = filled
    c.truncate(np.array([4, 1, 5]))
    ref.truncate([4, 1, 5])
    assert_cache_matches(c, ref)
    c.truncate(1)
    ref.truncate(1)
    assert_cache_matches(c, ref)
    c.truncate([0, 1, 0])
    ref.truncate([0, 1, 0])
    assert_cache_matches(c, ref)


@pytest.mark.parametrize(
    "lengths", [-1, 4, [5, 5, 5], [5, 3, 6], [5, -1, 0], [1, 2], [1, 2, 3, 4], np.array([1, 1])],
)
def test_truncate_invalid_changes_nothing(filled, lengths):
    c, ref = filled
    c.truncate([5, 3, 4])  # 4 and [5, 5, 5] exceed seq_lens[1] = 3
    ref.truncate([5, 3, 4])
    snap = snapshot(c)
    st = c.stats()
    with pytest.raises(ValueError) as ei:
        c.truncate(lengths)
    assert names(str(ei.value), "lengths", "truncate"), str(ei.value)
    assert_snapshot_equal(c, snap)
    assert_cache_matches(c, ref)
    assert c.stats()["live_bytes"] == st["live_bytes"]


# ---------------------------------------------------------------- reorder


@pytest.mark.parametrize("idx", [[2, 0, 0], [1, 1, 1], [0, 1, 2], [2, 1, 0]])
def test_reorder_matches_numpy(filled, idx):
    c, ref = filled
    c.truncate([5, 2, 3])  # distinct lengths make a wrong permutation visible
    ref.truncate([5, 2, 3])
    before = [c.export(l) for l in range(2)]
    lens = c.seq_lens.copy()
    c.reorder(np.array(idx, np.int64))
    ref.reorder(idx)
    np.testing.assert_array_equal(c.seq_lens, lens[idx])
    assert_cache_matches(c, ref)
    for l in range(2):
        k, v = c.export(l)
        n = int(lens[idx].max())
        assert_bit_equal(k, before[l][0][idx][:, :, :n])
        assert_bit_equal(v, before[l][1][idx][:, :, :n])
    # chained reorders index the state produced by the previous one
    c.reorder([1, 2, 0])
    ref.reorder([1, 2, 0])
    assert_cache_matches(c, ref)


def test_reorder_accepts_int32_and_lists(filled):
    c, ref = filled
    c.reorder(np.array([1, 0, 2], np.int32))
    ref.reorder([1, 0, 2])
    c.reorder([2, 2, 0])
    ref.reorder([2, 2, 0])
    assert_cache_matches(c, ref)


@pytest.mark.parametrize(
    "idx",
    [[0, 1, 3], [-1, 0, 1], [0, 1], [0, 1, 2, 0], [0.0, 1.0, 2.0],
     np.array([0.0, 1.0, 2.0]), np.array([[0, 1, 2]]), [2**40, 0, 0]],
)
def test_reorder_invalid_changes_nothing(filled, idx):
    c, ref = filled
    c.truncate([5, 2, 3])
    ref.truncate([5, 2, 3])
    snap = snapshot(c)
    with pytest.raises(ValueError) as ei:
        c.reorder(idx)
    assert names(str(ei.value), "indices"), str(ei.value)
    assert_snapshot_equal(c, snap)
    assert_cache_matches(c, ref)


# ---------------------------------------------------------------- fork


def test_fork_is_independent(filled):
    c, ref = filled
    f = c.fork()
    fref = ref.copy()
    assert int(f.handle[0]) != int(c.handle[0])
    assert (f.num_layers, f.batch_size, f.kv_num_heads, f.head_dim, f.v_head_dim, f.max_sequence_length) == \
        (c.num_layers, c.batch_size, c.kv_num_heads, c.head_dim, c.v_head_dim, c.max_sequence_length)
    assert_cache_matches(f, fref, "fork")
    # mutate the fork: original unchanged
    f.reorder([2, 2, 1])
    fref.reorder([2, 2, 1])
    f.truncate([1, 4, 0])
    fref.truncate([1, 4, 0])
    assert_cache_matches(c, ref, "original after fork mutation")
    assert_cache_matches(f, fref, "fork")
    # mutate the original: fork unchanged
    c.reorder([1, 0, 0])
    ref.reorder([1, 0, 0])
    c.truncate([3, 0, 2])
    ref.truncate([3, 0, 2])
    assert_cache_matches(f, fref, "fork after original mutation")
    assert_cache_matches(c, ref, "original")
    # closing the original leaves the fork usable
    g = f.fork()
    c.close()
    assert_cache_matches(f, fref, "fork after original closed")
    f.reset()
    assert_cache_matches(g, fref, "fork of fork after fork reset")
    g.close()
    f.close()


def test_fork_of_empty_cache():
    with KVCache(1, 2, 1, 4, dtype="float16", max_sequence_length=3, memory_limit_bytes=1 << 20) as c:
        with c.fork() as f:
            assert str(np.dtype(f.dtype)) == "float16"
            assert f.memory_limit_bytes == 1 << 20
            np.testing.assert_array_equal(f.seq_lens, [0, 0])


# ---------------------------------------------------------------- reset / close


def test_reset(filled):
    c, ref = filled
    h = int(c.handle[0])
    c.reset()
    ref.reset()
    assert_cache_matches(c, ref)
    assert c.stats()["committed_bytes"] == 0
    assert int(c.handle[0]) == h
    assert c.max_sequence_length == 16


def _using_methods(c):
    return {
        "seq_lens": lambda: c.seq_lens,
        "stats": c.stats,
        "export": lambda: c.export(0),
        "fork": c.fork,
        "reset": c.reset,
        "truncate": lambda: c.truncate(0),
        "reorder": lambda: c.reorder([0] * 3),
    }


def test_close_idempotent_and_use_after_close(filled):
    c, _ = filled
    c.close()
    c.close()
    for name, call in _using_methods(c).items():
        with pytest.raises(ValueError):
            call()


def test_context_manager(rng):
    keys, values = make_past(rng)
    with KVCache.from_past(keys, values) as c:
        assert c.seq_lens[0] == 5
    for name, call in _using_methods(c).items():
        with pytest.raises(ValueError):
            call()
    with pytest.raises(RuntimeError, match="boom"):
        with KVCache(1, 3, 1, 4, max_sequence_length=4) as d:
            raise RuntimeError("boom")
    with pytest.raises(ValueError):
        d.stats()
    c.close()  # still idempotent after the context manager closed it


def test_close_decrements_num_live_caches():
    import onnx_light_ep._core as core

    gc.collect()
    n0 = core.num_live_caches()
    cs = [KVCache(1, 1, 1, 4, max_sequence_length=4) for _ in range(5)]
    assert core.num_live_caches() == n0 + 5
    for c in cs:
        c.close()
    assert core.num_live_caches() == n0


def test_dropped_cache_is_released_by_gc():
    """cache.py: memory is released by close(), a with block, or garbage collection."""
    import onnx_light_ep._core as core

    gc.collect()
    n0 = core.num_live_caches()
    c = KVCache(1, 1, 1, 4, max_sequence_length=4)
    assert core.num_live_caches() == n0 + 1
    del c
    gc.collect()
    assert core.num_live_caches() == n0


def test_memory_limit_zero_is_a_limit_not_unlimited(rng):
    """memory_limit_bytes=0 must either be rejected (ValueError naming it) or be
    a real 0-byte cap; it must not silently mean 'no limit' (that is None)."""
    keys, values = make_past(rng, T=2)
    try:
        c = KVCache(1, 3, 2, 4, max_sequence_length=4, memory_limit_bytes=0)
    except ValueError as e:
        assert names(str(e), "memory_limit_bytes"), str(e)
    else:
        with c:
            assert c.memory_limit_bytes == 0, f"memory_limit_bytes=0 reads back as {c.memory_limit_bytes!r}"
    try:
        d = KVCache.from_past(keys, values, memory_limit_bytes=0)
    except ValueError as e:
        assert names(str(e), "memory_limit_bytes"), str(e)
    else:
        committed = d.stats()["committed_bytes"]
        d.close()
        pytest.fail(f"from_past(memory_limit_bytes=0) committed {committed} bytes")


def test_from_past_non_contiguous_views(rng):
    keys, values = make_past(rng, L=2, B=3, H=2, T=10, D=4)
    kv = [k[:, ::-1, ::2] for k in keys]  # strided, reversed views
    vv = [np.asfortranarray(v[:, :, 1::2]) for v in values]
    with KVCache.from_past(kv, vv) as c:
        np.testing.assert_array_equal(c.seq_lens, [5, 5, 5])
        for l in range(2):
            k, v = c.export(l)
            assert_bit_equal(k, np.ascontiguousarray(kv[l]), f"layer {l} key")
            assert_bit_equal(v, np.ascontiguousarray(vv[l]), f"layer {l} value")


@pytest.mark.parametrize(
    "head_dim,v_head_dim,dtype,want",
    [
        (128, None, "float16", 256),  # 128 KiB pages
        (128, None, "bfloat16", 256),
        (128, None, "float32", 128),
        (64, None, "float16", 512),
        (256, None, "float16", 128),  # 128 tokens hold 128 KiB already
        (64, 128, "float16", 512),  # (64 + 128) * 2 * 256 = 96 KiB < 128 KiB
        (4, None, "float32", 1024),  # capped
    ],
)
def test_default_page_tokens(head_dim, v_head_dim, dtype, want):
    got = onnx_light_ep.default_page_tokens(head_dim, dtype, v_head_dim)
    assert got == want
    row = (head_dim + (v_head_dim or head_dim)) * np.dtype(NP_DTYPE[dtype]).itemsize
    assert got == 1024 or got * row >= onnx_light_ep.DEFAULT_PAGE_BYTES
    assert got == 128 or (got // 2) * row < onnx_light_ep.DEFAULT_PAGE_BYTES
    # what a cache gets without page_tokens, alone and in a pool that names none
    geom = dict(num_layers=1, batch_size=1, kv_num_heads=1, head_dim=head_dim, dtype=dtype, max_sequence_length=8)
    if v_head_dim is not None:
        geom["v_head_dim"] = v_head_dim
    with KVCache(**geom) as c:
        assert c.page_tokens == want
    with onnx_light_ep.KVPool() as pool, KVCache(pool=pool, **geom) as c:
        assert c.page_tokens == want
    with onnx_light_ep.KVPool(page_tokens=64) as pool, KVCache(pool=pool, **geom) as c:
        assert c.page_tokens == 64


def test_default_page_tokens_errors():
    with pytest.raises(ValueError, match="head_dim"):
        onnx_light_ep.default_page_tokens(0, "float16")
    with pytest.raises(ValueError, match="v_head_dim"):
        onnx_light_ep.default_page_tokens(64, "float16", 5000)
    with pytest.raises(ValueError, match="dtype"):
        onnx_light_ep.default_page_tokens(64, "int8")
