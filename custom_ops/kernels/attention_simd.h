// SIMD attention kernel body, written once against a vector-traits class V
// (V::W float lanes) and instantiated in attention_avx512.cc / attention_avx2.cc,
// each compiled with its own ISA flags. Only those translation units include it.
//
// Per tile of W keys (K/V rows converted to float once per tile, shared by the
// whole query-head group):
//   scores  s[r][0..W) = q_r . k_j        (W accumulators, one transpose-reduce)
//   online softmax per row: tile max, one rescale factor, p = exp(s - m)
//   output  acc[r] = acc[r] * corr + sum_j p[r][j] v_j   (rescale fused into the load)
// Layout: K and V rows as the cache stores them (row-major [position, head_dim]);
// the tile loop reads each K/V row once per group from memory and then from L1.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "kernels/attention.h"
#include "kernels/attention_internal.h"

namespace olep {
namespace kernels {
namespace simd {

template <class V>
inline typename V::vf tanh_v(typename V::vf y) {
  // tanh(y) = sign(y) * (1 - e) / (1 + e), e = exp(-2|y|) <= 1 (no overflow).
  const typename V::vf ay = V::abs(y);
  const typename V::vf e = V::exp(V::mul(ay, V::set1(-2.0f)));
  const typename V::vf one = V::set1(1.0f);
  const typename V::vf t = V::div(V::sub(one, e), V::add(one, e));
  return V::copysign(t, y);
}

// Converts n rows of `cols` elements (storage type t) to float rows; rows n..W-1 are zero.
template <class V>
inline void load_tile(DType t, const void* src, int64_t n, int64_t cols, float* dst) {
  constexpr int W = V::W;
  if (t == DType::kFloat32) {
    std::memcpy(dst, src, static_cast<size_t>(n * cols) * sizeof(float));
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (int64_t e = 0; e < n * cols; e += W)
      V::store(dst + e, t == DType::kFloat16 ? V::load_f16(s + e) : V::load_bf16(s + e));
  }
  if (n < W) std::memset(dst + n * cols, 0, static_cast<size_t>((W - n) * cols) * sizeof(float));
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

// acc[0..NV*W) = acc * c + sum_{t<n} p[t] * v[t][0..NV*W); NV fixed so the
// accumulators stay in registers.
template <class V, class L, int NV>
inline void pv_chunk(float* acc, const typename L::elem* v, const float* p, int64_t n, int64_t v_stride, float c) {
  using vf = typename V::vf;
  constexpr int W = V::W;
  vf o[NV];
  const vf cv = V::set1(c);
#pragma GCC unroll 8
  for (int u = 0; u < NV; ++u) o[u] = V::mul(V::load(acc + u * W), cv);
  for (int64_t t = 0; t < n; ++t) {
    const vf pv = V::set1(p[t]);
    const typename L::elem* vr = v + t * v_stride;
#pragma GCC unroll 8
    for (int u = 0; u < NV; ++u) o[u] = V::fma(pv, L::load(vr + u * W), o[u]);
  }
#pragma GCC unroll 8
  for (int u = 0; u < NV; ++u) V::store(acc + u * W, o[u]);
}

// One output row: Dv (a multiple of W) in register-resident chunks of 8, 4, 2, 1 vectors.
template <class V, class L>
inline void pv_row(float* acc, const typename L::elem* v, const float* p, int64_t n, int64_t Dv, float c) {
  constexpr int W = V::W;
  int64_t d = 0;
  for (; d + 8 * W <= Dv; d += 8 * W) pv_chunk<V, L, 8>(acc + d, v + d, p, n, Dv, c);
  if (d + 4 * W <= Dv) { pv_chunk<V, L, 4>(acc + d, v + d, p, n, Dv, c); d += 4 * W; }
  if (d + 2 * W <= Dv) { pv_chunk<V, L, 2>(acc + d, v + d, p, n, Dv, c); d += 2 * W; }
  if (d + W <= Dv) pv_chunk<V, L, 1>(acc + d, v + d, p, n, Dv, c);
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

  const bool capped = a.softcap > 0.0f;
  const float qscale = capped ? 1.0f : a.scale;
  for (int64_t h = 0; h < G; ++h)
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
  int64_t kmin = a.num_keys, kmax = 0;
  for (int64_t i = 0; i < valid; ++i) {
    int64_t lo, hi;
    detail::visible_range(a, i, &lo, &hi);
    kmin = std::min(kmin, lo);
    kmax = std::max(kmax, hi);
  }
  kmin = std::max(kmin, key_begin);
  kmax = std::min(kmax, std::min(key_end, a.num_keys));
  if (kmin >= kmax) return;

  const float lowest = detail::lowest_of(a.mask.dtype);
  const size_t es = dtype_size(a.dtype);
  const MaskView& mk = a.mask;

  for (int64_t blk = 0; blk < a.num_blocks; ++blk) {
    const KVBlock& kb = a.blocks[blk];
    const int64_t b0 = std::max(kmin, kb.first_position);
    const int64_t b1 = std::min(kmax, kb.first_position + kb.num_rows);
    for (int64_t j0 = b0; j0 < b1; j0 += W) {
      const int64_t n = std::min<int64_t>(W, b1 - j0);
      const char* krows = static_cast<const char*>(kb.key) + static_cast<size_t>((j0 - kb.first_position) * D) * es;
      const char* vrows = static_cast<const char*>(kb.value) + static_cast<size_t>((j0 - kb.first_position) * Dv) * es;
      const KE* kp;
      const KE* vp;
      if constexpr (kTiles) {
        load_tile<V>(a.dtype, krows, n, D, ktile);
        load_tile<V>(a.dtype, vrows, n, Dv, vtile);
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

      // ---- scores and online softmax, row by row ----
      bool any = false;
      bool first_row = true;
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
          if (!live) {
            corr[r] = 1.0f;
            std::memset(prow, 0, sizeof(float) * W);
            continue;
          }
          // W dot products.
          vf acc[W];
          for (int t = 0; t < W; ++t) acc[t] = V::zero();
          const float* q = qf + r * D;
          if (first_row) {
            // The first row of a tile walks K row by row: sequential addresses, which the
            // hardware prefetchers follow, so the tile streams in from DRAM while we compute
            // (walking it column-wise first measured 1.6x slower for MHA decode).
#pragma GCC unroll 16
            for (int t = 0; t < W; ++t) {
              const KE* kr = kp + t * D;
              vf a0 = V::mul(V::load(q), KL::load(kr));
              vf a1 = V::zero();
              int64_t d = W;
              for (; d + W < D; d += 2 * W) {
                a1 = V::fma(V::load(q + d), KL::load(kr + d), a1);
                a0 = V::fma(V::load(q + d + W), KL::load(kr + d + W), a0);
              }
              if (d < D) a1 = V::fma(V::load(q + d), KL::load(kr + d), a1);
              acc[t] = V::add(a0, a1);
            }
            first_row = false;
          } else {
            // Later rows find the tile in L1: column-wise needs one q load per W keys.
            for (int64_t d = 0; d < D; d += W) {
              const vf qv = V::load(q + d);
#pragma GCC unroll 16
              for (int t = 0; t < W; ++t) acc[t] = V::fma(qv, KL::load(kp + t * D + d), acc[t]);
            }
          }
          vf s = V::transpose_reduce(acc);
          if (capped) {
            const vf x = V::mul(s, V::set1(a.scale));
            s = V::mul(V::set1(a.softcap), tanh_v<V>(V::mul(x, V::set1(1.0f / a.softcap))));
          }
          s = V::add(s, bias);
          if (V::nan_bits(s) & live) {  // NaN in q, k or the mask: the row's result is NaN (ONNX Attention)
            st->l[r] = NAN;
            corr[r] = 1.0f;
            std::memset(prow, 0, sizeof(float) * W);
            continue;
          }
          s = V::select(live, s, V::set1(-INFINITY));
          const float tmax = V::reduce_max(s);
          if (!(tmax > -INFINITY)) {
            corr[r] = 1.0f;
            std::memset(prow, 0, sizeof(float) * W);
            continue;
          }
          const float m_old = st->m[r];
          const float m_new = std::max(m_old, tmax);
          const float c = std::exp(m_old - m_new);
          vf p = V::exp(V::sub(s, V::set1(m_new)));
          p = V::select(live, p, V::zero());
          st->l[r] = st->l[r] * c + V::reduce_add(p);
          st->m[r] = m_new;
          corr[r] = c;
          V::store(prow, p);
          any = true;
        }
      }
      if (!any) continue;

      // ---- weighted V accumulation, rescale fused ----
      for (int64_t i = 0; i < valid; ++i)
        for (int64_t h = 0; h < G; ++h) {
          const int64_t r = h * S + i;
          pv_row<V, KL>(st->acc + r * Dv, vp, ptile + r * W, n, Dv, corr[r]);
        }
    }
  }
}

// Group rows (query heads sharing the kv head x query rows) from which converting a
// float16/bfloat16 tile once beats converting on every load (measured on Zen 4, D=128:
// inline wins at 1, 4 and 8 rows, the tile at 32).
constexpr int64_t kConvertTileRows = 16;

template <class V>
void attend_range(const AttentionGroup& a, int64_t key_begin, int64_t key_end, AttentionState* st, float* scratch) {
  constexpr int W = V::W;
  if (a.head_dim % W != 0 || a.v_head_dim % W != 0) {
    attend_range_scalar(a, key_begin, key_end, st, scratch);
    return;
  }
  const bool tiles = a.group_size * std::min(a.num_valid_rows, a.num_rows) >= kConvertTileRows;
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
