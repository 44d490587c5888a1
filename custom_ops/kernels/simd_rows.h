// The row path: one query row per register lane group, scores by register-blocked q . k,
// online softmax row by row, P.V with the rescale fused (internal). See attention_simd.h.
#pragma once

#include "kernels/simd_row_codes.h"
#include "kernels/simd_row_pv.h"
#include "kernels/simd_row_scores.h"

namespace olep {
namespace kernels {
namespace simd {
namespace {  // internal linkage: each ISA translation unit its own copy (attention_simd.h)

// L: how K/V storage is read; kTiles: convert each K/V tile to float once (shared by
// every query row of the group) instead of converting on every load. enc: the encoding of
// every block in [key_begin, key_end) (quantized runs take kTiles, attention_simd.h).
template <class V, class L, bool kTiles>
void attend_impl(const AttentionGroup& a, int64_t key_begin, int64_t key_end, AttentionState* st, float* scratch,
                 KVEncoding enc = KVEncoding::kNative, bool fixed = false) {
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
  float* corr = vtile + W * Dv;     // [R]
  float* lsum = corr + R;           // [R, W] lane-wise sums of p, folded into st->l at the end
  float* pchunk = lsum + R * W;     // [chunk tiles, R, W] scores, then probabilities
  // int8 codes read as codes (L = LoadI8): 16-bit fixed point. Per row and block, q times the
  // block's K scales (q . (code * scale) = (q * scale) . code) rounded to int16 relative to its
  // largest element (q16, qsc = its scale: relative error <= 2^-16 of max |q * scale|), scores
  // = qsc * exact int32 sums of q16 x codes (I16Dot); P.V by pv_rows_i16 (simd_pv.h).
  // int4 codes likewise (L = LoadI4, simd_quant4.h): q16 permuted to the unpacked K order, plus
  // a per-row score term from the K minimums (qbias) and a per-row P.V term from the V minimums
  // (vbias).
  constexpr bool kCodes4 = std::is_same<L, LoadI4<V>>::value && !kTiles;
  constexpr bool kCodes = (std::is_same<L, LoadI8<V>>::value || kCodes4) && !kTiles;
  float* qs = pchunk + (kChunkKeys > R * W ? kChunkKeys : R * W);  // [R, D] kTiles + fixed: sq * q16 as float
  int16_t* q16 = reinterpret_cast<int16_t*>(qs);                   // [R, D] kCodes
  float* qsc = reinterpret_cast<float*>(q16 + R * D);              // [R] kCodes
  float* qbias = qs + R * D;                                       // [R] int4: sum_d q * scale * key_min
  float* vbias = qbias + R;                                        // [R] int4 kCodes: this tile's sum p * value_min
  const bool int4 = enc == KVEncoding::kInt4;
  int16_t* pw = reinterpret_cast<int16_t*>(vtile);  // [R, 2 * W + 2] P.V weights, kCodes (no V tile then)

  const bool capped = a.softcap > 0.0f;
  // bfloat16 q . k by VDPBF16PS (levels that have it, head_dim a multiple of 2 * W, at least
  // 3 rows per KV head): q rows stay raw bf16 in the qf area, unscaled; the scale multiplies
  // the finished scores. Measured on Zen 4 (D = 128, from DRAM, time / read time): 4 rows
  // 1.70 -> 1.42, 3 rows 1.74 -> 1.64; but 2 rows 1.25 -> 1.35 and 1 row 0.95 -> 1.0-1.8
  // (memory-bound there: the full-line K loads of the dot loop stream worse), so 1-2 rows
  // keep the converting loads.
  constexpr bool kDotLevel = V::kBf16Dot && std::is_same<L, LoadBF16<V>>::value && !kTiles;
  const bool dot = kDotLevel && enc == KVEncoding::kNative && D % (2 * W) == 0 && G * valid >= 3;
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
  const size_t es = stored_elem_bytes(a.dtype, enc);
  const MaskView& mk = a.mask;
  std::fill(lsum, lsum + R * W, 0.0f);
  TilePrefetch pf;
  const int64_t row_count = G * valid;
  // pf.step() calls per tile: score loops, then P.V loops (one per key per row pair and chunk)
  // P.V rows per V load at AVX2 (pv_tile_rows): 4, so each V vector is loaded (and converted)
  // once per 4 rows (GQA 32/8, in L2, AVX2: 2 rows measured 4-30% slower, fp32 the most).
  constexpr int kPvRows = 4;
  // AVX-512 (W >= 16): pv_rows, kPvWide rows per V load (float32 2, 16-bit 4), then the rest
  // (pv_blocks).
  constexpr int kPvWide = std::is_same<KE, float>::value ? 2 : 4;
  const int64_t tile_steps = [&] {
    const int64_t r4 = row_count / 4, r2 = row_count % 4 / 2, r1 = row_count % 2;
    const int E = dot || kCodes ? 2 * W : W;  // elements per score-loop iteration
    const int64_t scores = kCodes4 ? (r4 * 4 + r2 * 2) * (D / (4 * W)) + r1 * W  // scores_i4_rows: one per 4 W
                                   : r4 * scores_rows_steps<W, 4>(D, E) + r2 * scores_rows_steps<W, 2>(D, E) + r1 * W;
    const PvBlocks wide = pv_blocks(row_count, kPvWide);
    const int64_t tail_passes = wide.tail == 3   ? pv_passes<W, 3>(Dv)
                                : wide.tail == 2 ? pv_passes<W, 2>(Dv)
                                : wide.tail == 1 ? pv_passes<W, 1>(Dv)
                                                 : 0;
    const int64_t pv = kCodes ? (row_count / 2) * W * pv_passes<W, 2>(Dv) + (row_count % 2) * W * pv_passes<W, 1>(Dv)
                       : W >= 16 ? wide.full * W * pv_passes<W, kPvWide>(Dv) + W * tail_passes
                              : (row_count / kPvRows) * pv_tile_steps<W, kPvRows>(Dv) +
                                    (row_count % kPvRows / 2) * pv_tile_steps<W, 2>(Dv) +
                                    (row_count % 2) * pv_tile_steps<W, 1>(Dv);
    return scores + pv;
  }();

  // Tiles are taken a chunk at a time: the scores of every tile of the chunk (K rows), then
  // softmax and P.V tile by tile (V rows); the same arithmetic in the same order as tile by
  // tile. One query row (MHA decode) takes a whole block of at most kChunkKeys rows (a page)
  // as one chunk, so the page, K rows then V rows, is read as one sequential stream: each
  // stream that starts at a new address costs about 1 us on Zen 4 while the hardware
  // prefetcher retrains, and K and V read tile by tile are two streams per page (fp16 MHA,
  // 128-token pages: 1.64x one block tile by tile, 1.16x by pages; BENCHMARKS.md). Longer
  // blocks (one contiguous block) and several rows keep one-tile chunks: two streams that
  // advance together (chunked, one block measured 10% slower), and several rows' software
  // prefetch of the next tile covers page starts.
  // One query row of float16/bfloat16 at AVX2 (W = 8): software prefetch of the K rows (scores
  // pass) and V rows (P.V pass) row_ahead bytes past the tile being read, a tile's worth per
  // tile. Past a page's K rows that is its V rows (pages hold K rows then V rows); past its V
  // rows, whatever the pool holds next (up to row_ahead bytes per block fetched in vain). On
  // Zen 3 the hardware prefetchers alone left the 16-bit stream at 0.65x stream_read (MHA, 16K
  // keys, kernel alone, tools/cpp/bench_paged_attention, alternating builds: fp16 0.76x and
  // bf16 0.84x the time per step; fp32 2.5% slower with it, so not there; 8 KiB ahead no better).
  // On Zen 4 at the forced AVX2 level it costs instead (paged fp16 MHA 16K, 256-token pages:
  // 1.82x -> 1.38x the read time without it, bf16 1.80x -> 1.36-1.40x), so V::row_ahead() gives
  // the distance per core: 4096 bytes on cores without AVX-512, 0 on those with it.
  const int64_t row_ahead = W == 8 && enc == KVEncoding::kNative && es == 2 ? V::row_ahead() : 0;
  // One query row over int8 / int4 pages: software prefetch one block (page) ahead, spread over
  // the current page's chunk. Each page is a new stream for the hardware prefetchers, and a
  // code page is short (int8: 64 KiB + scales at 256 tokens, D = 128; int4: half) against their
  // retraining, while its compute per byte is 1.4x (int8) to 3.4x (int4) fp16's: without it,
  // the time was about the read time plus the compute time. Zen 4, MHA 32 heads, 8K keys,
  // 256-token pages (tools/cpp/bench_quant_attention, alternating builds), time / own read time:
  // int8 1.78-1.85 -> 1.57-1.59, int4 3.55-3.75 -> 2.74-2.88 at AVX-512; int8 3.0-3.5 -> 2.2-2.3,
  // int4 5.4-5.8 -> 4.6 at AVX2 (forced). Spread over half the steps (int8 2.0-2.2) or over
  // twice as many (int8 1.68-1.70) measured worse; for native pages it measured slower at
  // AVX-512 (fp16 / bf16 MHA 16K: 13-15 -> 16-18 ms), as the earlier tile-ahead prefetch did.
  // The next block's K rows are fetched over this chunk's score loops and its V rows (and
  // scales) over its P.V loops (TilePrefetch::reset_split), each at its pass's rate of reading:
  // one rate over both passes fetched K and half of V during the score loops, a burst of
  // prefetches ahead of the demand reads that held DRAM below its rate (a synthetic loop over
  // scattered 64 KiB pages, one core: the next page fetched line for line with the current one
  // 2.5-2.8 ns per line, all of it during the first half 4.6-4.8 ns, none 3.7-4.6 ns). MHA 8K
  // int8, alternating builds (bench_quant_attention f16 8192 256 32 1 128 20), time / native
  // fp16: AVX2 0.80 -> 0.62-0.66, AVX-512 0.77 -> 0.71-0.73; int4 0.72 -> 0.68-0.71 at AVX2,
  // 0.59 -> 0.60-0.61 at AVX-512 (compute-bound there).
  constexpr bool kBlockAhead = kCodes;
  TileCursor kc{a, kmin, kmax, W, es};  // the scores pass
  TileCursor vc{a, kmin, kmax, W, es};  // the softmax + P.V pass, over the same tiles
  // Several rows over native blocks: the K and V rows of the first kPrefetchTilesAhead tiles,
  // fetched into L2 at once (the tile prefetcher, one step per tile). The spread prefetch
  // (TilePrefetch::reset_next) covers every later tile; these only the hardware prefetchers
  // would, which start each stream with a few demand misses (a call per kv head: new streams
  // for its pages' K and V rows). Zen 4, paged, 3 MiB
  // read between layers as a real decode step's weight MatMuls do (tools/cpp/
  // bench_paged_attention ... 256 3, alternating builds): SmolLM2's shape (f32 300 256 3 3 64)
  // 24.1-25.4 -> 22.2-22.8 us per layer; GQA 32/8 fp16, 512 keys, 5% less at AVX2 and AVX-512;
  // 8K keys unchanged. One row (MHA) measured slower with it (fp16 512 keys: 0.34 -> 0.36 ms at
  // AVX-512, 0.37-0.39 -> 0.43 ms at AVX2). (The same loop moved into a separate inline function
  // measured no gain, for a reason not found: the binary then held fewer prefetch instructions.)
  if (row_count >= 2 && enc == KVEncoding::kNative) {
    TileCursor sc{a, kmin, kmax, W, es};
    for (int t = 0; t < kPrefetchTilesAhead && sc.next(); ++t) {
      pf.reset(sc.krows, sc.n * D * static_cast<int64_t>(es), sc.vrows, sc.n * Dv * static_cast<int64_t>(es), 1);
      pf.step();  // the whole tile in one step
    }
  }
  int64_t scaled_blk = -1;              // kCodes: the block whose K scales q16 holds
  const float* qk = qf;                 // the q rows the score loops read
  for (bool more = kc.next(); more;) {
    const int64_t chunk_block = kc.blk;
    // (R == 1: the chunk's scores are laid out [tiles, R, W]; scratch_floats sizes them for one row)
    const int chunk_tiles = R == 1 && row_count == 1 && a.blocks[chunk_block].num_rows <= kChunkKeys ? kChunkKeys / W : 1;
    const bool block_ahead = kBlockAhead && chunk_tiles > 1;
    int64_t v_rate = 64;  // block_ahead: the prefetch rate of the P.V pass (TilePrefetch::reset_split)
    int tiles = 0;
    for (; more && tiles < chunk_tiles && kc.blk == chunk_block; more = kc.next(), ++tiles) {
      const int64_t n = kc.n;
      const char* krows = kc.krows;
      float* ptile = pchunk + tiles * R * W;
      // Software prefetch of the next tile, spread over this tile's loops, when several rows
      // share the KV head: their compute is long enough that the hardware prefetchers alone
      // leave DRAM idle for part of each tile (GQA 32/8 fp32: 1.8x -> 1.07x the read limit).
      // One row (MHA) on native pages walks K sequentially: at AVX-512 the hardware prefetchers keep up
      // (software prefetch measured slower on Zen 4); at AVX2 16-bit rows row_ahead bytes ahead
      // are prefetched (see row_ahead).
      if (block_ahead) {
        // One row over code pages: the next block's K rows over this chunk's score loops (W steps
        // per tile), its V row pairs and scales over the deferred P.V (one step per row pair and
        // block call; set_rate below), so the next page streams in while this one is computed.
        if (tiles == 0) {
          const char *nk, *nv;
          int64_t nkb, nvb;
          kc.next_block_bytes(&nk, &nkb, &nv, &nvb);
          const int64_t rows = kc.end - kc.j0;
          const int64_t ntiles = std::min<int64_t>(chunk_tiles, (kc.end + W - 1) / W - kc.j0 / W);
          // V: spread as if the P.V loops made 5/4 of their steps (one per row pair and call), so
          // the last fifth of the next page's V rows and its scales are left to the demand reads
          // and the hardware prefetchers: fetching all of it measured slower (MHA 8K int8, time /
          // fp16: AVX2 0.62-0.64 -> 0.735-0.75, AVX-512 0.72-0.735 -> 0.75; half of it 0.645 /
          // 0.75), for a reason not found.
          const int64_t v_steps = codes_pv_calls<W, kCodes4>(Dv) * ((rows + 1) / 2) * 5 / 4;
          v_rate = pf.reset_split(nk, nkb, ntiles * W, nv, nvb, v_steps);
        }
      } else {
        pf.reset(nullptr, 0, nullptr, 0, 1);
        if (row_count >= 2) pf.reset_next(kc, D * es, Dv * es, tile_steps);
        else if (row_ahead > 0) pf.reset(krows + row_ahead, kc.n * D * es, nullptr, 0, W);
      }
      if constexpr (kCodes4) {
        if (kc.blk != scaled_blk) {  // (ktile is free until the tile's K copy)
          codes_query_i4<V>(a, a.blocks[kc.blk], qf, q16, qsc, qbias, ktile);
          scaled_blk = kc.blk;
        }
      } else if constexpr (kCodes) {
        if (kc.blk != scaled_blk) {
          codes_query_i8<V>(a, a.blocks[kc.blk].key_scale, qf, q16, qsc, ktile);
          scaled_blk = kc.blk;
        }
      } else if (kTiles && fixed && kc.blk != scaled_blk) {  // the same fixed-point q, as float
        fixed_query_float<V>(a, a.blocks[kc.blk], int4, qf, qs, qbias, ktile);
        scaled_blk = kc.blk;
        qk = qs;
      }
      const KE* kp;
      if constexpr (kTiles) {
        convert_k_tile<V>(a, kc, n, W, ktile, fixed);
        kp = ktile;
      } else {
        if (n == W) {
          kp = reinterpret_cast<const KE*>(krows);
        } else {  // partial tile: K rows n..W-1 must not be read; pad with zeros
          const size_t rb = kCodes4 ? static_cast<size_t>(D / 2) : static_cast<size_t>(D) * sizeof(KE);
          char* raw = reinterpret_cast<char*>(ktile);
          std::memcpy(raw, krows, static_cast<size_t>(n) * rb);
          std::memset(raw + n * rb, 0, static_cast<size_t>(W - n) * rb);
          kp = reinterpret_cast<const KE*>(raw);
        }
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
          if constexpr (kCodes4) {
            if (cnt == 4) scores_i4_rows<V, 4>(q16, D, kp, rows, ptile, &pf);
            else if (cnt >= 2) scores_i4_rows<V, 2>(q16, D, kp, rows, ptile, &pf);
            else scores_i4_walk<V>(q16 + rows[0] * D, D, kp, ptile + rows[0] * W, &pf);
          } else if constexpr (kCodes) {
            using Dot = I16Dot<V>;
            if (cnt == 4) scores_rows<V, Dot, 4>(q16, D, kp, rows, ptile, &pf);
            else if (cnt >= 2) scores_rows<V, Dot, 2>(q16, D, kp, rows, ptile, &pf);
            else scores_row_walk<V, Dot>(q16 + rows[0] * D, D, kp, ptile + rows[0] * W, &pf);
          } else {
            using Dot = FloatDot<V, KL>;
            if (cnt == 4) scores_rows<V, Dot, 4>(qk, D, kp, rows, ptile, &pf);
            else if (cnt >= 2) scores_rows<V, Dot, 2>(qk, D, kp, rows, ptile, &pf);
            else scores_row_walk<V, Dot>(qk + rows[0] * D, D, kp, ptile + rows[0] * W, &pf);
          }
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
    }

    // kCodes, one query row, a chunk of several tiles: P.V is deferred until the chunk's softmax
    // is done, then the weights of every tile are rounded (independent per-tile maxima, no longer
    // one tile's max -> rounding -> P.V chain between two tiles' P.V), then P.V runs tile by tile
    // in order with each tile's rescale factor: the same arithmetic in the same order.
    struct Deferred {
      const char* vrows;
      int64_t vpar, n;
      int t;
      float corr, vbias;
    };
    const bool defer = kCodes && tiles > 1 && R == 1 && 2 * W * (D + Dv) >= tiles * (2 * W + 2);
    Deferred dq[kChunkKeys / 8];
    int ndq = 0;
    if (block_ahead) pf.set_rate(v_rate);
    for (int t = 0; t < tiles; ++t) {
      vc.next();
      const int64_t j0 = vc.j0, n = vc.n;
      float* ptile = pchunk + t * R * W;
      const KE* vp;
      if constexpr (kTiles) {
        convert_v_tile<V>(a, vc, n, W, vtile);
        vp = vtile;
      } else {
        vp = reinterpret_cast<const KE*>(vc.vrows);  // only rows < n are read
      }

      // kCodes: the V scales of this tile's keys, folded into the probabilities below (and
      // int4: their minimums, vbias)
      vf vscale = V::zero(), vminv = V::zero();
      if constexpr (kCodes) {
        const KVBlock& vb = a.blocks[vc.blk];
        const int64_t at = vb.page_row + (j0 - vb.first_position);
        auto tile_of = [&](const float* x) {
          if (n == W) return V::load(x + at);
          alignas(64) float part[W] = {};  // the last tile of a block: rows past it must not be read
          for (int64_t t = 0; t < n; ++t) part[t] = x[at + t];
          return V::load(part);
        };
        vscale = tile_of(vb.value_scale);
        if constexpr (kCodes4) vminv = tile_of(vb.value_min);
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
          if constexpr (kCodes4) vbias[r] = 0.0f;
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
          // The usual tile of a decode step: full, every key visible, no mask, no softcap, every
          // score finite. The same results as the steps below with live == tile_bits (select
          // keeps every lane), in fewer instructions: one finiteness test for the two checks,
          // no lane selects. (Its max / exp / sums steps mirror the general ones below: change
          // both together.)
          if (n == W && live == tile_bits && mk.kind == MaskKind::kNone && !capped) {
            vf f = s;
            if (dot) f = V::mul(f, V::set1(a.scale));
            if constexpr (kCodes) f = V::mul(f, V::set1(qsc[r]));
            if (int4 && (kCodes || fixed)) f = V::add(f, V::set1(qbias[r]));
            f = V::add(f, V::zero());  // as the zero bias below: a -0 score becomes +0 (the max's bits)
            if (V::le_bits(V::abs(f), FLT_MAX) == tile_bits) {
              float m_ref = st->m[r];
              float c = 1.0f;
              if (V::gt_bits(f, m_ref)) {
                const float m_new = std::max(m_ref, V::reduce_max(f));
                c = std::exp(m_ref - m_new);
                st->l[r] *= c;
                V::store(lsum + r * W, V::mul(V::load(lsum + r * W), V::set1(c)));
                st->m[r] = m_ref = m_new;
              }
              const vf p = V::exp(V::sub(f, V::set1(m_ref)));
              V::store(lsum + r * W, V::add(V::load(lsum + r * W), p));
              corr[r] = c;
              if constexpr (kCodes4) vbias[r] = V::reduce_add(V::mul(p, vminv));
              if constexpr (kCodes) V::store(prow, V::mul(p, vscale));
              else V::store(prow, p);
              any = true;
              continue;
            }
          }
          if (dot && !capped) s = V::mul(s, V::set1(a.scale));  // dot scores are unscaled
          if constexpr (kCodes) s = V::mul(s, V::set1(qsc[r]));  // fixed-point sums
          if (int4 && (kCodes || fixed)) s = V::add(s, V::set1(qbias[r]));  // the K minimums' part
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
          // kCodes: p * scale[key] weights the V codes (an unseen -0 stays -0: scales are >= 0)
          if constexpr (kCodes4) vbias[r] = V::reduce_add(V::mul(p, vminv));  // unseen -0 adds 0
          if constexpr (kCodes) V::store(prow, V::mul(p, vscale));
          else V::store(prow, p);
          any = true;
        }
      }
      if (!any) continue;
      if (kCodes && defer) {
        dq[ndq++] = Deferred{vc.vrows, vc.vpar, n, t, corr[0], kCodes4 ? vbias[0] : 0.0f};
        continue;
      }

      // ---- weighted V accumulation, rescale fused; RB rows per V load ----
      if constexpr (kCodes) {
        pv_codes_tile<V, kCodes4>(a, ptile, corr, vbias, pw, st->acc, vc.vrows, vc.vpar, n, &pf);
      } else {
        // AVX-512: blocks of kPvWide rows per V load, then the rest as one block (pv_blocks).
        // AVX2: kPvRows rows per V load, then a pair, then single rows; one row (MHA decode) takes
        // pv_rows' key loop (16-bit) or pv_row_keys (float32), not pv_tile_rows (memory-bound
        // there; the unrolled loop measured no faster).
        if (W >= 16) {  // AVX-512: pv_rows (pv_tile_rows measured 7% slower there for GQA bf16, no faster otherwise)
          constexpr int RB = kPvWide;
          auto pv = [&](auto rb, const int64_t* rs) OLEP_LAMBDA_HOT {
            constexpr int kRB = decltype(rb)::value;
            if (all_seen) pv_rows<V, KL, kRB, false>(st->acc, rs, Dv, vp, ptile, 1, W, n, corr, &pf);
            else pv_rows<V, KL, kRB, true>(st->acc, rs, Dv, vp, ptile, 1, W, n, corr, &pf);
          };
          const PvBlocks wide = pv_blocks(row_count, RB);
          int64_t rows[4];
          int nr = 0;
          int64_t full = 0;
          for (int64_t i = 0; i < valid; ++i)
            for (int64_t h = 0; h < G; ++h) {
              rows[nr++] = h * S + i;
              if (nr == RB && full < wide.full) {
                pv(std::integral_constant<int, RB>{}, rows);
                nr = 0;
                ++full;
              }
            }
          if (nr == 3) pv(std::integral_constant<int, 3>{}, rows);
          else if (nr == 2) pv(std::integral_constant<int, 2>{}, rows);
          else if (nr == 1) pv(std::integral_constant<int, 1>{}, rows);
          continue;  // (the last step of the tile)
        }
        if (row_count == 1) {  // G = 1, one valid row: state row 0
          const int64_t row0[1] = {0};
          if (row_ahead > 0) pf.reset(vc.vrows + row_ahead, n * Dv * es, nullptr, 0, n * pv_passes<W, 1>(Dv));
          // float32 V rows wider than the 8 accumulators: pv_row_keys, each V row read whole in
          // turn (Zen 4, AVX2 level, paged MHA fp32 16K, 128-token pages: 2.0-2.1x -> 1.28-1.40x
          // the read time); 16-bit rows keep pv_rows (pv_row_keys measured 1.32x -> 1.46x there).
          if (std::is_same<KE, float>::value && Dv > 8 * W && Dv % (8 * W) == 0) {
            if (all_seen) pv_row_keys<V, KL, false>(st->acc, Dv, vp, Dv, ptile, n, corr[0], &pf);
            else pv_row_keys<V, KL, true>(st->acc, Dv, vp, Dv, ptile, n, corr[0], &pf);
          } else if (all_seen) pv_rows<V, KL, 1, false>(st->acc, row0, Dv, vp, ptile, 1, W, n, corr, &pf);
          else pv_rows<V, KL, 1, true>(st->acc, row0, Dv, vp, ptile, 1, W, n, corr, &pf);
          continue;  // (the last step of the tile)
        }
        constexpr int RB = kPvRows;
        int64_t rows[RB];
        int nr = 0;
        auto pv = [&](auto rb, const int64_t* rs) OLEP_LAMBDA_HOT {
          constexpr int kRB = decltype(rb)::value;
          if (all_seen) pv_tile_rows<V, KL, kRB, false>(st->acc, rs, Dv, vp, ptile, n, corr, &pf);
          else pv_tile_rows<V, KL, kRB, true>(st->acc, rs, Dv, vp, ptile, n, corr, &pf);
        };
        for (int64_t i = 0; i < valid; ++i)
          for (int64_t h = 0; h < G; ++h) {
            rows[nr++] = h * S + i;
            if (nr == RB) {
              pv(std::integral_constant<int, RB>{}, rows);
              nr = 0;
            }
          }
        int k = 0;
        if constexpr (RB > 2)
          for (; k + 2 <= nr; k += 2) pv(std::integral_constant<int, 2>{}, rows + k);
        for (; k < nr; ++k) pv(std::integral_constant<int, 1>{}, rows + k);
      }
    }
    if constexpr (kCodes) {
      if (ndq > 0) {
        constexpr int64_t kStride = 2 * W + 2;
        int16_t* words = reinterpret_cast<int16_t*>(ktile);  // ktile + vtile: [ndq, kStride]
        float ws[kChunkKeys / 8], wpr[kChunkKeys / 8];
        for (int q = 0; q < ndq; ++q) {
          round_weights<V>(pchunk + dq[q].t * W, dq[q].vpar, words + q * kStride, ws + q, wpr + q);
        }
        float* accp = st->acc;
        for (int q = 0; q < ndq; ++q) {
          const int16_t* wq = words + q * kStride;
          const int64_t npairs = (dq[q].vpar + dq[q].n + 1) / 2;
          if constexpr (kCodes4)
            pv_rows_i4<V, 1>(&accp, &wq, ws + q, wpr + q, &dq[q].corr, &dq[q].vbias,
                             reinterpret_cast<const uint8_t*>(dq[q].vrows), Dv, npairs, &pf);
          else
            pv_rows_i16<V, 1>(&accp, &wq, ws + q, wpr + q, &dq[q].corr, reinterpret_cast<const int8_t*>(dq[q].vrows),
                              Dv, npairs, &pf);
        }
      }
    }
  }
  for (int64_t i = 0; i < valid; ++i)
    for (int64_t h = 0; h < G; ++h) {
      const int64_t r = h * S + i;
      st->l[r] += V::reduce_add(V::load(lsum + r * W));
    }
}

}  // namespace
}  // namespace simd
}  // namespace kernels
}  // namespace olep
