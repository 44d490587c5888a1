// SIMD attention kernel body, written once against a vector-traits class V
// (V::W float lanes) and instantiated in attention_avx2.cc, attention_avx512.cc and
// attention_avx512_bf16.cc, each compiled with its own ISA flags. Only those translation
// units include it. V::kBf16Dot levels compute bfloat16 q . k with V::dot_bf16 (VDPBF16PS)
// on raw bf16 rows (row path with >= 3 rows per KV head, lanes path).
//
// Two paths, chosen per call by how many query rows share the KV head (group_size x
// valid rows, "rows"):
//
// Row path (rows < W, or a mask tensor): per tile of W keys
//   scores  s[r][0..W) = q_r . k_j   register blocks of 4 (or 2) rows x W/4 keys: each K
//           load serves 4 rows, each q load W/4 keys; one transpose-reduce per W scores.
//           A single row (MHA) walks K row by row instead (sequential addresses).
//   online softmax per row: tile max, one rescale factor, p = exp(s - m)
//   output  acc[r] = acc[r] * corr + sum_j p[r][j] v_j, 2 rows per V load, rescale fused.
// Lanes path (rows >= W, no mask tensor): W query rows in the lanes of a vector, scores one
//   vector per key from broadcast K elements, softmax lane-wise (see attend_lanes).
//
// Layout: K and V rows as the cache stores them (row-major [position, head_dim]): the
// append writes one contiguous row per head, and both paths read each K/V row once per
// group from memory, then from L1/L2. When several rows share a KV head the next tile is
// software-prefetched, spread over the current tile's loops (TilePrefetch).
// float16/bfloat16 rows are converted on load (row path, few rows) or once per tile.
#pragma once

#include <algorithm>
#include <cmath>
#include <cfloat>
#include <cstring>
#include <type_traits>

#include "kernels/attention.h"
#include "kernels/attention_internal.h"

namespace olep {
namespace kernels {
namespace simd {

// The hot helpers below must inline into the tile loops (GCC otherwise outlines some of
// them once the kernels grow, costing a call and register spills per tile).
#define OLEP_HOT inline __attribute__((always_inline))
#define OLEP_COLD_REGS __attribute__((noinline))

template <class V>
OLEP_HOT typename V::vf tanh_v(typename V::vf y) {
  // tanh(y) = sign(y) * (1 - e) / (1 + e), e = exp(-2|y|) <= 1 (no overflow).
  const typename V::vf ay = V::abs(y);
  const typename V::vf e = V::exp(V::mul(ay, V::set1(-2.0f)));
  const typename V::vf one = V::set1(1.0f);
  const typename V::vf t = V::div(V::sub(one, e), V::add(one, e));
  return V::select(V::nan_bits(y), y, V::copysign(t, y));  // V::exp clamps: keep NaN a NaN
}

// Rows [0, n) of `cols` elements (storage type t) as float; rows n..rows-1 zero.
template <class V>
inline void convert_rows(DType t, const void* src, int64_t n, int64_t cols, int64_t rows, float* dst) {
  constexpr int W = V::W;
  if (t == DType::kFloat32) {
    std::memcpy(dst, src, static_cast<size_t>(n * cols) * sizeof(float));
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (int64_t e = 0; e < n * cols; e += W)
      V::store(dst + e, t == DType::kFloat16 ? V::load_f16(s + e) : V::load_bf16(s + e));
  }
  if (n < rows) std::memset(dst + n * cols, 0, static_cast<size_t>((rows - n) * cols) * sizeof(float));
}

// How the inner loops read K/V rows of a storage type (converted to float on load).
template <class V>
struct LoadF32 {
  using elem = float;
  static typename V::vf load(const float* p) { return V::load(p); }
};
template <class V>
struct LoadF16 {
  using elem = uint16_t;
  static typename V::vf load(const uint16_t* p) { return V::load_f16(p); }
};
template <class V>
struct LoadBF16 {
  using elem = uint16_t;
  static typename V::vf load(const uint16_t* p) { return V::load_bf16(p); }
};

// Spreads the software prefetch of the next tile's K and V rows over the current tile's
// compute, a line per step() (into L2): a burst of prefetches at the start of a tile
// fills the miss buffers and stalls the loads of the tile being computed.
struct TilePrefetch {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t k_bytes = 0, v_bytes = 0, done = 0, per_step = 64;
  // Rows to fetch: k_bytes of K from next_k, v_bytes of V from next_v, over `steps` calls of step().
  void reset(const char* next_k, int64_t kb, const char* next_v, int64_t vb, int64_t steps) {
    k = next_k;
    v = next_v;
    k_bytes = kb;
    v_bytes = vb;
    done = 0;
    const int64_t lines = (kb + vb + 63) / 64;
    per_step = 64 * std::max<int64_t>(1, (lines + steps - 1) / std::max<int64_t>(steps, 1));
  }
  // The `tile` rows after the tile starting at j0 (clamped to the block's last row `end`).
  void reset_next(const char* krows, const char* vrows, int64_t j0, int64_t end, int64_t tile, int64_t k_row_bytes,
                  int64_t v_row_bytes, int64_t steps) {
    const int64_t n = std::max<int64_t>(0, std::min<int64_t>(tile, end - j0 - tile));
    reset(krows + tile * k_row_bytes, n * k_row_bytes, vrows + tile * v_row_bytes, n * v_row_bytes, steps);
  }
  void step() {
    const int64_t end = std::min(done + per_step, k_bytes + v_bytes);
    for (; done < end; done += 64) {
      if (done < k_bytes) __builtin_prefetch(k + done, 0, 2);
      else __builtin_prefetch(v + (done - k_bytes), 0, 2);
    }
  }
};

// RB output rows x NU vectors of Dv: o = o * c[row] + sum_t p(t, row) * v[t], with
// p(t, row) = ptile[t * p_tstride + row * p_rstride]. Each V vector is loaded (and
// converted) once for the RB rows.
// Probabilities of keys a row cannot see are stored as -0.0f (kUnseen); a visible key's
// probability is >= +0.0f (exp may underflow to +0). kSkipZero: skip the unseen (row, key)
// pairs, for tiles holding keys some row cannot see (masked, causal future of a prefill row,
// outside the window): their V rows must not reach that row (0 * NaN is NaN), while a visible
// key whose probability underflowed still does, as in ONNX. Tiles every row sees in full take
// the plain loop.
constexpr float kUnseen = -0.0f;
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
                    int64_t p_tstride, int64_t p_rstride, int64_t n, const float* corr, TilePrefetch* pf) {
  constexpr int W = V::W;
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
}

// Walks the tiles of up to `tile` keys in [kmin, kmax), block by block. After next() returns
// true: j0 = first key, n = keys in the tile, end = the block's last key in range (exclusive),
// krows / vrows = row j0 of the block's K / V storage. (A plain loop, not a callback: a lambda
// body sees its captures through a pointer, which measured 20% slower for MQA.)
struct TileCursor {
  const AttentionGroup& a;
  int64_t kmin, kmax, tile;
  size_t es;
  int64_t blk = -1, j0 = 0, n = 0, end = 0;
  const char* krows = nullptr;
  const char* vrows = nullptr;
  bool next() {
    if (blk >= 0 && j0 + tile < end) {
      j0 += tile;
    } else {
      for (++blk; blk < a.num_blocks; ++blk) {
        const KVBlock& kb = a.blocks[blk];
        j0 = std::max(kmin, kb.first_position);
        end = std::min(kmax, kb.first_position + kb.num_rows);
        if (j0 < end) break;
      }
      if (blk >= a.num_blocks) return false;
    }
    const KVBlock& kb = a.blocks[blk];
    n = std::min(tile, end - j0);
    krows = static_cast<const char*>(kb.key) + static_cast<size_t>((j0 - kb.first_position) * a.head_dim) * es;
    vrows = static_cast<const char*>(kb.value) + static_cast<size_t>((j0 - kb.first_position) * a.v_head_dim) * es;
    return true;
  }
};

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

// How the score loops multiply q by K, kStep elements per vector:
// FloatDot: float q (pre-scaled) times K loaded through KL (converted to float), FMAs.
// Bf16Dot (levels with V::kBf16Dot): raw bf16 q (unscaled) and K rows, V::dot_bf16
// (VDPBF16PS: two exact bf16 products per float lane), 2 * W elements per vector.
template <class V, class KL>
struct FloatDot {
  using vf = typename V::vf;
  using qelem = float;
  using kelem = typename KL::elem;
  static constexpr int kStep = V::W;
  static vf load_q(const float* p) { return V::load(p); }
  static vf load_k(const kelem* p) { return KL::load(p); }
  static vf mul(vf q, vf k) { return V::mul(q, k); }
  static vf madd(vf acc, vf q, vf k) { return V::fma(q, k, acc); }
};
template <class V>
struct Bf16Dot {
  using vf = typename V::vf;
  using qelem = uint16_t;
  using kelem = uint16_t;
  static constexpr int kStep = 2 * V::W;
  static vf load_q(const uint16_t* p) { return V::load_raw(p); }
  static vf load_k(const uint16_t* p) { return V::load_raw(p); }
  static vf mul(vf q, vf k) { return V::dot_bf16(V::zero(), q, k); }
  static vf madd(vf acc, vf q, vf k) { return V::dot_bf16(acc, q, k); }
};

// Raw scores of RB query rows against the W keys of a tile (rows of kp, stride D; rows past
// the valid ones are zero padding): ptile[row * W + t] = q_row . k_t. Register block of RB
// rows x KB = W / RB keys: each K load serves RB rows and each q load KB keys; one
// transpose-reduce per W scores.
template <class V, class Dot, int RB>
OLEP_COLD_REGS void scores_rows(const typename Dot::qelem* qf, int64_t D, const typename Dot::kelem* kp,
                                const int64_t* rows, float* ptile, TilePrefetch* pf) {
  using vf = typename V::vf;
  constexpr int W = V::W, KB = W / RB, E = Dot::kStep;
  alignas(64) float x[RB][W];  // x[g] lane rr * KB + tt: row rr, key g * KB + tt
  for (int g = 0; g < RB; ++g) {
    vf acc[W];
#pragma GCC unroll 16
    for (int e = 0; e < W; ++e) acc[e] = V::zero();
    const typename Dot::kelem* kg = kp + g * KB * D;
    for (int64_t d = 0; d < D; d += E) {
      pf->step();
      vf kv[KB];
#pragma GCC unroll 16
      for (int tt = 0; tt < KB; ++tt) kv[tt] = Dot::load_k(kg + tt * D + d);
#pragma GCC unroll 4
      for (int rr = 0; rr < RB; ++rr) {
        const vf qv = Dot::load_q(qf + rows[rr] * D + d);
#pragma GCC unroll 16
        for (int tt = 0; tt < KB; ++tt) acc[rr * KB + tt] = Dot::madd(acc[rr * KB + tt], qv, kv[tt]);
      }
    }
    V::store(x[g], V::transpose_reduce(acc));
  }
  for (int rr = 0; rr < RB; ++rr)
    for (int g = 0; g < RB; ++g) std::memcpy(ptile + rows[rr] * W + g * KB, &x[g][rr * KB], KB * sizeof(float));
}

// One row against the tile, walking K row by row (sequential addresses).
template <class V, class Dot>
OLEP_COLD_REGS void scores_row_walk(const typename Dot::qelem* q, int64_t D, const typename Dot::kelem* kp, float* out,
                                    TilePrefetch* pf) {
  using vf = typename V::vf;
  constexpr int W = V::W, E = Dot::kStep;
  vf acc[W];
#pragma GCC unroll 16
  for (int t = 0; t < W; ++t) {
    pf->step();
    const typename Dot::kelem* kr = kp + t * D;
    vf a0 = Dot::mul(Dot::load_q(q), Dot::load_k(kr));
    vf a1 = V::zero();
    int64_t d = E;
    for (; d + E < D; d += 2 * E) {
      a1 = Dot::madd(a1, Dot::load_q(q + d), Dot::load_k(kr + d));
      a0 = Dot::madd(a0, Dot::load_q(q + d + E), Dot::load_k(kr + d + E));
    }
    if (d < D) a1 = Dot::madd(a1, Dot::load_q(q + d), Dot::load_k(kr + d));
    acc[t] = V::add(a0, a1);
  }
  V::store(out, V::transpose_reduce(acc));
}

// L: how K/V storage is read; kTiles: convert each K/V tile to float once (shared by
// every query row of the group) instead of converting on every load.
template <class V, class L, bool kTiles>
void attend_impl(const AttentionGroup& a, int64_t key_begin, int64_t key_end, AttentionState* st, float* scratch) {
  using vf = typename V::vf;
  using KL = std::conditional_t<kTiles, LoadF32<V>, L>;  // how the loops below load K/V
  using KE = typename KL::elem;
  constexpr int W = V::W;
  const int64_t G = a.group_size, S = a.num_rows, D = a.head_dim, Dv = a.v_head_dim;
  const int64_t valid = std::min(a.num_valid_rows, S);
  const int64_t R = G * S;
  float* qf = scratch;              // [R, D], scaled by `scale` unless softcap is on
  float* ktile = qf + R * D;        // [W, D]
  float* vtile = ktile + W * D;     // [W, Dv]
  float* ptile = vtile + W * Dv;    // [R, W]
  float* corr = ptile + R * W;      // [R]
  float* lsum = corr + R;           // [R, W] lane-wise sums of p, folded into st->l at the end

  const bool capped = a.softcap > 0.0f;
  // bfloat16 q . k by VDPBF16PS (levels that have it, head_dim a multiple of 2 * W, at least
  // 3 rows per KV head): q rows stay raw bf16 in the qf area, unscaled; the scale multiplies
  // the finished scores. Measured on Zen 4 (D = 128, from DRAM, time / read time): 4 rows
  // 1.70 -> 1.42, 3 rows 1.74 -> 1.64; but 2 rows 1.25 -> 1.35 and 1 row 0.95 -> 1.0-1.8
  // (memory-bound there: the full-line K loads of the dot loop stream worse), so 1-2 rows
  // keep the converting loads.
  constexpr bool kDotLevel = V::kBf16Dot && std::is_same<L, LoadBF16<V>>::value && !kTiles;
  const bool dot = kDotLevel && D % (2 * W) == 0 && G * valid >= 3;
  uint16_t* qb = reinterpret_cast<uint16_t*>(qf);  // [R, D] raw bf16 when dot
  if (dot) {
    for (int64_t h = 0; h < G; ++h)
      for (int64_t i = 0; i < valid; ++i)
        std::memcpy(qb + (h * S + i) * D, static_cast<const uint16_t*>(a.q) + h * a.q_head_stride + i * a.q_row_stride,
                    static_cast<size_t>(D) * sizeof(uint16_t));
  }
  const float qscale = capped ? 1.0f : a.scale;
  for (int64_t h = 0; h < G && !dot; ++h)
    for (int64_t i = 0; i < valid; ++i) {
      float* dst = qf + (h * S + i) * D;
      const int64_t off = h * a.q_head_stride + i * a.q_row_stride;
      for (int64_t d = 0; d < D; d += W) {
        vf x;
        if (a.dtype == DType::kFloat32) x = V::load(static_cast<const float*>(a.q) + off + d);
        else if (a.dtype == DType::kFloat16) x = V::load_f16(static_cast<const uint16_t*>(a.q) + off + d);
        else x = V::load_bf16(static_cast<const uint16_t*>(a.q) + off + d);
        V::store(dst + d, V::mul(x, V::set1(qscale)));
      }
    }

  // Keys any row can see.
  int64_t kmin, kmax;
  detail::visible_union(a, &kmin, &kmax);
  kmin = std::max(kmin, key_begin);
  kmax = std::min(kmax, std::min(key_end, a.num_keys));
  if (kmin >= kmax) return;

  const float lowest = detail::lowest_of(a.mask.dtype);
  const size_t es = dtype_size(a.dtype);
  const MaskView& mk = a.mask;
  std::fill(lsum, lsum + R * W, 0.0f);
  TilePrefetch pf;
  const int64_t row_count = G * valid;
  // pf.step() calls per tile: score loops, then P.V loops (one per key per row pair and chunk)
  constexpr int kPvRows = (W >= 16 && !std::is_same<KE, float>::value) ? 4 : 2;
  const int64_t tile_steps = [&] {
    const int64_t r4 = row_count / 4, r2 = row_count % 4 / 2, r1 = row_count % 2;
    const int64_t dsteps = dot ? D / (2 * W) : D / W;  // score-loop iterations per row block
    const int64_t scores = r4 * 4 * dsteps + r2 * 2 * dsteps + r1 * W;
    const int64_t pv = (row_count / kPvRows) * W * pv_passes<W, kPvRows>(Dv) + (row_count % kPvRows) * W * pv_passes<W, 1>(Dv);
    return scores + pv;
  }();

  for (TileCursor tc{a, kmin, kmax, W, es}; tc.next();) {
    const int64_t j0 = tc.j0, n = tc.n, b1 = tc.end;
    const char* krows = tc.krows;
    const char* vrows = tc.vrows;
    // Software prefetch of the next tile, spread over this tile's loops, when several rows
    // share the KV head: their compute is long enough that the hardware prefetchers alone
    // leave DRAM idle for part of each tile (GQA 32/8 fp32: 1.8x -> 1.07x the read limit).
    // One row (MHA) walks K sequentially and the hardware prefetchers keep up; software
    // prefetch measured slower there.
    pf.reset(nullptr, 0, nullptr, 0, 1);
    if (row_count >= 2) pf.reset_next(krows, vrows, j0, b1, W, D * es, Dv * es, tile_steps);
    const KE* kp;
    const KE* vp;
    if constexpr (kTiles) {
      convert_rows<V>(a.dtype, krows, n, D, W, ktile);
      convert_rows<V>(a.dtype, vrows, n, Dv, W, vtile);
      kp = ktile;
      vp = vtile;
    } else {
      if (n == W) {
        kp = reinterpret_cast<const KE*>(krows);
      } else {  // partial tile: K rows n..W-1 must not be read; pad with zeros
        KE* raw = reinterpret_cast<KE*>(ktile);
        std::memcpy(raw, krows, static_cast<size_t>(n * D) * sizeof(KE));
        std::memset(raw + n * D, 0, static_cast<size_t>((W - n) * D) * sizeof(KE));
        kp = raw;
      }
      vp = reinterpret_cast<const KE*>(vrows);  // only rows < n are read
    }

    // ---- raw scores of every row, RB rows x W keys per register block ----
    {
      int64_t rows[4];
      int nr = 0;
      auto flush = [&](int cnt) {
        if constexpr (kDotLevel) {
          if (dot) {
            const uint16_t* kb = reinterpret_cast<const uint16_t*>(kp);
            using Dot = Bf16Dot<V>;
            if (cnt == 4) scores_rows<V, Dot, 4>(qb, D, kb, rows, ptile, &pf);
            else if (cnt >= 2) scores_rows<V, Dot, 2>(qb, D, kb, rows, ptile, &pf);
            else scores_row_walk<V, Dot>(qb + rows[0] * D, D, kb, ptile + rows[0] * W, &pf);
            return;
          }
        }
        using Dot = FloatDot<V, KL>;
        if (cnt == 4) scores_rows<V, Dot, 4>(qf, D, kp, rows, ptile, &pf);
        else if (cnt >= 2) scores_rows<V, Dot, 2>(qf, D, kp, rows, ptile, &pf);
        else scores_row_walk<V, Dot>(qf + rows[0] * D, D, kp, ptile + rows[0] * W, &pf);
      };
      for (int64_t i = 0; i < valid; ++i)
        for (int64_t h = 0; h < G; ++h) {
          rows[nr++] = h * S + i;
          if (nr == 4) {
            flush(nr);
            nr = 0;
          }
        }
      // Left-over rows: pairs, then one row walking K row by row (MHA decode: sequential
      // addresses the hardware prefetchers follow; column-wise measured 1.6x slower).
      while (nr > 0) {
        const int cnt = nr >= 2 ? 2 : 1;
        flush(cnt);
        for (int k = cnt; k < nr; ++k) rows[k - cnt] = rows[k];
        nr -= cnt;
      }
    }

    // ---- online softmax, row by row ----
    bool any = false;
    bool all_seen = true;  // every row sees every key of the tile
    const unsigned tile_bits = n >= 32 ? ~0u : ((1u << n) - 1u);
    for (int64_t i = 0; i < valid; ++i) {
      int64_t lo, hi;
      detail::visible_range(a, i, &lo, &hi);
      const unsigned range = V::key_range(j0, std::max(lo, j0), std::min(hi, j0 + n));
      for (int64_t h = 0; h < G; ++h) {
        const int64_t r = h * S + i;
        float* prow = ptile + r * W;
        unsigned live = range;
        vf bias = V::zero();
        if (live && mk.kind != MaskKind::kNone) {
          const int64_t mo = h * mk.head_stride + i * mk.row_stride + j0 * mk.key_stride;
          if (mk.kind == MaskKind::kBool) {
            if (mk.key_stride == 1) {
              live &= V::bool_bits(static_cast<const uint8_t*>(mk.data) + mo, n);
            } else {
              const bool on = static_cast<const uint8_t*>(mk.data)[mo] != 0;
              if (!on) live = 0;
            }
          } else {
            alignas(64) float bb[W];
            if (mk.key_stride == 1 && mk.dtype == DType::kFloat32 && n == W) {
              std::memcpy(bb, static_cast<const float*>(mk.data) + mo, sizeof(bb));
            } else {
              for (int t = 0; t < W; ++t)
                bb[t] = t < n ? detail::load(mk.dtype, mk.data, mo + t * mk.key_stride) : 0.0f;
            }
            bias = V::load(bb);
            live &= ~V::le_bits(bias, lowest);  // NaN biases stay live and make the row NaN
          }
        }
        if (live != tile_bits) all_seen = false;
        if (!live) {
          corr[r] = 1.0f;
          std::fill(prow, prow + W, kUnseen);
          continue;
        }
        vf s = V::load(prow);
        if (dot && !capped) s = V::mul(s, V::set1(a.scale));  // dot scores are unscaled
        if (capped) {
          const vf x = V::mul(s, V::set1(a.scale));
          s = V::mul(V::set1(a.softcap), tanh_v<V>(V::mul(x, V::set1(1.0f / a.softcap))));
        }
        s = V::add(s, bias);
        // NaN or +inf in a visible score (from q, k or the mask): the row's result is NaN, as
        // ONNX Attention's softmax gives (max = +inf, inf - inf = NaN).
        if (~V::le_bits(s, FLT_MAX) & live) {
          st->l[r] = NAN;
          corr[r] = 1.0f;
          std::fill(prow, prow + W, kUnseen);
          continue;
        }
        live &= ~V::le_bits(s, -INFINITY);  // a -inf score contributes nothing (scalar level too)
        if (live != tile_bits) all_seen = false;
        if (!live) {
          corr[r] = 1.0f;
          std::fill(prow, prow + W, kUnseen);
          continue;
        }
        // The max moves (horizontal max, scalar exp, rescale of acc and l) only in tiles where
        // a visible score exceeds it, a few tiles per row in practice (for i.i.d. scores about
        // ln(tiles)); other tiles add exp(s - m) <= 1 to lane-wise sums (lsum), folded into
        // l at the end of the call. (A reference allowed to lag the max, as some GPU kernels
        // do, would let p reach e^lag and overflow acc for |v| > FLT_MAX / e^lag; an exact max
        // keeps acc within the scalar level's range.)
        float m_ref = st->m[r];
        float c = 1.0f;
        if (V::gt_bits(s, m_ref) & live) {
          const float m_new = std::max(m_ref, V::reduce_max(V::select(live, s, V::set1(-INFINITY))));
          c = std::exp(m_ref - m_new);
          st->l[r] *= c;
          V::store(lsum + r * W, V::mul(V::load(lsum + r * W), V::set1(c)));
          st->m[r] = m_ref = m_new;
        }
        const vf p = V::select(live, V::exp(V::sub(s, V::set1(m_ref))), V::set1(kUnseen));
        V::store(lsum + r * W, V::add(V::load(lsum + r * W), p));
        corr[r] = c;
        V::store(prow, p);
        any = true;
      }
    }
    if (!any) continue;

    // ---- weighted V accumulation, rescale fused; RB rows per V load ----
    {
      // 16-bit K/V: 4 rows per V load, so each V vector is converted once per 4 rows
      // (measured 5% faster for GQA 32/8 fp16); float32: 2 rows with whole-row chunks.
      constexpr int RB = kPvRows;
      int64_t rows[RB];
      int nr = 0;
      for (int64_t i = 0; i < valid; ++i)
        for (int64_t h = 0; h < G; ++h) {
          rows[nr++] = h * S + i;
          if (nr == RB) {
            if (all_seen) pv_rows<V, KL, RB, false>(st->acc, rows, Dv, vp, ptile, 1, W, n, corr, &pf);
            else pv_rows<V, KL, RB, true>(st->acc, rows, Dv, vp, ptile, 1, W, n, corr, &pf);
            nr = 0;
          }
        }
      for (int k = 0; k < nr; ++k) {
        if (all_seen) pv_rows<V, KL, 1, false>(st->acc, rows + k, Dv, vp, ptile, 1, W, n, corr, &pf);
        else pv_rows<V, KL, 1, true>(st->acc, rows + k, Dv, vp, ptile, 1, W, n, corr, &pf);
      }
    }
  }
  for (int64_t i = 0; i < valid; ++i)
    for (int64_t h = 0; h < G; ++h) {
      const int64_t r = h * S + i;
      st->l[r] += V::reduce_add(V::load(lsum + r * W));
    }
}

// ---------------------------------------------------------------------------------
// Query rows in lanes: the path for groups at least one vector wide (MQA, GQA with
// group_size * rows >= W, prefill blocks) and no mask tensor.
//
// The row-per-key layout above spends, per query row and tile, a transpose-reduce, two
// horizontal reductions and a scalar exp: cheap next to the K/V stream when one or a few
// rows share a KV head, but for 32 rows per KV head (MQA) the kernel is compute-bound and
// those reductions cost as much as the FMAs. Here W query rows sit in the W lanes of a
// vector: with Q transposed once per call (qt[d][r]), the score of key t for W rows is
//   s_t = sum_d qt[d][rows] * broadcast(k_t[d])
// one vector per key, no reduction; max, exp, sum and the rescale factor are lane-wise.
// P.V then blocks RB rows x NU output vectors in registers per V row load.
// Measured on Zen 4 (decode, D=128, L=4K, from DRAM): 32 rows 1.3x (fp32) / 1.4x (fp16)
// faster than the row path, 16 rows 1.15x; in L2 it runs at ~80% of peak FMA throughput.
// ---------------------------------------------------------------------------------

// Keys per tile of the lanes path (32: halves the per-tile accumulator load/rescale/store
// against 16, measured 5-7% faster for MQA; scratch_floats in attention_common.cc sizes for it).
constexpr int kLaneTileKeys = 32;

// Scratch: scratch_floats() in attention_common.cc covers the layout below.
template <class V>
void attend_lanes(const AttentionGroup& a, int64_t key_begin, int64_t key_end, AttentionState* st, float* scratch) {
  using vf = typename V::vf;
  constexpr int W = V::W;
  constexpr int TK = kLaneTileKeys;     // keys per tile
  constexpr int KB = 8;                 // keys per block of score registers
  constexpr int RB = W >= 16 ? 4 : 2;   // output rows per P.V register block (32 vs 16 registers)
  const int64_t G = a.group_size, S = a.num_rows, D = a.head_dim, Dv = a.v_head_dim;
  const int64_t valid = std::min(a.num_valid_rows, S);
  const int64_t R = G * S, Rp = (R + W - 1) / W * W;
  float* qt = scratch;             // [D, Rp] transposed, scaled queries
  float* ktile = qt + D * Rp;      // [TK, D]
  float* vtile = ktile + TK * D;   // [TK, Dv]
  float* ptile = vtile + TK * Dv;  // [TK, Rp] scores, then probabilities
  float* mloc = ptile + TK * Rp;   // [Rp] running max, lanes
  float* lloc = mloc + Rp;         // [Rp] running sum, lanes
  float* corr = lloc + Rp;         // [Rp] this tile's rescale factor

  const bool capped = a.softcap > 0.0f;
  const float qscale = capped ? 1.0f : a.scale;
  // bfloat16 on levels with VDPBF16PS (head_dim even): qt holds raw bf16 pairs instead,
  // qt2[i][r] = (q[r][2i], q[r][2i+1]) in one 32-bit lane, unscaled, and each score vector is
  // one dot_bf16 per pair of K elements (broadcast as one 32-bit value from the raw K row).
  constexpr bool kDotLevel = V::kBf16Dot;
  const bool dot = kDotLevel && a.dtype == DType::kBFloat16 && D % 2 == 0;
  uint32_t* qt2 = reinterpret_cast<uint32_t*>(qt);  // [D / 2, Rp] when dot
  std::fill(qt, qt + D * Rp, 0.0f);
  for (int64_t h = 0; h < G; ++h)
    for (int64_t i = 0; i < valid; ++i) {
      const int64_t r = h * S + i, off = h * a.q_head_stride + i * a.q_row_stride;
      if (dot) {
        const uint16_t* qr = static_cast<const uint16_t*>(a.q) + off;
        for (int64_t d = 0; d < D; d += 2) qt2[d / 2 * Rp + r] = qr[d] | static_cast<uint32_t>(qr[d + 1]) << 16;
      } else {
        for (int64_t d = 0; d < D; ++d) qt[d * Rp + r] = detail::load(a.dtype, a.q, off + d) * qscale;
      }
    }
  for (int64_t r = 0; r < Rp; ++r) {
    mloc[r] = r < R ? st->m[r] : -INFINITY;
    lloc[r] = r < R ? st->l[r] : 0.0f;
  }

  // Keys any row can see; whether every row sees the same range.
  int64_t kmin, kmax;
  detail::visible_union(a, &kmin, &kmax);
  const bool uniform = valid == 1 || (!a.is_causal && a.local_window_size <= 0);
  const int64_t ulo = kmin, uhi = kmax;
  kmin = std::max(kmin, key_begin);
  kmax = std::min(kmax, std::min(key_end, a.num_keys));
  if (kmin >= kmax) return;

  // Lanes of each row block that hold a real, valid row.
  auto block_rows = [&](int64_t b) {
    unsigned bits = 0;
    for (int lane = 0; lane < W; ++lane) {
      const int64_t r = b * W + lane;
      if (r < R && r % S < valid) bits |= 1u << lane;
    }
    return bits;
  };
  const int64_t nblocks = Rp / W;
  const size_t es = dtype_size(a.dtype);
  const vf neg_inf = V::set1(-INFINITY);
  TilePrefetch pf;
  // pf.step() calls per tile: every other score-loop iteration, then one per key per P.V call
  const int64_t lane_steps = nblocks * (TK / KB) * (D / 2) + (G * valid / RB) * pv_passes<W, RB>(Dv) * TK +
                             (G * valid % RB) * pv_passes<W, 1>(Dv) * TK;

  for (TileCursor tc{a, kmin, kmax, TK, es}; tc.next();) {
    const int64_t j0 = tc.j0, n = tc.n, b1 = tc.end;
    const char* krows = tc.krows;
    const char* vrows = tc.vrows;
    pf.reset_next(krows, vrows, j0, b1, TK, D * es, Dv * es, lane_steps);  // spread over this tile's loops
    const float* kp = nullptr;
    const uint16_t* kraw = nullptr;  // dot: raw bf16 K rows
    const float* vp;
    if (dot) {
      if (n == TK) {
        kraw = reinterpret_cast<const uint16_t*>(krows);
      } else {  // pad a partial tile with zeros (K rows >= n must not be read)
        uint16_t* raw = reinterpret_cast<uint16_t*>(ktile);
        std::memcpy(raw, krows, static_cast<size_t>(n * D) * sizeof(uint16_t));
        std::memset(raw + n * D, 0, static_cast<size_t>((TK - n) * D) * sizeof(uint16_t));
        kraw = raw;
      }
    } else if (a.dtype == DType::kFloat32 && n == TK) {
      kp = reinterpret_cast<const float*>(krows);
    } else {  // convert, or pad a partial tile with zeros (K rows >= n must not be read)
      convert_rows<V>(a.dtype, krows, n, D, TK, ktile);
      kp = ktile;
    }
    if (a.dtype == DType::kFloat32) {
      vp = reinterpret_cast<const float*>(vrows);  // only rows < n are read
    } else {
      convert_rows<V>(a.dtype, vrows, n, Dv, n, vtile);
      vp = vtile;
    }

    bool all_seen = true;  // every valid row sees every key of the tile
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t rb = b * W;
      // live[t]: lanes for which key j0 + t is visible.
      unsigned live[TK];
      const unsigned rows_bits = block_rows(b);
      if (uniform) {
        for (int t = 0; t < TK; ++t) live[t] = (t < n && j0 + t >= ulo && j0 + t < uhi) ? rows_bits : 0u;
      } else {
        for (int t = 0; t < TK; ++t) live[t] = 0;
        for (int lane = 0; lane < W; ++lane) {
          if (!(rows_bits >> lane & 1u)) continue;
          int64_t lo, hi;
          detail::visible_range(a, (rb + lane) % S, &lo, &hi);
          const int64_t t0 = std::max<int64_t>(lo - j0, 0), t1 = std::min<int64_t>(hi - j0, n);
          for (int64_t t = t0; t < t1; ++t) live[t] |= 1u << lane;
        }
      }
      unsigned any = 0;
      for (int t = 0; t < TK; ++t) any |= live[t];
      for (int t = 0; t < n; ++t)
        if (live[t] != rows_bits) all_seen = false;
      if (!any) {
        V::store(corr + rb, V::set1(1.0f));
        for (int t = 0; t < n; ++t) V::store(ptile + t * Rp + rb, V::set1(kUnseen));
        continue;
      }

      // Scores: KB keys at a time, one broadcast K element (dot: element pair) per FMA.
      if constexpr (kDotLevel) {
        if (dot) {
          const vf sc = V::set1(capped ? 1.0f : a.scale);  // capped: scaled in the softcap below
          for (int k0 = 0; k0 < TK; k0 += KB) {
            vf acc[KB];
#pragma GCC unroll 8
            for (int u = 0; u < KB; ++u) acc[u] = V::zero();
            const uint16_t* kr = kraw + k0 * D;
            const float* qc = reinterpret_cast<const float*>(qt2 + rb);
            for (int64_t d = 0; d < D; d += 2) {
              pf.step();  // the float loop below steps every other d: same count
              const vf qv = V::load(qc + d / 2 * Rp);
#pragma GCC unroll 8
              for (int u = 0; u < KB; ++u) acc[u] = V::dot_bf16(acc[u], qv, V::set1_pair(kr + u * D + d));
            }
#pragma GCC unroll 8
            for (int u = 0; u < KB; ++u) V::store(ptile + (k0 + u) * Rp + rb, V::mul(acc[u], sc));
          }
        }
      }
      for (int k0 = 0; k0 < TK && !dot; k0 += KB) {
        vf acc[KB];
#pragma GCC unroll 8
        for (int u = 0; u < KB; ++u) acc[u] = V::zero();
        const float* kr = kp + k0 * D;
        const float* qc = qt + rb;
        for (int64_t d = 0; d < D; ++d) {
          if ((d & 1) == 0) pf.step();
          const vf qv = V::load(qc + d * Rp);
#pragma GCC unroll 8
          for (int u = 0; u < KB; ++u) acc[u] = V::fma(qv, V::set1(kr[u * D + d]), acc[u]);
        }
#pragma GCC unroll 8
        for (int u = 0; u < KB; ++u) V::store(ptile + (k0 + u) * Rp + rb, acc[u]);
      }

      // Online softmax, lane-wise.
      unsigned nan_lanes = 0;
      vf mt = neg_inf;
      for (int t = 0; t < n; ++t) {
        vf x = V::load(ptile + t * Rp + rb);
        if (capped) {
          const vf y = V::mul(x, V::set1(a.scale));
          x = V::mul(V::set1(a.softcap), tanh_v<V>(V::mul(y, V::set1(1.0f / a.softcap))));
          V::store(ptile + t * Rp + rb, x);
        }
        // NaN or +inf (from q or k): the row's result is NaN, as in ONNX Attention
        nan_lanes |= ~V::le_bits(x, FLT_MAX) & live[t];
      }
      for (int t = 0; t < n; ++t) {
        const vf x = V::load(ptile + t * Rp + rb);
        live[t] &= ~nan_lanes & ~V::le_bits(x, -INFINITY);  // a -inf score contributes nothing
        if (live[t] != rows_bits) all_seen = false;
        mt = V::max(mt, V::select(live[t], x, neg_inf));
      }
      const vf mo = V::load(mloc + rb);
      const vf mn = V::max(mo, mt);
      const vf mref = V::max(mn, V::set1(-FLT_MAX));  // finite even where nothing is visible yet
      const vf c = V::exp(V::sub(mo, mref));
      vf lsum = V::zero();
      for (int t = 0; t < n; ++t) {
        const vf p = V::select(live[t], V::exp(V::sub(V::load(ptile + t * Rp + rb), mref)), V::set1(kUnseen));
        lsum = V::add(lsum, p);
        V::store(ptile + t * Rp + rb, p);
      }
      vf l = V::fma(V::load(lloc + rb), c, lsum);
      l = V::select(nan_lanes, V::set1(NAN), l);
      V::store(lloc + rb, l);
      V::store(mloc + rb, mn);
      V::store(corr + rb, c);
    }

    // P.V: RB rows at a time, each V row loaded once per block of rows.
    int64_t rows[RB];
    int nr = 0;
    for (int64_t h = 0; h < G; ++h)
      for (int64_t i = 0; i < valid; ++i) {
        rows[nr++] = h * S + i;
        if (nr == RB) {
          if (all_seen) pv_rows<V, LoadF32<V>, RB, false>(st->acc, rows, Dv, vp, ptile, Rp, 1, n, corr, &pf);
          else pv_rows<V, LoadF32<V>, RB, true>(st->acc, rows, Dv, vp, ptile, Rp, 1, n, corr, &pf);
          nr = 0;
        }
      }
    for (int k = 0; k < nr; ++k) {
      if (all_seen) pv_rows<V, LoadF32<V>, 1, false>(st->acc, rows + k, Dv, vp, ptile, Rp, 1, n, corr, &pf);
      else pv_rows<V, LoadF32<V>, 1, true>(st->acc, rows + k, Dv, vp, ptile, Rp, 1, n, corr, &pf);
    }
  }
  for (int64_t h = 0; h < G; ++h)
    for (int64_t i = 0; i < valid; ++i) {
      const int64_t r = h * S + i;
      st->m[r] = mloc[r];
      st->l[r] = lloc[r];
    }
}

// Group rows (query heads sharing the kv head x query rows) from which converting a
// float16/bfloat16 tile once beats converting on every load (measured on Zen 4, D=128:
// inline wins at 1, 4 and 8 rows, the tile at 32).
constexpr int64_t kConvertTileRows = 16;

// Rows (group_size x valid query rows) from which the lanes path runs: a full vector
// (measured on Zen 4: AVX-512 at 8 rows, half the lanes empty, is 15% slower than the row
// path; at 16 and 32 rows 15-40% faster).
template <class V>
constexpr int64_t lanes_min_rows() {
  return V::W;
}

template <class V>
void attend_range(const AttentionGroup& a, int64_t key_begin, int64_t key_end, AttentionState* st, float* scratch) {
  constexpr int W = V::W;
  if (a.head_dim % W != 0 || a.v_head_dim % W != 0) {
    attend_range_scalar(a, key_begin, key_end, st, scratch);
    return;
  }
  const int64_t group_rows = a.group_size * std::min(a.num_valid_rows, a.num_rows);
  if (a.mask.kind == MaskKind::kNone && group_rows >= lanes_min_rows<V>()) {
    attend_lanes<V>(a, key_begin, key_end, st, scratch);
    return;
  }
  const bool tiles = group_rows >= kConvertTileRows;
  switch (a.dtype) {
    case DType::kFloat32:
      attend_impl<V, LoadF32<V>, false>(a, key_begin, key_end, st, scratch);
      return;
    case DType::kFloat16:
      if (tiles) attend_impl<V, LoadF16<V>, true>(a, key_begin, key_end, st, scratch);
      else attend_impl<V, LoadF16<V>, false>(a, key_begin, key_end, st, scratch);
      return;
    case DType::kBFloat16:
      if (tiles) attend_impl<V, LoadBF16<V>, true>(a, key_begin, key_end, st, scratch);
      else attend_impl<V, LoadBF16<V>, false>(a, key_begin, key_end, st, scratch);
      return;
  }
}

}  // namespace simd
}  // namespace kernels
}  // namespace olep
