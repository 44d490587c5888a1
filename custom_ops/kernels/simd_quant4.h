// int4 pages (KVEncoding::kInt4) on the row path, 16-bit fixed point (internal; see
// simd_rows.h, which calls these for few rows per kv head, and kv_block.h for the layouts).
//
// Codes are unpacked in registers: 2 * W bytes zero-extended to int16 give the low nibbles
// (V::low_nibbles) and the high nibbles (V::high_nibbles) of those bytes, 2 * W codes each.
// - K: in a row, bytes 16 g + i hold channels 32 g + i (low) and 32 g + 16 + i (high), so one
//   unpacked load of 2 * W bytes holds the channels int4_q_channel names; q16 is stored in that
//   order per chunk of 4 * W channels (int4_permute_q), and the dot products are exact int32.
// - V: a row pair's bytes 32 g + 2 i + parity hold channels 32 g + i (low) and 32 g + 16 + i
//   (high) of both rows, so after unpacking each 32-bit lane is (row 2k, row 2k + 1) of one
//   channel: one VPMADDWD / VPDPWSSD against a broadcast pair of 16-bit weights.
#pragma once

#include "kernels/simd_pv.h"

namespace olep {
namespace kernels {
namespace simd {
namespace {  // internal linkage: each ISA translation unit its own copy (attention_simd.h)

// Channel of lane L (0 <= L < 2 * W) of the low (high = false) or high unpacked half of the K
// load covering chunk c (channels 4 W c .. 4 W c + 4 W - 1).
template <int W>
constexpr int64_t int4_q_channel(int64_t c, int64_t L, bool high) {
  return 4 * W * c + 32 * (L / 16) + (L % 16) + (high ? 16 : 0);
}

// q16 in natural channel order -> the order int4 K loads unpack to: per chunk c, 2 * W lanes for
// the low nibbles then 2 * W for the high ones. D is a multiple of 4 * W.
// (Lanes 16 k .. 16 k + 15 of a half are 16 consecutive channels: copied as runs.)
template <int W>
inline void int4_permute_q(const int16_t* q16, int64_t D, int16_t* out) {
  static_assert((2 * W) % 16 == 0, "a half holds whole runs of 16 lanes");
  for (int64_t c = 0; c < D / (4 * W); ++c)
    for (int64_t L = 0; L < 2 * W; L += 16) {
      std::memcpy(out + 4 * W * c + L, q16 + int4_q_channel<W>(c, L, false), 16 * sizeof(int16_t));
      std::memcpy(out + 4 * W * c + 2 * W + L, q16 + int4_q_channel<W>(c, L, true), 16 * sizeof(int16_t));
    }
}

// Raw fixed-point sums of one row (q16 permuted) against the W keys of a tile (rows of kp,
// D / 2 bytes apart, rows past the valid ones zero): out[t] = sum_d q16[d] * code[t][d].
template <class V, int64_t kD>
OLEP_COLD_REGS void scores_i4_walk_d(const int16_t* q, int64_t Drt, const uint8_t* kp, float* out, TilePrefetch* pf) {
  const int64_t D = kD > 0 ? kD : Drt;  // kD > 0: a compile-time head_dim (unrolled inner loop)
  using vf = typename V::vf;
  constexpr int W = V::W;
  vf acc[W];
#pragma GCC unroll 16
  for (int t = 0; t < W; ++t) {
    pf->step();
    const uint8_t* kr = kp + t * (D / 2);
    using vi = typename V::vi;
    vi a0 = V::izero(), a1 = V::izero();
#pragma GCC unroll 8
    for (int64_t d = 0; d < D; d += 4 * W) {
      const vi x = V::iwiden_u8(kr + d / 2);
      vi qlo, qhi;
      std::memcpy(&qlo, q + d, sizeof(qlo));
      std::memcpy(&qhi, q + d + 2 * W, sizeof(qhi));
      a0 = V::idot(a0, qlo, V::ilow_nibbles(x));
      a1 = V::idot(a1, qhi, V::ihigh_nibbles(x));
    }
    acc[t] = V::cf(V::iadd(a0, a1));
  }
  V::store(out, V::transpose_reduce_i32(acc));  // exact int32 totals, each converted once
}

// scores_i4_walk_d with byte dot products, at levels with V::kVnni8 (VPDPBUSD, AVX512_VNNI):
// q16 = 256 h + l with h = q16 >> 8 in [-128, 127] and l = q16 & 0xff in [0, 255], so
// q16 . code = 256 (h . code) + l . code, each a VPDPBUSD (unsigned bytes x signed bytes, four
// per 32-bit lane) over the codes as bytes (nibbles in [0, 15], valid as either). Per 8 W codes
// one load, three instructions to split the nibbles and four VPDPBUSD, against two widening
// loads, four nibble operations, four q loads and four VPDPWSSD on the 16-bit path. Both paths
// add in int32 without saturation, so their totals agree modulo 2^32 and are exact (tests/cpp/
// test_attention.cc holds this level to the avx512 level bit for bit); |q16| <= 32767 and codes
// <= 15 keep every partial sum far from 2^31. A load of 4 W bytes holds two int4_permute_q
// chunks: its low nibbles are chunk 2 m's low half then chunk 2 m + 1's, its high nibbles their
// high halves. Zen 4, MHA 32 heads, 8K keys, 256-token pages, alternating builds
// (tools/cpp/bench_quant_attention f16 8192 256 32 1 128 10 {32|1}): int4 / fp16 0.59-0.62 ->
// 0.53-0.58 with each head's pages consecutive, 0.59-0.64 -> 0.59-0.61 in decode order; in cache
// (... f16 2048 256 1 1 128 400 1 1) 0.0160 -> 0.0146 ms.
// The same split for int8 codes (h . code as h . (code ^ 0x80) - 128 sum(h)) was 7% faster in
// cache but slower from DRAM (int8 / fp16 0.80 -> 0.86-0.88 consecutive, 0.74-0.76 -> 0.78-0.79
// in decode order), with half-line loads too: int8 keeps the 16-bit walk.
template <class V, int64_t kD>
OLEP_COLD_REGS void scores_i4_walk_vnni(const int16_t* q, const uint8_t* kp, float* out, TilePrefetch* pf) {
  using vf = typename V::vf;
  using vi = typename V::vi;
  constexpr int W = V::W, E = 4 * W;  // bytes per load: 8 W channels
  constexpr int C = static_cast<int>(kD / (2 * E));
  static_assert(kD % (2 * E) == 0, "whole byte vectors per K row");
  vi hlo[C], llo[C], hhi[C], lhi[C];
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) {
    const int16_t* qc = q + c * 2 * E;  // chunks 2c, 2c + 1 of 4 W entries: [low 2W, high 2W] each
    V::split_i16(qc, qc + E, &hlo[c], &llo[c]);
    V::split_i16(qc + E / 2, qc + E + E / 2, &hhi[c], &lhi[c]);
  }
  const vi low4 = V::iset1_i8(15);
  vf acc[W];
#pragma GCC unroll 16
  for (int t = 0; t < W; ++t) {
    pf->step();
    const uint8_t* kr = kp + t * (kD / 2);
    vi sh = V::izero(), sl = V::izero();
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const vi x = V::iload(kr + c * E);
      const vi lo = V::iand(x, low4), hi = V::iand(V::isrl4_i16(x), low4);
      sh = V::dpbusd(sh, lo, hlo[c]);
      sh = V::dpbusd(sh, hi, hhi[c]);
      sl = V::dpbusd(sl, llo[c], lo);
      sl = V::dpbusd(sl, lhi[c], hi);
    }
    acc[t] = V::cf(V::iadd(V::ishl8_i32(sh), sl));
  }
  V::store(out, V::transpose_reduce_i32(acc));  // exact int32 totals, each converted once
}

template <class V>
OLEP_HOT void scores_i4_walk(const int16_t* q, int64_t D, const uint8_t* kp, float* out, TilePrefetch* pf) {
  if constexpr (V::kVnni8) {
    if (D == 128) return scores_i4_walk_vnni<V, 128>(q, kp, out, pf);
    if (D == 256) return scores_i4_walk_vnni<V, 256>(q, kp, out, pf);
  }
  if (D == 128) scores_i4_walk_d<V, 128>(q, D, kp, out, pf);
  else if (D == 64) scores_i4_walk_d<V, 64>(q, D, kp, out, pf);
  else if (D == 256) scores_i4_walk_d<V, 256>(q, D, kp, out, pf);
  else scores_i4_walk_d<V, 0>(q, D, kp, out, pf);
}

// RB rows x W keys, register blocks of RB rows x KB = W / RB keys: each unpacked K load serves
// RB rows (ptile[row * W + t] as scores_rows writes them).
template <class V, int RB>
OLEP_COLD_REGS void scores_i4_rows(const int16_t* q16, int64_t D, const uint8_t* kp, const int64_t* rows, float* ptile,
                                   TilePrefetch* pf) {
  using vf = typename V::vf;
  constexpr int W = V::W, KB = W / RB;
  vf x[RB];  // x[g] lane rr * KB + tt: row rr, key g * KB + tt
  for (int g = 0; g < RB; ++g) {
    vf acc[W];
#pragma GCC unroll 16
    for (int e = 0; e < W; ++e) acc[e] = V::zero();
    const uint8_t* kg = kp + g * KB * (D / 2);
    for (int64_t d = 0; d < D; d += 4 * W) {
      pf->step();
      vf lo[KB], hi[KB];
#pragma GCC unroll 16
      for (int tt = 0; tt < KB; ++tt) {
        const vf w = V::widen_u8(kg + tt * (D / 2) + d / 2);
        lo[tt] = V::low_nibbles(w);
        hi[tt] = V::high_nibbles(w);
      }
#pragma GCC unroll 4
      for (int rr = 0; rr < RB; ++rr) {
        const vf ql = V::load_raw_i16(q16 + rows[rr] * D + d), qh = V::load_raw_i16(q16 + rows[rr] * D + d + 2 * W);
#pragma GCC unroll 16
        for (int tt = 0; tt < KB; ++tt) acc[rr * KB + tt] = V::dot_i16(V::dot_i16(acc[rr * KB + tt], ql, lo[tt]), qh, hi[tt]);
      }
    }
    x[g] = V::transpose_reduce_i32(acc);  // exact int32 totals, each converted once
  }
  V::template transpose_blocks<RB>(x);  // one vector store per row, as scores_rows
#pragma GCC unroll 4
  for (int rr = 0; rr < RB; ++rr) V::store(ptile + rows[rr] * W, x[rr]);
}

// P.V over int4 V row pairs: as pv_block_i16 (simd_pv.h) with NU unpacked loads of 2 * W bytes
// (load u covers channels int4 V lo / hi bases), plus each row's vbias = sum_t p_t * value_min_t
// added to every channel: o = o * corr + wscale * sum + vbias.
template <class V, int RB, int NU>
OLEP_HOT void pv_block_i4(float* const* acc, const int16_t* const* words, const float* wscale, const float* wpre,
                          const float* corr,
                          const float* vbias, const uint8_t* pairs, int64_t Dv, int64_t load0, int64_t npairs,
                          TilePrefetch* pf) {
  using vf = typename V::vf;
  using vi = typename V::vi;
  constexpr int W = V::W;
  vi s[RB][2 * NU];
#pragma GCC unroll 4
  for (int rr = 0; rr < RB; ++rr)
#pragma GCC unroll 8
    for (int u = 0; u < 2 * NU; ++u) s[rr][u] = V::izero();
  for (int64_t k = 0; k < npairs; ++k) {
    pf->step();
    vi lo[NU], hi[NU];
#pragma GCC unroll 8
    for (int u = 0; u < NU; ++u) {
      const vi x = V::iwiden_u8(pairs + k * Dv + (load0 + u) * 2 * W);
      lo[u] = V::ilow_nibbles(x);
      hi[u] = V::ihigh_nibbles(x);
    }
#pragma GCC unroll 4
    for (int rr = 0; rr < RB; ++rr) {
      int32_t w;
      std::memcpy(&w, words[rr] + 2 * k, sizeof(w));
      const vi wb = V::iset1(w);
#pragma GCC unroll 8
      for (int u = 0; u < NU; ++u) {
        s[rr][2 * u] = V::idot(s[rr][2 * u], lo[u], wb);
        s[rr][2 * u + 1] = V::idot(s[rr][2 * u + 1], hi[u], wb);
      }
    }
  }
#pragma GCC unroll 4
  for (int rr = 0; rr < RB; ++rr) {
    const vf ws = V::set1(wscale[rr]), vb = V::set1(vbias[rr]);
    const bool plain = corr[rr] == 1.0f && wpre[rr] == 1.0f;  // the usual tile: no rescale, no pre-scale
    const vf c = V::set1(corr[rr]), wp = V::set1(wpre[rr]);
#pragma GCC unroll 8
    for (int u = 0; u < NU; ++u) {
      // load L = load0 + u: 32-channel group L / (16 / W), W-channel slot L % (16 / W)
      const int64_t L = load0 + u, base = 32 * (L / (16 / W)) + W * (L % (16 / W));
      for (int half = 0; half < 2; ++half) {
        float* o = acc[rr] + base + 16 * half;
        const vf x = V::icvt(s[rr][2 * u + half]);
        V::store(o, V::add(plain ? V::fma(x, ws, V::load(o)) : V::fma(V::mul(x, ws), wp, V::mul(V::load(o), c)), vb));
      }
    }
  }
}

// pv_block_i4 over the whole Dv (a multiple of 32): Dv / (2 W) loads per row pair, NU at a time
// (RB * 2 * NU sums in registers).
template <class V, int RB>
OLEP_HOT void pv_rows_i4(float* const* acc, const int16_t* const* words, const float* wscale, const float* wpre,
                         const float* corr,
                         const float* vbias, const uint8_t* pairs, int64_t Dv, int64_t npairs, TilePrefetch* pf) {
  constexpr int W = V::W;
  constexpr int NU = (W >= 16 ? (RB <= 2 ? 4 : 2) : (RB == 1 ? 4 : 2));
  const int64_t loads = Dv / (2 * W);
  int64_t l = 0;
  for (; l + NU <= loads; l += NU) pv_block_i4<V, RB, NU>(acc, words, wscale, wpre, corr, vbias, pairs, Dv, l, npairs, pf);
  for (; l < loads; ++l) pv_block_i4<V, RB, 1>(acc, words, wscale, wpre, corr, vbias, pairs, Dv, l, npairs, pf);
}

}  // namespace
}  // namespace simd
}  // namespace kernels
}  // namespace olep
