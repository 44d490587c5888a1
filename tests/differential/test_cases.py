"""CASES.md entries (components cache-op / kernel) against CacheAttention, through both the
OnnxLightExecutionProvider session and the plain CPU session (custom-op library).
Layouts are BNSH unless a test says 3-D. Oracle: ``reference.ref_attn`` (fp64)."""
import numpy as np
import pytest

import ort_utils
from models import cache_attention_model
from reference import (BF16, assert_close, from_bnsh, np_dtype, ref_attn, ref_rows, to_bnsh)


@pytest.fixture(params=["ep", "cpu"])
def make_session(request, olep):
    def make(model):
        if request.param == "ep":
            return ort_utils.make_ep_session(olep, model)
        return ort_utils.make_cpu_session(olep, model)
    return make


def model(hq, hkv, d, **kw):
    return cache_attention_model(q_num_heads=hq, kv_num_heads=hkv, head_dim=d, **kw)


def step(sess, cache, q, k, v, *, rank=4, mask=None, seqlens_k=None, with_export=False):
    """One CacheAttention run (layer 0). q/k/v given in BNSH; returns (Y in BNSH, outputs)."""
    hq, hkv = q.shape[1], k.shape[1]
    lay = (lambda x: x) if rank == 4 else from_bnsh
    feeds = {"query_0": lay(q), "key_0": lay(k), "value_0": lay(v), "kv_cache": cache.handle}
    if mask is not None:
        feeds["attn_mask"] = mask
    if seqlens_k is not None:
        feeds["seqlens_k"] = np.asarray(seqlens_k, np.int32)
    out = ort_utils.run(sess, feeds)
    y = out["Y_0"]
    return (y if rank == 4 else to_bnsh(y, hq)), out


def bits(a):
    a = np.asarray(a)
    return a.view(f"u{a.dtype.itemsize}")


def assert_bit_equal(a, b, msg=""):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (msg, a.shape, b.shape, a.dtype, b.dtype)
    assert np.array_equal(bits(a), bits(b)), msg


def assert_no_nan(*arrays):
    for a in arrays:
        assert np.all(np.isfinite(np.asarray(a, np.float64))), "non-finite values"


def rnd(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


# --------------------------------------------------------------------------------------- C01
@pytest.mark.parametrize("seed_mode", ["new", "from_past_empty"])
@pytest.mark.parametrize("rank", [4, 3])
def test_c01_empty_past(make_session, olep, make_cache, seed_mode, rank):
    """C01: zero-length cache on the first step; present (export / CacheExport) == k bit-exactly."""
    rng = np.random.default_rng(1)
    B, H, D, S = 1, 2, 4, 3
    if seed_mode == "new":
        cache = make_cache(1, B, H, D, dtype="float32", max_sequence_length=16)
    else:
        z = np.zeros((B, H, 0, D), np.float32)
        cache = olep.KVCache.from_past([z], [z.copy()], max_sequence_length=16)
    try:
        assert cache.seq_lens.tolist() == [0]
        ek, ev = cache.export(0)
        assert ek.shape == (B, H, 0, D) and ev.shape == (B, H, 0, D)
        sess = make_session(model(H, H, D, rank=rank, is_causal=1, with_export=True))
        q, k, v = rnd(rng, B, H, S, D), rnd(rng, B, H, S, D), rnd(rng, B, H, S, D)
        past = np.zeros((B, H, 0, D), np.float32)
        y, out = step(sess, cache, q, k, v, rank=rank)
        assert out["Y_0"].shape == ((B, H, S, D) if rank == 4 else (B, S, H * D))
        assert_close(y, ref_attn(q, k, v, past, past)[0], np.float32, "Y")
        assert_bit_equal(out["present_key_0"], k, "CacheExport present_key != k")
        assert_bit_equal(out["present_value_0"], v, "CacheExport present_value != v")
        ek, ev = cache.export(0)
        assert_bit_equal(ek, k, "export key != k")
        assert_bit_equal(ev, v, "export value != v")
        assert cache.seq_lens.tolist() == [S]
    finally:
        cache.close()


# --------------------------------------------------------------------------------------- C02
@pytest.mark.parametrize("lens", [[2, 2], [2, 1]], ids=["lens22", "lens21"])
def test_c02_per_row_validity_capacity5(make_session, make_cache, lens):
    """C02: B=2, H=1, D=4, capacity 5, right-padded prompts via seqlens_k; per-row validity,
    decode token of a short row written at its own slot; padded input rows are NaN-poisoned."""
    rng = np.random.default_rng(2)
    B, H, D, M = 2, 1, 4, 5
    cache = make_cache(1, B, H, D, dtype="float32", max_sequence_length=M)
    sess = make_session(model(H, H, D, is_causal=1, with_seqlens_k=True))
    lens = np.array(lens)

    # prefill S=2, rows >= lens[b] are padding: poison them with NaN
    q, k, v = rnd(rng, B, H, 2, D), rnd(rng, B, H, 2, D), rnd(rng, B, H, 2, D)
    for b in range(B):
        q[b, :, lens[b]:] = k[b, :, lens[b]:] = v[b, :, lens[b]:] = np.nan
    y, _ = step(sess, cache, q, k, v, seqlens_k=lens - 1)
    assert_no_nan(y)
    assert_close(y, ref_rows(q, k, v, None, None, lens, [0, 0]), np.float32, "prefill")
    validity = (np.arange(M)[None, :] < cache.seq_lens[:, None]).astype(int)
    assert validity.tolist() == ([[1, 1, 0, 0, 0], [1, 1, 0, 0, 0]] if lens[1] == 2
                                 else [[1, 1, 0, 0, 0], [1, 0, 0, 0, 0]])
    pk, pv = k.copy(), v.copy()

    # one decode per row
    q1, k1, v1 = rnd(rng, B, H, 1, D), rnd(rng, B, H, 1, D), rnd(rng, B, H, 1, D)
    y1, _ = step(sess, cache, q1, k1, v1, seqlens_k=lens)
    assert_no_nan(y1)
    assert_close(y1, ref_rows(q1, k1, v1, pk, pv, [1, 1], lens), np.float32, "decode")
    validity = (np.arange(M)[None, :] < cache.seq_lens[:, None]).astype(int)
    assert validity.tolist() == ([[1, 1, 1, 0, 0], [1, 1, 1, 0, 0]] if lens[1] == 2
                                 else [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    ek, ev = cache.export(0)
    assert ek.shape == (B, H, 3, D)
    for b in range(B):
        n = lens[b]
        assert_bit_equal(ek[b, :, :n], pk[b, :, :n], f"row {b} prompt keys")
        assert_bit_equal(ek[b, :, n], k1[b, :, 0], f"row {b} new key not at slot {n}")
        assert_bit_equal(ev[b, :, n], v1[b, :, 0], f"row {b} new value not at slot {n}")
        assert not np.any(ek[b, :, n + 1:]) and not np.any(ev[b, :, n + 1:]), f"row {b} tail not zero"
    assert_no_nan(ek, ev)

    # fill row 0 to capacity; one more step must fail and leave the cache as it was
    while cache.seq_lens[0] < M:
        sk = np.minimum(cache.seq_lens, M - 1).astype(np.int32)
        sk[1] = cache.seq_lens[1] - 1  # row 1: n=0 (no new token)
        step(sess, cache, *(rnd(rng, B, H, 1, D) for _ in range(3)), seqlens_k=sk)
    before = cache.seq_lens.tolist()
    before_k = cache.export(0)[0]
    with pytest.raises(Exception):
        step(sess, cache, *(rnd(rng, B, H, 1, D) for _ in range(3)), seqlens_k=cache.seq_lens)
    assert cache.seq_lens.tolist() == before
    assert_bit_equal(cache.export(0)[0], before_k, "failed run changed the cache")


# --------------------------------------------------------------------------------------- C03
@pytest.mark.parametrize("seqlens_k_rank", [1, 2])
def test_c03_seqlens_k_total_minus_one(make_session, make_cache, seqlens_k_rank):
    """C03: GQA Hq=4, Hkv=2, D=8, capacity 8, rows [4,2] right-padded to S=4, seqlens_k [3,1]
    then [4,2]; also given with shape (2,1). Decode token of row b lands at slot seqlens_k[b]."""
    rng = np.random.default_rng(3)
    B, Hq, Hkv, D, M = 2, 4, 2, 8, 8
    cache = make_cache(1, B, Hkv, D, dtype="float32", max_sequence_length=M)
    sess = make_session(model(Hq, Hkv, D, is_causal=1, with_seqlens_k=True,
                              seqlens_k_rank=seqlens_k_rank))

    def sk(vals):
        a = np.array(vals, np.int32)
        return a if seqlens_k_rank == 1 else a.reshape(B, 1)

    lens = np.array([4, 2])
    q, k, v = rnd(rng, B, Hq, 4, D), rnd(rng, B, Hkv, 4, D), rnd(rng, B, Hkv, 4, D)
    q[1, :, 2:] = k[1, :, 2:] = v[1, :, 2:] = np.nan   # padding poison
    y, _ = step(sess, cache, q, k, v, seqlens_k=sk([3, 1]))
    assert_no_nan(y)
    assert_close(y, ref_rows(q, k, v, None, None, lens, [0, 0]), np.float32, "prefill")
    assert cache.seq_lens.tolist() == [4, 2]

    q1, k1, v1 = rnd(rng, B, Hq, 1, D), rnd(rng, B, Hkv, 1, D), rnd(rng, B, Hkv, 1, D)
    y1, _ = step(sess, cache, q1, k1, v1, seqlens_k=sk([4, 2]))
    assert_no_nan(y1)
    assert_close(y1, ref_rows(q1, k1, v1, k, v, [1, 1], lens), np.float32, "decode")
    assert cache.seq_lens.tolist() == [5, 3]
    ek, ev = cache.export(0)
    assert ek.shape == (B, Hkv, 5, D) and ev.shape == (B, Hkv, 5, D)
    for b, slot in enumerate([4, 2]):
        assert_bit_equal(ek[b, :, :slot], k[b, :, :slot], f"row {b} prompt")
        assert_bit_equal(ek[b, :, slot], k1[b, :, 0], f"row {b} decode key not at slot {slot}")
        assert_bit_equal(ev[b, :, slot], v1[b, :, 0], f"row {b} decode value not at slot {slot}")
        assert not np.any(ek[b, :, slot + 1:]) and not np.any(ev[b, :, slot + 1:])

    # a step where only row 0 advances (n_1 = 0): row 1 output zeros, row 1 unchanged
    full_k = np.concatenate([k, k1], 2)
    full_v = np.concatenate([v, v1], 2)
    full_k[1, :, 3:] = 0
    full_v[1, :, 3:] = 0
    full_k[1, :, 2] = k1[1, :, 0]
    full_v[1, :, 2] = v1[1, :, 0]
    q2, k2, v2 = rnd(rng, B, Hq, 1, D), rnd(rng, B, Hkv, 1, D), rnd(rng, B, Hkv, 1, D)
    k2[1] = v2[1] = q2[1] = np.nan
    y2, _ = step(sess, cache, q2, k2, v2, seqlens_k=sk([5, 2]))
    assert_no_nan(y2)
    assert_close(y2, ref_rows(q2, k2, v2, full_k, full_v, [1, 0], [5, 3]), np.float32, "n_b=0 step")
    assert cache.seq_lens.tolist() == [6, 3]


# --------------------------------------------------------------------------------------- C04
@pytest.mark.parametrize("seed", ["run", "from_past"])
def test_c04b_causal_offset_is_past_length(make_session, olep, seed):
    """C04 (b): past via the cache + is_causal=1 -> offset = past length (bottom-right)."""
    rng = np.random.default_rng(4)
    D = 4
    K, V = rnd(rng, 1, 1, 3, D), rnd(rng, 1, 1, 3, D)
    sess = make_session(model(1, 1, D, is_causal=1))
    if seed == "run":
        cache = olep.KVCache(1, 1, 1, D, dtype="float32", max_sequence_length=8)
        step(sess, cache, rnd(rng, 1, 1, 2, D), K[:, :, :2], V[:, :, :2])
    else:
        cache = olep.KVCache.from_past([K[:, :, :2]], [V[:, :, :2]], max_sequence_length=8)
    try:
        assert cache.seq_lens.tolist() == [2]
        q = rnd(rng, 1, 1, 1, D)
        y, _ = step(sess, cache, q, K[:, :, 2:], V[:, :, 2:])
        exp = ref_attn(q, K[:, :, 2:], V[:, :, 2:], K[:, :, :2], V[:, :, :2])[0]
        assert_close(y, exp, np.float32, "decode sees all 3 keys")
        assert not np.allclose(y[0, 0, 0], V[0, 0, 0], atol=1e-3), "upper-left alignment (sees key 0 only)"
    finally:
        cache.close()

    # block of S=2 after P=1: row 0 must see keys {0,1}, row 1 keys {0,1,2}
    cache = olep.KVCache.from_past([K[:, :, :1]], [V[:, :, :1]], max_sequence_length=8)
    try:
        q = rnd(rng, 1, 1, 2, D)
        y, _ = step(sess, cache, q, K[:, :, 1:], V[:, :, 1:])
        exp = ref_attn(q, K[:, :, 1:], V[:, :, 1:], K[:, :, :1], V[:, :, :1])[0]
        wrong = ref_attn(q, K[:, :, 1:], V[:, :, 1:], K[:, :, :1], V[:, :, :1], q_offset=0)[0]
        assert np.abs(exp - wrong).max() > 1e-2
        assert_close(y, exp, np.float32, "S=2 block after P=1")
    finally:
        cache.close()


# --------------------------------------------------------------------------------------- C05
@pytest.mark.parametrize("rank", [4, 3])
def test_c05_gqa_repeat_interleave(make_session, make_cache, rank):
    """C05: Hq=4, Hkv=2, D=2, K=0, V(kv0)=0, V(kv1)=1, Q=1 -> per q head [0,0,1,1] exactly."""
    B, Hq, Hkv, D = 1, 4, 2, 2
    cache = make_cache(1, B, Hkv, D, dtype="float32", max_sequence_length=4)
    sess = make_session(model(Hq, Hkv, D, rank=rank, is_causal=0))
    q = np.ones((B, Hq, 1, D), np.float32)
    k = np.zeros((B, Hkv, 1, D), np.float32)
    v = np.zeros((B, Hkv, 1, D), np.float32)
    v[:, 1] = 1.0
    y, _ = step(sess, cache, q, k, v, rank=rank)
    assert y[0, :, 0, :].tolist() == [[0, 0], [0, 0], [1, 1], [1, 1]]


@pytest.mark.parametrize("hq,hkv", [(6, 3), (8, 2)])
def test_c05_gqa_random(make_session, make_cache, hq, hkv):
    """C05: GQA Hq=6/Hkv=3 and Hq=8/Hkv=2 random vs ref (prefill S=4 then decode S=1)."""
    rng = np.random.default_rng(5 + hq)
    B, D = 2, 8
    cache = make_cache(1, B, hkv, D, dtype="float32", max_sequence_length=8)
    sess = make_session(model(hq, hkv, D, is_causal=0))
    pk = np.zeros((B, hkv, 0, D), np.float32)
    pv = pk.copy()
    for S in (4, 1):
        q, k, v = rnd(rng, B, hq, S, D), rnd(rng, B, hkv, S, D), rnd(rng, B, hkv, S, D)
        y, _ = step(sess, cache, q, k, v)
        exp = ref_attn(q, k, v, pk, pv, causal=False)[0]
        # tile semantics (h -> h % Hkv) must be distinguishable on this data
        Kt = np.tile(np.concatenate([pk, k], 2), (1, hq // hkv, 1, 1))
        Vt = np.tile(np.concatenate([pv, v], 2), (1, hq // hkv, 1, 1))
        tiled = ref_attn(q, Kt, Vt, causal=False)[0]
        assert np.abs(exp - tiled).max() > 1e-2
        assert_close(y, exp, np.float32, f"S={S}")
        pk, pv = np.concatenate([pk, k], 2), np.concatenate([pv, v], 2)


# --------------------------------------------------------------------------------------- C06
def test_c06_window3_decode(make_session, make_cache):
    """C06: local_window_size=3, past 5 (positions 0..4), decode position 5 sees keys {3,4,5}."""
    rng = np.random.default_rng(6)
    D = 4
    cache = make_cache(1, 1, 1, D, dtype="float32", max_sequence_length=8)
    sess = make_session(model(1, 1, D, is_causal=1, local_window_size=3))
    q, k, v = rnd(rng, 1, 1, 5, D), rnd(rng, 1, 1, 5, D), rnd(rng, 1, 1, 5, D)
    y, _ = step(sess, cache, q, k, v)
    assert_close(y, ref_attn(q, k, v, window=3)[0], np.float32, "prefill of the past")
    q1, k1, v1 = rnd(rng, 1, 1, 1, D), rnd(rng, 1, 1, 1, D), rnd(rng, 1, 1, 1, D)
    y1, _ = step(sess, cache, q1, k1, v1)
    exp = ref_attn(q1, k1, v1, k, v, window=3)[0]
    _, p, _, _ = ref_attn(q1, k1, v1, k, v, window=3)
    assert np.flatnonzero(p[0, 0, 0]).tolist() == [3, 4, 5]
    buggy = ref_attn(q1, k1, v1, k, v, window=4)[0]
    assert np.abs(exp - buggy).max() > 1e-3
    assert_close(y1, exp, np.float32, "decode at position 5")


def test_c06_window3_prefill(make_session, make_cache):
    """C06 prefill variant: S=6, P=0, W=3: row i sees keys max(0,i-2)..i."""
    rng = np.random.default_rng(61)
    D = 4
    cache = make_cache(1, 1, 1, D, dtype="float32", max_sequence_length=8)
    sess = make_session(model(1, 1, D, is_causal=1, local_window_size=3))
    q, k, v = rnd(rng, 1, 1, 6, D), rnd(rng, 1, 1, 6, D), rnd(rng, 1, 1, 6, D)
    y, _ = step(sess, cache, q, k, v)
    _, p, _, _ = ref_attn(q, k, v, window=3)
    for i in range(6):
        assert np.flatnonzero(p[0, 0, i]).tolist() == list(range(max(0, i - 2), i + 1))
    assert_close(y, ref_attn(q, k, v, window=3)[0], np.float32, "prefill W=3")


# --------------------------------------------------------------------------------------- C07
def _c07_tokens(positions, D=4):
    k = np.array([[p] * D for p in positions], np.float32)[None, None]
    v = np.array([[p, -p, 0.5 * p, 1.0] for p in positions], np.float32)[None, None]
    return k, v


def test_c07_window8_decode_6_to_10(make_session, make_cache):
    """C07: local_window_size=8 on a cache of capacity 16; keys tagged by position; prefill 6,
    decode to total 10; each step vs ref over the full history with window=8."""
    rng = np.random.default_rng(7)
    D, W = 4, 8
    cache = make_cache(1, 1, 1, D, dtype="float32", max_sequence_length=16)
    sess = make_session(model(1, 1, D, is_causal=1, local_window_size=W))
    q = (0.1 * rng.standard_normal((1, 1, 6, D))).astype(np.float32)
    k, v = _c07_tokens(range(6))
    y, _ = step(sess, cache, q, k, v)
    assert_close(y, ref_attn(q, k, v, window=W)[0], np.float32, "prefill 6")
    hk, hv = k, v
    for pos in range(6, 10):
        q1 = (0.1 * rng.standard_normal((1, 1, 1, D))).astype(np.float32)
        k1, v1 = _c07_tokens([pos])
        y1, _ = step(sess, cache, q1, k1, v1)
        exp, p, _, _ = ref_attn(q1, k1, v1, hk, hv, window=W)
        assert np.flatnonzero(p[0, 0, 0]).tolist() == list(range(max(0, pos - W + 1), pos + 1))
        if pos >= W:
            assert np.abs(exp - ref_attn(q1, k1, v1, hk, hv)[0]).max() > 1e-3
        assert_close(y1, exp, np.float32, f"decode at total {pos + 1}")
        hk, hv = np.concatenate([hk, k1], 2), np.concatenate([hv, v1], 2)
        assert cache.seq_lens.tolist() == [pos + 1]
    ek, ev = cache.export(0)
    assert_bit_equal(ek, hk, "window is a mask: all 10 rows stay in the cache")
    assert_bit_equal(ev, hv)


def test_c07_window8_chunk_6_to_9(make_session, make_cache):
    """C07 multi-token variant: S=3 new tokens at once, total 6 -> 9, window 8."""
    rng = np.random.default_rng(71)
    D, W = 4, 8
    cache = make_cache(1, 1, 1, D, dtype="float32", max_sequence_length=16)
    sess = make_session(model(1, 1, D, is_causal=1, local_window_size=W))
    q = (0.1 * rng.standard_normal((1, 1, 6, D))).astype(np.float32)
    k, v = _c07_tokens(range(6))
    step(sess, cache, q, k, v)
    q1 = (0.1 * rng.standard_normal((1, 1, 3, D))).astype(np.float32)
    k1, v1 = _c07_tokens(range(6, 9))
    y1, _ = step(sess, cache, q1, k1, v1)
    exp = ref_attn(q1, k1, v1, k, v, window=W)[0]
    assert np.abs(exp - ref_attn(q1, k1, v1, k, v)[0]).max() > 1e-3
    assert_close(y1, exp, np.float32, "chunk 6->9")
    assert cache.seq_lens.tolist() == [9]


# --------------------------------------------------------------------------------------- C08
@pytest.mark.parametrize("mask_shape", ["full", "bcast"])
@pytest.mark.parametrize("encoding", ["bool", "neg_inf", "finfo_min"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_c08_left_padding_fully_masked_rows(make_session, make_cache, dtype, encoding, mask_shape):
    """C08: left padding, causal, key validity [[1,1,1,1],[0,0,1,1]], mask as bool, additive
    -inf and additive finfo.min; fp32 and fp16. Rows (1,0),(1,1) see no key -> all zeros (for
    every encoding, as the case states: finfo.min is the exporters' "masked" value); row 1
    queries 2..3 equal the unpadded reference on keys 2..3; row 0 unaffected; no NaN."""
    dt = np_dtype(dtype)
    rng = np.random.default_rng(8)
    B, H, S, D = 2, 1, 4, 4
    valid = np.array([[1, 1, 1, 1], [0, 0, 1, 1]], bool)
    shape = (B, 1, S, S) if mask_shape == "full" else (B, 1, 1, S)
    vb = np.broadcast_to(valid[:, None, None, :], shape)
    if encoding == "bool":
        mask = np.ascontiguousarray(vb)
    else:
        neg = -np.inf if encoding == "neg_inf" else np.finfo(dt).min
        mask = np.where(vb, 0, neg).astype(dt)
    cache = make_cache(1, B, H, D, dtype=dtype, max_sequence_length=8)
    sess = make_session(model(H, H, D, dtype=dtype, is_causal=1,
                              with_mask="bool" if encoding == "bool" else "float"))
    q, k, v = rnd(rng, B, H, S, D, dtype=dt), rnd(rng, B, H, S, D, dtype=dt), rnd(rng, B, H, S, D, dtype=dt)
    y, _ = step(sess, cache, q, k, v, mask=mask)
    assert y.dtype == dt
    assert_no_nan(y)
    assert np.all(y[1, :, :2] == 0), "fully masked rows must be exactly zero"
    assert_close(y, ref_attn(q, k, v, key_valid=valid)[0], dt, "key_valid reference")
    assert_close(y[0:1], ref_attn(q[0:1], k[0:1], v[0:1])[0], dt, "row 0 unaffected")
    assert_close(y[1:2, :, 2:], ref_attn(q[1:2, :, 2:], k[1:2, :, 2:], v[1:2, :, 2:])[0], dt,
                 "row 1 queries 2..3 vs unpadded reference")


# --------------------------------------------------------------------------------------- C09
@pytest.mark.parametrize("mode", ["past", "single_step"])
@pytest.mark.parametrize("scale", [None, 0.125], ids=["default_scale", "scale_0.125"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_c09_lowp_overflow(make_session, make_cache, dtype, scale, mode):
    """C09: q=k0=40, k1=39, D=64: q.k0 = 102400 overflows fp16; fp32 accumulation gives
    scaled scores 12800/12480 -> output ~= v0 (atol 1e-3), never NaN/inf."""
    dt = np_dtype(dtype)
    rng = np.random.default_rng(9)
    D = 64
    q = np.full((1, 1, 1, D), 40.0, dt)
    k0, k1 = np.full((1, 1, 1, D), 40.0, dt), np.full((1, 1, 1, D), 39.0, dt)
    v0, v1 = rnd(rng, 1, 1, 1, D, dtype=dt), rnd(rng, 1, 1, 1, D, dtype=dt)
    cache = make_cache(1, 1, 1, D, dtype=dtype, max_sequence_length=4)
    if mode == "past":
        sess = make_session(model(1, 1, D, dtype=dtype, is_causal=1, scale=scale))
        y0, _ = step(sess, cache, q, k0, v0)
        assert_no_nan(y0)
        np.testing.assert_allclose(y0.astype(np.float32), v0.astype(np.float32), atol=1e-3)
        y, _ = step(sess, cache, q, k1, v1)
    else:
        sess = make_session(model(1, 1, D, dtype=dtype, is_causal=0, scale=scale))
        y, _ = step(sess, cache, np.concatenate([q, q], 2), np.concatenate([k0, k1], 2),
                    np.concatenate([v0, v1], 2))
    assert y.dtype == dt
    assert_no_nan(y)
    for i in range(y.shape[2]):
        np.testing.assert_allclose(y[0, 0, i].astype(np.float32), v0[0, 0, 0].astype(np.float32),
                                   atol=1e-3, err_msg=f"row {i}")


# ------------------------------------------------------------- 16-bit caches, grouped heads
@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 64), (12, 4, 128), (32, 1, 64)],
                         ids=["gqa4_d64", "gqa3_d128", "mqa32_d64"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_lowp_grouped_heads(make_session, make_cache, dtype, hq, hkv, d):
    """fp16/bf16 caches with 3, 4 and 32 query heads per KV head and head_dim a multiple of 32:
    on the avx512_bf16 level the bf16 scores go through VDPBF16PS (row path from 3 rows, lanes
    path for 32), on the others through converting loads. Prefill 37 rows (several tiles, a
    partial one), then 3 decode steps, against the float64 reference at 16-bit tolerance."""
    dt = np_dtype(dtype)
    rng = np.random.default_rng(hq * 100 + d)
    B = 2
    cache = make_cache(1, B, hkv, d, dtype=dtype, max_sequence_length=64)
    sess = make_session(model(hq, hkv, d, dtype=dtype, is_causal=1))
    pk, pv = np.zeros((B, hkv, 0, d), dt), np.zeros((B, hkv, 0, d), dt)
    for S in (37, 1, 1, 1):
        q = rnd(rng, B, hq, S, d, dtype=dt)
        k, v = rnd(rng, B, hkv, S, d, dtype=dt), rnd(rng, B, hkv, S, d, dtype=dt)
        y, _ = step(sess, cache, q, k, v)
        assert y.dtype == dt
        assert_close(y, ref_attn(q, k, v, pk, pv)[0], dt, f"S={S} past={pk.shape[2]}")
        pk, pv = np.concatenate([pk, k], 2), np.concatenate([pv, v], 2)


# --------------------------------------------------------------------------------------- C10
@pytest.mark.parametrize("rank,dv", [(4, 8), (3, 8), (3, 16)])
def test_c10_default_scale(make_session, make_cache, rank, dv):
    """C10: no scale attribute -> 1/sqrt(D) with D = q/k head size (Hq=4, Hkv=2, D=8), never
    1/sqrt(2D) (=1/sqrt(16)) nor 1/sqrt(Dv). Prefill S=3 then one decode."""
    rng = np.random.default_rng(10)
    B, Hq, Hkv, D = 1, 4, 2, 8
    cache = make_cache(1, B, Hkv, D, v_head_dim=dv, dtype="float32", max_sequence_length=8)
    sess = make_session(model(Hq, Hkv, D, v_head_dim=dv, rank=rank, is_causal=1))
    pk, pv = np.zeros((B, Hkv, 0, D), np.float32), np.zeros((B, Hkv, 0, dv), np.float32)
    for S in (3, 1):
        q = (2 * rng.standard_normal((B, Hq, S, D))).astype(np.float32)
        k, v = rnd(rng, B, Hkv, S, D), rnd(rng, B, Hkv, S, dv)
        y, _ = step(sess, cache, q, k, v, rank=rank)
        exp = ref_attn(q, k, v, pk, pv)[0]
        wrong = ref_attn(q, k, v, pk, pv, scale=1 / np.sqrt(2 * D))[0]
        assert np.abs(exp - wrong).max() > 1e-2
        assert np.abs(y - wrong).max() > 1e-3, "used 1/sqrt(2D)"
        assert_close(y, exp, np.float32, f"S={S} default scale 1/sqrt({D})")
        pk, pv = np.concatenate([pk, k], 2), np.concatenate([pv, v], 2)


# --------------------------------------------------------------------------------------- C11
def test_c11_3d_inputs(make_session, make_cache):
    """C11: 3-D (1,2,4) inputs, q_num_heads=kv_num_heads=2, D=2, Q=arange(8)/4,
    K=arange(8)[::-1]/4, V=arange(8), is_causal=0 -> Y (1,2,4); export / present 4-D BNSH."""
    Q = (np.arange(8) / 4).astype(np.float32).reshape(1, 2, 4)
    K = (np.arange(8)[::-1] / 4).astype(np.float32).reshape(1, 2, 4)
    V = np.arange(8).astype(np.float32).reshape(1, 2, 4)
    Q4, K4, V4 = (x.reshape(1, 2, 2, 2).transpose(0, 2, 1, 3) for x in (Q, K, V))
    exp = ref_attn(Q4, K4, V4, causal=False)[0].transpose(0, 2, 1, 3).reshape(1, 2, 4)
    Qw, Kw, Vw = (x.reshape(1, 2, 2, 2) for x in (Q, K, V))   # reshape without transpose
    wrong = ref_attn(Qw, Kw, Vw, causal=False)[0].reshape(1, 2, 4)
    assert np.abs(exp - wrong).max() > 1e-2

    cache = make_cache(1, 1, 2, 2, dtype="float32", max_sequence_length=4)
    sess = make_session(model(2, 2, 2, rank=3, is_causal=0, with_export=True))
    out = ort_utils.run(sess, {"query_0": Q, "key_0": K, "value_0": V, "kv_cache": cache.handle})
    assert out["Y_0"].shape == (1, 2, 4)
    assert_close(out["Y_0"], exp, np.float32, "Y")
    assert_bit_equal(out["present_key_0"], np.ascontiguousarray(K4), "CacheExport present_key")
    assert_bit_equal(out["present_value_0"], np.ascontiguousarray(V4), "CacheExport present_value")
    ek, ev = cache.export(0)
    assert_bit_equal(ek, np.ascontiguousarray(K4), "export key")
    assert_bit_equal(ev, np.ascontiguousarray(V4), "export value")


# --------------------------------------------------------------------------------------- C12
def test_c12_rank3_mask_broadcast_per_head(make_session, make_cache):
    """C12: B=2, H=2, S=1, T=3, D=4, is_causal=0, additive mask (2,1,3): mask[0]=[0,0,-inf],
    mask[1]=[0,-inf,0] broadcast to (B,H,S,T) -> per head, not per batch."""
    rng = np.random.default_rng(12)
    B, H, D = 2, 2, 4
    cache = make_cache(1, B, H, D, dtype="float32", max_sequence_length=4)
    prefill = make_session(model(H, H, D, is_causal=0))
    pk, pv = rnd(rng, B, H, 2, D), rnd(rng, B, H, 2, D)
    step(prefill, cache, rnd(rng, B, H, 2, D), pk, pv)
    sess = make_session(model(H, H, D, is_causal=0, with_mask="float", mask_rank=3))
    mask = np.array([[[0, 0, -np.inf]], [[0, -np.inf, 0]]], np.float32)
    q, k, v = rnd(rng, B, H, 1, D), rnd(rng, B, H, 1, D), rnd(rng, B, H, 1, D)
    y, _ = step(sess, cache, q, k, v, mask=mask)
    exp, p, _, _ = ref_attn(q, k, v, pk, pv, causal=False, add_mask=mask[None])
    assert np.all(p[:, 0, 0, 2] == 0) and np.all(p[:, 1, 0, 1] == 0)
    wrong = ref_attn(q, k, v, pk, pv, causal=False, add_mask=mask[:, None])[0]
    assert np.abs(exp - wrong).max() > 1e-2
    assert_close(y, exp, np.float32, "rank-3 mask per head")


# --------------------------------------------------------------------------------------- C14
def test_c14_beam_reorder(make_session, olep, make_cache):
    """C14: 3 beams, H=1, D=2; identical prefill, query right after prefill (identity), then
    reorder [2,0,0], [1,1,2], [0,0,0] with a distinct position-tagged token appended per beam
    after each; every beam's output vs ref on its explicitly reconstructed history."""
    rng = np.random.default_rng(14)
    NB, H, D, P = 3, 1, 2, 3
    cache = make_cache(1, NB, H, D, dtype="float32", max_sequence_length=16)
    sess = make_session(model(H, H, D, is_causal=1))
    q0 = np.repeat(rnd(rng, 1, H, P, D), NB, 0)
    k0 = np.repeat(rnd(rng, 1, H, P, D), NB, 0)
    v0 = np.repeat(rnd(rng, 1, H, P, D), NB, 0)
    y, _ = step(sess, cache, q0, k0, v0)
    assert_close(y, ref_attn(q0, k0, v0)[0], np.float32, "prefill")
    hist = [(k0[b], v0[b]) for b in range(NB)]   # per beam: (H, L, D) each

    def decode(t):
        pos = P + t
        q = rnd(rng, NB, H, 1, D)
        k = np.array([[[[pos, 0.25 * (b + 1)]]] for b in range(NB)], np.float32)
        v = np.array([[[[10.0 * pos + b, -(10.0 * pos + b)]]] for b in range(NB)], np.float32)
        y, _ = step(sess, cache, q, k, v)
        for b in range(NB):
            hk, hv = hist[b]
            exp = ref_attn(q[b:b + 1], k[b:b + 1], v[b:b + 1], hk[None], hv[None])[0]
            assert_close(y[b:b + 1], exp, np.float32, f"step {t} beam {b}")
        for b in range(NB):
            hist[b] = (np.concatenate([hist[b][0], k[b]], 1), np.concatenate([hist[b][1], v[b]], 1))

    def check_export(msg):
        ek, ev = cache.export(0)
        assert_bit_equal(ek, np.stack([h[0] for h in hist]), msg)
        assert_bit_equal(ev, np.stack([h[1] for h in hist]), msg)

    decode(0)   # before any reorder: identity
    check_export("before reorder")
    for t, idx in enumerate([[2, 0, 0], [1, 1, 2], [0, 0, 0]], start=1):
        cache.reorder(idx)
        hist = [hist[i] for i in idx]
        assert cache.seq_lens.tolist() == [P + t] * NB
        check_export(f"after reorder {idx}")
        decode(t)
    check_export("final")


# ------------------------------------------------------- C06, C07, C14 on paged storage
# The same semantics with pages of 32 positions, histories that cross page ends, and sliding
# windows that evict pages (the cache's sliding_window + rollback_tokens).

def test_c06_paged_window3_across_page_ends_with_eviction(make_session, make_cache):
    rng = np.random.default_rng(160)
    D, W = 4, 3
    cache = make_cache(1, 1, 1, D, dtype="float32", max_sequence_length=128, page_tokens=32, sliding_window=W)
    sess = make_session(model(1, 1, D, is_causal=1, local_window_size=W))
    q, k, v = rnd(rng, 1, 1, 31, D), rnd(rng, 1, 1, 31, D), rnd(rng, 1, 1, 31, D)
    y, _ = step(sess, cache, q, k, v)
    assert_close(y, ref_attn(q, k, v, window=W)[0], np.float32, "prefill 31")
    hk, hv = k, v
    for pos in range(31, 70):
        q1, k1, v1 = rnd(rng, 1, 1, 1, D), rnd(rng, 1, 1, 1, D), rnd(rng, 1, 1, 1, D)
        y1, _ = step(sess, cache, q1, k1, v1)
        exp, p, _, _ = ref_attn(q1, k1, v1, hk, hv, window=W)
        assert np.flatnonzero(p[0, 0, 0]).tolist() == [pos - 2, pos - 1, pos]
        assert_close(y1, exp, np.float32, f"decode at position {pos}")
        hk, hv = np.concatenate([hk, k1], 2), np.concatenate([hv, v1], 2)
        assert cache._first_positions()[0, 0] == max(0, pos + 1 - W) // 32 * 32
    assert cache.stats()["num_pages"] <= 2


@pytest.mark.parametrize("rollback", [0, 5])
def test_c07_paged_window8_evicts_only_whole_pages_out_of_window(make_session, make_cache, rollback):
    """C07 on pages: W=8, pages of 32. Prefill 30, decode to 70 (two evictions), with a chunk of
    S=3 across an eviction point: each call keeps W-1+S keys, then trims whole pages."""
    rng = np.random.default_rng(170 + rollback)
    D, W = 4, 8
    cache = make_cache(1, 1, 1, D, dtype="float32", max_sequence_length=128, page_tokens=32, sliding_window=W,
                       rollback_tokens=rollback)
    sess = make_session(model(1, 1, D, is_causal=1, local_window_size=W))
    q = (0.1 * rng.standard_normal((1, 1, 30, D))).astype(np.float32)
    k, v = _c07_tokens(range(30))
    step(sess, cache, q, k, v)
    hk, hv, n = k, v, 30
    while n < 70:
        S = 3 if n in (38, 39, 40) else 1
        q1 = (0.1 * rng.standard_normal((1, 1, S, D))).astype(np.float32)
        k1, v1 = _c07_tokens(range(n, n + S))
        y1, _ = step(sess, cache, q1, k1, v1)
        assert_close(y1, ref_attn(q1, k1, v1, hk, hv, window=W)[0], np.float32, f"total {n} + {S}")
        hk, hv, n = np.concatenate([hk, k1], 2), np.concatenate([hv, v1], 2), n + S
        first = int(cache._first_positions()[0, 0])
        assert first == max(0, n - W - rollback) // 32 * 32, (n, first)
        ek, _ = cache.export(0)
        assert_bit_equal(ek[:, :, first:], hk[:, :, first:], f"rows kept at total {n}")
        assert not ek[:, :, :first].any()  # evicted positions read back as zeros
    with pytest.raises(ValueError, match="earliest length"):
        cache.truncate(n - W - rollback - 1 - 32)


def test_c14_paged_beam_reorder_copies_only_shared_tail_pages(make_session, make_cache):
    """C14 on pages of 32 with a 40-token prefill (a full page and a partly filled one): reorders
    [2,0,0], [1,1,2], [0,0,0]; appends after a reorder copy each shared tail page once."""
    rng = np.random.default_rng(140)
    NB, H, D, P = 3, 1, 2, 40
    cache = make_cache(1, NB, H, D, dtype="float32", max_sequence_length=128, page_tokens=32)
    sess = make_session(model(H, H, D, is_causal=1))
    q0 = np.repeat(rnd(rng, 1, H, P, D), NB, 0)
    k0 = np.repeat(rnd(rng, 1, H, P, D), NB, 0)
    v0 = np.repeat(rnd(rng, 1, H, P, D), NB, 0)
    step(sess, cache, q0, k0, v0)
    hist = [(k0[b], v0[b]) for b in range(NB)]
    row = 2 * D * 4
    for t, idx in enumerate([[2, 0, 0], [1, 1, 2], [0, 0, 0]], start=1):
        cache.reorder(idx)
        hist = [hist[i] for i in idx]
        copies_before = cache.stats()["bytes_copied"]
        pos = P + t - 1
        q = rnd(rng, NB, H, 1, D)
        k = np.array([[[[pos, 0.25 * (b + 1)]]] for b in range(NB)], np.float32)
        v = np.array([[[[10.0 * pos + b, -(10.0 * pos + b)]]] for b in range(NB)], np.float32)
        y, _ = step(sess, cache, q, k, v)
        for b in range(NB):
            hk, hv = hist[b]
            assert_close(y[b:b + 1], ref_attn(q[b:b + 1], k[b:b + 1], v[b:b + 1], hk[None], hv[None])[0],
                         np.float32, f"reorder {idx} beam {b}")
        hist = [(np.concatenate([hist[b][0], k[b]], 1), np.concatenate([hist[b][1], v[b]], 1)) for b in range(NB)]
        # every beam sharing its tail page with another copied its (pos % 32) valid rows, once
        shared = sum(1 for b in range(NB) if idx.count(idx[b]) > 1)
        copied = cache.stats()["bytes_copied"] - copies_before
        assert copied <= shared * (pos % 32) * row, (idx, copied)
        ek, ev = cache.export(0)
        assert_bit_equal(ek, np.stack([h[0] for h in hist]), f"after reorder {idx}")
        assert_bit_equal(ev, np.stack([h[1] for h in hist]))
