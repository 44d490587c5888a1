// The lanes path: W query rows in the lanes of a vector (internal). See attention_simd.h.
#pragma once

#include "kernels/simd_lane_kernels.h"

namespace olep {
namespace kernels {
namespace simd {
namespace {  // internal linkage: each ISA translation unit its own copy (attention_simd.h)

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
// Per tile it is two small GEMMs with register-blocked micro-kernels: scores = K tile x Q^T
// (lane_scores: 2 row vectors x 4 keys; at 32 registers the running totals of the 16-element
// partial sums stay in registers too, at 16 in the score tile; the K tile loaded or converted
// once per tile) and O += P x V tile (lane_pv: 8 consecutive rows x 3 output
// vectors at 32 registers, 6 x 2 at 16; the probabilities broadcast from their lanes).
// Measured (tools/bench_lanes_kernel.py, MQA 32/1, head_dim 128, 4K keys, 1 thread, shared
// Xeon, K/V in caches or from memory): 1.5-1.7x the compute floor at AVX2, 1.9-2.2x at AVX-512
// (was 1.9-2.2x / 2.1-2.4x); the micro-kernels run at 70-90% of peak from L1 alone, ~65% in place.
// ---------------------------------------------------------------------------------

// qt[d * Rp + h * S + i] = q(head h, row i)[d] * scale for the valid rows: blocks of W rows x W
// channels transposed in registers (V::transpose_square: W row loads, W stores of W lanes),
// then the rows left (fewer than W in all when every row is valid, else fewer than W per head)
// in bands of 16 channels: each row's 16 elements
// are one read, and the band's 16 rows of qt stay in L1 while the rows go by. (Row by row over
// all of head_dim wrote every float to a new line of qt, with the dtype switch per element: a
// 64-row prefill diagonal block at D = 128 on Zen 4, in cache, took 0.029 ms with it, 0.022 with
// the bands, whose scalar stores were still ~2 us of it; tools/cpp/bench_lanes_attention f32 64
// 1 64 128.) The same products (one multiply by scale per element) either way.
template <class V, class T, class Load, class Cvt>
void transpose_q_as(const AttentionGroup& a, const T* q, int64_t valid, int64_t Rp, float scale, float* qt, Load load,
                    Cvt cvt) {
  using vf = typename V::vf;
  constexpr int W = V::W;
  constexpr int64_t kBand = 16;
  const int64_t G = a.group_size, S = a.num_rows, D = a.head_dim, hs = a.q_head_stride, rs = a.q_row_stride;
  // (head_dim is a multiple of W on this path: attend_range sends other sizes to the scalar level)
  const vf sc = V::set1(scale);
  auto row = [&](int64_t r) { return q + (r / S) * hs + (r % S) * rs; };  // row r = h * S + i
  // Rows r0 .. r0 + W - 1 (all valid), every channel.
  auto block = [&](int64_t r0) {
    const T* rp[W];
#pragma GCC unroll 16
    for (int k = 0; k < W; ++k) rp[k] = row(r0 + k);
    for (int64_t d0 = 0; d0 < D; d0 += W) {
      vf x[W];
#pragma GCC unroll 16
      for (int k = 0; k < W; ++k) x[k] = V::mul(load(rp[k] + d0), sc);
      V::transpose_square(x);
      float* o = qt + d0 * Rp + r0;
#pragma GCC unroll 16
      for (int k = 0; k < W; ++k) V::store(o + k * Rp, x[k]);
    }
  };
  // Row r, channels [d0, d0 + nb).
  auto band = [&](int64_t r, int64_t d0, int64_t nb) {
    const T* p = row(r) + d0;
    float* o = qt + d0 * Rp + r;
    if (nb == kBand) {
#pragma GCC unroll 16
      for (int64_t dd = 0; dd < kBand; ++dd) o[dd * Rp] = cvt(p[dd]) * scale;
    } else {
      for (int64_t dd = 0; dd < nb; ++dd) o[dd * Rp] = cvt(p[dd]) * scale;
    }
  };
  if (valid == S) {
    // Every row valid: blocks of any W consecutive rows, across heads where S is not a multiple
    // of W (a decode step's S = 1: W heads per block). Blocks within each head left a decode
    // step's rows all to the bands, ~7 us per call for MQA 32/1 fp16 (4096 scalar conversions
    // and strided stores), as much as a few hundred keys: a KV split's start paid it again.
    const int64_t R = G * S, r_rest = R / W * W;
    for (int64_t r0 = 0; r0 < r_rest; r0 += W) block(r0);
    for (int64_t d0 = 0; d0 < D; d0 += kBand)
      for (int64_t r = r_rest; r < R; ++r) band(r, d0, std::min(kBand, D - d0));
    return;
  }
  const int64_t i_rest = valid / W * W;  // rows [i_rest, valid) of every head take the bands
  for (int64_t h = 0; h < G; ++h)
    for (int64_t i0 = 0; i0 < i_rest; i0 += W) block(h * S + i0);
  for (int64_t d0 = 0; d0 < D; d0 += kBand)
    for (int64_t h = 0; h < G; ++h)
      for (int64_t i = i_rest; i < valid; ++i) band(h * S + i, d0, std::min(kBand, D - d0));
}
template <class V>
void transpose_q(const AttentionGroup& a, int64_t valid, int64_t Rp, float scale, float* qt) {
  // (lambdas, not function pointers: a pointer not folded away would need an out-of-line copy
  // of the converter in this ISA unit, a weak symbol; see common/dtype.h)
  switch (a.dtype) {
    case DType::kFloat32:
      transpose_q_as<V>(a, static_cast<const float*>(a.q), valid, Rp, scale, qt,
                        [](const float* p) { return V::load(p); }, [](float x) { return x; });
      return;
    case DType::kFloat16:
      transpose_q_as<V>(a, static_cast<const uint16_t*>(a.q), valid, Rp, scale, qt,
                        [](const uint16_t* p) { return V::load_f16(p); }, [](uint16_t x) { return half_to_float(x); });
      return;
    case DType::kBFloat16:
      transpose_q_as<V>(a, static_cast<const uint16_t*>(a.q), valid, Rp, scale, qt,
                        [](const uint16_t* p) { return V::load_bf16(p); }, [](uint16_t x) { return bf16_to_float(x); });
      return;
  }
}

// Scratch: scratch_floats() in attention_common.cc covers the layout below.
// The next tile's 16-bit K and V rows converted to float a few vectors per step() of the current
// tile's micro-kernels (ConvertPrefetch::step), so that the conversions issue among their
// multiply-adds instead of in a loop of their own before the tile: on Zen 4 VCVTPH2PS runs
// beside the FMAs (16 FMAs + 4 conversions per 16 cycles, as fast as the FMAs alone), and the
// separate loop cost ~10% of an MQA fp16 step in cache.
template <class V>
struct TileConvert {
  const uint16_t* src = nullptr;  // the range being converted, `left` elements (a multiple of W)
  float* dst = nullptr;
  int64_t left = 0;
  const uint16_t* src2 = nullptr;  // then this one
  float* dst2 = nullptr;
  int64_t left2 = 0;
  int64_t per_step = 0;  // elements per step(), a multiple of W
  bool bf16 = false;
  // kn elements of K rows from k into kd (k null: none), then vn of V rows from v into vd, over
  // `steps` calls of step(); finish() converts what the steps left.
  void reset(const void* k, float* kd, int64_t kn, const void* v, float* vd, int64_t vn, int64_t steps,
             bool is_bf16) {
    constexpr int W = V::W;
    if (k == nullptr) kn = 0;
    src = static_cast<const uint16_t*>(kn > 0 ? k : v), dst = kn > 0 ? kd : vd, left = kn > 0 ? kn : vn;
    src2 = static_cast<const uint16_t*>(v), dst2 = vd, left2 = kn > 0 ? vn : 0;
    const int64_t vectors = (kn + vn) / W;
    per_step = W * std::max<int64_t>(1, (vectors + steps - 1) / std::max<int64_t>(steps, 1));
    bf16 = is_bf16;
  }
  OLEP_HOT void convert(int64_t m) {
    constexpr int W = V::W;
    for (int64_t e = 0; e < m; e += W) V::store(dst + e, bf16 ? V::load_bf16(src + e) : V::load_f16(src + e));
    src += m, dst += m, left -= m;
    if (left == 0) src = src2, dst = dst2, left = left2, left2 = 0;
  }
  OLEP_HOT void step() {
    if (left > 0) convert(std::min(per_step, left));
  }
  void finish() {
    while (left > 0) convert(left);
  }
};
// A tile prefetcher whose steps also convert (TileConvert).
template <class V>
struct ConvertPrefetch : TilePrefetch {
  TileConvert<V> cv;
  OLEP_HOT void step() {
    TilePrefetch::step();
    cv.step();
  }
};

template <class V>
void attend_lanes(const AttentionGroup& a, int64_t key_begin, int64_t key_end, AttentionState* st, float* scratch,
                  KVEncoding enc = KVEncoding::kNative, bool fixed = false) {
  using vf = typename V::vf;
  constexpr int W = V::W;
  constexpr int TK = kLaneTileKeys;     // keys per tile
  constexpr int RB = lane_pv_block_rows<V>();  // output rows per P.V register block
  const int64_t G = a.group_size, S = a.num_rows, D = a.head_dim, Dv = a.v_head_dim;
  const int64_t valid = std::min(a.num_valid_rows, S);
  const int64_t R = G * S, Rp = (R + W - 1) / W * W;
  float* qt = scratch;             // [D, Rp] transposed, scaled queries
  float* ktile = qt + D * Rp;      // [TK, D]
  float* vtile = ktile + TK * D;   // [TK, Dv]
  float* knext = vtile + TK * Dv;  // [TK, D] 16-bit rows: the next tile's K, converted during this one
  float* vnext = knext + TK * D;   // [TK, Dv] and its V (TileConvert)
  float* ptile = vnext + TK * Dv;  // [TK, Rp] scores, then probabilities
  float* mloc = ptile + TK * Rp;   // [Rp] running max, lanes
  float* lloc = mloc + Rp;         // [Rp] running sum, lanes
  float* corr = lloc + Rp;         // [Rp] this tile's rescale factor
  float* qt8 = corr + Rp;          // [D, Rp] int8 blocks, fixed: sq * q16 per row (int8_query)
  float* lbias = qt8 + D * Rp;     // [Rp] int4 blocks, fixed: the K minimums' part of each score
                                   // then [Rp / W] int64 indices of live row blocks (live_blocks),
                                   // [Rp / W] lane bits (block_bits), [Rp / W] x 4 int64 key ranges

  const bool capped = a.softcap > 0.0f;
  const float qscale = capped ? 1.0f : a.scale;
  // bfloat16 on levels with VDPBF16PS (head_dim even): qt holds raw bf16 pairs instead,
  // qt2[i][r] = (q[r][2i], q[r][2i+1]) in one 32-bit lane, unscaled, and each score vector is
  // one dot_bf16 per pair of K elements (broadcast as one 32-bit value from the raw K row).
  constexpr bool kDotLevel = V::kBf16Dot;
  const bool dot = kDotLevel && enc == KVEncoding::kNative && a.dtype == DType::kBFloat16 && D % 2 == 0;
  uint32_t* qt2 = reinterpret_cast<uint32_t*>(qt);  // [D / 2, Rp] when dot
  // Lanes no row fills: the padding rows past R, and rows past `valid` (transpose_q writes the
  // rest; a 64-row prefill block zeroed all 32 KiB of qt per call before).
  if (valid < S) {
    std::fill(qt, qt + D * Rp, 0.0f);
  } else if (R < Rp) {
    for (int64_t d = 0; d < D; ++d) std::fill(qt + d * Rp + R, qt + (d + 1) * Rp, 0.0f);
  }
  if (fixed) {
    std::fill(qt8, qt8 + D * Rp, 0.0f);
    std::fill(lbias, lbias + Rp, 0.0f);
  }
  if (dot) {
    for (int64_t h = 0; h < G; ++h)
      for (int64_t i = 0; i < valid; ++i) {
        const int64_t r = h * S + i;
        const uint16_t* qr = static_cast<const uint16_t*>(a.q) + h * a.q_head_stride + i * a.q_row_stride;
        for (int64_t d = 0; d < D; d += 2) qt2[d / 2 * Rp + r] = qr[d] | static_cast<uint32_t>(qr[d + 1]) << 16;
      }
  } else {
    transpose_q<V>(a, valid, Rp, qscale, qt);
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
  const int64_t nblocks = Rp / W;
  // [Rp / W] row blocks with a visible key, 8-byte aligned (the scratch need only be float-aligned)
  int64_t* live_blocks =
      reinterpret_cast<int64_t*>((reinterpret_cast<uintptr_t>(lbias + Rp) + 7) & ~uintptr_t{7});
  unsigned* block_bits = reinterpret_cast<unsigned*>(live_blocks + nblocks);  // [Rp / W]
  for (int64_t b = 0; b < nblocks; ++b) {
    unsigned bits = 0;
    for (int lane = 0; lane < W; ++lane) {
      const int64_t r = b * W + lane;
      if (r < R && r % S < valid) bits |= 1u << lane;
    }
    block_bits[b] = bits;
  }
  auto block_rows = [&](int64_t b) { return block_bits[b]; };
  // Rows that see different key ranges (causal prefill, windows): per row block the keys all its
  // valid rows see, [brange[4b], brange[4b+1]), and the keys any of them sees, [brange[4b+2],
  // brange[4b+3]), found once per call. A tile inside the first takes the fast softmax path and
  // every row of the block takes its P.V; a tile outside the second is skipped; only the tiles
  // on a block's edge look at its rows one by one (per lane and key: ~10% of a causal
  // prefill's time when every tile did).
  // (A block without valid rows gets every key as its "all" range and none as its "any"
  // range; every use of brange tests block_bits first.)
  int64_t* brange =
      reinterpret_cast<int64_t*>((reinterpret_cast<uintptr_t>(block_bits + nblocks) + 7) & ~uintptr_t{7});
  if (!uniform) {
    for (int64_t b = 0; b < nblocks; ++b) {
      int64_t all_lo = INT64_MIN, all_hi = INT64_MAX, any_lo = INT64_MAX, any_hi = INT64_MIN;
      for (int lane = 0; lane < W; ++lane) {
        if (!(block_bits[b] >> lane & 1u)) continue;
        int64_t lo, hi;
        detail::visible_range(a, (b * W + lane) % S, &lo, &hi);
        all_lo = std::max(all_lo, lo), all_hi = std::min(all_hi, hi);
        any_lo = std::min(any_lo, lo), any_hi = std::max(any_hi, hi);
      }
      brange[4 * b] = all_lo, brange[4 * b + 1] = all_hi, brange[4 * b + 2] = any_lo, brange[4 * b + 3] = any_hi;
    }
  }
  // The tile [j0, j0 + n) is inside / outside the keys of row block b.
  auto tile_in_all = [&](int64_t b, int64_t j0, int64_t n) {
    return uniform ? j0 >= ulo && j0 + n <= uhi : j0 >= brange[4 * b] && j0 + n <= brange[4 * b + 1];
  };
  auto tile_off_any = [&](int64_t b, int64_t j0, int64_t n) {
    return uniform ? std::max(j0, ulo) >= std::min(j0 + n, uhi)
                   : std::max(j0, brange[4 * b + 2]) >= std::min(j0 + n, brange[4 * b + 3]);
  };
  // seen_all[b]: this tile, every valid row of block b sees every key with a finite probability,
  // so its P.V needs no kUnseen test (lane_pv's kSkipZero). [Rp / W]
  unsigned* seen_all = reinterpret_cast<unsigned*>(brange + 4 * nblocks);
  const size_t es = stored_elem_bytes(a.dtype, enc);
  const vf neg_inf = V::set1(-INFINITY);
  // 16-bit rows (native): the next tile's K and V rows are converted into knext / vnext a few
  // vectors per prefetch step of this tile's loops (TileConvert), pf's steps doing both.
  const bool pipe = V::kRegs >= 32 && enc == KVEncoding::kNative && a.dtype != DType::kFloat32;
  ConvertPrefetch<V> pf;
  TilePrefetch* pf_plain = &pf;  // (the micro-kernels instantiated for the plain prefetcher)
  const char* next_k = nullptr;  // the K rows knext / vnext hold (pipe), or null
  // Native blocks: the first kPrefetchTilesAhead tiles' K and V rows fetched into L2 at once, as
  // the row path does (simd_rows.h); reset_next's spread prefetch covers every later tile. A call
  // starts on rows no prefetch has touched (a decode step splits each kv head's keys into
  // 2048-key ranges), and its first tiles otherwise waited on demand misses.
  if (enc == KVEncoding::kNative) {
    TileCursor sc{a, kmin, kmax, TK, es};
    for (int t = 0; t < kPrefetchTilesAhead && sc.next(); ++t) {
      pf_plain->reset(sc.krows, sc.n * D * static_cast<int64_t>(es), sc.vrows, sc.n * Dv * static_cast<int64_t>(es), 1);
      pf_plain->step();  // the whole tile in one step
    }
  }
  // pf.step() calls per tile (all row blocks live): one per head_dim block per score micro-kernel
  // call, then one per 8 keys per P.V call
  const int64_t dblocks = (D + kLaneScoreBlock - 1) / kLaneScoreBlock;
  // runs are all R rows when every row is valid, else `valid` rows per head
  const int64_t pv_calls = valid == S ? lane_pv_run_calls<RB>(R) : G * lane_pv_run_calls<RB>(valid);
  const int64_t lane_steps = lane_score_steps<V>(nblocks, TK, dblocks) + pv_calls * lane_pv_passes<W>(Dv) * (TK / 8);

  int64_t scaled_blk = -1;  // fixed: the block whose K scales qt8 holds
  const float* qsrc = fixed ? qt8 : qt;  // dot: qt holds the raw bf16 pairs
  // Causal rows (no window): keys from the last TK-aligned position that every valid row sees
  // (the block's causal frontier, where a 64-row prefill block's diagonal lies) go in tiles of
  // kLaneFrontKeys keys, the rest in tiles of TK: the frontier tiles score and weight fewer keys
  // no row of a row block sees (64 rows, 16-row blocks: 2560 (row, key) pairs of multiply-adds
  // on the diagonal against 3072 with 32-key tiles, 2080 of them visible). Results do not
  // depend on the tile size beyond rounding (the online softmax rescales per tile).
  int64_t front = kmax;
  if (!uniform && a.local_window_size <= 0) {  // (the lanes path has no mask tensor)
    int64_t all_hi = INT64_MAX;
    for (int64_t b = 0; b < nblocks; ++b)
      if (block_bits[b]) all_hi = std::min(all_hi, brange[4 * b + 1]);
    front = std::max(kmin, std::min(kmax, all_hi / TK * TK));
  }
  for (int phase = 0; phase < 2; ++phase) {
    const int tk = phase == 0 ? TK : kLaneFrontKeys;  // keys per tile of this phase
    const int64_t p0 = phase == 0 ? kmin : front, p1 = phase == 0 ? front : kmax;
    for (TileCursor tc{a, p0, p1, tk, es}; p0 < p1 && tc.next();) {
      const int64_t j0 = tc.j0, n = tc.n;
      if (fixed && tc.blk != scaled_blk) {
        const float* ks = a.blocks[tc.blk].key_scale;
        float* row = ktile;  // free until this tile's K conversion (ktile holds TK * D floats)
        float* t = row + D;  // fixed_query_row's scratch: D floats, then D int16
        int16_t* q16 = reinterpret_cast<int16_t*>(t + D);
        for (int64_t r = 0; r < R; ++r) {
          if (r % S >= valid) continue;
          for (int64_t d = 0; d < D; ++d) row[d] = qt[d * Rp + r];
          const float sq = fixed_query_row<V>(row, ks, D, q16, t);
          for (int64_t d = 0; d < D; ++d) qt8[d * Rp + r] = sq * static_cast<float>(q16[d]);
          lbias[r] = enc == KVEncoding::kInt4 ? int4_query_bias<V>(row, a.blocks[tc.blk].key_min, D) : 0.0f;
        }
        scaled_blk = tc.blk;
      }
      const char* krows = tc.krows;
      const char* vrows = tc.vrows;
      pf.reset_next(tc, D * es, Dv * es, lane_steps);  // spread over this tile's loops
      const float* kp = nullptr;
      const uint16_t* kraw = nullptr;  // dot: raw bf16 K rows
      const float* vp;
      bool converted = false;  // ktile / vtile hold this tile's rows, converted during the last tile
      if (next_k != nullptr) {
        pf.cv.finish();
        if (next_k == krows && n == tk) {
          std::swap(ktile, knext);
          std::swap(vtile, vnext);
          converted = true;
        }
        next_k = nullptr;
      }
      if (pipe) {  // the next tile, if whole, converted over this one's steps
        const char *nk, *nv;
        int64_t rows = 0;
        tc.peek(&nk, &nv, &rows, 1);
        if (rows == tk) {
          pf.cv.reset(dot ? nullptr : nk, knext, tk * D, nv, vnext, tk * Dv, lane_steps, a.dtype == DType::kBFloat16);
          next_k = nk;
        }
      }
      if (dot) {
        if (n == tk) {
          kraw = reinterpret_cast<const uint16_t*>(krows);
        } else {  // pad a partial tile with zeros (K rows >= n must not be read)
          uint16_t* raw = reinterpret_cast<uint16_t*>(ktile);
          std::memcpy(raw, krows, static_cast<size_t>(n * D) * sizeof(uint16_t));
          std::memset(raw + n * D, 0, static_cast<size_t>((tk - n) * D) * sizeof(uint16_t));
          kraw = raw;
        }
      } else if (a.dtype == DType::kFloat32 && enc == KVEncoding::kNative && n == tk) {
        kp = reinterpret_cast<const float*>(krows);
      } else {  // convert (dequantize), or pad a partial tile with zeros (K rows >= n must not be read)
        if (!converted) convert_k_tile<V>(a, tc, n, tk, ktile, fixed);
        kp = ktile;
      }
      if (a.dtype == DType::kFloat32 && enc == KVEncoding::kNative) {
        vp = reinterpret_cast<const float*>(vrows);  // only rows < n are read
      } else {
        if (!converted) convert_v_tile<V>(a, tc, n, n, vtile);
        vp = vtile;
      }

      // Scores of the row blocks that see any key of the tile, pairs of row vectors per
      // micro-kernel call (lane_tile_scores).
      int64_t nlive = 0;
      for (int64_t b = 0; b < nblocks; ++b) {
        const unsigned rows_bits = block_rows(b);
        bool any = false;
        if (uniform || rows_bits == 0 || tile_in_all(b, j0, n) || tile_off_any(b, j0, n)) {
          any = rows_bits != 0 && !tile_off_any(b, j0, n);
        } else {
          for (int lane = 0; lane < W && !any; ++lane) {
            if (!(rows_bits >> lane & 1u)) continue;
            int64_t lo, hi;
            detail::visible_range(a, (b * W + lane) % S, &lo, &hi);
            any = std::max(j0, lo) < std::min(j0 + n, hi);
          }
        }
        if (any) live_blocks[nlive++] = b;
      }
      {
        const bool add_bias = fixed && enc == KVEncoding::kInt4;
        const vf sc = V::set1(capped ? 1.0f : a.scale);  // dot: capped scores are scaled in the softcap below
        const uint16_t* kr2 = dot ? kraw : nullptr;
        auto tile_scores = [&](auto dc) OLEP_LAMBDA_HOT {
          constexpr int64_t DC = decltype(dc)::value;
          if (pipe) lane_tile_scores<V, DC>(live_blocks, nlive, qsrc, lbias, add_bias, Rp, kp, kr2, sc, D, ptile, tk, &pf);
          else lane_tile_scores<V, DC>(live_blocks, nlive, qsrc, lbias, add_bias, Rp, kp, kr2, sc, D, ptile, tk, pf_plain);
        };
        if (D == 128)
          tile_scores(std::integral_constant<int64_t, 128>{});
        else if (D == 64)
          tile_scores(std::integral_constant<int64_t, 64>{});
        else
          tile_scores(std::integral_constant<int64_t, 0>{});
      }

      for (int64_t b = 0; b < nblocks; ++b) {
        const int64_t rb = b * W;
        bool capped_done = false;
        seen_all[b] = 1u;
        // A block none of whose rows sees the tile (rows before a causal tile): its rows take no
        // P.V of it (the run loop below leaves them out), so only corr and p are set.
        if (!uniform && block_bits[b] != 0 && tile_off_any(b, j0, n)) {
          V::store(corr + rb, V::set1(1.0f));
          for (int t = 0; t < n; ++t) V::store(ptile + t * Rp + rb, V::set1(kUnseen));
          continue;
        }
        // Every valid row of the block sees every key of the tile (no causal edge, window or
        // range end inside it).
        if (block_bits[b] != 0 && tile_in_all(b, j0, n)) {
          // Fast path: scores finite in every lane (else the general path below sorts out NaN,
          // +inf and -inf): tile max, rescale factor, probabilities and their sum in two passes.
          const vf sa = V::set1(a.scale), inv_cap = V::set1(capped ? 1.0f / a.softcap : 0.0f);
          const vf cap = V::set1(a.softcap);
          vf mt = neg_inf;
          unsigned bad = 0;
          for (int t = 0; t < n; ++t) {
            vf x = V::load(ptile + t * Rp + rb);
            if (capped) {
              x = V::mul(cap, tanh_v<V>(V::mul(V::mul(x, sa), inv_cap)));
              V::store(ptile + t * Rp + rb, x);
            }
            bad |= ~V::le_bits(V::abs(x), FLT_MAX);  // NaN, +-inf
            mt = V::max(mt, x);
          }
          if (!(bad & block_bits[b])) {
            const vf mo = V::load(mloc + rb);
            const vf mn = V::max(mo, mt);  // finite in the rows' lanes
            const vf c = V::exp(V::sub(mo, mn));
            vf lsum = V::zero();
            for (int t = 0; t < n; ++t) {
              const vf pt = V::exp(V::sub(V::load(ptile + t * Rp + rb), mn));
              lsum = V::add(lsum, pt);
              V::store(ptile + t * Rp + rb, pt);
            }
            V::store(lloc + rb, V::fma(V::load(lloc + rb), c, lsum));
            V::store(mloc + rb, mn);
            V::store(corr + rb, c);
            continue;
          }
          capped_done = capped;  // the general path below must not cap again
        }
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
          if (live[t] != rows_bits) seen_all[b] = 0u;
        if (!any) {
          V::store(corr + rb, V::set1(1.0f));
          for (int t = 0; t < n; ++t) V::store(ptile + t * Rp + rb, V::set1(kUnseen));
          continue;
        }

        // Online softmax, lane-wise.
        unsigned nan_lanes = 0;
        vf mt = neg_inf;
        for (int t = 0; t < n; ++t) {
          vf x = V::load(ptile + t * Rp + rb);
          if (capped && !capped_done) {
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
          if (live[t] != rows_bits) seen_all[b] = 0u;
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

      // P.V: runs of consecutive rows (h * S + i) that see the tile, in blocks of up to RB rows
      // (lane_pv_take), each V vector loaded once per block. Rows that see no key of the tile
      // (prefill rows before it, outside their window) keep their accumulators.
      // A run lies in row blocks of one seen_all value (all_seen): a causal tile's full rows take
      // the P.V without kUnseen tests, only its edge block's rows the tested one (every row of a
      // prefill block's frontier tiles took the tested one). The same multiply-adds either way.
      // With the division-free row loop below and qt zeroed only where no row writes it: a
      // 64-row diagonal block in cache (tools/cpp/bench_lanes_attention f32 64 1 64 128 150 256,
      // Zen 4, minimum of 3 alternating runs) 0.0186-0.0188 -> 0.0180-0.0181 ms, 128 keys
      // 0.0402-0.0407 -> 0.0394-0.0397; a whole S = 512 prefill through ORT within its noise.
      auto flush = [&](int64_t r0, int64_t len, bool all_seen) {
        while (len > 0) {
          const int nr = lane_pv_take<RB>(len);
          if (pipe) {
            if (all_seen) lane_pv_flush<V, false>(st->acc, r0, nr, Dv, vp, ptile, Rp, n, corr, &pf);
            else lane_pv_flush<V, true>(st->acc, r0, nr, Dv, vp, ptile, Rp, n, corr, &pf);
          } else if (all_seen) {
            lane_pv_flush<V, false>(st->acc, r0, nr, Dv, vp, ptile, Rp, n, corr, pf_plain);
          } else {
            lane_pv_flush<V, true>(st->acc, r0, nr, Dv, vp, ptile, Rp, n, corr, pf_plain);
          }
          r0 += nr;
          len -= nr;
        }
      };
      int64_t r0 = 0, len = 0;
      bool run_all = true;  // seen_all of the run's blocks
      for (int64_t r = 0, i = 0; r < R; ++r, i = i + 1 == S ? 0 : i + 1) {  // i = r % S (no division per row)
        bool sees = i < valid;
        if (sees && !uniform && !tile_in_all(r / W, j0, n)) {
          int64_t lo, hi;
          detail::visible_range(a, i, &lo, &hi);
          sees = std::max(j0, lo) < std::min(j0 + n, hi);
        }
        if (!sees) {
          flush(r0, len, run_all);
          r0 = r + 1;
          len = 0;
          continue;
        }
        const bool all = seen_all[r / W] != 0u;
        if (len > 0 && all != run_all) {
          flush(r0, len, run_all);
          r0 = r;
          len = 0;
        }
        run_all = all;
        ++len;
      }
      flush(r0, len, run_all);
    }
  }
  for (int64_t h = 0; h < G; ++h)
    for (int64_t i = 0; i < valid; ++i) {
      const int64_t r = h * S + i;
      st->m[r] = mloc[r];
      st->l[r] = lloc[r];
    }
}

}  // namespace
}  // namespace simd
}  // namespace kernels
}  // namespace olep
