"""Slabs and huge pages of the page pool (custom_ops/kvcache/page_pool.cc).

Pages are carved from 2 MiB-aligned slabs that are faulted in at creation with
MADV_HUGEPAGE and then MADV_COLLAPSE, because streaming K/V from 4 KiB pages
reads at ~60% of the bandwidth of 2 MiB pages. What must hold: the data is
unchanged; the pool's committed_bytes is exactly the slab bytes the process
holds (resident anonymous memory grows by that much), every committed byte is
in one of live / free / overhead; empty slabs stay mapped for reuse only within
the pool's keep_free_bytes (and go with trim() or the last cache); slabs are
huge-page backed where the kernel can collapse.
"""
from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvcache_util import assert_bit_equal  # noqa: E402

from onnx_light_ep import KVCache, KVPool, _core  # noqa: E402

MIB2 = 2 << 20
MADV_COLLAPSE = 25


def _kernel_collapses() -> bool:
    """MADV_COLLAPSE exists since Linux 6.1; older kernels answer EINVAL. Probed on a private
    anonymous mapping, like the pool's slabs."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    prot_rw, map_private_anon = 0x3, 0x22
    p = libc.mmap(None, 2 * MIB2, prot_rw, map_private_anon, -1, 0)
    if p in (None, ctypes.c_void_p(-1).value):
        return False
    addr = (p + MIB2 - 1) // MIB2 * MIB2
    ctypes.memset(addr, 1, MIB2)
    ok = libc.madvise(ctypes.c_void_p(addr), MIB2, MADV_COLLAPSE) == 0
    libc.munmap(ctypes.c_void_p(p), 2 * MIB2)
    return ok


def _rollup(field: str) -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _past(rng, B, H, T, D, dtype=np.float32):
    k = [rng.standard_normal((B, H, T, D)).astype(dtype)]
    v = [rng.standard_normal((B, H, T, D)).astype(dtype)]
    return k, v


def test_imported_past_is_exact_and_accounted():
    rng = np.random.default_rng(1)
    B, H, T, D = 2, 3, 1000, 64
    k, v = _past(rng, B, H, T, D)
    with KVPool() as pool:
        with KVCache.from_past(k, v, max_sequence_length=2048, pool=pool) as c:
            ek, ev = c.export(0)
            assert_bit_equal(ek, k[0], "K")
            assert_bit_equal(ev, v[0], "V")
            P = c.page_tokens
            page = P * 2 * D * 4
            pages = B * H * -(-T // P)
            st, ps = c.stats(), pool.stats()
            assert st["committed_bytes"] == pages * page
            assert st["live_bytes"] == B * H * T * 2 * D * 4
            assert ps["live_bytes"] == pages * page and ps["num_pages"] == pages
            assert ps["committed_bytes"] == ps["live_bytes"] + ps["free_bytes"] + ps["overhead_bytes"]
            assert ps["committed_bytes"] % MIB2 == 0 and ps["committed_bytes"] >= ps["live_bytes"]
            assert ps["committed_bytes"] - ps["live_bytes"] < MIB2  # one partly used slab
        ps = pool.stats()
        assert ps["live_bytes"] == 0 and ps["committed_bytes"] == 0  # empty slabs are unmapped


def test_slabs_are_huge_pages_when_the_kernel_collapses():
    if not _kernel_collapses():
        pytest.skip("this kernel has no MADV_COLLAPSE (Linux < 6.1 or THP disabled): slabs stay on 4 KiB pages")
    rng = np.random.default_rng(2)
    k, v = _past(rng, 1, 8, 4096, 128)  # 32 MiB of K+V
    before = _rollup("AnonHugePages")
    with KVCache.from_past(k, v, max_sequence_length=8192) as c:
        committed = c.stats()["committed_bytes"]
        gained = _rollup("AnonHugePages") - before
        assert gained >= 0.9 * committed, (gained, committed)


def test_resident_memory_matches_committed_bytes():
    """Anonymous memory the process gains equals the pages' slabs (within 512 KiB of unrelated
    allocations), also after a truncate and for a fork (which shares every page)."""
    rng = np.random.default_rng(5)
    B, H, T, D = 1, 4, 4096 + 64, 128
    k, v = _past(rng, B, H, T, D)
    base = _rollup("Anonymous")
    base_slabs = _core.process_committed_bytes()
    pool = KVPool()
    with KVCache.from_past(k, v, max_sequence_length=8192, pool=pool) as c:
        slabs = _core.process_committed_bytes() - base_slabs
        assert slabs == pool.stats()["committed_bytes"] >= c.stats()["committed_bytes"]
        assert abs((_rollup("Anonymous") - base) - slabs) <= 512 << 10
        c.truncate([7])
        slabs = _core.process_committed_bytes() - base_slabs
        ps = pool.stats()
        assert slabs == ps["committed_bytes"]
        # one page per head is left; a head's pages are consecutive (docs/API.md), so at most
        # one slab per head holds a page; of the rest, keep_free_bytes stay mapped for reuse
        assert 0 < ps["empty_slab_bytes"] <= ps["keep_free_bytes"] == KVPool.DEFAULT_KEEP_FREE_BYTES
        assert slabs - ps["empty_slab_bytes"] <= H * MIB2
        assert c.stats()["num_pages"] == H
        assert abs((_rollup("Anonymous") - base) - slabs) <= 512 << 10
        assert pool.trim() == ps["empty_slab_bytes"]
        slabs = _core.process_committed_bytes() - base_slabs
        assert slabs <= H * MIB2 and pool.stats()["empty_slab_bytes"] == 0
        assert abs((_rollup("Anonymous") - base) - slabs) <= 512 << 10  # trimmed memory is given back
        f = c.fork()
        try:
            assert _core.process_committed_bytes() - base_slabs == slabs  # a fork maps nothing
            assert f.stats()["committed_bytes"] == c.stats()["committed_bytes"]
        finally:
            f.close()
    pool.close()
    assert _core.process_committed_bytes() == base_slabs


def test_truncate_then_append_keeps_rows_exact():
    """Truncate into a page, then import again: rows before the cut are unchanged, pages past it
    are released."""
    rng = np.random.default_rng(6)
    k, v = _past(rng, 1, 2, 700, 64)
    with KVCache.from_past(k, v, max_sequence_length=4096, page_tokens=256) as c:
        c.truncate([300])
        assert c.stats()["num_pages"] == 2 * 2
        ek, ev = c.export(0)
        assert_bit_equal(ek, k[0][:, :, :300], "K after truncate")
        assert_bit_equal(ev, v[0][:, :, :300], "V after truncate")


@pytest.mark.parametrize("keep_free_bytes", [None, 0])
def test_empty_slabs_are_reused_within_keep_free_bytes(keep_free_bytes):
    """A cache truncated across page starts leaves empty slabs; the pool keeps up to
    keep_free_bytes of them mapped (default 64 MiB), and the next pages come from them without
    mapping anything. keep_free_bytes=0 unmaps them at once. Closing the last cache unmaps all."""
    rng = np.random.default_rng(8)
    B, H, T, D = 1, 4, 4096, 128  # 8 MiB of K+V per head: 4 slabs per head
    k, v = _past(rng, B, H, T, D)
    base_slabs = _core.process_committed_bytes()
    with KVPool(keep_free_bytes=keep_free_bytes) as pool:
        keep = pool.keep_free_bytes
        assert keep == (KVPool.DEFAULT_KEEP_FREE_BYTES if keep_free_bytes is None else 0)
        assert pool.stats()["keep_free_bytes"] == keep
        with KVCache.from_past(k, v, max_sequence_length=8192, pool=pool, page_tokens=256) as c:
            full = pool.stats()["committed_bytes"]
            c.truncate([7])
            s = pool.stats()
            assert s["committed_bytes"] == s["live_bytes"] + s["free_bytes"] + s["overhead_bytes"]
            assert s["empty_slab_bytes"] == min(keep, full - H * MIB2)
            assert _core.process_committed_bytes() - base_slabs == s["committed_bytes"]
            # the same rows again, in a second cache of the pool: it takes every free page (those
            # of the kept empty slabs too) before mapping the 2 MiB slabs it still lacks
            with KVCache.from_past(k, v, max_sequence_length=8192, pool=pool, page_tokens=256) as c2:
                mapped = _core.process_committed_bytes() - base_slabs - s["committed_bytes"]
                need = c2.stats()["committed_bytes"]  # 256 KiB pages: no slab tail, no overhead
                assert mapped == -(-max(0, need - s["free_bytes"]) // MIB2) * MIB2
                ek, _ = c2.export(0)
                assert_bit_equal(ek, k[0], "K of the cache on reused slabs")
        assert pool.stats()["committed_bytes"] == 0  # the last cache closed: empty slabs unmapped
    assert _core.process_committed_bytes() == base_slabs


def test_keep_free_bytes_and_trim_arguments():
    with pytest.raises(ValueError, match="keep_free_bytes must be >= 0"):
        KVPool(keep_free_bytes=-1)
    with pytest.raises(ValueError, match="keep_free_bytes"):
        KVPool(keep_free_bytes=1.5)
    pool = KVPool(keep_free_bytes=4 * MIB2)
    assert pool.trim() == 0
    pool.close()
    with pytest.raises(ValueError, match="KVPool.trim"):
        pool.trim()


_REFUSED_MAPPING_SCRIPT = r"""
import resource, sys
import numpy as np
from onnx_light_ep import KVCache, KVCacheMemoryError, KVPool

def vm_size():
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024

MIB = 1 << 20
headroom = int(sys.argv[1]) * MIB
rng = np.random.default_rng(9)
pool = KVPool()
# 16 MiB of 128 KiB pages (128 positions x head_dim 128 x fp32, K and V) in 8 slabs, emptied: kept
k1 = [rng.standard_normal((1, 4, 4096, 128)).astype(np.float32)]
c1 = KVCache.from_past(k1, k1, max_sequence_length=4096, pool=pool, page_tokens=128)
c1.truncate([0])
kept = pool.stats()["empty_slab_bytes"]
assert kept == 16 * MIB, kept
# A second cache with another page size (256 KiB) needs 16 MiB of new slabs.
k2 = [rng.standard_normal((1, 4, 4096, 128)).astype(np.float32)]
resource.setrlimit(resource.RLIMIT_AS, (vm_size() + headroom, resource.RLIM_INFINITY))
try:
    c2 = KVCache.from_past(k2, k2, max_sequence_length=4096, pool=pool, page_tokens=256)
except KVCacheMemoryError as e:
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    s = pool.stats()
    print("refused", s["empty_slab_bytes"], s["live_bytes"], c1.seq_lens.tolist(), str(e)[:80])
else:
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    ek, ev = c2.export(0)
    assert np.array_equal(ek, k2[0]) and np.array_equal(ev, k2[0])
    print("mapped", pool.stats()["empty_slab_bytes"], c2.stats()["live_bytes"])
"""


@pytest.mark.parametrize("headroom_mib", [8, 0])
def test_refused_mapping_unmaps_kept_slabs_and_retries(tmp_path, headroom_mib):
    """When the system refuses a new slab (here: an address-space limit, RLIMIT_AS, in a child
    process), the pool unmaps the empty slabs it kept and tries once more: with 8 MiB of headroom
    the 16 MiB a new cache needs fit only in the 16 MiB the kept slabs gave back. With no
    headroom at all the retry fails too: KVCacheMemoryError, and the other cache is unchanged."""
    import subprocess

    script = tmp_path / "refused_mapping.py"
    script.write_text(_REFUSED_MAPPING_SCRIPT)
    r = subprocess.run([sys.executable, str(script), str(headroom_mib)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    words = r.stdout.split()
    if headroom_mib:
        assert words[:2] == ["mapped", "0"], r.stdout  # the kept slabs went; the cache is exact
        assert int(words[2]) == 16 << 20
    else:
        assert words[:4] == ["refused", "0", "0", "[0]"], r.stdout
        assert "the system refused to map a slab" in r.stdout, r.stdout


def test_private_pool_keeps_one_page_per_layer_sequence_and_head():
    """A cache without a pool keeps at most one page per (layer, sequence, kv head) of emptied
    slabs (whole slabs, plus one), not the shared pools' 64 MiB: a truncate to 7 positions of a
    16 MiB cache leaves its one partly used slab per head and at most 2 empty slabs mapped."""
    rng = np.random.default_rng(10)
    B, H, T, D = 1, 4, 4096, 128  # 4 pages of 128 KiB per step: keep 2 MiB + 2 MiB
    k, v = _past(rng, B, H, T, D)
    base_slabs = _core.process_committed_bytes()
    with KVCache.from_past(k, v, max_sequence_length=8192, page_tokens=128) as c:
        assert _core.process_committed_bytes() - base_slabs == 16 << 20
        c.truncate([7])
        assert _core.process_committed_bytes() - base_slabs == H * MIB2 + 2 * MIB2
        ps = c.pool_stats()  # the private pool, seen through its cache
        assert ps["keep_free_bytes"] == 2 * MIB2 and ps["empty_slab_bytes"] == 2 * MIB2
        assert ps["committed_bytes"] == H * MIB2 + 2 * MIB2 == ps["live_bytes"] + ps["free_bytes"]
        assert ps["num_caches"] == 1 and ps["live_bytes"] == c.stats()["committed_bytes"]
    assert _core.process_committed_bytes() == base_slabs
    with KVPool() as pool, KVCache.from_past(k, v, max_sequence_length=8192, pool=pool) as c:
        assert c.pool_stats() == pool.stats()  # a given pool: the same figures as its own stats()
    with pytest.raises(ValueError, match="KVCache.pool_stats"):
        c.pool_stats()  # closed
