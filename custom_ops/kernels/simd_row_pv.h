// The row path's P.V of one tile (internal; simd_rows.h): weighted V rows of at most W keys
// into RB output rows, the rescale fused. See attention_simd.h.
#pragma once

#include "kernels/simd_common.h"
#include "kernels/simd_tiles.h"

namespace olep {
namespace kernels {
namespace simd {
namespace {  // internal linkage: each ISA translation unit its own copy (attention_simd.h)

// RB output rows x NU vectors of Dv: o = o * corr[rr] + sum_t p[rr][t] * v[t] over the tile's
// n <= W keys (v: row t at v + t * v_stride; p[rr]: the row's W probabilities, kUnseen for keys
// it cannot see). Each V vector is loaded (and converted) once for the RB rows. The same
// arithmetic in the same order as pv_block (simd_pv.h), written for the row path's short
// tiles: the probability rows and accumulators are addressed once per call, a full tile's
// key loop is unrolled, and the prefetcher steps every kPvStepKeys keys (pv_tile_steps), so the
// key loop is loads and multiply-adds only. kSkipZero: skip the unseen (row, key) pairs (see
// pv_block).
// Keys between two TilePrefetch steps in pv_tile_block (a full tile; a partial one steps once):
// 2, as bursts of prefetches measured slower at AVX-512 (GQA bf16).
constexpr int kPvStepKeys = 2;

template <class V, class L, int RB, int NU, bool kSkipZero>
OLEP_HOT void pv_tile_block(float* const* acc, const float* const* p, const typename L::elem* v, int64_t v_stride,
                            int64_t n, const float* corr, TilePrefetch* pf) {
  using vf = typename V::vf;
  constexpr int W = V::W;
  pf->step();
  vf o[RB][NU];
  // The usual tile leaves every row's max where it was (corr 1): the accumulators as they are
  // (x * 1 is x, NaN and -0 included), RB x NU multiplies fewer on the FMA ports.
  bool rescale = false;
#pragma GCC unroll 4
  for (int rr = 0; rr < RB; ++rr) rescale |= corr[rr] != 1.0f;
  if (rescale) {
#pragma GCC unroll 4
    for (int rr = 0; rr < RB; ++rr) {
      const vf c = V::set1(corr[rr]);
#pragma GCC unroll 8
      for (int u = 0; u < NU; ++u) o[rr][u] = V::mul(V::load(acc[rr] + u * W), c);
    }
  } else {
#pragma GCC unroll 4
    for (int rr = 0; rr < RB; ++rr)
#pragma GCC unroll 8
      for (int u = 0; u < NU; ++u) o[rr][u] = V::load(acc[rr] + u * W);
  }
  auto key = [&](int64_t t) OLEP_LAMBDA_HOT {
    vf vv[NU];
#pragma GCC unroll 8
    for (int u = 0; u < NU; ++u) vv[u] = L::load(v + t * v_stride + u * W);
#pragma GCC unroll 4
    for (int rr = 0; rr < RB; ++rr) {
      const float pt = p[rr][t];
      if (kSkipZero && pt == 0.0f && std::signbit(pt)) continue;  // kUnseen
      const vf pb = V::set1(pt);
#pragma GCC unroll 8
      for (int u = 0; u < NU; ++u) o[rr][u] = V::fma(pb, vv[u], o[rr][u]);
    }
  };
  if (n == W) {
#pragma GCC unroll 16
    for (int t = 0; t < W; ++t) {
      if (t % kPvStepKeys == kPvStepKeys - 1) pf->step();
      key(t);
    }
  } else {
    for (int64_t t = 0; t < n; ++t) key(t);
  }
#pragma GCC unroll 4
  for (int rr = 0; rr < RB; ++rr)
#pragma GCC unroll 8
    for (int u = 0; u < NU; ++u) V::store(acc[rr] + u * W, o[rr][u]);
}

// Vectors of Dv per pv_tile_block call for RB rows: as many as the registers hold next to the
// RB x NU accumulators (16 vector registers at W = 8, 32 at W = 16).
template <int W, int RB>
constexpr int pv_tile_nu() {
  return W >= 16 ? (RB <= 2 ? 8 : 4) : (RB == 1 ? 8 : RB == 2 ? 4 : 2);
}

// pv_tile_block over the whole Dv (a multiple of W) for rows `rows` of the state (accumulator
// st_acc + row * Dv, probabilities ptile + row * W, rescale corr[row]): chunks of
// pv_tile_nu vectors, then 4, 2, 1.
template <class V, class L, int RB, bool kSkipZero>
OLEP_HOT void pv_tile_rows(float* st_acc, const int64_t* rows, int64_t Dv, const typename L::elem* v,
                           const float* ptile, int64_t n, const float* corr, TilePrefetch* pf_io) {
  TilePrefetch local = *pf_io;  // in registers, written back at the end (see scores_rows)
  TilePrefetch* pf = &local;
  constexpr int W = V::W, NU = pv_tile_nu<W, RB>();
  float* acc[RB];
  const float* p[RB];
  float c[RB];
#pragma GCC unroll 4
  for (int rr = 0; rr < RB; ++rr) {
    p[rr] = ptile + rows[rr] * W;
    c[rr] = corr[rows[rr]];
  }
  auto point = [&](int64_t off) OLEP_LAMBDA_HOT {
#pragma GCC unroll 4
    for (int rr = 0; rr < RB; ++rr) acc[rr] = st_acc + rows[rr] * Dv + off;
  };
  int64_t d = 0;
  for (; d + NU * W <= Dv; d += NU * W) {
    point(d);
    pv_tile_block<V, L, RB, NU, kSkipZero>(acc, p, v + d, Dv, n, c, pf);
  }
  if constexpr (NU > 4) {
    if (d + 4 * W <= Dv) {
      point(d);
      pv_tile_block<V, L, RB, 4, kSkipZero>(acc, p, v + d, Dv, n, c, pf);
      d += 4 * W;
    }
  }
  if constexpr (NU > 2) {
    if (d + 2 * W <= Dv) {
      point(d);
      pv_tile_block<V, L, RB, 2, kSkipZero>(acc, p, v + d, Dv, n, c, pf);
      d += 2 * W;
    }
  }
  for (; d + W <= Dv; d += W) {
    point(d);
    pv_tile_block<V, L, RB, 1, kSkipZero>(acc, p, v + d, Dv, n, c, pf);
  }
  *pf_io = local;
}

// pf->step() calls pv_tile_rows<V, L, RB> makes for Dv on a full tile (1 + W / kPvStepKeys per
// pv_tile_block call).
template <int W, int RB>
constexpr int64_t pv_tile_steps(int64_t Dv) {
  constexpr int NU = pv_tile_nu<W, RB>();
  int64_t d = 0, calls = 0;
  for (; d + NU * W <= Dv; d += NU * W) ++calls;
  if (NU > 4 && d + 4 * W <= Dv) { ++calls; d += 4 * W; }
  if (NU > 2 && d + 2 * W <= Dv) { ++calls; d += 2 * W; }
  for (; d + W <= Dv; d += W) ++calls;
  return calls * (1 + W / kPvStepKeys);
}

}  // namespace
}  // namespace simd
}  // namespace kernels
}  // namespace olep
