"""A failed run changes nothing, whatever fails (docs/API.md "When a step commits").

Each failure point is driven through each path that can run a converted model:

- ``wrapper``: ``onnx_light_ep.InferenceSession`` (EP selected; its ``run`` is a deferred
  transaction: rows become visible only when ORT returned normally);
- ``ep``: a plain ``onnxruntime.InferenceSession`` on options from ``onnx_light_ep.register()``
  (the EP's OnRunStart/OnRunEnd bound the run);
- ``cpu``: a plain ORT CPU session with the custom-op library (no run boundaries at all).

with graphs that end in a ``CacheCommit`` node (what ``convert`` writes: every path is exact)
and graphs without one (the last layer commits: only the wrapper is exact; the other paths are
documented to commit a run whose failure comes after the last layer, which these tests pin).

Failure points: a node after the last layer (Reshape with a bad shape), a CacheExport error, a
cache with fewer layers than the model, ``RunOptions.terminate`` landing anywhere in the run
(late cancellations included), bad ``seqlens_k`` values at the int32/int64 limits, duplicate
and missing ``layer`` indices. After each failure: seq_lens, content and statistics as before,
and the retried run gives the outputs of a run that never failed.
"""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvcache_util import RefCache, assert_cache_matches, random_qkv  # noqa: E402
from reference import FP32_ATOL, FP32_RTOL  # noqa: E402

import onnx_light_ep  # noqa: E402
from onnx_light_ep import KVCache  # noqa: E402

DOMAIN = onnx_light_ep.DOMAIN
B, HQ, HKV, D = 1, 4, 2, 32
PATHS = ["wrapper", "ep", "cpu"]


def transaction_model(num_layers=2, *, with_commit=True, late_dim=0, export_layer=None, export_dtype=TP.FLOAT,
                      layers=None, seqlens_dtype=None):
    """CacheAttention layers (chained) -> Reshape(Y_last, late_shape) -> optional MatMul to
    `late_dim` columns (an LM head's worth of work after the last layer) -> outputs; optional
    CacheExport of `export_layer` typed `export_dtype`; optional CacheCommit after every output."""
    layers = list(range(num_layers)) if layers is None else layers
    inputs = [helper.make_tensor_value_info("kv_cache", TP.INT64, [1]),
              helper.make_tensor_value_info("late_shape", TP.INT64, [2])]
    if seqlens_dtype is not None:
        inputs.append(helper.make_tensor_value_info("seqlens_k", seqlens_dtype, [B]))
    nodes, outputs, inits = [], [], [helper.make_tensor("zero", TP.FLOAT, [], [0.0])]
    for i, layer in enumerate(layers):
        for name in ("query", "key", "value"):
            inputs.append(helper.make_tensor_value_info(f"{name}_{i}", TP.FLOAT, [B, None, None, D]))
        q = f"query_{i}"
        if i > 0:
            nodes += [helper.make_node("ReduceSum", [f"Y_{i - 1}"], [f"s_{i}"], keepdims=0),
                      helper.make_node("Mul", [f"s_{i}", "zero"], [f"z_{i}"]),
                      helper.make_node("Add", [q, f"z_{i}"], [f"q_{i}"])]
            q = f"q_{i}"
        ins = [q, f"key_{i}", f"value_{i}", "kv_cache"]
        if seqlens_dtype is not None:
            ins += ["", "seqlens_k"]
        attrs = dict(layer=int(layer), is_causal=1)
        if with_commit:
            attrs["commit_node"] = 1
        nodes.append(helper.make_node("CacheAttention", ins, [f"Y_{i}"], domain=DOMAIN, name=f"layer{i}", **attrs))
        outputs.append(helper.make_tensor_value_info(f"Y_{i}", TP.FLOAT, None))
    last = f"Y_{len(layers) - 1}"
    nodes.append(helper.make_node("Reshape", [last, "late_shape"], ["late"]))
    late = "late"
    if late_dim:
        w = np.random.default_rng(0).standard_normal((HQ * D, late_dim)).astype(np.float32) / 64
        inits.append(helper.make_tensor("head_w", TP.FLOAT, w.shape, w.ravel()))
        # A node after the MatMul: ORT checks RunOptions.terminate between nodes, so a
        # cancellation landing in the MatMul is seen before it (a cancelled LM head).
        nodes += [helper.make_node("MatMul", ["late", "head_w"], ["head"]),
                  helper.make_node("Relu", ["head"], ["logits"])]
        late = "logits"
    outputs.append(helper.make_tensor_value_info(late, TP.FLOAT, None))
    if export_layer is not None:
        nodes.append(helper.make_node("CacheExport", ["kv_cache", last], ["pk", "pv"], domain=DOMAIN,
                                      layer=export_layer, dtype=int(export_dtype)))
        outputs += [helper.make_tensor_value_info("pk", export_dtype, None),
                    helper.make_tensor_value_info("pv", export_dtype, None)]
    if with_commit:
        nodes.append(helper.make_node("CacheCommit", ["kv_cache"] + [o.name for o in outputs], ["kv_cache_seq_lens"],
                                      domain=DOMAIN, name="commit"))
        outputs.append(helper.make_tensor_value_info("kv_cache_seq_lens", TP.INT64, None))
    g = helper.make_graph(nodes, "transaction", inputs, outputs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1)],
                             ir_version=10).SerializeToString()


def session(model, path, threads=1):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = threads
    if path == "wrapper":
        return onnx_light_ep.InferenceSession(model, so)
    if path == "ep":
        so = onnx_light_ep.register(so)
        s = ort.InferenceSession(model, so)
        assert s.get_providers()[0] == onnx_light_ep.EP_NAME
        return s
    so.register_custom_ops_library(onnx_light_ep.get_library_path())
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def feeds(cache, qkv, S, *, late_ok=True, seqlens=None):
    f = {"kv_cache": cache.handle, "late_shape": np.array([-1, HQ * D if late_ok else 7], np.int64)}
    for i, (q, k, v) in enumerate(qkv):
        f[f"query_{i}"], f[f"key_{i}"], f[f"value_{i}"] = q, k, v
    if seqlens is not None:
        f["seqlens_k"] = seqlens
    return f


def state(cache):
    """Everything a failed run must leave as it was (stats read first: export counts copies)."""
    st = cache.stats()
    st.pop("bytes_copied")
    return cache.seq_lens.tolist(), st, [tuple(x.copy() for x in cache.export(l)) for l in range(cache.num_layers)]


def assert_same_state(cache, before, what):
    lens, st, content = state(cache)
    assert lens == before[0], (what, lens, before[0])
    assert st == before[1], (what, st, before[1])
    for l, ((k, v), (k0, v0)) in enumerate(zip(content, before[2])):
        np.testing.assert_array_equal(k, k0, err_msg=f"{what}: K layer {l}")
        np.testing.assert_array_equal(v, v0, err_msg=f"{what}: V layer {l}")


def good_run(sess, cache, ref, rng, S, what):
    qkv = random_qkv(rng, cache.num_layers, B, HQ, HKV, S, D)
    want = ref.step(qkv)
    got = sess.run(None, feeds(cache, qkv, S))
    for l in range(cache.num_layers):
        np.testing.assert_allclose(got[l], want[l], atol=FP32_ATOL, rtol=FP32_RTOL, err_msg=f"{what}: Y_{l}")
    assert_cache_matches(cache, ref, what)
    return got


def exact(path, with_commit):
    return with_commit or path == "wrapper"


@pytest.mark.parametrize("with_commit", [True, False])
@pytest.mark.parametrize("path", PATHS)
def test_node_after_the_last_layer_fails(path, with_commit):
    rng = np.random.default_rng(1)
    sess = session(transaction_model(with_commit=with_commit), path)
    with KVCache(2, B, HKV, D, max_sequence_length=256) as cache:
        ref = RefCache(2, B, HKV, D)
        good_run(sess, cache, ref, rng, 5, "prefill")
        before = state(cache)
        qkv = random_qkv(rng, 2, B, HQ, HKV, 3, D)
        with pytest.raises(Exception, match="Reshape|reshape"):
            sess.run(None, feeds(cache, qkv, 3, late_ok=False))
        if exact(path, with_commit):
            assert_same_state(cache, before, "after a failure after the last layer")
            # The retry gives what a run that never failed gives.
            want = ref.step(qkv)
            got = sess.run(None, feeds(cache, qkv, 3))
            for l in range(2):
                np.testing.assert_allclose(got[l], want[l], atol=FP32_ATOL, rtol=FP32_RTOL)
            assert_cache_matches(cache, ref, "after the retry")
        else:
            # Documented: without a commit node the last layer commits, so this failure lands
            # after the commit and the rows stay (docs/API.md).
            assert cache.seq_lens.tolist() == [8]


@pytest.mark.parametrize("with_commit", [True, False])
@pytest.mark.parametrize("path", PATHS)
def test_cache_export_error(path, with_commit):
    rng = np.random.default_rng(2)
    sess = session(transaction_model(with_commit=with_commit, export_layer=1, export_dtype=TP.FLOAT16), path)
    with KVCache(2, B, HKV, D, max_sequence_length=64) as cache:
        before = state(cache)
        with pytest.raises(Exception, match="cache's type float"):
            sess.run(None, feeds(cache, random_qkv(rng, 2, B, HQ, HKV, 4, D), 4))
        if exact(path, with_commit):
            assert_same_state(cache, before, "after a CacheExport error")
        else:
            assert cache.seq_lens.tolist() in ([0], [4])


@pytest.mark.parametrize("path", PATHS)
def test_cache_with_fewer_layers_than_the_model(path):
    rng = np.random.default_rng(3)
    sess = session(transaction_model(3), path)
    with KVCache(2, B, HKV, D, max_sequence_length=64) as cache:
        before = state(cache)
        for _ in range(3):  # every attempt fails the same way; nothing ever sticks
            with pytest.raises(Exception, match="num_layers|more attention layers"):
                sess.run(None, feeds(cache, random_qkv(rng, 3, B, HQ, HKV, 2, D), 2))
            assert_same_state(cache, before, "after a run with more layers than the cache")


@pytest.mark.parametrize("path,with_commit", [("wrapper", True), ("wrapper", False), ("ep", True), ("cpu", True)])
def test_cancellations_anywhere_change_nothing(path, with_commit):
    """RunOptions.terminate from another thread at random moments of runs whose last layer is
    followed by an LM head's worth of work: each run either succeeds (its rows appended once) or
    changes nothing; a cancelled step retried gives the outputs of a run that never failed, and
    no cancellation makes a later valid run fail. (Without a commit node plain sessions commit
    at the last layer by contract: test_node_after_the_last_layer_fails pins that.)"""
    rng = np.random.default_rng(4)
    S, L = 16, 4
    sess = session(transaction_model(L, with_commit=with_commit, late_dim=16384), path)
    cache = KVCache(L, B, HKV, D, max_sequence_length=4096)
    ref = RefCache(L, B, HKV, D)
    run_s = []
    for _ in range(3):  # the first run includes ORT's lazy set-up: time the later ones
        t0 = time.perf_counter()
        good_run(sess, cache, ref, rng, S, "warm-up")
        run_s.append(time.perf_counter() - t0)
    run_s = min(run_s[1:])
    cancelled = 0

    def cancel_after(opts, delay, stop):
        end = time.perf_counter() + delay
        while time.perf_counter() < end:  # spin: a sleeping timer lands too coarsely
            if stop.is_set():
                return
        opts.terminate = True

    for i in range(120):  # until 10 runs were cancelled (the machine may be busy)
        if cancelled >= 10:
            break
        qkv = random_qkv(rng, L, B, HQ, HKV, S, D)
        before = state(cache)
        opts, stop = ort.RunOptions(), threading.Event()
        th = threading.Thread(target=cancel_after, args=(opts, rng.uniform(0, 1.1 * run_s), stop))
        th.start()
        try:
            got = sess.run(None, feeds(cache, qkv, S), opts)
        except Exception as e:  # noqa: BLE001 - ORT's own classes
            assert "terminate" in str(e).lower() or "cancel" in str(e).lower(), str(e)
            cancelled += 1
            stop.set()
            th.join()
            assert_same_state(cache, before, f"run {i}: after a cancellation")
            got = sess.run(None, feeds(cache, qkv, S))  # the retry, not cancelled
        stop.set()
        th.join()
        want = ref.step(qkv)
        for l in range(L):
            np.testing.assert_allclose(got[l], want[l], atol=FP32_ATOL, rtol=FP32_RTOL, err_msg=f"run {i}: Y_{l}")
        assert cache.seq_lens.tolist() == ref.seq_lens.tolist(), i
    assert_cache_matches(cache, ref, "final")
    assert cancelled >= 10, f"only {cancelled} of {i + 1} runs were cancelled: the canceller seldom landed in a run"
    cache.close()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [TP.INT32, TP.INT64])
def test_seqlens_k_limits_are_range_checked(path, dtype):
    rng = np.random.default_rng(5)
    sess = session(transaction_model(2, seqlens_dtype=dtype), path)
    np_dt = np.int32 if dtype == TP.INT32 else np.int64
    info = np.iinfo(np_dt)
    with KVCache(2, B, HKV, D, max_sequence_length=64) as cache:
        ref = RefCache(2, B, HKV, D)
        qkv = random_qkv(rng, 2, B, HQ, HKV, 3, D)
        want = ref.step(qkv)
        got = sess.run(None, feeds(cache, qkv, 3, seqlens=np.array([2], np_dt)))  # int64 accepted too
        np.testing.assert_allclose(got[0], want[0], atol=FP32_ATOL, rtol=FP32_RTOL)
        before = state(cache)
        for bad in (info.max, info.min, info.max - 1, -2, 3 + 3):
            with pytest.raises(Exception, match=r"seqlens_k'\[0\] = "):
                sess.run(None, feeds(cache, random_qkv(rng, 2, B, HQ, HKV, 3, D), 3,
                                     seqlens=np.array([bad], np_dt)))
            assert_same_state(cache, before, f"after seqlens_k={bad}")


@pytest.mark.parametrize("path", ["wrapper", "ep"])
@pytest.mark.parametrize("layers,words", [([0, 1, 1], "both have layer=1"), ([0, 2], "no CacheAttention node has layer=1"),
                                          ([1, 0], "both have layer")])
def test_bad_layer_indices_fail_at_session_creation(path, layers, words):
    if layers == [1, 0]:  # a permutation is a valid index set; order is a run-time matter
        model = transaction_model(2, layers=layers)
        session(model, path)
        return
    with pytest.raises(Exception, match=words):
        session(transaction_model(len(layers), layers=layers), path)


def test_duplicate_layer_on_plain_cpu_fails_at_the_first_run():
    rng = np.random.default_rng(6)
    sess = session(transaction_model(3, layers=[0, 1, 1], with_commit=True), "cpu")
    with KVCache(2, B, HKV, D, max_sequence_length=64) as cache:
        before = state(cache)
        with pytest.raises(Exception, match="two nodes have layer=1"):
            sess.run(None, feeds(cache, random_qkv(rng, 3, B, HQ, HKV, 2, D), 2))
        assert_same_state(cache, before, "after duplicate layers")


@pytest.mark.parametrize("path", ["wrapper", "ep"])
def test_commit_node_mismatch_fails_at_session_creation(path):
    model = transaction_model(2, with_commit=True)
    import onnx

    m = onnx.load_from_string(model)
    commit = [n for n in m.graph.node if n.op_type == "CacheCommit"][0]
    m.graph.node.remove(commit)
    m.graph.output.pop()
    with pytest.raises(Exception, match="commit_node=1 but no CacheCommit"):
        session(m.SerializeToString(), path)
    m2 = onnx.load_from_string(transaction_model(2, with_commit=False))
    m2.graph.node.append(helper.make_node("CacheCommit", ["kv_cache", "Y_0"], ["c"], domain=DOMAIN))
    m2.graph.output.append(helper.make_tensor_value_info("c", TP.INT64, None))
    with pytest.raises(Exception, match="commit at their last layer"):
        session(m2.SerializeToString(), path)


def test_wrapper_reraises_arena_error_kinds():
    """KVCacheMemoryError from session.run through the wrapper, with the ORT error chained."""
    rng = np.random.default_rng(7)
    sess = session(transaction_model(2), "wrapper")
    with KVCache(2, B, HKV, D, max_sequence_length=512, memory_limit_bytes=1) as cache:
        with pytest.raises(onnx_light_ep.KVCacheMemoryError) as ei:
            sess.run(None, feeds(cache, random_qkv(rng, 2, B, HQ, HKV, 2, D), 2))
        assert isinstance(ei.value.__cause__, Exception) and "KVCacheMemoryError:" in str(ei.value.__cause__)
        assert "memory_limit_bytes is 1" in str(ei.value)
        assert cache.seq_lens.tolist() == [0]
