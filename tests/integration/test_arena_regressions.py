"""Regressions for faults an adversarial review of the paged arena found, each reproduced first:

- a KeyboardInterrupt (any BaseException) inside onnx_light_ep.InferenceSession.run left the
  thread's run open forever (the cache owned by a dead run, later runs never committing);
- KVCache.rollback read seq_lens and truncated in two calls, so it raced concurrent runs;
- two caches in one graph committed by two CacheCommit nodes were not atomic (now: one
  CacheCommit names every cache, num_caches; two commit nodes fail at session creation);
- closing a pool raced with creating a cache in it; a KVPool object collected while a
  checkpoint still pinned its pages leaked its handle;
- Python ints beyond int64 raised TypeError/OverflowError naming no argument;
- checkpoint_bytes counted pages another cache also held; a restore across max_sequence_length
  did not say which field differed; geometry properties still answered after close();
  KVPool(page_tokens=2**20) was accepted; a window wider than the cache was refused;
- on the plain CPU EP path, a failed run's reservation stayed held until that cache was used
  again: now the next run of the same graph on that thread rolls it back.
"""
from __future__ import annotations

import gc
import sys
import threading
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvcache_util import RefCache, assert_cache_matches, build_model, feeds_for, make_session, random_qkv  # noqa: E402
from test_run_transactions import B, D, HKV, HQ, feeds, session, transaction_model  # noqa: E402

import onnx_light_ep  # noqa: E402
from onnx_light_ep import KVCache, KVPool, _core, _registration  # noqa: E402

DOMAIN = onnx_light_ep.DOMAIN


def test_keyboard_interrupt_inside_run_leaves_the_cache_usable():
    """The wrapper's run ends the deferred run whatever escapes ORT's run (here a
    KeyboardInterrupt raised after ORT appended the rows): nothing commits, the next runs on
    this and other threads work and commit."""
    sess = make_session(build_model(2), "ep")
    base_run = type(sess).__mro__[1].run

    def interrupted(self, *args, **kwargs):
        base_run(self, *args, **kwargs)  # the rows are appended to the deferred step...
        raise KeyboardInterrupt          # ...and the run is interrupted before it returns

    guarded = _registration._guarded(interrupted)
    rng = np.random.default_rng(0)
    with KVCache(2, 2, 2, 8, max_sequence_length=64) as c:
        ref = RefCache(2, 2, 2, 8)
        with pytest.raises(KeyboardInterrupt):
            guarded(sess, None, feeds_for(c.handle, random_qkv(rng, 2, 2, 4, 2, 5, 8)))
        assert c.seq_lens.tolist() == [0, 0] and c.stats()["reserved_bytes"] == 0
        errors = []
        t = threading.Thread(target=lambda: (c.truncate(0), errors.append(None)))
        t.start()
        t.join()
        assert errors == [None]  # not KVCacheBusyError: no dead run owns the cache
        for _ in range(3):
            qkv = random_qkv(rng, 2, 2, 4, 2, 2, 8)
            want = ref.step(qkv)
            got = sess.run(None, feeds_for(c.handle, qkv))
            np.testing.assert_allclose(got[1], want[1], atol=1e-5, rtol=1e-4)
        assert_cache_matches(c, ref)


def test_rollback_is_atomic_against_concurrent_runs():
    sess = make_session(build_model(1), "ep")
    rng = np.random.default_rng(1)
    qkv = random_qkv(rng, 1, 1, 4, 2, 1, 8)
    runs, done = 800, threading.Event()
    rolled = [0]
    with KVCache(1, 1, 2, 8, max_sequence_length=runs + 8) as c:

        def roller():
            while not done.is_set():
                if c.seq_lens[0] >= 2:
                    try:
                        c.rollback(1)
                        rolled[0] += 1
                    except (ValueError, onnx_light_ep.KVCacheBusyError):
                        pass

        t = threading.Thread(target=roller)
        t.start()
        ok = 0
        for _ in range(runs):
            try:
                sess.run(None, feeds_for(c.handle, qkv))
                ok += 1
            except onnx_light_ep.KVCacheBusyError:
                pass
        done.set()
        t.join()
        assert rolled[0] > 0 and ok > rolled[0], (ok, rolled[0])
        assert c.seq_lens[0] == ok - rolled[0], (ok, rolled[0], c.seq_lens)


def _two_cache_model(two_commit_nodes):
    t = TP.FLOAT
    ins = [helper.make_tensor_value_info(n, t, None) for n in ("qa", "ka", "va", "qb", "kb", "vb")]
    ins += [helper.make_tensor_value_info("kv_a", TP.INT64, [1]), helper.make_tensor_value_info("kv_b", TP.INT64, [1]),
            helper.make_tensor_value_info("shape", TP.INT64, [2])]
    nodes = [helper.make_node("CacheAttention", ["qa", "ka", "va", "kv_a"], ["ya"], domain=DOMAIN, layer=0,
                              commit_node=1),
             helper.make_node("CacheAttention", ["qb", "kb", "vb", "kv_b"], ["yb"], domain=DOMAIN, layer=0,
                              commit_node=1),
             helper.make_node("Reshape", ["ya", "shape"], ["late"])]
    if two_commit_nodes:
        nodes += [helper.make_node("CacheCommit", ["kv_a", "ya", "yb"], ["lens_a"], domain=DOMAIN),
                  helper.make_node("CacheCommit", ["kv_b", "late", "lens_a"], ["lens"], domain=DOMAIN)]
    else:
        nodes.append(helper.make_node("CacheCommit", ["kv_a", "kv_b", "ya", "yb", "late"], ["lens"], domain=DOMAIN,
                                      num_caches=2))
    outs = [helper.make_tensor_value_info(n, t, None) for n in ("ya", "yb", "late")]
    outs.append(helper.make_tensor_value_info("lens", TP.INT64, None))
    return helper.make_model(helper.make_graph(nodes, "two", ins, outs),
                             opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1)],
                             ir_version=10).SerializeToString()


@pytest.mark.parametrize("path", ["wrapper", "ep", "cpu"])
def test_one_commit_node_for_two_caches_is_atomic(path):
    rng = np.random.default_rng(2)
    sess = session(_two_cache_model(False), path)
    x = lambda: rng.standard_normal((1, 1, 1, 8)).astype(np.float32)  # noqa: E731
    with KVCache(1, 1, 1, 8, max_sequence_length=64) as a, KVCache(1, 1, 1, 8, max_sequence_length=64) as b:
        f = dict(qa=x(), ka=x(), va=x(), qb=x(), kb=x(), vb=x(), kv_a=a.handle, kv_b=b.handle)
        with pytest.raises(Exception, match="Reshape|reshape"):
            sess.run(None, dict(f, shape=np.array([-1, 7], np.int64)))
        assert a.seq_lens.tolist() == [0] and b.seq_lens.tolist() == [0]
        out = sess.run(None, dict(f, shape=np.array([-1, 8], np.int64)))
        assert out[-1].tolist() == [1, 1]  # the lengths of both caches, in input order
        assert a.seq_lens.tolist() == [1] and b.seq_lens.tolist() == [1]


@pytest.mark.parametrize("path", ["wrapper", "ep"])
def test_two_commit_nodes_fail_at_session_creation(path):
    with pytest.raises(Exception, match="2 CacheCommit nodes in one graph"):
        session(_two_cache_model(True), path)


def test_pool_close_never_leaves_a_cache_in_a_closed_pool():
    for _ in range(100):
        pool = KVPool()
        made = []

        def create():
            try:
                made.append(KVCache(1, 1, 1, 8, max_sequence_length=8, pool=pool))
            except ValueError:
                pass

        t = threading.Thread(target=create)
        t.start()
        try:
            pool.close()
            closed = True
        except ValueError as e:
            assert "in use" in str(e)
            closed = False
        t.join()
        if closed:
            assert not made, "a cache was created in a pool that close() released"
        for c in made:
            c.close()
        if not pool.closed:
            pool.close()


def test_pool_collected_while_a_checkpoint_pins_its_pages_is_released_later():
    pool = KVPool()
    h = pool.handle
    c = KVCache(1, 1, 1, 8, max_sequence_length=64, pool=pool)
    c.truncate(0)
    cp = c.checkpoint()
    c.close()
    del c, pool
    gc.collect()
    assert _core.is_live(h)  # still in use by the checkpoint
    cp.close()
    del cp
    gc.collect()
    assert not _core.is_live(h)


@pytest.mark.parametrize("call,arg", [
    (lambda: KVCache(1, 1, 1, 8, max_sequence_length=2**64), "max_sequence_length"),
    (lambda: KVCache(1, 1, 1, 8, max_sequence_length=8, sliding_window=2**64), "sliding_window"),
    (lambda: KVPool(2**64), "memory_limit_bytes"),
    (lambda: KVPool(page_tokens=2**20), "page_tokens"),
])
def test_huge_ints_are_value_errors_naming_the_argument(call, arg):
    with pytest.raises(ValueError, match=arg):
        call()


def test_huge_ints_in_methods():
    with KVCache(1, 2, 1, 8, max_sequence_length=8) as c:
        for call, arg in ((lambda: c.truncate(2**63), "lengths"), (lambda: c.rollback(2**63), "num_tokens"),
                          (lambda: c.truncate([2**64, 0]), "lengths"), (lambda: c.export(2**63), "layer"),
                          (lambda: c.fork([2**70]), "indices")):
            with pytest.raises(ValueError, match=arg):
                call()


def test_checkpoint_bytes_counts_only_pages_no_one_else_holds():
    k = np.random.default_rng(3).standard_normal((1, 1, 40, 8)).astype(np.float32)
    with KVPool() as pool:
        c = KVCache.from_past([k], [k], max_sequence_length=64, page_tokens=32, pool=pool)
        cp = c.checkpoint()
        f = c.fork()
        c.truncate(0)
        assert c.stats()["checkpoint_bytes"] == 0  # the fork still holds those pages
        f.close()
        assert c.stats()["checkpoint_bytes"] == 2 * 32 * 16 * 4
        cp.close()
        c.close()


def test_restore_names_the_field_that_differs():
    with KVPool() as pool:
        a = KVCache(1, 1, 1, 8, max_sequence_length=64, pool=pool)
        b = KVCache(1, 1, 1, 8, max_sequence_length=128, pool=pool)
        cp = a.checkpoint()
        with pytest.raises(ValueError, match="max_sequence_length is 64 but the cache's is 128"):
            b.restore(cp)
        cp.close()
        a.close()
        b.close()


def test_geometry_properties_raise_after_close_and_wide_windows_are_allowed():
    c = KVCache(2, 1, 1, 8, max_sequence_length=16, sliding_window=[None, 100])  # wider than the cache
    assert c.sliding_window == [None, 100]
    c.close()
    for name in ("num_layers", "batch_size", "head_dim", "dtype", "page_tokens", "memory_limit_bytes"):
        with pytest.raises(ValueError, match="closed"):
            getattr(c, name)


def test_plain_cpu_failed_run_reservation_is_released_by_the_next_run_of_the_graph():
    """Plain CPU EP path, no run boundaries: a run that fails after its last layer leaves its
    reserved pages held; the next run of the same graph on the same thread (here on another
    cache of the pool) rolls that step back and its pages return to the pool."""
    rng = np.random.default_rng(4)
    cpu = session(transaction_model(2, with_commit=True), "cpu")
    with KVPool(page_tokens=32) as pool:
        a = KVCache(2, B, HKV, D, max_sequence_length=64, pool=pool)
        b = KVCache(2, B, HKV, D, max_sequence_length=64, pool=pool)
        qkv = random_qkv(rng, 2, B, HQ, HKV, 1, D)
        with pytest.raises(Exception, match="Reshape|reshape"):
            cpu.run(None, feeds(a, qkv, 1, late_ok=False))
        held = pool.stats()["live_bytes"]
        assert held > 0  # the failed run's reservation (nothing signals its end on this path)
        cpu.run(None, feeds(b, qkv, 1))
        assert pool.stats()["live_bytes"] == held  # a's reservation went back; b holds the same amount
        assert a.stats()["reserved_bytes"] == 0 and a.seq_lens.tolist() == [0]
        a.close()
        b.close()
