"""Huge pages in the KVCache arena (custom_ops/kvcache/kv_cache.cc, promote_written).

Blocks of >= 2 MiB (max_sequence_length * head_dim * element size) are laid out on 2 MiB
boundaries and every fully written 2 MiB region is remapped with one huge page
(MADV_COLLAPSE), because streaming K/V from 4 KiB pages reads at ~60% of the bandwidth.
What must hold: the data is unchanged, committed memory is exactly the touched pages (only
whole written regions are collapsed), truncating into a collapsed region frees what is past
the new length and zeroes the rest of its page, and appending after that stays correct.
"""
from __future__ import annotations

import ctypes
import mmap
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvcache_util import assert_bit_equal  # noqa: E402

from onnx_light_ep import KVCache  # noqa: E402

MIB2 = 2 << 20
MADV_COLLAPSE = 25


def _kernel_collapses() -> bool:
    """MADV_COLLAPSE exists since Linux 6.1; older kernels answer EINVAL. Probed on a private
    anonymous mapping, like the arena's."""
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


def _anon_huge_bytes() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


def _past(rng, B, H, T, D, dtype=np.float32):
    k = [rng.standard_normal((B, H, T, D)).astype(dtype)]
    v = [rng.standard_normal((B, H, T, D)).astype(dtype)]
    return k, v


def test_imported_past_is_exact_and_committed_exactly():
    rng = np.random.default_rng(0)
    B, H, T, D, cap = 2, 2, 5000, 128, 9000  # blocks of 9000*128*4 B = 4.4 MiB
    k, v = _past(rng, B, H, T, D)
    with KVCache.from_past(k, v, max_sequence_length=cap) as c:
        ek, ev = c.export(0)
        assert_bit_equal(ek, k[0])
        assert_bit_equal(ev, v[0])
        page = mmap.PAGESIZE
        per_block = (T * D * 4 + page - 1) // page * page
        assert c.stats()["committed_bytes"] == B * H * 2 * per_block


@pytest.mark.skipif(not _kernel_collapses(), reason="this kernel has no MADV_COLLAPSE (Linux < 6.1)")
def test_full_regions_become_huge_pages():
    rng = np.random.default_rng(1)
    B, H, T, D, cap = 1, 4, 4096 + 300, 128, 8192  # one full 2 MiB region per K and per V block
    k, v = _past(rng, B, H, T, D)
    before = _anon_huge_bytes()
    with KVCache.from_past(k, v, max_sequence_length=cap) as c:
        grown = _anon_huge_bytes() - before
        full_regions = (T * D * 4) // MIB2  # per block
        assert grown >= B * H * 2 * full_regions * MIB2, (grown, full_regions)
        del c


def test_small_blocks_keep_small_pages_and_exact_commit():
    rng = np.random.default_rng(2)
    k, v = _past(rng, 1, 2, 300, 64)
    with KVCache.from_past(k, v, max_sequence_length=1024) as c:  # 256 KiB blocks
        assert c.stats()["reserved_bytes"] == 2 * 2 * 1024 * 64 * 4
        assert_bit_equal(c.export(0)[0], k[0])


def test_truncate_into_collapsed_region_then_append():
    """Truncate to the middle of a huge page, append rows through from_past's layout rules
    (reorder copies rows back in), and check every row and the zero tail."""
    rng = np.random.default_rng(3)
    B, H, T, D, cap = 2, 1, 6000, 128, 8192
    k, v = _past(rng, B, H, T, D)
    with KVCache.from_past(k, v, max_sequence_length=cap) as c:
        c.truncate([1234, 4500])
        ek, ev = c.export(0)
        assert_bit_equal(ek[0, :, :1234], k[0][0, :, :1234])
        assert not ek[0, :, 1234:].any()
        assert_bit_equal(ek[1, :, :4500], k[0][1, :, :4500])
        assert not ek[1, :, 4500:].any()
        page = mmap.PAGESIZE
        rup = lambda n: (n * D * 4 + page - 1) // page * page  # noqa: E731
        assert c.stats()["committed_bytes"] == H * 2 * (rup(1234) + rup(4500))
        c.reorder([1, 1])  # rewrites sequence 0 with sequence 1's 4500 rows (crosses 2 MiB again)
        ek, ev = c.export(0)
        assert_bit_equal(ek[0, :, :4500], k[0][1, :, :4500])
        assert_bit_equal(ev[0, :, :4500], v[0][1, :, :4500])
        assert c.stats()["committed_bytes"] == H * 2 * 2 * rup(4500)
        f = c.fork()
        try:
            assert_bit_equal(f.export(0)[1], ev)
        finally:
            f.close()


def _mappings():
    """(start, end, VmFlags) of every mapping of this process, from /proc/self/smaps."""
    out, cur = [], None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            a, b = head.split("-")
            cur = [int(a, 16), int(b, 16), ""]
            out.append(cur)
        elif head == "VmFlags:" and cur is not None:
            cur[2] = line
    return out


def test_arena_opts_out_of_fault_time_huge_pages():
    """With THP "always" the kernel would back a block's first row with a 2 MiB page; the
    arena marks its reservation MADV_NOHUGEPAGE ("nh") so committed_bytes stays what the rows
    touch, and only fully written regions are collapsed. Checked on the VMA flags, which holds
    whatever the machine's THP setting is."""
    rng = np.random.default_rng(4)
    k, v = _past(rng, 1, 2, 3, 128)

    def nh_bytes() -> int:
        return sum(end - start for start, end, flags in _mappings() if " nh" in flags)

    before = nh_bytes()
    with KVCache.from_past(k, v, max_sequence_length=8192) as c:
        reserved = c.stats()["reserved_bytes"]
        assert nh_bytes() - before >= reserved, (nh_bytes(), before, reserved)


def test_resident_memory_matches_committed_bytes():
    """Anonymous memory the process gains equals committed_bytes (within 512 KiB of unrelated
    allocations), also after a truncate back into a collapsed region and for a fork."""
    rng = np.random.default_rng(5)
    B, H, T, D, cap = 1, 4, 4096 + 64, 128, 8192
    k, v = _past(rng, B, H, T, D)

    def anon() -> int:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) * 1024
        return 0

    base = anon()
    with KVCache.from_past(k, v, max_sequence_length=cap) as c:
        assert abs((anon() - base) - c.stats()["committed_bytes"]) <= 512 << 10
        c.truncate([7])
        assert abs((anon() - base) - c.stats()["committed_bytes"]) <= 512 << 10
        f = c.fork()
        try:
            both = c.stats()["committed_bytes"] + f.stats()["committed_bytes"]
            assert abs((anon() - base) - both) <= 512 << 10
        finally:
            f.close()
