// The row path's pieces for int8 / int4 pages read as codes (internal; simd_rows.h): the
// fixed-point q per block, the P.V weights in 16-bit fixed point. See attention_simd.h.
#pragma once

#include "kernels/simd_pv.h"
#include "kernels/simd_quant4.h"

namespace olep {
namespace kernels {
namespace simd {
namespace {  // internal linkage: each ISA translation unit its own copy (attention_simd.h)

// Calls of pv_block_i16 (int8) / pv_block_i4 (int4) that one row's P.V of a tile makes
// (pv_rows_i16<V, 1> / pv_rows_i4<V, 1>): each steps the prefetcher once per V row pair.
// pv_rows_i16 splits Dv as pv_rows does (pv_passes).
template <int W, bool kCodes4>
constexpr int64_t codes_pv_calls(int64_t Dv) {
  if (kCodes4) {
    const int64_t loads = Dv / (2 * W);
    return loads / 4 + loads % 4;
  }
  return pv_passes<W, 1>(Dv);
}

// A row's P.V weights of one tile (ptile: W lanes, >= 0 or -0 for unseen keys, lanes past the
// tile's keys unseen) in 16-bit fixed point, laid out as the V row pairs: w[par + t] = weight of
// key t (w[0] = 0 when the tile starts at an odd page row, par = 1), 2 W + 2 entries; the largest
// maps to 32767, and weight = w * ws * wpre (a max below 2^-100 is first scaled by 2^100 exactly,
// p * pre before * 32767 / m, which would overflow float32 there; wpre = 1 / pre applied last).
template <class V>
OLEP_HOT void round_weights(const float* ptile, int64_t par, int16_t* w, float* ws, float* wpre) {
  constexpr int W = V::W;
  w[0] = w[W] = w[W + 1] = 0;
  const typename V::vf p = V::load(ptile);
  float m = V::reduce_max(p);
  const float pre = m < 0x1p-100f ? 0x1p100f : 1.0f;
  m *= pre;
  V::round_i16(w + par, V::mul(V::mul(p, V::set1(pre)), V::set1(m > 0.0f ? 32767.0f / m : 0.0f)));
  *ws = m / 32767.0f;
  *wpre = 1.0f / pre;
}

// Most rows (group_size x valid query rows) the int8 fixed-point row path takes (its per-tile
// weight buffers are sized for them; attend_run sends more rows to the tiled path).
constexpr int kCodesMaxRows = 15;

// int8 K codes read as codes: row r of q (qf, scaled) times the block's K scales `ks`, rounded
// to int16 relative to its largest element (q16 [R, D], qsc[r] = its scale; fixed_query_row),
// for the rows (h, i) of the group; `t` holds D floats of scratch. int32 sums of D products of
// |q16| <= qmax and |code| <= 127 stay below 2^31.
template <class V>
OLEP_HOT void codes_query_i8(const AttentionGroup& a, const float* ks, const float* qf, int16_t* q16, float* qsc,
                             float* t) {
  const int64_t G = a.group_size, S = a.num_rows, D = a.head_dim, valid = std::min(a.num_valid_rows, S);
  for (int64_t h = 0; h < G; ++h)
    for (int64_t i = 0; i < valid; ++i) {
      const int64_t r = h * S + i;
      qsc[r] = fixed_query_row<V>(qf + r * D, ks, D, q16 + r * D, t);
    }
}

// int4 K codes read as codes: as codes_query_i8 (fixed_query_row), q16 permuted to the
// unpacked K order (int4_permute_q), plus qbias[r] (int4_query_bias). `t`: 1.5 D floats of
// scratch. (Once per row and page; as scalar code, detail::int8_query and int4_bias, it took
// ~1500 cycles per row and 256-key page: Zen 4, 8K keys, int4 / fp16 time 0.94 -> 0.81 for GQA
// 32/8 and 0.64 -> 0.59 for MHA when made SIMD.)
template <class V>
OLEP_HOT void codes_query_i4(const AttentionGroup& a, const KVBlock& kb, const float* qf, int16_t* q16, float* qsc,
                             float* qbias, float* t) {
  constexpr int W = V::W;
  const int64_t G = a.group_size, S = a.num_rows, D = a.head_dim, valid = std::min(a.num_valid_rows, S);
  int16_t* natural = reinterpret_cast<int16_t*>(t + D);  // q16 in channel order
  for (int64_t h = 0; h < G; ++h)
    for (int64_t i = 0; i < valid; ++i) {
      const int64_t r = h * S + i;
      const float* q = qf + r * D;
      qsc[r] = fixed_query_row<V>(q, kb.key_scale, D, natural, t);
      int4_permute_q<W>(natural, D, q16 + r * D);
      qbias[r] = int4_query_bias<V>(q, kb.key_min, D);
    }
}

// Quantized blocks converted to float tiles: the same fixed-point q as float, qs[r * D + d] =
// sq * q16 (fixed_query_row), and qbias[r] (int4: int4_query_bias, else 0). `t`: 1.5 D floats.
template <class V>
OLEP_HOT void fixed_query_float(const AttentionGroup& a, const KVBlock& kb, bool int4, const float* qf, float* qs,
                                float* qbias, float* t) {
  constexpr int W = V::W;
  const int64_t G = a.group_size, S = a.num_rows, D = a.head_dim, valid = std::min(a.num_valid_rows, S);
  int16_t* q16 = reinterpret_cast<int16_t*>(t + D);
  for (int64_t h = 0; h < G; ++h)
    for (int64_t i = 0; i < valid; ++i) {
      const int64_t r = h * S + i;
      const float sq = fixed_query_row<V>(qf + r * D, kb.key_scale, D, q16, t);
      for (int64_t d = 0; d < D; d += W) V::store(qs + r * D + d, V::mul(V::set1(sq), V::load_i16(q16 + d)));
      qbias[r] = int4 ? int4_query_bias<V>(qf + r * D, kb.key_min, D) : 0.0f;
    }
}


// P.V of one tile for the rows of the group, V read as int8 (or int4, kCodes4) codes: each
// row's weights p * value_scale (ptile, row r at r * W) in 16-bit fixed point, laid out as the
// V row pairs (a tile starting at an odd page row begins with a zero weight for the row
// before), then pv_rows_i16 / pv_rows_i4; corr[r] rescales row r's accumulator, vbias[r]
// (int4) is its P.V term from the V minimums. pw: [rows, 2 * W + 2] int16 of scratch; vrows,
// par, n: the tile's V row pair, its first key's place in it and its keys (TileCursor).
template <class V, bool kCodes4>
OLEP_HOT void pv_codes_tile(const AttentionGroup& a, const float* ptile, const float* corr, const float* vbias,
                            int16_t* pw, float* st_acc, const char* vrows, int64_t par, int64_t n, TilePrefetch* pf) {
  constexpr int W = V::W;
  const int64_t G = a.group_size, S = a.num_rows, Dv = a.v_head_dim, valid = std::min(a.num_valid_rows, S);
  const int64_t npairs = (par + n + 1) / 2;
  constexpr int64_t kStride = 2 * W + 2;
  float wscale[kCodesMaxRows], wpre[kCodesMaxRows], cs[kCodesMaxRows], vb[kCodesMaxRows];
  float* accp[kCodesMaxRows];
  const int16_t* wp[kCodesMaxRows];
  int nrows = 0;  // rows in (query row, head) order, as the score loops take them
  for (int64_t i = 0; i < valid; ++i)
    for (int64_t h = 0; h < G; ++h, ++nrows) {
      const int64_t r = h * S + i;
      int16_t* w = pw + nrows * kStride;
      round_weights<V>(ptile + r * W, par, w, wscale + nrows, wpre + nrows);
      cs[nrows] = corr[r];
      vb[nrows] = kCodes4 ? vbias[r] : 0.0f;
      accp[nrows] = st_acc + r * Dv;
      wp[nrows] = w;
    }
  int k = 0;
  if constexpr (kCodes4) {
    const uint8_t* pairs4 = reinterpret_cast<const uint8_t*>(vrows);
    for (; k + 2 <= nrows; k += 2)
      pv_rows_i4<V, 2>(accp + k, wp + k, wscale + k, wpre + k, cs + k, vb + k, pairs4, Dv, npairs, pf);
    if (k < nrows) pv_rows_i4<V, 1>(accp + k, wp + k, wscale + k, wpre + k, cs + k, vb + k, pairs4, Dv, npairs, pf);
    k = nrows;
  }
  const int8_t* pairs = reinterpret_cast<const int8_t*>(vrows);
  // 4 rows per V load where the registers allow (16 sums + 4 V vectors), else 2, then 1
  if constexpr (W >= 16)
    for (; k + 4 <= nrows; k += 4)
      pv_rows_i16<V, 4>(accp + k, wp + k, wscale + k, wpre + k, cs + k, pairs, Dv, npairs, pf);
  for (; k + 2 <= nrows; k += 2)
    pv_rows_i16<V, 2>(accp + k, wp + k, wscale + k, wpre + k, cs + k, pairs, Dv, npairs, pf);
  if (k < nrows) pv_rows_i16<V, 1>(accp + k, wp + k, wscale + k, wpre + k, cs + k, pairs, Dv, npairs, pf);
}

}  // namespace
}  // namespace simd
}  // namespace kernels
}  // namespace olep
