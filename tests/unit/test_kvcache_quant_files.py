"""save/load of quantized caches against crafted files: a file whose checksum is recomputed after
its payload is changed must still hold only quantized pages the codec can write (docs/API.md,
"Quantized pages"): scales finite and >= 0, int4 minimums finite, int8 codes in [-127, 127].
A page outside that (a NaN or negative scale, code -128) is refused, as a bad header is, since
the kernels rely on it (scales >= 0, |code| <= 127 for their int32 sums); the pool keeps nothing."""
import struct

import numpy as np
import pytest

import onnx_light_ep as olep

M64 = (1 << 64) - 1


def fnv(chunks):
    """persist.cc Checksum: 64-bit FNV-1a over the 8-byte words of each put, then its tail bytes."""
    h = 1469598103934665603
    for c in chunks:
        n = len(c) // 8 * 8
        for w in np.frombuffer(bytes(c[:n]), "<u8").tolist():
            h = ((h ^ w) * 1099511628211) & M64
        for x in c[n:]:
            h = ((h ^ x) * 1099511628211) & M64
    return h


def parse(path):
    """The chunks of a version-3 file as save() puts them; the quantized pages' chunks."""
    raw = open(path, "rb").read()
    o, chunks = 0, []

    def take(n):
        nonlocal o
        c = bytearray(raw[o:o + n])
        o += n
        chunks.append(c)
        return c

    def i64():
        return struct.unpack("<q", take(8))[0]

    take(8), take(4), take(4)
    L, B, H, D, Dv, _, dt, P, _, kq, _, _ = [i64() for _ in range(12)]
    for _ in range(L):
        i64()
    lens = [i64() for _ in range(B)]
    first = [i64() for _ in range(L * B)]
    for _ in range(L * B):
        i64()
    spans = [(l, b, range(first[l * B + b] // P, (lens[b] + P - 1) // P)) for l in range(L) for b in range(B)]
    bmap = take(sum(len(r) * H for _, _, r in spans))
    enc, e = {}, 0
    for l, b, r in spans:
        for blk in r:
            for h in range(H):
                enc[(l, b, blk, h)] = bmap[e]
                e += 1
    es = [4, 2, 2][dt]
    codes = P * (D + Dv) // (2 if kq == 2 else 1)
    qbytes = codes + (8 if kq == 2 else 4) * (D + P)
    pages = []
    for l, b, r in spans:
        for h in range(H):
            for blk in r:
                if enc[(l, b, blk, h)]:
                    pages.append(take(qbytes))
                else:
                    n = min(P, lens[b] - blk * P)
                    take(n * D * es), take(n * Dv * es)
    assert int.from_bytes(raw[o:], "little") == fnv(chunks)  # the model of the checksum holds
    return chunks, pages, dict(D=D, Dv=Dv, P=P, codes=codes)


def write(path, chunks):
    open(path, "wb").write(b"".join(bytes(c) for c in chunks) + fnv(chunks).to_bytes(8, "little"))


def saved(tmp_path, mode):
    P, D = 32, 32
    rng = np.random.default_rng(0)
    k = rng.standard_normal((1, 1, 4 * P, D)).astype(np.float32)
    v = rng.standard_normal((1, 1, 4 * P, D)).astype(np.float32)
    path = str(tmp_path / f"{mode}.olkv")
    with olep.KVCache.from_past([k], [v], page_tokens=P, kv_quant=mode, recent_tokens=0, sink_tokens=0) as c:
        c.save(path)
    return path


def f32(x):
    return np.float32(x).tobytes()


# (what, byte offset in the page's metadata from the scales' start, in units of float32 / code)
CASES = {
    "int8": [("NaN K scale", "meta", 0, f32(np.nan)), ("inf K scale", "meta", 3, f32(np.inf)),
             ("negative V scale", "meta", 32 + 5, f32(-0.5)), ("code -128", "code", 7, b"\x80")],
    "int4": [("NaN K scale", "meta", 0, f32(np.nan)), ("negative V scale", "meta", 32 + 5, f32(-0.5)),
             ("NaN K minimum", "meta", 64 + 2, f32(np.nan)), ("inf V minimum", "meta", 96 + 1, f32(-np.inf))],
}


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_crafted_quantized_pages_are_refused(tmp_path, mode):
    path = saved(tmp_path, mode)
    with olep.KVCache.load(path) as c:  # the file as saved loads
        assert c.stats()["native_bytes"] == 0
    for what, where, at, data in CASES[mode]:
        chunks, pages, g = parse(path)
        page = pages[1]
        o = g["codes"] + 4 * at if where == "meta" else at
        page[o:o + len(data)] = data
        bad = str(tmp_path / "bad.olkv")
        write(bad, chunks)
        pool = olep.KVPool(page_tokens=32)
        with pytest.raises(ValueError, match="quantized page"):
            olep.KVCache.load(bad, pool=pool)
        st = pool.stats()  # nothing kept: every page allocated for the file went back
        assert st["live_bytes"] == 0 and st["num_pages"] == 0 and st["num_caches"] == 0, (what, st)
        pool.close()
