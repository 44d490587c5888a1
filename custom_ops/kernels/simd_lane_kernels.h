// The lanes path's micro-kernels (internal; simd_lanes.h): the score kernels (K tile x Q^T,
// register-blocked rows x keys) and the P.V kernels (P x V tile), with their block-size rules
// and step counts. See the overview in simd_lanes.h.
#pragma once

#include "kernels/simd_pv.h"

namespace olep {
namespace kernels {
namespace simd {
namespace {  // internal linkage: each ISA translation unit its own copy (attention_simd.h)

// Score micro-kernels: MR row vectors (W query rows each) x NK keys of one tile, all in
// registers, over head_dim: per element d, MR q loads and NK broadcast K elements feed MR x NK
// FMAs (each K element serves MR vectors of rows, each q vector NK keys). The K rows of the tile
// are at kr + u * D (DC > 0: head_dim as a compile-time constant, so that the NK row addresses
// are one pointer plus constant displacements; 0: D at run time). q . k in partial sums over
// blocks of kLaneScoreBlock elements (accuracy, attention_internal.h), added up in the score tile:
// out[m] + u * Rp holds key u's scores of row vector m. One prefetch step per block.
// lb (int4 blocks, fixed point): the K minimums' part of each score, per row vector, or null.
// head_dim elements per partial sum of the lanes path: detail::kScoreBlock (16), as the scalar
// level. (32 runs the AVX-512 score kernel ~20% faster from L1 here, but SmolLM2's prefill logits
// then differ from plain ORT's by 1.5e-4, past the fp32 compare tolerance; 16: 7e-5.)
constexpr int64_t kLaneScoreBlock = detail::kScoreBlock;

// Whether a score micro-kernel of MR row vectors x NK keys keeps the running totals of its
// kLaneScoreBlock partial sums in registers: the MR x NK block sums, as many totals, the MR q
// vectors and a broadcast fit (lane_score_keys picks NK so at 32 registers); else the totals live
// in the score tile. The same additions in the same order either way: total = b0 (+ bias), then
// total + b1, ...
template <class V, int MR, int NK>
constexpr bool lane_register_totals() {
  return 2 * MR * NK + MR + 1 <= V::kRegs;
}

template <class V, int MR, int NK, int64_t DC, class PF>
OLEP_HOT void lane_scores(const float* const* qc, int64_t Rp, const float* kr, int64_t Drt, float* const* out,
                          const float* const* lb, PF* pf) {
  using vf = typename V::vf;
  const int64_t D = DC > 0 ? DC : Drt;
  constexpr bool kRegTotals = lane_register_totals<V, MR, NK>();
  vf tot[kRegTotals ? MR : 1][kRegTotals ? NK : 1];
#pragma GCC unroll 4
  for (int m = 0; m < (kRegTotals ? MR : 1); ++m)
#pragma GCC unroll 16
    for (int u = 0; u < (kRegTotals ? NK : 1); ++u) tot[m][u] = V::zero();  // D = 0
  for (int64_t d0 = 0; d0 < D; d0 += kLaneScoreBlock) {
    vf acc[MR][NK];
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 16
      for (int u = 0; u < NK; ++u) acc[m][u] = V::zero();
    const int64_t d1 = std::min<int64_t>(D, d0 + kLaneScoreBlock);
#pragma GCC unroll 4
    for (int64_t d = d0; d < d1; ++d) {
      vf qv[MR];
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) qv[m] = V::load(qc[m] + d * Rp);
#pragma GCC unroll 16
      for (int u = 0; u < NK; ++u) {
        const vf kb = V::set1(kr[u * D + d]);
#pragma GCC unroll 4
        for (int m = 0; m < MR; ++m) acc[m][u] = V::fma(qv[m], kb, acc[m][u]);
      }
    }
    pf->step();
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      if (d0 == 0 && lb) {
        const vf b = V::load(lb[m]);
#pragma GCC unroll 16
        for (int u = 0; u < NK; ++u) acc[m][u] = V::add(acc[m][u], b);
      }
#pragma GCC unroll 16
      for (int u = 0; u < NK; ++u) {
        if constexpr (kRegTotals) tot[m][u] = d0 == 0 ? acc[m][u] : V::add(tot[m][u], acc[m][u]);
        else V::store(out[m] + u * Rp, d0 == 0 ? acc[m][u] : V::add(V::load(out[m] + u * Rp), acc[m][u]));
      }
    }
  }
  if constexpr (kRegTotals) {
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 16
      for (int u = 0; u < NK; ++u) V::store(out[m] + u * Rp, tot[m][u]);
  }
}

// The same for raw bfloat16 q and K on levels with VDPBF16PS: qc[m] + i * Rp holds the q pairs
// (2i, 2i + 1) of row vector m as 32-bit lanes, K pairs are broadcast as one 32-bit value, and the
// finished scores are multiplied by sc.
template <class V, int MR, int NK, int64_t DC, class PF>
OLEP_HOT void lane_scores_bf16(const float* const* qc, int64_t Rp, const uint16_t* kr, int64_t Drt,
                               float* const* out, typename V::vf sc, PF* pf) {
  using vf = typename V::vf;
  const int64_t D = DC > 0 ? DC : Drt;
  constexpr bool kRegTotals = lane_register_totals<V, MR, NK>();
  vf tot[kRegTotals ? MR : 1][kRegTotals ? NK : 1];
#pragma GCC unroll 4
  for (int m = 0; m < (kRegTotals ? MR : 1); ++m)
#pragma GCC unroll 16
    for (int u = 0; u < (kRegTotals ? NK : 1); ++u) tot[m][u] = V::zero();  // D = 0
  for (int64_t d0 = 0; d0 < D; d0 += kLaneScoreBlock) {
    vf acc[MR][NK];
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 16
      for (int u = 0; u < NK; ++u) acc[m][u] = V::zero();
    const int64_t d1 = std::min<int64_t>(D, d0 + kLaneScoreBlock);
#pragma GCC unroll 4
    for (int64_t d = d0; d < d1; d += 2) {
      vf qv[MR];
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) qv[m] = V::load(qc[m] + d / 2 * Rp);
#pragma GCC unroll 16
      for (int u = 0; u < NK; ++u) {
        const vf kb = V::set1_pair(kr + u * D + d);
#pragma GCC unroll 4
        for (int m = 0; m < MR; ++m) acc[m][u] = V::dot_bf16(acc[m][u], qv[m], kb);
      }
    }
    pf->step();
    const bool last = d1 == D;
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 16
      for (int u = 0; u < NK; ++u) {
        if constexpr (kRegTotals) {
          vf x = d0 == 0 ? acc[m][u] : V::add(tot[m][u], acc[m][u]);
          tot[m][u] = last ? V::mul(x, sc) : x;
        } else {
          vf x = d0 == 0 ? acc[m][u] : V::add(V::load(out[m] + u * Rp), acc[m][u]);
          if (last) x = V::mul(x, sc);
          V::store(out[m] + u * Rp, x);
        }
      }
  }
  if constexpr (kRegTotals) {
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 16
      for (int u = 0; u < NK; ++u) V::store(out[m] + u * Rp, tot[m][u]);
  }
}

// Keys per score micro-kernel call for pairs of row vectors: 4 (single row vectors take 8).
// With 32 vector registers the 8 block sums and 8 totals stay in registers: on Zen 4 2 x 4
// measured 0.89-0.94x the time of 2 x 8 with the totals in the score tile (prefill blocks of 64
// rows, MQA 32/1 fp32 / fp16 / bf16, in cache). With 16 registers the totals stay in the tile:
// 2 x 2 with register totals measured 1.10-1.17x the time of 2 x 4 (Zen 4, AVX2 level).
template <class V>
constexpr int lane_score_keys() {
  return 4;
}

// Row vectors per score micro-kernel call while `left` row vectors remain: 3 at 16 registers
// (3 x 4 sums, 3 q vectors and a broadcast fill them; 7 loads per 12 FMAs against 2 x 4's 6 per
// 8) unless that would leave a lone row vector (4 left: 2 + 2); 2 otherwise; 1 for the last.
// The same sums either way (each score is one accumulator's). Zen 4 at the AVX2 level, a 64-row
// causal prefill block over 512 keys in cache (tools/cpp/bench_lanes_attention f32 512 1 64 128
// 200 256, hot, 3 runs, min): 0.209 ms with pairs, 0.198-0.200 with 3 + 3 + 2.
template <class V>
constexpr int lane_score_rows(int64_t left) {
  if (left >= 3 && V::kRegs <= 16 && left != 4) return 3;
  return left >= 2 ? 2 : static_cast<int>(left);
}

// pf.step() calls of lane_tile_scores for nb row vectors, tk keys and dblocks head_dim blocks.
template <class V>
constexpr int64_t lane_score_steps(int64_t nb, int64_t tk, int64_t dblocks) {
  int64_t steps = 0;
  for (int64_t left = nb; left > 0;) {
    const int m = lane_score_rows<V>(left);
    steps += (m == 1 ? tk / 8 : tk / lane_score_keys<V>()) * dblocks;
    left -= m;
  }
  return steps;
}

// The scores of the row vectors blk[0..nb) (row block indices, any order) for the first nk keys
// (nk: a multiple of 8, at most TK) of a tile (keys past its n padded with zero K rows): groups of
// lane_score_rows row vectors.
template <class V, int64_t DC, class PF>
OLEP_HOT void lane_tile_scores(const int64_t* blk, int64_t nb, const float* qsrc, const float* lbias, bool add_bias,
                               int64_t Rp, const float* kp, const uint16_t* kraw, typename V::vf sc, int64_t D,
                               float* ptile, int nk, PF* pf) {
  constexpr int W = V::W, NK = lane_score_keys<V>(), NK1 = 8;
  int64_t i = 0;
  if constexpr (!V::kBf16Dot) {
    for (; lane_score_rows<V>(nb - i) == 3; i += 3) {
      const float* qc[3] = {qsrc + blk[i] * W, qsrc + blk[i + 1] * W, qsrc + blk[i + 2] * W};
      const float* lb[3] = {lbias + blk[i] * W, lbias + blk[i + 1] * W, lbias + blk[i + 2] * W};
      for (int k0 = 0; k0 < nk; k0 += NK) {
        float* out[3] = {ptile + k0 * Rp + blk[i] * W, ptile + k0 * Rp + blk[i + 1] * W,
                         ptile + k0 * Rp + blk[i + 2] * W};
        lane_scores<V, 3, NK, DC>(qc, Rp, kp + k0 * D, D, out, add_bias ? lb : nullptr, pf);
      }
    }
  }
  for (; i + 2 <= nb; i += 2) {
    const float* qc[2] = {qsrc + blk[i] * W, qsrc + blk[i + 1] * W};
    const float* lb[2] = {lbias + blk[i] * W, lbias + blk[i + 1] * W};
    for (int k0 = 0; k0 < nk; k0 += NK) {
      float* out[2] = {ptile + k0 * Rp + blk[i] * W, ptile + k0 * Rp + blk[i + 1] * W};
      if constexpr (V::kBf16Dot) {
        if (kraw) {
          lane_scores_bf16<V, 2, NK, DC>(qc, Rp, kraw + k0 * D, D, out, sc, pf);
          continue;
        }
      }
      lane_scores<V, 2, NK, DC>(qc, Rp, kp + k0 * D, D, out, add_bias ? lb : nullptr, pf);
    }
  }
  if (i < nb) {
    const float* qc[1] = {qsrc + blk[i] * W};
    const float* lb[1] = {lbias + blk[i] * W};
    for (int k0 = 0; k0 < nk; k0 += NK1) {
      float* out[1] = {ptile + k0 * Rp + blk[i] * W};
      if constexpr (V::kBf16Dot) {
        if (kraw) {
          lane_scores_bf16<V, 1, NK1, DC>(qc, Rp, kraw + k0 * D, D, out, sc, pf);
          continue;
        }
      }
      lane_scores<V, 1, NK1, DC>(qc, Rp, kp + k0 * D, D, out, add_bias ? lb : nullptr, pf);
    }
  }
}

// P.V micro-kernel of the lanes path: RB consecutive output rows x NU vectors of v_head_dim in
// registers, o = o * c[rr] + sum_t p(t, rr) v[t] over the tile's n keys; row rr's accumulators at
// acc + rr * Dv, its probabilities p(t, rr) = p[t * Rp + rr] (rows in lanes: one pointer, constant
// offsets), its rescale factor c[rr]. Per key: RB broadcasts and NU V vector loads feed RB x NU
// FMAs. One prefetch step per 8 keys. kSkipZero: skip the kUnseen pairs (see pv_block, simd_pv.h).
template <class V, int RB, int NU, bool kSkipZero, class PF>
OLEP_HOT void lane_pv(float* acc, int64_t Dv, const float* p, int64_t Rp, const float* v, int64_t n, const float* c,
                      PF* pf) {
  using vf = typename V::vf;
  constexpr int W = V::W;
  vf o[RB][NU];
#pragma GCC unroll 8
  for (int rr = 0; rr < RB; ++rr) {
    const vf cr = V::set1(c[rr]);
#pragma GCC unroll 8
    for (int u = 0; u < NU; ++u) o[rr][u] = V::mul(V::load(acc + rr * Dv + u * W), cr);
  }
  for (int64_t t0 = 0; t0 < n; t0 += 8) {
    pf->step();
    const int64_t t1 = std::min<int64_t>(n, t0 + 8);
    for (int64_t t = t0; t < t1; ++t) {
      vf vv[NU];
#pragma GCC unroll 8
      for (int u = 0; u < NU; ++u) vv[u] = V::load(v + t * Dv + u * W);
#pragma GCC unroll 8
      for (int rr = 0; rr < RB; ++rr) {
        const float pt = p[t * Rp + rr];
        if (kSkipZero && pt == 0.0f && std::signbit(pt)) continue;  // kUnseen
        const vf pb = V::set1(pt);
#pragma GCC unroll 8
        for (int u = 0; u < NU; ++u) o[rr][u] = V::fma(pb, vv[u], o[rr][u]);
      }
    }
  }
#pragma GCC unroll 8
  for (int rr = 0; rr < RB; ++rr)
#pragma GCC unroll 8
    for (int u = 0; u < NU; ++u) V::store(acc + rr * Dv + u * W, o[rr][u]);
}

// Rows of a P.V register block: 8 at 32 vector registers (x 3 vectors, lane_pv_vectors), 6 at 16
// (x 2: 12 accumulators, 2 V vectors, 1 broadcast). Measured from L1 on a Xeon: AVX-512 8 x 2
// 95 GFMA/s, 4 x 4 82; AVX2 4 x 2 52, 2 x 4 44; on Zen 3 (AVX2, 32 KiB L1) 4 x 2 47, 6 x 2 45 from
// L1, but in the kernel 6 x 2 reads each V tile from L2 a third fewer times (MQA 32/1 fp32/fp16/
// bf16, 4K keys, tools/bench_lanes_kernel.py setting, alternating builds: 0.85-0.89x the median
// time; prefill 512 rows 0.82-0.88x).
template <class V>
constexpr int lane_pv_block_rows() {
  return V::W >= 16 ? 8 : 6;
}

// Rows of a run of `len` consecutive rows that the next lane_pv_flush call takes: RB while
// len >= RB, except that at RB = 6 a run that would leave a 2-row tail takes 4 (32 rows:
// 4 + 6 + 6 + 6 + 6 + 4, 8 rows: 4 + 4), as a 2-row block reuses each V load half as often.
template <int RB>
constexpr int lane_pv_take(int64_t len) {
  if (len < RB) return static_cast<int>(len);
  return RB == 6 && len % RB == 2 ? 4 : RB;
}

// lane_pv_rows calls of one lane_pv_flush of nr <= RB rows (its blocks: RB, or 4, 2, 1).
template <int RB>
constexpr int64_t lane_pv_flush_calls(int nr) {
  if (nr == RB) return 1;
  int64_t calls = 0;
  if (RB > 4 && nr >= 4) {
    ++calls;
    nr -= 4;
  }
  if (nr >= 2) {
    ++calls;
    nr -= 2;
  }
  return calls + (nr == 1);
}

// lane_pv_rows calls for a run of len consecutive rows (taken by lane_pv_take).
template <int RB>
constexpr int64_t lane_pv_run_calls(int64_t len) {
  int64_t calls = 0;
  while (len > 0) {
    const int nr = lane_pv_take<RB>(len);
    calls += lane_pv_flush_calls<RB>(nr);
    len -= nr;
  }
  return calls;
}
// Output vectors per lane_pv call (the rest of v_head_dim in calls of 2, then 1): 3 at 32 vector
// registers (8 x 3 = 24 accumulators, 3 V vectors, a broadcast: 11 loads per 24 FMAs against 10
// per 16 with 2, and a quarter fewer broadcasts of each probability), 2 at 16. The same sums in
// the same order either way (each output element is one accumulator's), so results are bit for
// bit those of 8 x 2. Zen 4, `avx512_bf16`, MQA 32/1, alternating builds, minimum ms: in cache
// (tools/cpp/bench_paged_attention {f16|bf16|f32} 512 256 1 32 128 2000 1) fp16 0.0891-0.0902 ->
// 0.0880-0.0891, bf16 0.0688-0.0699 -> 0.0678-0.0685, fp32 0.0843-0.0851 -> 0.0844-0.0855; 16K
// keys from DRAM in the EP's 8 splits (... 16384 256 1 32 128 6 96 0 8) bf16 2.25-2.27 ->
// 2.18-2.22, fp16 2.91-2.92 -> 2.88.
template <int W>
constexpr int lane_pv_vectors() {
  return W >= 16 ? 3 : 2;
}

// Rows [r0, r0 + RB) over all of v_head_dim (a multiple of W).
template <class V, int RB, bool kSkipZero, class PF>
OLEP_HOT void lane_pv_rows(float* st_acc, int64_t r0, int64_t Dv, const float* v, const float* ptile, int64_t Rp,
                           int64_t n, const float* corr, PF* pf) {
  constexpr int W = V::W, NU = lane_pv_vectors<W>();
  float* acc = st_acc + r0 * Dv;
  int64_t d = 0;
  for (; d + NU * W <= Dv; d += NU * W)
    lane_pv<V, RB, NU, kSkipZero>(acc + d, Dv, ptile + r0, Rp, v + d, n, corr + r0, pf);
  if constexpr (NU > 2) {
    if (d + 2 * W <= Dv) {
      lane_pv<V, RB, 2, kSkipZero>(acc + d, Dv, ptile + r0, Rp, v + d, n, corr + r0, pf);
      d += 2 * W;
    }
  }
  for (; d + W <= Dv; d += W) lane_pv<V, RB, 1, kSkipZero>(acc + d, Dv, ptile + r0, Rp, v + d, n, corr + r0, pf);
}

// Rows [r0, r0 + nr) (nr <= lane_pv_block_rows) through lane_pv_rows: the largest block, then 4, 2, 1.
template <class V, bool kSkipZero, class PF>
OLEP_HOT void lane_pv_flush(float* st_acc, int64_t r0, int nr, int64_t Dv, const float* v, const float* ptile,
                            int64_t Rp, int64_t n, const float* corr, PF* pf) {
  constexpr int RB = lane_pv_block_rows<V>();
  if (nr == RB) {
    lane_pv_rows<V, RB, kSkipZero>(st_acc, r0, Dv, v, ptile, Rp, n, corr, pf);
    return;
  }
  if constexpr (RB > 4) {
    if (nr >= 4) {
      lane_pv_rows<V, 4, kSkipZero>(st_acc, r0, Dv, v, ptile, Rp, n, corr, pf);
      r0 += 4;
      nr -= 4;
    }
  }
  if (nr >= 2) {
    lane_pv_rows<V, 2, kSkipZero>(st_acc, r0, Dv, v, ptile, Rp, n, corr, pf);
    r0 += 2;
    nr -= 2;
  }
  if (nr == 1) lane_pv_rows<V, 1, kSkipZero>(st_acc, r0, Dv, v, ptile, Rp, n, corr, pf);
}

// lane_pv calls of lane_pv_rows for Dv (blocks of lane_pv_vectors, then 2, then 1 vectors).
template <int W>
constexpr int64_t lane_pv_passes(int64_t Dv) {
  constexpr int NU = lane_pv_vectors<W>();
  const int64_t rest = Dv % (NU * W);
  return Dv / (NU * W) + (NU > 2 && rest >= 2 * W ? 1 + (rest - 2 * W) / W : rest / W);
}

}  // namespace
}  // namespace simd
}  // namespace kernels
}  // namespace olep
