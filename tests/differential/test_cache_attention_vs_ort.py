"""CacheAttention, step by step, vs standard ONNX Attention (opset 23) on plain ORT fed the
equivalent past_key/past_value (present fed back), and vs the fp64 oracle ``ref_attn``.

Each config: (optional past imported with KVCache.from_past) -> prefill S=5 -> 20 decode
steps S=1 -> one chunk S=3. Run through the EP session and through the plain CPU session
(custom-op library), asserting which provider ran CacheAttention, the cache bookkeeping
(seq_lens, stats) after every step and export() == ORT present at the end.
"""
import dataclasses
import zlib

import numpy as np
import pytest

import ort_utils
from models import cache_attention_model, onnx_attention_model
from reference import (assert_close, bool_to_additive, from_bnsh, np_dtype, ref_attn,
                       to_bnsh)

CAPACITY = 64
STEPS = [5] + [1] * 20 + [3]


@dataclasses.dataclass(frozen=True)
class Cfg:
    id: str
    hq: int
    hkv: int
    d: int = 8
    dv: int = None
    dtype: str = "float32"
    rank: int = 4
    b: int = 1
    causal: int = 1
    mask: str = None          # None | 'bool' | 'float'
    mask_rank: int = 4        # 2: (S,T)  3: (Hq,S,T)  4: (B,1,S,T)
    softcap: float = 0.0
    window: int = -1
    scale: float = None
    past0: int = 0            # tokens imported with KVCache.from_past before the first run
    layers: int = 1
    q_gain: float = 1.0       # multiplies q (pushes scores into the softcap regime)

    @property
    def Dv(self):
        return self.d if self.dv is None else self.dv


CONFIGS = [
    Cfg("mha_f32_r4_b1_causal", 4, 4, d=8),
    Cfg("gqa_f32_r4_b3_causal_2layers", 8, 2, d=16, b=3, layers=2),
    Cfg("mqa_f32_r3_b3_causal", 4, 1, d=8, rank=3, b=3),
    Cfg("gqa_f16_r4_b1_causal", 8, 2, d=16, dtype="float16"),
    Cfg("mha_f16_r3_b3_causal_frompast", 4, 4, d=8, dtype="float16", rank=3, b=3, past0=7),
    Cfg("gqa_f32_r3_b3_boolmask4_causal", 8, 2, d=8, rank=3, b=3, mask="bool", mask_rank=4),
    Cfg("mqa_f32_r4_b1_floatmask2_noncausal", 4, 1, d=16, causal=0, mask="float", mask_rank=2),
    Cfg("gqa_f16_r4_b3_floatmask3_causal_2layers", 8, 2, d=8, dtype="float16", b=3, mask="float",
        mask_rank=3, layers=2),
    Cfg("mha_f32_r4_b3_softcap_scale_causal", 4, 4, d=8, b=3, softcap=2.0, scale=0.5, q_gain=3.0),
    Cfg("gqa_f16_r3_b1_softcap_boolmask_causal", 8, 2, d=16, dtype="float16", rank=3,
        mask="bool", mask_rank=4, softcap=5.0, q_gain=3.0),
    Cfg("gqa_f32_r4_b3_window4_causal", 8, 2, d=8, b=3, window=4),
    Cfg("mqa_f16_r3_b1_window6_causal_frompast", 4, 1, d=16, dtype="float16", rank=3, window=6,
        past0=9),
    Cfg("mha_f32_r4_b3_window5_noncausal_floatmask", 4, 4, d=8, b=3, causal=0, window=5,
        mask="float", mask_rank=4),
    Cfg("gqa_f32_r3_b1_noncausal_dv12_frompast", 8, 2, d=8, dv=12, rank=3, causal=0, past0=4),
]


def _make_mask(cfg, rng, B, S, P):
    """Random mask over past+current columns; key P+i (the row's own token) always visible so
    no row is fully masked (plain ORT returns NaN for those; that is covered by C08)."""
    T = P + S
    shape = {2: (S, T), 3: (cfg.hq, S, T), 4: (B, 1, S, T)}[cfg.mask_rank]
    self_col = np.zeros((S, T), bool)
    self_col[np.arange(S), P + np.arange(S)] = True
    if cfg.mask == "bool":
        m = (rng.random(shape) > 0.35) | self_col
        return m, bool_to_additive(m)
    m = rng.standard_normal(shape)
    m = np.where((rng.random(shape) < 0.2) & ~self_col, -np.inf, m).astype(np_dtype(cfg.dtype))
    return m, m.astype(np.float64)


@pytest.mark.parametrize("backend", ["ep", "cpu"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.id)
def test_cache_attention_vs_ort(cfg, backend, olep, tmp_path):
    dt = np_dtype(cfg.dtype)
    B, L, Hq, Hkv, D, Dv = cfg.b, cfg.layers, cfg.hq, cfg.hkv, cfg.d, cfg.Dv
    rng = np.random.default_rng(zlib.crc32(cfg.id.encode()))

    ours_model = cache_attention_model(
        layer_count=L, q_num_heads=Hq, kv_num_heads=Hkv, head_dim=D, v_head_dim=cfg.dv,
        dtype=cfg.dtype, rank=cfg.rank, with_mask=cfg.mask, mask_rank=cfg.mask_rank,
        is_causal=cfg.causal, softcap=cfg.softcap, local_window_size=cfg.window, scale=cfg.scale)
    so = ort_utils.new_session_options(tmp_path)
    if backend == "ep":
        sess = ort_utils.make_ep_session(olep, ours_model, so)
        expected_provider = ort_utils.EP_NAME
    else:
        sess = ort_utils.make_cpu_session(olep, ours_model, so)
        expected_provider = ort_utils.CPU_EP

    # plain ORT has no sliding window in opset 23: windowed configs compare to ref_attn only
    use_ort = cfg.window == -1
    ort_sess = None
    if use_ort:
        ort_sess = ort_utils.make_ort_session(onnx_attention_model(
            layer_count=L, q_num_heads=Hq, kv_num_heads=Hkv, head_dim=D, v_head_dim=cfg.dv,
            dtype=cfg.dtype, rank=cfg.rank, with_mask=cfg.mask, mask_rank=cfg.mask_rank,
            is_causal=cfg.causal, softcap=cfg.softcap, scale=cfg.scale))

    def rnd(*shape):
        return rng.standard_normal(shape).astype(dt)

    hist_k = [rnd(B, Hkv, cfg.past0, D) for _ in range(L)]
    hist_v = [rnd(B, Hkv, cfg.past0, Dv) for _ in range(L)]
    if cfg.past0:
        cache = olep.KVCache.from_past(hist_k, hist_v, max_sequence_length=CAPACITY)
    else:
        cache = olep.KVCache(L, B, Hkv, D, v_head_dim=cfg.dv, dtype=cfg.dtype,
                             max_sequence_length=CAPACITY)
    try:
        assert cache.seq_lens.tolist() == [cfg.past0] * B
        assert (cache.num_layers, cache.batch_size, cache.kv_num_heads, cache.head_dim,
                cache.v_head_dim) == (L, B, Hkv, D, Dv)
        st0 = cache.stats()
        assert st0["bytes_copied"] == 0, st0
        assert st0["live_bytes"] == L * B * Hkv * cfg.past0 * (D + Dv) * dt.itemsize, st0
        P = cfg.past0
        for step, S in enumerate(STEPS):
            feeds, ort_feeds = {"kv_cache": cache.handle}, {}
            qs, ks, vs = [], [], []
            for l in range(L):
                q, k, v = rnd(B, Hq, S, D), rnd(B, Hkv, S, D), rnd(B, Hkv, S, Dv)
                q = (q.astype(np.float32) * cfg.q_gain).astype(dt)
                qs.append(q), ks.append(k), vs.append(v)
                lay = (lambda x, h: x) if cfg.rank == 4 else (lambda x, h: from_bnsh(x))
                f = {f"query_{l}": lay(q, Hq), f"key_{l}": lay(k, Hkv), f"value_{l}": lay(v, Hkv)}
                feeds.update(f)
                ort_feeds.update(f)
                ort_feeds[f"past_key_{l}"] = hist_k[l]
                ort_feeds[f"past_value_{l}"] = hist_v[l]
            add = None
            if cfg.mask:
                m, add = _make_mask(cfg, rng, B, S, P)
                feeds["attn_mask"] = m
                ort_feeds["attn_mask"] = m
            before = cache.stats()

            out = ort_utils.run(sess, feeds)
            ort_out = ort_utils.run(ort_sess, ort_feeds) if use_ort else None

            for l in range(L):
                where = f"{cfg.id}/{backend} step {step} (P={P}, S={S}) layer {l}"
                y = out[f"Y_{l}"]
                y4 = y if cfg.rank == 4 else to_bnsh(y, Hq)
                exp_shape = (B, Hq, S, Dv) if cfg.rank == 4 else (B, S, Hq * Dv)
                assert y.shape == exp_shape and y.dtype == dt, (where, y.shape, y.dtype)
                ref = ref_attn(qs[l], ks[l], vs[l], hist_k[l], hist_v[l], scale=cfg.scale,
                               causal=bool(cfg.causal), softcap=cfg.softcap, add_mask=add,
                               window=None if cfg.window == -1 else cfg.window)[0]
                assert_close(y4, ref, dt, f"{where}: CacheAttention vs ref_attn")
                if use_ort:
                    yo = ort_out[f"Y_{l}"]
                    yo4 = yo if cfg.rank == 4 else to_bnsh(yo, Hq)
                    assert_close(yo4, ref, dt, f"{where}: ONNX Attention (ORT) vs ref_attn (oracle check)")
                    assert_close(y4, yo4, dt, f"{where}: CacheAttention vs ONNX Attention (ORT)")
                    pk, pv = ort_out[f"present_key_{l}"], ort_out[f"present_value_{l}"]
                    assert np.array_equal(pk, np.concatenate([hist_k[l], ks[l]], 2))
                    hist_k[l], hist_v[l] = pk, pv
                else:
                    hist_k[l] = np.concatenate([hist_k[l], ks[l]], 2)
                    hist_v[l] = np.concatenate([hist_v[l], vs[l]], 2)
            P += S
            assert cache.seq_lens.tolist() == [P] * B, (step, cache.seq_lens)
            after = cache.stats()
            assert after["bytes_appended"] - before["bytes_appended"] == \
                L * B * Hkv * S * (D + Dv) * dt.itemsize, (step, before, after)
            assert after["bytes_copied"] == 0, (step, after)
            assert after["num_appends"] - before["num_appends"] == 1, (step, before, after)
            assert after["live_bytes"] == L * B * Hkv * P * (D + Dv) * dt.itemsize, (step, after)
            assert after["reserved_bytes"] == 0 and after["committed_bytes"] >= after["live_bytes"], after

        for l in range(L):
            ek, ev = cache.export(l)
            assert ek.shape == (B, Hkv, P, D) and ev.shape == (B, Hkv, P, Dv)
            assert ek.dtype == dt and ev.dtype == dt
            # bit-exact: present is a concatenation, no arithmetic involved
            assert np.array_equal(ek.view(f"u{dt.itemsize}"), hist_k[l].view(f"u{dt.itemsize}")), \
                f"layer {l}: export key != present_key"
            assert np.array_equal(ev.view(f"u{dt.itemsize}"), hist_v[l].view(f"u{dt.itemsize}")), \
                f"layer {l}: export value != present_value"
    finally:
        cache.close()
    assert ort_utils.end_profile_providers(sess, "CacheAttention") == {expected_provider}


@pytest.mark.parametrize("cfg", [c for c in CONFIGS if c.window == -1], ids=lambda c: c.id)
def test_onnx_attention_oracle(cfg):
    """Plain ORT ONNX Attention (opset 23) vs ref_attn over the same step schedule: validates
    the oracle, the model builder and the mask generator independently of the package."""
    dt = np_dtype(cfg.dtype)
    B, Hq, Hkv, D, Dv = cfg.b, cfg.hq, cfg.hkv, cfg.d, cfg.Dv
    rng = np.random.default_rng(zlib.crc32(cfg.id.encode()) + 1)
    sess = ort_utils.make_ort_session(onnx_attention_model(
        q_num_heads=Hq, kv_num_heads=Hkv, head_dim=D, v_head_dim=cfg.dv, dtype=cfg.dtype,
        rank=cfg.rank, with_mask=cfg.mask, mask_rank=cfg.mask_rank, is_causal=cfg.causal,
        softcap=cfg.softcap, scale=cfg.scale))
    hk = rng.standard_normal((B, Hkv, cfg.past0, D)).astype(dt)
    hv = rng.standard_normal((B, Hkv, cfg.past0, Dv)).astype(dt)
    P = cfg.past0
    for S in STEPS:
        q = (rng.standard_normal((B, Hq, S, D)) * cfg.q_gain).astype(dt)
        k = rng.standard_normal((B, Hkv, S, D)).astype(dt)
        v = rng.standard_normal((B, Hkv, S, Dv)).astype(dt)
        lay = (lambda x: x) if cfg.rank == 4 else from_bnsh
        feeds = {"query_0": lay(q), "key_0": lay(k), "value_0": lay(v), "past_key_0": hk,
                 "past_value_0": hv}
        add = None
        if cfg.mask:
            feeds["attn_mask"], add = _make_mask(cfg, rng, B, S, P)
        out = ort_utils.run(sess, feeds)
        y = out["Y_0"] if cfg.rank == 4 else to_bnsh(out["Y_0"], Hq)
        ref = ref_attn(q, k, v, hk, hv, scale=cfg.scale, causal=bool(cfg.causal),
                       softcap=cfg.softcap, add_mask=add)[0]
        assert_close(y, ref, dt, f"P={P} S={S}")
        hk, hv = out["present_key_0"], out["present_value_0"]
        P += S
        assert hk.shape == (B, Hkv, P, D)


def test_provider_assignment(olep, ep_session, cpu_session, providers_that_ran):
    """providers_that_ran: the EP session runs CacheAttention on OnnxLightExecutionProvider, the
    plain session (custom-op library) on CPUExecutionProvider."""
    m = cache_attention_model(q_num_heads=2, kv_num_heads=1, head_dim=8, is_causal=1)
    rng = np.random.default_rng(0)
    found = {}
    for name, factory in (("ep", lambda so: ep_session(m, so)), ("cpu", lambda so: cpu_session(m, so))):
        with olep.KVCache(1, 2, 1, 8, max_sequence_length=8) as cache:
            feeds = {"query_0": rng.standard_normal((2, 2, 3, 8)).astype(np.float32),
                     "key_0": rng.standard_normal((2, 1, 3, 8)).astype(np.float32),
                     "value_0": rng.standard_normal((2, 1, 3, 8)).astype(np.float32),
                     "kv_cache": cache.handle}
            found[name] = providers_that_ran(factory, feeds, "CacheAttention")
            assert cache.seq_lens.tolist() == [3, 3]
    assert found == {"ep": {ort_utils.EP_NAME}, "cpu": {ort_utils.CPU_EP}}
