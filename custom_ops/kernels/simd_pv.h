// P.V accumulation: weighted V rows into the output accumulators (internal).
#pragma once

#include "kernels/simd_common.h"
#include "kernels/simd_tiles.h"

namespace olep {
namespace kernels {
namespace simd {
namespace {  // internal linkage: each ISA translation unit its own copy (attention_simd.h)

// RB output rows x NU vectors of Dv: o = o * c[row] + sum_t p(t, row) * v[t], with
// p(t, row) = ptile[t * p_tstride + row * p_rstride]. Each V vector is loaded (and
// converted) once for the RB rows.
// Probabilities of keys a row cannot see are stored as -0.0f (kUnseen); a visible key's
// probability is >= +0.0f (exp may underflow to +0). kSkipZero: skip the unseen (row, key)
// pairs, for tiles holding keys some row cannot see (masked, causal future of a prefill row,
// outside the window): their V rows must not reach that row (0 * NaN is NaN), while a visible
// key whose probability underflowed still does, as in ONNX. Tiles every row sees in full take
// the plain loop.
template <class V, class L, int RB, int NU, bool kSkipZero>
OLEP_HOT void pv_block(float* const* acc, const int64_t* rows, const typename L::elem* v, int64_t v_stride,
                     const float* ptile, int64_t p_tstride, int64_t p_rstride, int64_t n, const float* corr,
                     TilePrefetch* pf) {
  using vf = typename V::vf;
  constexpr int W = V::W;
  vf o[RB][NU];
  const float* pr[RB];
#pragma GCC unroll 4
  for (int rr = 0; rr < RB; ++rr) {
    pr[rr] = ptile + rows[rr] * p_rstride;
    const vf c = V::set1(corr[rows[rr]]);
#pragma GCC unroll 8
    for (int u = 0; u < NU; ++u) o[rr][u] = V::mul(V::load(acc[rr] + u * W), c);
  }
  for (int64_t t = 0; t < n; ++t) {
    pf->step();
    vf vv[NU];
#pragma GCC unroll 8
    for (int u = 0; u < NU; ++u) vv[u] = L::load(v + t * v_stride + u * W);
#pragma GCC unroll 4
    for (int rr = 0; rr < RB; ++rr) {
      const float p = pr[rr][t * p_tstride];
      if (kSkipZero && p == 0.0f && std::signbit(p)) continue;  // kUnseen
      const vf pb = V::set1(p);
#pragma GCC unroll 8
      for (int u = 0; u < NU; ++u) o[rr][u] = V::fma(pb, vv[u], o[rr][u]);
    }
  }
#pragma GCC unroll 4
  for (int rr = 0; rr < RB; ++rr)
#pragma GCC unroll 8
    for (int u = 0; u < NU; ++u) V::store(acc[rr] + u * W, o[rr][u]);
}

// pv_block over the whole Dv (a multiple of W) in chunks of 4, 2, 1 vectors.
template <class V, class L, int RB, bool kSkipZero>
OLEP_HOT void pv_rows(float* st_acc, const int64_t* rows, int64_t Dv, const typename L::elem* v, const float* ptile,
                    int64_t p_tstride, int64_t p_rstride, int64_t n, const float* corr, TilePrefetch* pf_io) {
  constexpr int W = V::W;
  TilePrefetch local = *pf_io;  // in registers across the blocks' key loops (scores_rows says why)
  TilePrefetch* pf = &local;
  float* acc[RB];
  auto point = [&](int64_t off) {
    for (int rr = 0; rr < RB; ++rr) acc[rr] = st_acc + rows[rr] * Dv + off;
  };
  int64_t d = 0;
  // Whole 8-vector chunks when the registers allow (RB * 8 accumulators + 8 V vectors):
  // each V row is then read in one sequential pass, which the stream from DRAM needs.
  constexpr bool kWide = (W >= 16 && RB <= 2) || RB == 1;
  if constexpr (kWide) {
    for (; d + 8 * W <= Dv; d += 8 * W) {
      point(d);
      pv_block<V, L, RB, 8, kSkipZero>(acc, rows, v + d, Dv, ptile, p_tstride, p_rstride, n, corr, pf);
    }
  }
  for (; d + 4 * W <= Dv; d += 4 * W) {
    point(d);
    pv_block<V, L, RB, 4, kSkipZero>(acc, rows, v + d, Dv, ptile, p_tstride, p_rstride, n, corr, pf);
  }
  if (d + 2 * W <= Dv) {
    point(d);
    pv_block<V, L, RB, 2, kSkipZero>(acc, rows, v + d, Dv, ptile, p_tstride, p_rstride, n, corr, pf);
    d += 2 * W;
  }
  if (d + W <= Dv) {
    point(d);
    pv_block<V, L, RB, 1, kSkipZero>(acc, rows, v + d, Dv, ptile, p_tstride, p_rstride, n, corr, pf);
  }
  *pf_io = local;
}

// One output row whose Dv is wider than the registers hold (AVX2: 8 accumulators, 64 floats;
// Dv a multiple of 8 W above that): key by key over the whole Dv, the accumulators reloaded
// from acc per key and 8 W channels, so the tile's V rows are read whole, one after another.
// pv_rows instead takes the tile once per 8 W channels, every V row a part at a time: a strided
// walk the hardware prefetchers follow worse (simd_rows.h has the figures). The same arithmetic
// in the same order as pv_rows (o = o * corr, then + p_t * v_t in key order); one pf->step()
// per key and 8 W channels, as pv_rows (pv_passes).
template <class V, class L, bool kSkipZero>
OLEP_HOT void pv_row_keys(float* acc, int64_t Dv, const typename L::elem* v, int64_t v_stride, const float* p,
                          int64_t n, float corr, TilePrefetch* pf) {
  using vf = typename V::vf;
  constexpr int W = V::W, NU = 8;
  const vf c = V::set1(corr);  // applied with key 0
  for (int64_t t = 0; t < n; ++t) {
    const float pt = p[t];
    const bool skip = kSkipZero && pt == 0.0f && std::signbit(pt);  // kUnseen
    const vf pb = V::set1(pt);
    for (int64_t d = 0; d < Dv; d += NU * W) {
      pf->step();
      float* a = acc + d;
      if (skip && t > 0) continue;
      vf o[NU];
#pragma GCC unroll 8
      for (int u = 0; u < NU; ++u) o[u] = V::load(a + u * W);
      if (t == 0) {
#pragma GCC unroll 8
        for (int u = 0; u < NU; ++u) o[u] = V::mul(o[u], c);
      }
      if (!skip) {
        const typename L::elem* vr = v + t * v_stride + d;
#pragma GCC unroll 8
        for (int u = 0; u < NU; ++u) o[u] = V::fma(pb, L::load(vr + u * W), o[u]);
      }
#pragma GCC unroll 8
      for (int u = 0; u < NU; ++u) V::store(a + u * W, o[u]);
    }
  }
}

// How the row path's AVX-512 P.V groups `rows` output rows (simd_rows.h): `full` blocks of rb
// rows per V load, then one block of the `tail` rows left (0-3); with rb = 2 an odd row joins
// the last pair as one block of 3, so the V tile is read once more, not twice (GQA with 3
// query heads per kv head, head_dim 64, float32 — SmolLM2's shape — Zen 4, paged from DRAM:
// 0.300 -> 0.263-0.269 ms per layer, 1.48x -> 1.28x the read time; tools/cpp/bench_paged_attention
// f32 4096 256 3 3 64 200).
struct PvBlocks {
  int64_t full;
  int tail;
};
inline PvBlocks pv_blocks(int64_t rows, int rb) {
  PvBlocks b{rows / rb, static_cast<int>(rows % rb)};
  if (rb == 2 && b.tail == 1 && b.full >= 1) {
    --b.full;
    b.tail = 3;
  }
  return b;
}

// Number of pv_block calls pv_rows<V, L, RB> makes for Dv (each steps the prefetcher once
// per key).
template <int W, int RB>
constexpr int64_t pv_passes(int64_t Dv) {
  int64_t d = 0, calls = 0;
  if ((W >= 16 && RB <= 2) || RB == 1)
    for (; d + 8 * W <= Dv; d += 8 * W) ++calls;
  for (; d + 4 * W <= Dv; d += 4 * W) ++calls;
  if (d + 2 * W <= Dv) { ++calls; d += 2 * W; }
  if (d + W <= Dv) ++calls;
  return calls;
}

// P.V on int8 V codes in row pairs (KVEncoding::kInt8, kv_block.h), 16-bit fixed point: per
// output row, the tile's weights w_t = p_t * value_scale_t are rounded to int16 relative to the
// tile's largest, wq_t = round(w_t * 32767 / w_max) (each within 2^-16 of w_max: summed over
// the tile's keys, up to W times 2^-16 of the output's scale; the bound is in docs/API.md,
// "Quantized pages", P.V error bound), and each V row pair meets a pair of weights in one exact
// int32 pair dot product per channel (V::idot); o = o * corr + (w_max / 32767) * sum * wpre
// (wpre = 2^-100 for a tiny tile). `words` [RB] hold a row's int16 weights laid out as the V
// pairs are (weight of pair row i at words[rr][i]), `npairs` pairs from `pairs` (the V row pair
// of the tile's first key); sums stay below 2^31 (W / 2 + 1 pairs of 2 * 32767 * 127).
template <class V, int RB, int NU>
OLEP_HOT void pv_block_i16(float* const* acc, const int16_t* const* words, const float* wscale, const float* wpre,
                           const float* corr,
                           const int8_t* pairs, int64_t Dv, int64_t npairs, TilePrefetch* pf) {
  using vf = typename V::vf;
  using vi = typename V::vi;
  constexpr int W = V::W;
  vi s[RB][NU];
#pragma GCC unroll 4
  for (int rr = 0; rr < RB; ++rr)
#pragma GCC unroll 8
    for (int u = 0; u < NU; ++u) s[rr][u] = V::izero();
  for (int64_t k = 0; k < npairs; ++k) {
    pf->step();
    if constexpr (RB == 1) {
      // One row: each V vector widened right before its dot product. Widening all NU first
      // needs NU + NU sums + the weights in registers, 17 at AVX2 (NU = 8), and GCC spilled one
      // every pair (MHA 2K keys int8 in cache, Zen 4, AVX2 level, bench_quant_attention f16
      // 2048 256 8 1 128 1000 1 1, alternating builds: 0.184-0.186 -> 0.176-0.179 ms).
      int32_t w;
      std::memcpy(&w, words[0] + 2 * k, sizeof(w));
      const vi wb = V::iset1(w);
#pragma GCC unroll 8
      for (int u = 0; u < NU; ++u) s[0][u] = V::idot(s[0][u], V::iwiden_i8(pairs + k * 2 * Dv + u * 2 * W), wb);
      continue;
    }
    vi vv[NU];
#pragma GCC unroll 8
    for (int u = 0; u < NU; ++u) vv[u] = V::iwiden_i8(pairs + k * 2 * Dv + u * 2 * W);
#pragma GCC unroll 4
    for (int rr = 0; rr < RB; ++rr) {
      int32_t w;
      std::memcpy(&w, words[rr] + 2 * k, sizeof(w));
      const vi wb = V::iset1(w);
#pragma GCC unroll 8
      for (int u = 0; u < NU; ++u) s[rr][u] = V::idot(s[rr][u], vv[u], wb);
    }
  }
#pragma GCC unroll 4
  for (int rr = 0; rr < RB; ++rr) {
    const vf ws = V::set1(wscale[rr]);
    if (corr[rr] == 1.0f && wpre[rr] == 1.0f) {  // the usual tile: the max did not move, no pre-scale
#pragma GCC unroll 8
      for (int u = 0; u < NU; ++u) V::store(acc[rr] + u * W, V::fma(V::icvt(s[rr][u]), ws, V::load(acc[rr] + u * W)));
      continue;
    }
    const vf c = V::set1(corr[rr]), wp = V::set1(wpre[rr]);
#pragma GCC unroll 8
    for (int u = 0; u < NU; ++u)
      V::store(acc[rr] + u * W, V::fma(V::mul(V::icvt(s[rr][u]), ws), wp, V::mul(V::load(acc[rr] + u * W), c)));
  }
}

// pv_block_i16 over the whole Dv (a multiple of W): chunks of 8 vectors where the registers
// allow (RB * 8 sums + 8 V vectors), then 4, 2, 1.
template <class V, int RB>
OLEP_HOT void pv_rows_i16(float* const* acc, const int16_t* const* words, const float* wscale, const float* wpre,
                          const float* corr,
                          const int8_t* pairs, int64_t Dv, int64_t npairs, TilePrefetch* pf) {
  constexpr int W = V::W;
  constexpr bool kWide = (W >= 16 && RB <= 2) || RB == 1;
  float* at[RB];
  auto point = [&](int64_t d) {
    for (int rr = 0; rr < RB; ++rr) at[rr] = acc[rr] + d;
  };
  int64_t d = 0;
  if constexpr (kWide) {
    for (; d + 8 * W <= Dv; d += 8 * W) {
      point(d);
      pv_block_i16<V, RB, 8>(at, words, wscale, wpre, corr, pairs + 2 * d, Dv, npairs, pf);
    }
  }
  for (; d + 4 * W <= Dv; d += 4 * W) {
    point(d);
    pv_block_i16<V, RB, 4>(at, words, wscale, wpre, corr, pairs + 2 * d, Dv, npairs, pf);
  }
  if (d + 2 * W <= Dv) {
    point(d);
    pv_block_i16<V, RB, 2>(at, words, wscale, wpre, corr, pairs + 2 * d, Dv, npairs, pf);
    d += 2 * W;
  }
  if (d + W <= Dv) {
    point(d);
    pv_block_i16<V, RB, 1>(at, words, wscale, wpre, corr, pairs + 2 * d, Dv, npairs, pf);
  }
}

}  // namespace
}  // namespace simd
}  // namespace kernels
}  // namespace olep
