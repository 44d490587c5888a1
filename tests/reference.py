"""fp64 numpy oracle for attention (verbatim ``ref_attn`` from docs/CASES.md)
plus layout helpers and the tolerances every test uses.

Tolerances (never widen them to make a test pass):
  fp32:       atol=1e-5, rtol=1e-4
  fp16/bf16:  atol=2e-2, rtol=2e-2
"""
import numpy as np

try:  # bfloat16 numpy dtype
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    ml_dtypes = None
    BF16 = None

FP32_ATOL, FP32_RTOL = 1e-5, 1e-4
LOWP_ATOL, LOWP_RTOL = 2e-2, 2e-2

DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16)}
if BF16 is not None:
    DTYPES["bfloat16"] = BF16


def np_dtype(dtype):
    if isinstance(dtype, str):
        return DTYPES[dtype]
    return np.dtype(dtype)


def dtype_name(dtype):
    d = np_dtype(dtype)
    for k, v in DTYPES.items():
        if v == d:
            return k
    raise ValueError(dtype)


def tol(dtype):
    """(atol, rtol) for a storage dtype."""
    return (FP32_ATOL, FP32_RTOL) if np_dtype(dtype) == np.float32 else (LOWP_ATOL, LOWP_RTOL)


def assert_close(actual, expected, dtype, msg="", extra_atol=0.0):
    """At the dtype's tolerance: |actual - expected| <= atol + rtol |expected| elementwise.
    extra_atol adds a stated term, a scalar or an array broadcast to the outputs (quantized pages
    at the SIMD levels: pv_rounding_atol, per element)."""
    atol, rtol = tol(dtype)
    a = np.asarray(actual).astype(np.float64)
    e = np.asarray(expected).astype(np.float64)
    assert a.shape == e.shape, f"{msg}: shape {a.shape} != {e.shape}"
    assert np.all(np.isfinite(a)), f"{msg}: non-finite values in output"
    extra = np.asarray(extra_atol, np.float64)
    if extra.ndim == 0:
        np.testing.assert_allclose(a, e, atol=atol + float(extra), rtol=rtol, err_msg=msg)
        return
    allowed = np.broadcast_to(atol + extra + rtol * np.abs(e), a.shape)
    diff = np.abs(a - e)
    bad = ~(diff <= allowed)
    if bad.any():
        i = np.unravel_index(np.argmax(np.where(bad, diff - allowed, -np.inf)), a.shape)
        raise AssertionError(
            f"{msg}: {int(bad.sum())} of {a.size} elements beyond atol {atol:g} + extra + rtol {rtol:g} |expected|; "
            f"worst at {tuple(int(x) for x in i)}: actual {a[i]!r}, expected {e[i]!r}, |diff| {diff[i]:.3g} > "
            f"allowed {allowed[i]:.3g} (extra {np.broadcast_to(extra, a.shape)[i]:.3g})")


def int8_query(qs, ks):
    """The kernels' 16-bit fixed-point query against one int8 page (docs/API.md, "Quantized
    pages"; kernels/attention_internal.h int8_query), in the same float32 steps: qs [..., D]
    float32 (q times the scale; q alone with softcap), ks [D] the page's K scales. Returns
    (q16 [..., D] int64, sq [...] float32): q . (code * ks) is computed as sq * sum(q16 * code)."""
    f32 = np.float32
    qs = np.asarray(qs, f32)
    D = qs.shape[-1]
    x = (qs * np.asarray(ks, f32)).astype(f32)
    m = np.abs(x).max(axis=-1).astype(f32)
    qmax = f32(min(32767, 2147483647 // (127 * D)))
    pre = np.where(m < f32(2.0 ** -100), f32(2.0 ** 100), f32(1)).astype(f32)
    m = (m * pre).astype(f32)
    with np.errstate(divide="ignore"):
        inv = np.where(m > 0, qmax / np.where(m > 0, m, f32(1)), f32(0)).astype(f32)
    # x * pre first (exact), then * inv, as the kernels: pre * inv overflows float32 for m below about 2^-113
    q16 = np.rint(((x * pre[..., None]).astype(f32) * inv[..., None]).astype(f32)).astype(np.int64)
    sq = ((m / qmax).astype(f32) / pre).astype(f32)
    return q16, sq


# Keys per P.V tile of the SIMD levels' 16-bit fixed-point weights (V::W, the float32 lanes of a
# vector: kernels/simd_rows.h round_weights); the scalar level computes P.V in float32.
PV_TILE_KEYS = {"scalar": 0, "avx2": 8, "avx512": 16, "avx512_bf16": 16}
# Slack on the rounding's 1/2 unit: the float32 steps of round_weights (w * (32767 / M), then
# M / 32767: 3 roundings, 3 * 2^-24 * 32767 / (1/2) = 0.0117 of the 1/2 unit) and the kernel's
# float32 probabilities against the oracle's fp64 ones (about 1e-6 relative).
PV_ROUNDING_SLACK = 1.0 + 2.0 ** -6


def pv_rounding_atol(isa, probs, v_pages, group_size):
    """The SIMD levels' extra error on quantized pages beyond the float32 kernels' (docs/API.md,
    "Quantized pages", P.V bound), per output element: at a tile of PV_TILE_KEYS[isa] keys
    (positions j with equal j // W: pages start on that grid), a row's weights w_j = p_j * step_j
    (p the normalized probability, step the V scale, int4 step) are rounded to int16 against the
    tile's largest, M_T = max_{j in T} w_j, each within (1/2) M_T / 32767, and meet the V codes
    exactly, so
        |error[d]| <= PV_ROUNDING_SLACK / 65534 * sum_T M_T * sum_{j in T, p_j > 0} |code[j, d]|.
    probs [B, Hq, S, T] fp64 (ref_attn's second result, key index = position), v_pages:
    (b, kv_head, start, V codes [P, Dv], V steps [P]) per quantized page among the keys
    (value_codes), group_size query heads per kv head. Returns [B, Hq, S, Dv] float64 (0.0 at the
    scalar level or without quantized pages)."""
    W = PV_TILE_KEYS[isa]
    if W == 0 or not v_pages:
        return 0.0
    p = np.asarray(probs, np.float64)
    B, Hq, S, _ = p.shape
    g = group_size
    out = np.zeros((B, Hq, S, np.shape(v_pages[0][3])[1]))
    for b, h, start, codes, steps in v_pages:
        n = len(codes)
        if start % W or n % W:
            raise ValueError(f"v_pages: page at {start} of {n} rows is not on the grid of {W}-key tiles")
        pp = p[b, h * g:(h + 1) * g, :, start:start + n].reshape(g, S, n // W, W)
        mt = (pp * np.asarray(steps, np.float64).reshape(n // W, W)).max(-1)             # [g, S, tiles]
        c = np.abs(np.asarray(codes, np.float64)).reshape(n // W, W, -1)                 # [tiles, W, Dv]
        csum = np.einsum("gstw,twd->gstd", (pp > 0).astype(np.float64), c)              # visible keys' |code|
        out[b, h * g:(h + 1) * g] += np.einsum("gst,gstd->gsd", mt, csum)
    return out * (PV_ROUNDING_SLACK / 65534.0)


def ref_attn(q, k_new, v_new, past_k=None, past_v=None, *, scale=None, causal=True,
             q_offset=None, window=None, softcap=0.0, add_mask=None, key_valid=None, int8_pages=()):
    """fp64 attention (the rules above). int8_pages: (b, kv_head, start, codes [P, D], ks [D]
    float32[, kmin [D]]) per quantized page among the keys (int8; int4 with its K minimums):
    those keys score as the kernels compute them (int8_query: q in 16-bit fixed point, exact
    integer sums, plus q . kmin for int4), the rest as q . k; K/V hold the dequantized values."""
    f = np.float64
    q32 = q.astype(np.float32)
    q, k_new, v_new = q.astype(f), k_new.astype(f), v_new.astype(f)
    K = k_new if past_k is None else np.concatenate([past_k.astype(f), k_new], 2)
    V = v_new if past_v is None else np.concatenate([past_v.astype(f), v_new], 2)
    B, Hq, S, D = q.shape
    T, g = K.shape[2], Hq // K.shape[1]
    K, V = np.repeat(K, g, axis=1), np.repeat(V, g, axis=1)      # rule 1
    s = (q @ K.transpose(0, 1, 3, 2)) * (1.0 / np.sqrt(D) if scale is None else scale)
    if int8_pages:
        sc32 = np.float32(1) / np.sqrt(np.float32(D)) if scale is None else np.float32(scale)
        qs = q32 if softcap and softcap > 0 else (q32 * sc32).astype(np.float32)
        for b, h, start, codes, ks, *kmin in int8_pages:
            q16, sq = int8_query(qs[b, h * g:(h + 1) * g], ks)             # [g, S, D], [g, S]
            fixed = (q16.astype(f) @ np.asarray(codes, f).T) * sq[..., None].astype(f)
            if kmin:
                fixed = fixed + (qs[b, h * g:(h + 1) * g].astype(f) @ np.asarray(kmin[0], f))[..., None]
            if softcap and softcap > 0:
                fixed = fixed * float(sc32)
            s[b, h * g:(h + 1) * g, :, start:start + len(codes)] = fixed
    if softcap and softcap > 0:
        s = softcap * np.tanh(s / softcap)                          # rule 5
    off = (T - S) if q_offset is None else q_offset
    i = np.arange(S)[:, None] + off
    j = np.arange(T)[None, :]
    allow = np.ones((B, Hq, S, T), bool)
    if causal:            allow &= (j <= i)                         # rule 2
    if window is not None: allow &= (j > i - window)                # rule 3
    if key_valid is not None: allow &= key_valid[:, None, None, :]  # (B, T) bool
    s = s + np.where(allow, 0.0, -np.inf)
    if add_mask is not None:
        s = s + add_mask                                            # broadcast to (B,Hq,S,T)
    m = s.max(-1, keepdims=True)
    dead = ~np.isfinite(m)
    e = np.where(dead, 0.0, np.exp(s - np.where(dead, 0.0, m)))
    den = e.sum(-1, keepdims=True)
    p = np.where(den > 0, e / np.where(den > 0, den, 1.0), 0.0)     # rule 6
    return p @ V, p, K, V          # output (B,Hq,S,D), probs, expanded K/V


def bool_to_additive(mask):
    """bool mask (True = attend) -> fp64 additive mask (0 / -inf)."""
    return np.where(np.asarray(mask, bool), 0.0, -np.inf)


def to_bnsh(x, num_heads):
    """[B, S, H*D] -> [B, H, S, D]."""
    B, S, HD = x.shape
    assert HD % num_heads == 0
    return x.reshape(B, S, num_heads, HD // num_heads).transpose(0, 2, 1, 3)


def from_bnsh(x):
    """[B, H, S, D] -> [B, S, H*D]."""
    B, H, S, D = x.shape
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3)).reshape(B, S, H * D)


def ragged(rows, n_valid):
    """Right-pad per-row data: ``rows`` is [B, H, S, D]; returns a copy whose
    positions ``>= n_valid[b]`` of row b are zero (what a right-padded batch looks like)."""
    out = np.array(rows, copy=True)
    for b, n in enumerate(n_valid):
        out[b, :, n:, :] = 0
    return out


def ref_rows(q, k, v, past_k, past_v, n_new, past_len, **kw):
    """Per-row oracle for a ragged batch (BNSH). Row b: its ``past_len[b]`` cached keys
    plus the first ``n_new[b]`` new rows; query rows ``>= n_new[b]`` are zeros.
    ``past_k/past_v`` may be None (empty past)."""
    B, Hq, S, _ = q.shape
    Dv = v.shape[-1]
    out = np.zeros((B, Hq, S, Dv))
    for b in range(B):
        n, p = int(n_new[b]), int(past_len[b])
        if n == 0:
            continue
        pk = None if past_k is None else past_k[b:b + 1, :, :p]
        pv = None if past_v is None else past_v[b:b + 1, :, :p]
        out[b:b + 1, :, :n] = ref_attn(q[b:b + 1, :, :n], k[b:b + 1, :, :n], v[b:b + 1, :, :n],
                                       pk, pv, **kw)[0]
    return out


def _value_codes_int8(v):
    """V of one int8 page: per-row scales [P] float32 and codes [P, Dv] int8 (the cache's float32 steps)."""
    vs = (np.abs(v).max(axis=1) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        vq = np.where(vs[:, None] > 0, np.clip(np.rint(v / vs[:, None]), -127, 127), 0).astype(np.int8)
    return vq, vs


def _value_codes_int4(v):
    """V of one int4 page: per-row minimums and steps [P] float32, codes [P, Dv] in [0, 15]."""
    f32 = np.float32
    vmin = v.min(axis=1)
    vs = ((v.max(axis=1) - vmin) / f32(15)).astype(f32)
    with np.errstate(divide="ignore", invalid="ignore"):
        vq = np.where(vs[:, None] > 0, np.clip(np.rint(((v - vmin[:, None]) / vs[:, None]).astype(f32)), 0, 15),
                      0).astype(np.int64)
    return vq, vs, vmin


def value_codes(mode, v):
    """The V codes [P, Dv] and per-row steps [P] float32 (the int8 scale, the int4 step) of one
    page as the KVCache codec makes them from v [P, Dv] (values of the cache dtype): what the
    P.V fixed point weighs (pv_rounding_atol)."""
    v = np.asarray(v).astype(np.float32)
    return (_value_codes_int8(v) if mode == "int8" else _value_codes_int4(v)[:2])


def quantize_page_int8(k, v, codes=False):
    """The KVCache int8 codec on one page (docs/API.md, "Quantized pages"): k [P, D], v [P, Dv]
    (values of the cache dtype). K per channel, V per token, symmetric, round half to even, in
    float32 as the cache computes them. Returns the dequantized float32 (k, v), and with
    ``codes`` also the K codes [P, D] int8 and K scales [D] float32."""
    k = np.asarray(k).astype(np.float32)
    v = np.asarray(v).astype(np.float32)
    ks = (np.abs(k).max(axis=0) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        kq = np.where(ks > 0, np.clip(np.rint(k / ks), -127, 127), 0).astype(np.int8)
    vq, vs = _value_codes_int8(v)
    dk, dv = kq.astype(np.float32) * ks, vq.astype(np.float32) * vs[:, None]
    return (dk, dv, kq, ks) if codes else (dk, dv)


def quantize_page_int4(k, v, codes=False):
    """The KVCache int4 codec on one page (docs/API.md, "Quantized pages"): asymmetric, K per
    channel (min over the page's rows, step (max - min) / 15), V per token likewise, codes
    round_half_even((x - min) / step) clamped to [0, 15], float32 as the cache computes them.
    Returns the dequantized float32 (k, v) = min + code * step (a multiply, then an add), and
    with ``codes`` also the K codes [P, D] and the K steps and minimums [D]."""
    f32 = np.float32
    k = np.asarray(k).astype(f32)
    v = np.asarray(v).astype(f32)
    kmin = k.min(axis=0)
    ks = ((k.max(axis=0) - kmin) / f32(15)).astype(f32)
    with np.errstate(divide="ignore", invalid="ignore"):
        kq = np.where(ks > 0, np.clip(np.rint(((k - kmin) / ks).astype(f32)), 0, 15), 0).astype(np.int64)
    vq, vs, vmin = _value_codes_int4(v)
    dk = (kmin + (kq.astype(f32) * ks).astype(f32)).astype(f32)
    dv = (vmin[:, None] + (vq.astype(f32) * vs[:, None]).astype(f32)).astype(f32)
    return (dk, dv, kq, ks, kmin) if codes else (dk, dv)


def quantize_page(mode, k, v, codes=False):
    """quantize_page_int8 or quantize_page_int4 by kv_quant mode."""
    return (quantize_page_int8 if mode == "int8" else quantize_page_int4)(k, v, codes=codes)
