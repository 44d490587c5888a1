"""The arena's operations on quantized cold pages (KVCache(kv_quant="int8" / "int4")): fork and
reorder share quantized pages, truncate into a quantized page keeps the kept rows' values,
checkpoints, save/load keep the codes and scales exactly, stats count the encodings, bad
policies are ValueErrors. Attention on such pages: tests/differential/test_quantized_pages.py."""
import numpy as np
import pytest

import onnx_light_ep as olep
from reference import quantize_page

P, D, H = 32, 32, 2
MODES = ["int8", "int4"]


def expected(k, v, recent, sink, mode="int8"):
    """k, v [B, H, L, D] float32 after one import: cold pages dequantized."""
    k, v = k.copy(), v.copy()
    L = k.shape[2]
    for blk in range(-(-sink // P), max(0, L - recent) // P):
        sl = slice(blk * P, (blk + 1) * P)
        for b in range(k.shape[0]):
            for h in range(k.shape[1]):
                k[b, h, sl], v[b, h, sl] = quantize_page(mode, k[b, h, sl], v[b, h, sl])
    return k, v


def make(batch=1, length=5 * P, recent=40, sink=4, dtype=np.float32, seed=0, mode="int8", **kw):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((batch, H, length, D)).astype(dtype)
    v = rng.standard_normal((batch, H, length, D)).astype(dtype)
    cache = olep.KVCache.from_past([k, k[:, ::-1].copy()], [v, v[:, ::-1].copy()], page_tokens=P,
                                   kv_quant=mode, recent_tokens=recent, sink_tokens=sink,
                                   max_sequence_length=16 * P, **kw)
    return cache, k, v


@pytest.mark.parametrize("mode", MODES)
def test_policy_reads_back_and_stats_count_encodings(mode):
    cache, k, v = make(mode=mode)
    with cache:
        assert (cache.kv_quant, cache.recent_tokens, cache.sink_tokens) == (mode, 40, 4)
        st = cache.stats()
        # length 160, recent 40: blocks wholly before 120 are 0..2; block 0 holds the sinks
        quant_pages, native_pages = 2 * 2 * H, 3 * 2 * H  # [layers x heads] blocks 1, 2 / 0, 3, 4
        bits, meta = (8, 4) if mode == "int8" else (4, 8)  # code bits; metadata bytes per channel / row
        assert st["quantized_bytes"] == quant_pages * P * 2 * D * bits // 8
        assert st["scale_bytes"] == quant_pages * meta * (D + P)
        assert st["native_bytes"] == native_pages * P * 2 * D * 4
        assert st["num_pages"] == quant_pages + native_pages
        ek, ev = cache.export(0)
        xk, xv = expected(k, v, 40, 4, mode)
        assert np.array_equal(ek, xk) and np.array_equal(ev, xv)
    plain = olep.KVCache.from_past([k], [v], page_tokens=P)
    with plain:
        assert plain.kv_quant is None and plain.stats()["quantized_bytes"] == 0


@pytest.mark.parametrize("kw, match", [
    (dict(kv_quant="int3"), "kv_quant"),
    (dict(kv_quant="int8", recent_tokens=-1), "recent_tokens"),
    (dict(kv_quant="int8", sink_tokens=-2), "sink_tokens"),
])
def test_bad_policy_is_a_value_error(kw, match):
    with pytest.raises(ValueError, match=match):
        olep.KVCache(1, 1, H, D, max_sequence_length=64, **kw)


def test_int4_needs_head_dims_multiple_of_32():
    with pytest.raises(ValueError, match="int4.*head_dim and v_head_dim multiples of 32.*got 48 and 48"):
        olep.KVCache(1, 1, H, 48, max_sequence_length=64, kv_quant="int4")


@pytest.mark.parametrize("mode", MODES)
def test_fork_and_reorder_share_quantized_pages(mode):
    cache, k, v = make(batch=2, mode=mode)
    with cache:
        before = cache.stats()
        beams = cache.fork([1, 1, 0])
        with beams:
            st = beams.stats()
            assert st["bytes_copied"] == 0
            assert st["quantized_bytes"] == before["quantized_bytes"]  # the same pages, shared
            beams.reorder([2, 2, 2])
            ek, _ = beams.export(0)
            xk, _ = expected(k, v, 40, 4, mode)
            for b in range(3):
                assert np.array_equal(ek[b], xk[0])
            assert beams.stats()["bytes_copied"] == ek.nbytes * 2  # the export itself (K and V)


@pytest.mark.parametrize("mode", MODES)
def test_truncate_into_a_quantized_page_keeps_its_rows(mode):
    cache, k, v = make(dtype=np.float16, mode=mode)
    with cache:
        xk, xv = expected(k.astype(np.float32), v.astype(np.float32), 40, 4, mode)
        cut = P + 10  # inside block 1 (quantized)
        cache.truncate(cut)
        ek, ev = cache.export(0)
        assert np.array_equal(ek[:, :, :cut], xk[:, :, :cut].astype(np.float16))
        assert np.array_equal(ev[:, :, :cut], xv[:, :, :cut].astype(np.float16))
        st = cache.stats()
        assert st["quantized_bytes"] == 0  # block 0 holds sinks, block 1 is native again
        assert cache.seq_lens.tolist() == [cut]


@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_restore_and_save_load_keep_quantized_bytes(tmp_path, mode):
    cache, k, v = make(batch=2, length=6 * P + 5, mode=mode)
    with cache:
        e0 = [cache.export(layer) for layer in range(2)]
        with cache.checkpoint() as cp:
            cache.truncate([P, 2 * P])
            cache.restore(cp)
        for layer in range(2):
            ek, ev = cache.export(layer)
            assert np.array_equal(ek, e0[layer][0]) and np.array_equal(ev, e0[layer][1])
        path = tmp_path / "q.olkv"
        cache.save(path)
        st = cache.stats()
        with olep.KVCache.load(path) as loaded:
            assert (loaded.kv_quant, loaded.recent_tokens, loaded.sink_tokens) == (mode, 40, 4)
            for layer in range(2):
                ek, ev = loaded.export(layer)
                assert np.array_equal(ek, e0[layer][0]) and np.array_equal(ev, e0[layer][1])
            lst = loaded.stats()
            for key in ("quantized_bytes", "scale_bytes", "native_bytes", "committed_bytes", "num_pages"):
                assert lst[key] == st[key], key
        raw = bytearray(path.read_bytes())
        raw[-40] ^= 1  # inside the payload: the checksum must catch it
        bad = tmp_path / "bad.olkv"
        bad.write_bytes(bytes(raw))
        with pytest.raises(ValueError, match="checksum"):
            olep.KVCache.load(bad)


# ---- regressions from an adversarial review (each failed before its fix) ----

def test_truncate_into_int8_pages_respects_the_cache_quota(tmp_path):
    import ort_utils
    from models import cache_attention_model

    sess = ort_utils.make_ep_session(olep, cache_attention_model(layer_count=1, q_num_heads=1, kv_num_heads=1,
                                                                 head_dim=D, dtype="float32", is_causal=1,
                                                                 with_seqlens_k=True),
                                     ort_utils.new_session_options(tmp_path))
    rng = np.random.default_rng(0)
    quant_page = -(-(P * 2 * D + 4 * (D + P)) // 64) * 64
    limit = 5 * quant_page + P * 2 * D * 4  # what the last step needs; no room for two native pages
    c = olep.KVCache(1, 2, 1, D, max_sequence_length=8 * P, page_tokens=P, kv_quant="int8", recent_tokens=0,
                     sink_tokens=0, memory_limit_bytes=limit)
    with c:
        lens = np.zeros(2, np.int64)
        for step in range(6):  # one full page per step, alternating sequences: cold at its commit
            n = np.array([P, 0]) if step % 2 == 0 else np.array([0, P])
            x = rng.standard_normal((2, 1, P, D)).astype(np.float32)
            ort_utils.run(sess, {"query_0": x, "key_0": x, "value_0": x, "kv_cache": c.handle,
                                 "seqlens_k": (lens + n - 1).astype(np.int32)})
            lens += n
        assert c.stats()["native_bytes"] == 0
        before = c.export(0)
        with pytest.raises(olep.KVCacheMemoryError, match="memory_limit_bytes is"):
            c.truncate([3 * P - 5, 3 * P - 5])  # inside both sequences' last int8 page
        assert c.seq_lens.tolist() == [3 * P, 3 * P]
        after = c.export(0)
        assert np.array_equal(before[0], after[0]) and np.array_equal(before[1], after[1])
        c.truncate([3 * P - 5, 3 * P])  # one native page fits
        assert c.stats()["committed_bytes"] <= limit


def test_load_quantizes_pages_a_budget_left_native(tmp_path):
    rng = np.random.default_rng(1)
    k = rng.standard_normal((1, H, 4 * P, D)).astype(np.float32)
    native = 4 * H * P * 2 * D * 4
    with olep.KVPool(memory_limit_bytes=native) as pool:  # no room for any int8 page next to them
        c = olep.KVCache.from_past([k], [k], page_tokens=P, kv_quant="int8", recent_tokens=0, sink_tokens=0,
                                   pool=pool, max_sequence_length=8 * P)
        with c:
            assert c.stats()["quantized_bytes"] == 0  # best effort: the budget refused
            c.save(tmp_path / "c.olkv")
    with olep.KVCache.load(tmp_path / "c.olkv") as d:
        st = d.stats()
        assert st["native_bytes"] == 0 and st["quantized_bytes"] == 4 * H * P * 2 * D


def test_quantization_under_a_full_budget_frees_as_it_goes():
    rng = np.random.default_rng(2)
    k = rng.standard_normal((1, H, 4 * P, D)).astype(np.float32)
    native = 4 * H * P * 2 * D * 4
    quant_page = -(-(P * 2 * D + 4 * (D + P)) // 64) * 64
    with olep.KVPool(memory_limit_bytes=native + quant_page) as pool:  # room for one int8 page at a time
        with olep.KVCache.from_past([k], [k], page_tokens=P, kv_quant="int8", recent_tokens=0, sink_tokens=0,
                                    pool=pool, max_sequence_length=8 * P) as c:
            assert c.stats()["native_bytes"] == 0


def test_crafted_header_is_refused_before_allocating(tmp_path):
    import resource
    import struct

    L, B = 4096, 65536
    wrapped = (16 + 8 * (12 + L + B + 2 * L * B)) & 0xFFFFFFFF  # what a 32-bit size computation gives
    fields = [L, B, 1, 16, 16, 64, 0, 32, 0, 1, 0, 0]
    data = b"OLKVCACH" + struct.pack("<II", 3, wrapped) + struct.pack("<12q", *fields) + bytes(8 * (L + B))
    path = tmp_path / "bomb.olkv"
    path.write_bytes(data)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ValueError, match="header size .* does not match its geometry"):
        olep.KVCache.load(path)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 256 * 1024  # KiB: no GiB allocation
