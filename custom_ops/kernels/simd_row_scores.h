// The row path's q . k score loops (internal; simd_rows.h): register-blocked rows x keys, and
// one row walking K row by row. See attention_simd.h.
#pragma once

#include "kernels/simd_tiles.h"
#include "kernels/simd_common.h"

namespace olep {
namespace kernels {
namespace simd {
namespace {  // internal linkage: each ISA translation unit its own copy (attention_simd.h)

// Score-loop iterations (of E = Dot::kStep elements) between two TilePrefetch steps in
// scores_rows: one step per 2 W elements (a step per iteration cost ~3 instructions per FMA;
// far fewer steps make bursts of prefetches that stall the tile's own loads).
template <int W>
constexpr int score_step_iters(int E) {
  return E >= 2 * W ? 1 : 2 * W / E;
}
// pf->step() calls scores_rows makes for head_dim D.
template <int W, int RB>
constexpr int64_t scores_rows_steps(int64_t D, int E) {
  return RB * ((D / E + score_step_iters<W>(E) - 1) / score_step_iters<W>(E));
}

// Raw scores of RB query rows against the W keys of a tile (rows of kp, stride D; rows past
// the valid ones are zero padding): ptile[row * W + t] = q_row . k_t. Register block of RB
// rows x KB = W / RB keys: each K load serves RB rows and each q load KB keys; one
// transpose-reduce per W scores. The q row addresses are taken once and the prefetcher steps
// once per score_step_iters iterations (scores_rows_steps), so the inner loop is loads and
// multiply-adds only (per-iteration row addressing and prefetch bookkeeping measured 2x the
// FMA count in instructions). The sums run over d in the same order as a plain loop.
template <class V, class Dot, int RB>
OLEP_COLD_REGS void scores_rows(const typename Dot::qelem* qf, int64_t D, const typename Dot::kelem* kp,
                                const int64_t* rows, float* ptile, TilePrefetch* pf_io) {
  // The prefetcher's state in a local copy, written back at the end: through the caller's
  // pointer every step loaded and stored its fields (the caller's object has escaped, so they
  // could not stay in registers). GQA 32/8 in cache, Zen 4 at the AVX2 level, with the same
  // copy in pv_tile_rows (tools/cpp/bench_paged_attention f16 1024 256 8 4 128 1000 1,
  // alternating builds): fp16 0.267-0.269 -> 0.262 ms, fp32 0.290-0.296 -> 0.275-0.282 ms;
  // AVX-512 unchanged. From DRAM (f16 / bf16 16384 256 8 4 128 15): fp16 4.33-4.45 ->
  // 4.23-4.25 ms, bf16 4.60-4.66 -> 4.54-4.56 ms at AVX2.
  TilePrefetch local = *pf_io;
  TilePrefetch* pf = &local;
  using vf = typename V::vf;
  using qelem = typename Dot::qelem;
  using kelem = typename Dot::kelem;
  constexpr int W = V::W, KB = W / RB, E = Dot::kStep;
  vf x[RB];  // x[g] lane rr * KB + tt: row rr, key g * KB + tt
  const qelem* qr[RB];
#pragma GCC unroll 4
  for (int rr = 0; rr < RB; ++rr) qr[rr] = qf + rows[rr] * D;
  for (int g = 0; g < RB; ++g) {
    vf acc[W];
#pragma GCC unroll 16
    for (int e = 0; e < W; ++e) acc[e] = V::zero();
    const kelem* kg = kp + g * KB * D;
    auto iter = [&](int64_t d) OLEP_LAMBDA_HOT {
      vf kv[KB];
#pragma GCC unroll 16
      for (int tt = 0; tt < KB; ++tt) kv[tt] = Dot::load_k(kg + tt * D + d);
#pragma GCC unroll 4
      for (int rr = 0; rr < RB; ++rr) {
        vf qv = Dot::load_q(qr[rr] + d);
        // In a register for the KB keys: GCC otherwise folds the load into each of the KB
        // multiply-adds, KB loads of one q vector where one does. At AVX2 (RB 4 x KB 2, 16-bit
        // K) that made the loop load-bound, 10 loads per 8 FMAs (GQA 32/8 in cache, Zen 4 at
        // the AVX2 level: fp16 0.160 -> 0.133 ms, fp32 0.166 -> 0.148 ms; AVX-512 unchanged).
        if (KB > 1) asm("" : "+v"(qv));
#pragma GCC unroll 16
        for (int tt = 0; tt < KB; ++tt) acc[rr * KB + tt] = Dot::madd(acc[rr * KB + tt], qv, kv[tt]);
      }
    };
    constexpr int kIters = score_step_iters<W>(E);
    int64_t d = 0;
    for (; d + kIters * E <= D; d += kIters * E) {
      pf->step();
#pragma GCC unroll 4
      for (int k = 0; k < kIters; ++k) iter(d + k * E);
    }
    if (d < D) {
      pf->step();
      for (; d < D; d += E) iter(d);
    }
    x[g] = Dot::reduce(acc);
  }
  *pf_io = local;
  // Each row's W scores as one vector store: the softmax loads them right after as one vector,
  // which otherwise waits for RB separate KB-lane stores to reach L1 (a load fed by several
  // stores is not forwarded). 1-3% at the AVX2 level, none at AVX-512 (GQA 32/8 in cache, Zen 4,
  // tools/cpp/bench_paged_attention {f32|f16|bf16} 1024 256 1 4 128 1000 1, alternating builds).
  V::template transpose_blocks<RB>(x);
#pragma GCC unroll 4
  for (int rr = 0; rr < RB; ++rr) V::store(ptile + rows[rr] * W, x[rr]);
}

// One row against the tile, walking K row by row (sequential addresses). kD > 0: head_dim is kD
// (fully unrolled inner loop; scores_row_walk dispatches the common sizes).
template <class V, class Dot, int64_t kD = 0>
OLEP_COLD_REGS void scores_row_walk_d(const typename Dot::qelem* q, int64_t Drt, const typename Dot::kelem* kp,
                                      float* out, TilePrefetch* pf) {
  const int64_t D = kD > 0 ? kD : Drt;
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
#pragma GCC unroll 8
    for (; d + E < D; d += 2 * E) {
      a1 = Dot::madd(a1, Dot::load_q(q + d), Dot::load_k(kr + d));
      a0 = Dot::madd(a0, Dot::load_q(q + d + E), Dot::load_k(kr + d + E));
    }
    if (d < D) a1 = Dot::madd(a1, Dot::load_q(q + d), Dot::load_k(kr + d));
    acc[t] = Dot::add(a0, a1);
  }
  V::store(out, Dot::reduce(acc));
}
template <class V, class Dot>
OLEP_HOT void scores_row_walk(const typename Dot::qelem* q, int64_t D, const typename Dot::kelem* kp, float* out,
                              TilePrefetch* pf) {
  if (D == 128) scores_row_walk_d<V, Dot, 128>(q, D, kp, out, pf);
  else if (D == 64) scores_row_walk_d<V, Dot, 64>(q, D, kp, out, pf);
  else if (D == 256) scores_row_walk_d<V, Dot, 256>(q, D, kp, out, pf);
  else scores_row_walk_d<V, Dot, 0>(q, D, kp, out, pf);
}

}  // namespace
}  // namespace simd
}  // namespace kernels
}  // namespace olep
