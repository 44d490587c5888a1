"""Slabs and huge pages of the page pool (custom_ops/kvcache/page_pool.cc).

Pages are carved from 2 MiB-aligned slabs that are faulted in at creation with
MADV_HUGEPAGE and then MADV_COLLAPSE, because streaming K/V from 4 KiB pages
reads at ~60% of the bandwidth of 2 MiB pages. What must hold: the data is
unchanged; the pool's committed_bytes is exactly the slab bytes the process
holds (resident anonymous memory grows by that much), every committed byte is
in one of live / free / overhead; an empty slab is unmapped at once; slabs are
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
    with KVCache.from_past(k, v, max_sequence_length=8192) as c:
        slabs = _core.process_committed_bytes() - base_slabs
        assert slabs >= c.stats()["committed_bytes"]
        assert abs((_rollup("Anonymous") - base) - slabs) <= 512 << 10
        c.truncate([7])
        slabs = _core.process_committed_bytes() - base_slabs
        # one page per head is left; a head's pages are consecutive (docs/API.md), so at most
        # one slab per head stays mapped, and the rest is unmapped
        assert slabs <= H * MIB2
        assert c.stats()["num_pages"] == H
        assert abs((_rollup("Anonymous") - base) - slabs) <= 512 << 10
        f = c.fork()
        try:
            assert _core.process_committed_bytes() - base_slabs == slabs  # a fork maps nothing
            assert f.stats()["committed_bytes"] == c.stats()["committed_bytes"]
        finally:
            f.close()
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
