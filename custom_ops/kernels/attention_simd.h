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
//
// The pieces: simd_common.h (loaders, dot policies), simd_tiles.h (tile cursor, prefetch),
// simd_pv.h (P.V), simd_rows.h (row path; its score loops in simd_row_scores.h, its int8 /
// int4 code pieces in simd_row_codes.h), simd_lanes.h (lanes path; its micro-kernels in
// simd_lane_kernels.h); this header picks the path per call.
//
// Everything in these headers sits in an unnamed namespace inside olep::kernels::simd: each
// ISA translation unit keeps its own copy of every function, compiled with its own flags. With
// external linkage, an out-of-line inline function (TilePrefetch::step and TileCursor::next
// were weak symbols of libonnx_light.so) is one copy for all levels, whichever translation unit
// the linker kept: an AVX-512 copy of it would run on an AVX2-only CPU.
#pragma once

#include "kernels/simd_lanes.h"
#include "kernels/simd_rows.h"

namespace olep {
namespace kernels {
namespace simd {
namespace {  // internal linkage: each ISA translation unit its own copy (attention_simd.h)

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

// The level V with every float32 vector load split into two loads of half a cache line each
// (V::load_halves). One float32 query row per KV head (MHA decode) runs on it at levels whose
// vectors are whole lines: that row's K and V rows stream from DRAM behind the hardware
// prefetchers alone (no software prefetch at AVX-512, simd_rows.h), and with one 64-byte load
// per line they streamed slower than with two 32-byte loads, as the 16-bit rows' converting
// loads read them. Zen 4, 1 thread, time / read time (tools/bench_decode.py, MHA 32/32 fp32,
// runs alternating): 4K 1.35-1.41 -> 1.12, 16K 1.28-1.33 -> 1.12-1.26; the kernel alone
// (tools/cpp/bench_paged_attention f32 16384 256 32 1 128 8) 21.0-23.8 -> 19.0-21.7 ms, at the
// avx512 level likewise. In L2 (1K keys, one head) it costs 3%, and with 2 or 3 rows per KV
// head it measured slower from DRAM too (GQA 16/8: 1.53 -> 1.81 the read time), so only here.
// (The results are the same: the same values are loaded.)
template <class B>
struct HalfLineLoads : B {
  static typename B::vf load(const float* p) { return B::load_halves(p); }
};

// Keys [key_begin, key_end) whose blocks all have encoding `enc`.
template <class V>
void attend_run(const AttentionGroup& a, int64_t key_begin, int64_t key_end, AttentionState* st, float* scratch,
                KVEncoding enc) {
  const int64_t group_rows = a.group_size * std::min(a.num_valid_rows, a.num_rows);
  if (a.mask.kind == MaskKind::kNone && group_rows >= lanes_min_rows<V>()) {
    attend_lanes<V>(a, key_begin, key_end, st, scratch, enc, enc != KVEncoding::kNative && detail::int8_fixed_point(a));
    return;
  }
  if (enc != KVEncoding::kNative) {
    // int8: scores with q in 16-bit fixed point per (row, page) (detail::int8_query) unless q
    // times the K scales could overflow float32 (detail::int8_fixed_point: then dequantized K).
    // Few rows read the codes directly (exact int32 sums, simd_rows.h); many rows, or a head_dim
    // the int16 vectors do not divide, convert each tile to float once (simd_common.h) and take
    // the same fixed-point q as float.
    // int4 likewise (simd_quant4.h), head_dim a multiple of 4 W there.
    const bool fixed = detail::int8_fixed_point(a);
    const bool rows_ok = fixed && group_rows < kConvertTileRows && group_rows <= kCodesMaxRows;
    if (enc == KVEncoding::kInt4 && rows_ok && a.head_dim % (4 * V::W) == 0)
      attend_impl<V, LoadI4<V>, false>(a, key_begin, key_end, st, scratch, enc);
    else if (enc == KVEncoding::kInt8 && rows_ok && a.head_dim % (2 * V::W) == 0)
      attend_impl<V, LoadI8<V>, false>(a, key_begin, key_end, st, scratch, enc);
    else attend_impl<V, LoadF32<V>, true>(a, key_begin, key_end, st, scratch, enc, fixed);
    return;
  }
  const bool tiles = group_rows >= kConvertTileRows;
  switch (a.dtype) {
    case DType::kFloat32:
      if constexpr (V::kHalfLineLoads) {
        if (group_rows == 1) {
          attend_impl<HalfLineLoads<V>, LoadF32<HalfLineLoads<V>>, false>(a, key_begin, key_end, st, scratch);
          return;
        }
      }
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

// Splits the key range into runs of blocks of one encoding (blocks are sorted and disjoint;
// a (sequence, head) holds native sink pages, quantized cold pages, then native recent
// pages), each run attended into the same online-softmax state: one pass in key order.
template <class V>
void attend_range(const AttentionGroup& a, int64_t key_begin, int64_t key_end, AttentionState* st, float* scratch) {
  constexpr int W = V::W;
  if (a.head_dim % W != 0 || a.v_head_dim % W != 0) {
    attend_range_scalar(a, key_begin, key_end, st, scratch);
    return;
  }
  int64_t b = 0;
  while (b < a.num_blocks && a.blocks[b].encoding == KVEncoding::kNative) ++b;
  if (b == a.num_blocks) {  // all native (contiguous and unquantized caches)
    attend_run<V>(a, key_begin, key_end, st, scratch, KVEncoding::kNative);
    return;
  }
  for (b = 0; b < a.num_blocks;) {
    const KVEncoding enc = a.blocks[b].encoding;
    int64_t e = b + 1;
    while (e < a.num_blocks && a.blocks[e].encoding == enc) ++e;
    // Run [b, e): from its first position (the first run from key_begin) to the next run's.
    const int64_t lo = b == 0 ? key_begin : std::max(key_begin, a.blocks[b].first_position);
    const int64_t hi = e == a.num_blocks ? key_end : std::min(key_end, a.blocks[e].first_position);
    if (lo < hi) attend_run<V>(a, lo, hi, st, scratch, enc);
    b = e;
  }
}

}  // namespace
}  // namespace simd
}  // namespace kernels
}  // namespace olep
