"""CacheAttention on paged storage, at every ISA level this CPU has (conftest.py):

- long ragged histories (sequences ending mid-page at different positions, prefill chunks that
  cross several pages, decode steps, steps where some sequences append nothing) with page sizes
  that split the kernels' tiles differently (32, 64, 128 positions) vs the fp64 oracle, and
  bit-identical to the same bytes in one block per (layer, sequence, head);
- a sliding window past several evictions (sliding_window + rollback_tokens on the cache,
  local_window_size on the node) vs the oracle and bit-identical to a cache that evicts nothing;
- a beam history: prefill once, fork([0] * beams), reorders with repeats between decode steps
  (copy-on-write of shared tail pages) vs the oracle and vs plain ORT's ONNX Attention fed each
  beam's gathered past, and bit-identical to one-block storage;
for float32, float16 and bfloat16 (bfloat16 has no ONNX Attention kernel in ORT: oracle only).
"""
import zlib

import numpy as np
import pytest

import ort_utils
from models import AttnCfg, cache_attention_model, onnx_attention_model
from reference import assert_close, np_dtype, ref_attn

CAP = 320
ONE_BLOCK = 320  # page_tokens holding a whole sequence: one block per (layer, sequence, head)


CFGS = [
    AttnCfg("mha_f32", 4, 4, 16, "float32"),
    AttnCfg("gqa_f16", 8, 2, 32, "float16"),
    AttnCfg("mqa_bf16", 8, 1, 32, "bfloat16"),
    AttnCfg("gqa_bf16_wide", 16, 2, 64, "bfloat16"),
]


def bits(a):
    return np.ascontiguousarray(a).view(f"u{a.dtype.itemsize}")


def attend(q, k, v, hk, hv, n, window=None):
    """Oracle for one sequence's valid rows: q [1, Hq, S, D], new k/v [1, Hkv, S, D]; n rows real."""
    y = np.zeros(q.shape, np.float64)
    if n:
        y[:, :, :n] = ref_attn(q[:, :, :n], k[:, :, :n], v[:, :, :n], hk, hv, causal=True, window=window)[0]
    return y


@pytest.mark.parametrize("page_tokens", [32, 64, 128])
@pytest.mark.parametrize("cfg", CFGS, ids=lambda c: c.id)
def test_long_ragged_history(cfg, page_tokens, olep):
    dt = np_dtype(cfg.dtype)
    B, L, Hq, Hkv, D = 3, 2, cfg.hq, cfg.hkv, cfg.d
    rng = np.random.default_rng(zlib.crc32(cfg.id.encode()) + page_tokens)
    sess = ort_utils.make_ep_session(olep, cache_attention_model(
        layer_count=L, q_num_heads=Hq, kv_num_heads=Hkv, head_dim=D,
        dtype=cfg.dtype, with_seqlens_k=True, is_causal=1))
    steps = [(70, [70, 45, 33])] + [(1, [1, 1, 1])] * 20 + [(1, [1, 0, 1]), (45, [45, 10, 32])] + \
        [(1, [1, 1, 1])] * 12 + [(33, [0, 33, 7])]
    paged = olep.KVCache(L, B, Hkv, D, dtype=cfg.dtype, max_sequence_length=CAP, page_tokens=page_tokens)
    block = olep.KVCache(L, B, Hkv, D, dtype=cfg.dtype, max_sequence_length=CAP, page_tokens=ONE_BLOCK)
    hk = [[np.zeros((1, Hkv, 0, D), dt) for _ in range(B)] for _ in range(L)]
    hv = [[np.zeros((1, Hkv, 0, D), dt) for _ in range(B)] for _ in range(L)]
    lens = np.zeros(B, np.int64)
    try:
        for step, (S, n) in enumerate(steps):
            feeds = {"seqlens_k": (lens + np.asarray(n) - 1).astype(np.int32)}
            qkv = [(rng.standard_normal((B, Hq, S, D)).astype(dt), rng.standard_normal((B, Hkv, S, D)).astype(dt),
                    rng.standard_normal((B, Hkv, S, D)).astype(dt)) for _ in range(L)]
            for l, (q, k, v) in enumerate(qkv):
                feeds.update({f"query_{l}": q, f"key_{l}": k, f"value_{l}": v})
            out_p = ort_utils.run(sess, dict(feeds, kv_cache=paged.handle))
            out_b = ort_utils.run(sess, dict(feeds, kv_cache=block.handle))
            for l, (q, k, v) in enumerate(qkv):
                yp, yb = out_p[f"Y_{l}"], out_b[f"Y_{l}"]
                where = f"{cfg.id} P={page_tokens} step {step} layer {l}"
                assert np.array_equal(bits(yp), bits(yb)), f"{where}: paged != one block"
                for b in range(B):
                    ref = attend(q[b:b + 1], k[b:b + 1], v[b:b + 1], hk[l][b], hv[l][b], n[b])
                    assert_close(yp[b:b + 1].astype(np.float64), ref, dt, f"{where} seq {b}")
                    hk[l][b] = np.concatenate([hk[l][b], k[b:b + 1, :, :n[b]]], 2)
                    hv[l][b] = np.concatenate([hv[l][b], v[b:b + 1, :, :n[b]]], 2)
            lens += np.asarray(n)
            assert paged.seq_lens.tolist() == lens.tolist()
        st = paged.stats()
        assert st["num_pages"] == L * Hkv * sum(-(-int(x) // page_tokens) for x in lens)
        assert st["bytes_copied"] == 0
        for l in range(L):
            ek, _ = paged.export(l)
            for b in range(B):
                assert np.array_equal(bits(ek[b:b + 1, :, :lens[b]]), bits(hk[l][b]))
    finally:
        paged.close()
        block.close()


@pytest.mark.parametrize("cfg", CFGS[:3], ids=lambda c: c.id)
def test_sliding_window_past_several_evictions(cfg, olep):
    dt = np_dtype(cfg.dtype)
    B, L, Hq, Hkv, D, W, R, Pt = 2, 2, cfg.hq, cfg.hkv, cfg.d, 48, 8, 32
    rng = np.random.default_rng(zlib.crc32(cfg.id.encode()) + 7)
    sess = ort_utils.make_ep_session(olep, cache_attention_model(
        layer_count=L, q_num_heads=Hq, kv_num_heads=Hkv, head_dim=D,
        dtype=cfg.dtype, is_causal=1, local_window_size=W))
    evicting = olep.KVCache(L, B, Hkv, D, dtype=cfg.dtype, max_sequence_length=CAP, page_tokens=Pt,
                            sliding_window=W, rollback_tokens=R)
    keeping = olep.KVCache(L, B, Hkv, D, dtype=cfg.dtype, max_sequence_length=CAP, page_tokens=Pt)
    hk = [np.zeros((B, Hkv, 0, D), dt) for _ in range(L)]
    hv = [np.zeros((B, Hkv, 0, D), dt) for _ in range(L)]
    try:
        for step, S in enumerate([50] + [1] * 60 + [37] + [1] * 30):
            qkv = [(rng.standard_normal((B, Hq, S, D)).astype(dt), rng.standard_normal((B, Hkv, S, D)).astype(dt),
                    rng.standard_normal((B, Hkv, S, D)).astype(dt)) for _ in range(L)]
            feeds = {}
            for l, (q, k, v) in enumerate(qkv):
                feeds.update({f"query_{l}": q, f"key_{l}": k, f"value_{l}": v})
            out_e = ort_utils.run(sess, dict(feeds, kv_cache=evicting.handle))
            out_k = ort_utils.run(sess, dict(feeds, kv_cache=keeping.handle))
            for l, (q, k, v) in enumerate(qkv):
                assert np.array_equal(bits(out_e[f"Y_{l}"]), bits(out_k[f"Y_{l}"])), f"step {step} layer {l}"
                ref = ref_attn(q, k, v, hk[l], hv[l], causal=True, window=W)[0]
                assert_close(out_e[f"Y_{l}"].astype(np.float64), ref, dt, f"step {step} layer {l}")
                hk[l] = np.concatenate([hk[l], k], 2)
                hv[l] = np.concatenate([hv[l], v], 2)
            n = hk[0].shape[2]
            first = evicting._first_positions()
            assert (first == max(0, n - W - R) // Pt * Pt).all(), (n, first)
            # a sliding-window layer holds at most W + R plus two pages of rows per (sequence, head)
            per_head = evicting.stats()["num_pages"] // (L * B * Hkv)
            assert per_head * Pt <= W + R + 2 * Pt, (n, per_head)
        assert evicting._first_positions().min() > 0  # several evictions happened
    finally:
        evicting.close()
        keeping.close()


@pytest.mark.parametrize("cfg", CFGS[:3], ids=lambda c: c.id)
def test_beam_history_fork_and_reorder(cfg, olep):
    """Prefill one prompt, fork it into 3 beams, then decode with reorders whose indices repeat;
    each beam's output vs the oracle on its reconstructed history and vs ORT fed that history."""
    dt = np_dtype(cfg.dtype)
    beams, L, Hq, Hkv, D, Pt = 3, 2, cfg.hq, cfg.hkv, cfg.d, 32
    rng = np.random.default_rng(zlib.crc32(cfg.id.encode()) + 11)
    m1 = cache_attention_model(layer_count=L, q_num_heads=Hq, kv_num_heads=Hkv, head_dim=D, dtype=cfg.dtype,
                               is_causal=1)
    sess = ort_utils.make_ep_session(olep, m1)
    use_ort = cfg.dtype != "bfloat16"
    ort_sess = ort_utils.make_ort_session(onnx_attention_model(
        layer_count=L, q_num_heads=Hq, kv_num_heads=Hkv, head_dim=D, dtype=cfg.dtype, is_causal=1)) if use_ort else None

    def rows(b, S, H):
        return rng.standard_normal((b, H, S, D)).astype(dt)

    prompt = olep.KVCache(L, 1, Hkv, D, dtype=cfg.dtype, max_sequence_length=CAP, page_tokens=Pt)
    block1 = olep.KVCache(L, 1, Hkv, D, dtype=cfg.dtype, max_sequence_length=CAP, page_tokens=ONE_BLOCK)
    qkv = [(rows(1, 45, Hq), rows(1, 45, Hkv), rows(1, 45, Hkv)) for _ in range(L)]
    feeds = {}
    for l, (q, k, v) in enumerate(qkv):
        feeds.update({f"query_{l}": q, f"key_{l}": k, f"value_{l}": v})
    ort_utils.run(sess, dict(feeds, kv_cache=prompt.handle))
    ort_utils.run(sess, dict(feeds, kv_cache=block1.handle))
    hk = [np.repeat(qkv[l][1], beams, 0) for l in range(L)]
    hv = [np.repeat(qkv[l][2], beams, 0) for l in range(L)]
    cache = prompt.fork([0] * beams)
    block = block1.fork([0] * beams)
    prompt.close()
    block1.close()
    assert cache.stats()["bytes_copied"] == 0 and cache.stats()["shared_bytes"] == cache.stats()["committed_bytes"]
    reorders = [[2, 0, 0], [1, 1, 2], [0, 0, 0], [2, 1, 0], [1, 1, 1]]
    try:
        for step in range(30):
            qkv = [(rows(beams, 1, Hq), rows(beams, 1, Hkv), rows(beams, 1, Hkv)) for _ in range(L)]
            feeds, ort_feeds = {}, {}
            for l, (q, k, v) in enumerate(qkv):
                f = {f"query_{l}": q, f"key_{l}": k, f"value_{l}": v}
                feeds.update(f)
                ort_feeds.update(f, **{f"past_key_{l}": hk[l], f"past_value_{l}": hv[l]})
            out = ort_utils.run(sess, dict(feeds, kv_cache=cache.handle))
            out_b = ort_utils.run(sess, dict(feeds, kv_cache=block.handle))
            ort_out = ort_utils.run(ort_sess, ort_feeds) if use_ort else None
            for l, (q, k, v) in enumerate(qkv):
                y = out[f"Y_{l}"]
                assert np.array_equal(bits(y), bits(out_b[f"Y_{l}"])), f"step {step} layer {l}: paged != one block"
                ref = ref_attn(q, k, v, hk[l], hv[l], causal=True)[0]
                assert_close(y.astype(np.float64), ref, dt, f"step {step} layer {l}")
                if use_ort:
                    assert_close(y, ort_out[f"Y_{l}"], dt, f"step {step} layer {l}: vs ORT")
                hk[l] = np.concatenate([hk[l], k], 2)
                hv[l] = np.concatenate([hv[l], v], 2)
            if step % 6 == 5:
                idx = reorders[(step // 6) % len(reorders)]
                before = cache.stats()["bytes_copied"]
                cache.reorder(idx)
                block.reorder(idx)
                assert cache.stats()["bytes_copied"] == before
                hk = [x[idx] for x in hk]
                hv = [x[idx] for x in hv]
        # copy-on-write: whatever was copied is at most one tail page per (layer, beam, head) per step
        for l in range(L):
            ek, ev = cache.export(l)
            assert np.array_equal(bits(ek), bits(hk[l])) and np.array_equal(bits(ev), bits(hv[l]))
    finally:
        cache.close()
        block.close()
