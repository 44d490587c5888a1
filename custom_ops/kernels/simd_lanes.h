// The lanes path: W query rows in the lanes of a vector (internal). See attention_simd.h.
#pragma once

#include "kernels/simd_pv.h"

namespace olep {
namespace kernels {
namespace simd {

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

// Scratch: scratch_floats() in attention_common.cc covers the layout below.
template <class V>
void attend_lanes(const AttentionGroup& a, int64_t key_begin, int64_t key_end, AttentionState* st, float* scratch,
                  KVEncoding enc = KVEncoding::kNative, bool fixed = false) {
  using vf = typename V::vf;
  constexpr int W = V::W;
  constexpr int TK = kLaneTileKeys;     // keys per tile
  constexpr int KB = 8;                 // keys per block of score registers
  constexpr int RB = W >= 16 ? 4 : 2;   // output rows per P.V register block (32 vs 16 registers)
  constexpr int64_t kDotBlock = kScoreBlock;
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
  float* qt8 = corr + Rp;          // [D, Rp] int8 blocks, fixed: sq * q16 per row (int8_query)
  float* lbias = qt8 + D * Rp;     // [Rp] int4 blocks, fixed: the K minimums' part of each score

  const bool capped = a.softcap > 0.0f;
  const float qscale = capped ? 1.0f : a.scale;
  // bfloat16 on levels with VDPBF16PS (head_dim even): qt holds raw bf16 pairs instead,
  // qt2[i][r] = (q[r][2i], q[r][2i+1]) in one 32-bit lane, unscaled, and each score vector is
  // one dot_bf16 per pair of K elements (broadcast as one 32-bit value from the raw K row).
  constexpr bool kDotLevel = V::kBf16Dot;
  const bool dot = kDotLevel && enc == KVEncoding::kNative && a.dtype == DType::kBFloat16 && D % 2 == 0;
  uint32_t* qt2 = reinterpret_cast<uint32_t*>(qt);  // [D / 2, Rp] when dot
  std::fill(qt, qt + D * Rp, 0.0f);
  if (fixed) {
    std::fill(qt8, qt8 + D * Rp, 0.0f);
    std::fill(lbias, lbias + Rp, 0.0f);
  }
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
  const size_t es = stored_elem_bytes(a.dtype, enc);
  const vf neg_inf = V::set1(-INFINITY);
  TilePrefetch pf;
  // pf.step() calls per tile: every other score-loop iteration, then one per key per P.V call
  const int64_t lane_steps = nblocks * (TK / KB) * (D / 2) + (G * valid / RB) * pv_passes<W, RB>(Dv) * TK +
                             (G * valid % RB) * pv_passes<W, 1>(Dv) * TK;

  int64_t scaled_blk = -1;  // fixed: the block whose K scales qt8 holds
  const float* qsrc = fixed ? qt8 : qt;
  for (TileCursor tc{a, kmin, kmax, TK, es}; tc.next();) {
    const int64_t j0 = tc.j0, n = tc.n;
    if (fixed && tc.blk != scaled_blk) {
      const float* ks = a.blocks[tc.blk].key_scale;
      float* row = ktile;                                  // free until this tile's K conversion
      int16_t* t = reinterpret_cast<int16_t*>(row + D);  // ktile holds TK * D floats
      for (int64_t r = 0; r < R; ++r) {
        if (r % S >= valid) continue;
        for (int64_t d = 0; d < D; ++d) row[d] = qt[d * Rp + r];
        const float sq = detail::int8_query(row, ks, D, t);
        for (int64_t d = 0; d < D; ++d) qt8[d * Rp + r] = sq * static_cast<float>(t[d]);
        lbias[r] = enc == KVEncoding::kInt4 ? detail::int4_bias(row, a.blocks[tc.blk].key_min, D) : 0.0f;
      }
      scaled_blk = tc.blk;
    }
    const char* krows = tc.krows;
    const char* vrows = tc.vrows;
    pf.reset_next(tc, D * es, Dv * es, lane_steps);  // spread over this tile's loops
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
    } else if (a.dtype == DType::kFloat32 && enc == KVEncoding::kNative && n == TK) {
      kp = reinterpret_cast<const float*>(krows);
    } else {  // convert (dequantize), or pad a partial tile with zeros (K rows >= n must not be read)
      convert_k_tile<V>(a, tc, n, TK, ktile, fixed);
      kp = ktile;
    }
    if (a.dtype == DType::kFloat32 && enc == KVEncoding::kNative) {
      vp = reinterpret_cast<const float*>(vrows);  // only rows < n are read
    } else {
      convert_v_tile<V>(a, tc, n, n, vtile);
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
            vf tot[KB];
            const uint16_t* kr = kraw + k0 * D;
            const float* qc = reinterpret_cast<const float*>(qt2 + rb);
            for (int64_t d0 = 0; d0 < D; d0 += kDotBlock) {  // partial sums per block (accuracy)
              vf acc[KB];
#pragma GCC unroll 8
              for (int u = 0; u < KB; ++u) acc[u] = V::zero();
              const int64_t d1 = std::min<int64_t>(D, d0 + kDotBlock);
              for (int64_t d = d0; d < d1; d += 2) {
                pf.step();  // the float loop below steps every other d: same count
                const vf qv = V::load(qc + d / 2 * Rp);
#pragma GCC unroll 8
                for (int u = 0; u < KB; ++u) acc[u] = V::dot_bf16(acc[u], qv, V::set1_pair(kr + u * D + d));
              }
#pragma GCC unroll 8
              for (int u = 0; u < KB; ++u) tot[u] = d0 == 0 ? acc[u] : V::add(tot[u], acc[u]);
            }
#pragma GCC unroll 8
            for (int u = 0; u < KB; ++u) V::store(ptile + (k0 + u) * Rp + rb, V::mul(tot[u], sc));
          }
        }
      }
      for (int k0 = 0; k0 < TK && !dot; k0 += KB) {
        const float* kr = kp + k0 * D;
        const float* qc = qsrc + rb;
        float* out = ptile + k0 * Rp + rb;
        // Partial sums over blocks of kDotBlock elements, added up in ptile: one chain over the
        // whole head_dim loses ~2x the accuracy (see kDotBlock).
        for (int64_t d0 = 0; d0 < D; d0 += kDotBlock) {
          vf acc[KB];
#pragma GCC unroll 8
          for (int u = 0; u < KB; ++u) acc[u] = V::zero();
          const int64_t d1 = std::min<int64_t>(D, d0 + kDotBlock);
          for (int64_t d = d0; d < d1; ++d) {
            if ((d & 1) == 0) pf.step();
            const vf qv = V::load(qc + d * Rp);
#pragma GCC unroll 8
            for (int u = 0; u < KB; ++u) acc[u] = V::fma(qv, V::set1(kr[u * D + d]), acc[u]);
          }
          if (d0 == 0 && fixed && enc == KVEncoding::kInt4) {
            const vf lb = V::load(lbias + rb);
#pragma GCC unroll 8
            for (int u = 0; u < KB; ++u) acc[u] = V::add(acc[u], lb);
          }
#pragma GCC unroll 8
          for (int u = 0; u < KB; ++u)
            V::store(out + u * Rp, d0 == 0 ? acc[u] : V::add(V::load(out + u * Rp), acc[u]));
        }
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

}  // namespace simd
}  // namespace kernels
}  // namespace olep
