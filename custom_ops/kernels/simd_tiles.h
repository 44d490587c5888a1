// Tile walking over the block list and software prefetch of the next tile (internal).
// Tile sizes: the row path uses V::W keys, the lanes path kLaneTileKeys.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstddef>

#include "kernels/attention.h"

namespace olep {
namespace kernels {
namespace simd {
namespace {  // internal linkage: each ISA translation unit its own copy (attention_simd.h)

// Keys per tile of the lanes path (32: halves the per-tile accumulator load/rescale/store
// against 16, measured 5-7% faster for MQA; scratch_floats in attention_common.cc sizes for it).
constexpr int kLaneTileKeys = 32;
// Tiles must divide 32: pages hold a multiple of 32 positions (kvcache/geometry.h), and a page end
// inside a tile would split it, so the online softmax would rescale at other places than over
// one block and paged results would part from one block's (tests/differential/
// test_paged_vs_ort.py; 64-key tiles measured 2-4% faster in cache at AVX-512 and broke it).
static_assert(32 % kLaneTileKeys == 0, "lanes-path tiles must divide the page-size multiple (32)");
// Keys per tile of the lanes path on a causal frontier (simd_lanes.h): a multiple of 8, a power
// of two, dividing kLaneTileKeys.
constexpr int kLaneFrontKeys = 16;
// Rows of the largest block the row path reads as one chunk for one query row: its K rows,
// then its V rows (simd_rows.h). A multiple of every W; scratch_floats in
// attention_common.cc sizes for it.
constexpr int kChunkKeys = 1024;

// How far ahead TilePrefetch::reset_next fetches: the tile after the next one. One tile ahead
// (a tile's compute of lead) left DRAM idle part of the time with several rows per KV head:
// Zen 4, paged from DRAM (tools/cpp/bench_paged_attention, alternating builds, time / read
// time): SmolLM2's shape (f32 8192 256 3 3 64) 1.25-1.27 -> 1.17; GQA 32/8 16K at AVX2 f32
// 1.43-1.46 -> 1.29-1.36, f16 4.61-4.64 -> 4.32-4.36 ms, bf16 4.80-4.87 -> 4.53-4.58 ms; at
// AVX-512 f16 and bf16 ~5% less time, f32 unchanged. Three or four tiles ahead measured no
// better than two; MQA (lanes path, compute-bound) unchanged.
constexpr int kPrefetchTilesAhead = 2;

// Spreads the software prefetch of the next tile's K and V rows over the current tile's
// compute, a line per step() (into L2): a burst of prefetches at the start of a tile
// fills the miss buffers and stalls the loads of the tile being computed.
struct TilePrefetch {
  // Lines [p, pend) are fetched next, then [q, qend); addresses as integers (an empty range
  // is 0, 0: no pointer arithmetic on null; pend = 0: nothing left).
  uintptr_t p = 0, pend = 0, q = 0, qend = 0;
  int64_t per_step = 64;  // bytes per step()
  // Rows to fetch: kb bytes of K from next_k, vb bytes of V from next_v, over `steps` calls of step().
  void reset(const char* next_k, int64_t kb, const char* next_v, int64_t vb, int64_t steps) {
    const uintptr_t kn = kb > 0 ? static_cast<uintptr_t>(kb) : 0, vn = vb > 0 ? static_cast<uintptr_t>(vb) : 0;
    const uintptr_t k = kn ? reinterpret_cast<uintptr_t>(next_k) : 0, v = vn ? reinterpret_cast<uintptr_t>(next_v) : 0;
    if (kn) p = k, pend = k + kn, q = v, qend = v + vn;
    else p = v, pend = v + vn, q = qend = 0;
    if (kb + vb <= 0) {  // nothing to fetch (one query row): no division on the per-tile path
      per_step = 64;
      return;
    }
    const int64_t lines = (kb + vb + 63) / 64;
    per_step = 64 * std::max<int64_t>(1, (lines + steps - 1) / std::max<int64_t>(steps, 1));
  }
  // Two passes, the first reading K rows and the second V rows: the K rows over the first
  // pass's k_steps calls of step(), then the V rows over the second's v_steps. Returns the V
  // rate, which the caller sets (set_rate) when its second pass starts: a field for it here
  // is one more register in the loops that step a local copy (scores_rows, pv_tile_rows:
  // GQA 32/8 fp16 in cache at AVX2 measured 7% slower with it). (kb or vb <= 0: one rate.)
  int64_t reset_split(const char* next_k, int64_t kb, int64_t k_steps, const char* next_v, int64_t vb,
                      int64_t v_steps) {
    reset(next_k, kb, next_v, vb, k_steps + v_steps);
    if (kb <= 0 || vb <= 0) return per_step;
    per_step = std::max<int64_t>(64, (kb + k_steps - 1) / std::max<int64_t>(k_steps, 1));
    return std::max<int64_t>(64, (vb + v_steps - 1) / std::max<int64_t>(v_steps, 1));
  }
  void set_rate(int64_t bytes_per_step) { per_step = bytes_per_step; }
  // The tile kPrefetchTilesAhead after the cursor's current one (TileCursor::peek), possibly
  // in a later block.
  template <class Cursor>
  void reset_next(const Cursor& tc, int64_t k_row_bytes, int64_t v_row_bytes, int64_t steps) {
    const char* nk = nullptr;
    const char* nv = nullptr;
    int64_t rows = 0;
    tc.peek(&nk, &nv, &rows, kPrefetchTilesAhead);
    reset(nk, rows * k_row_bytes, nv, rows * v_row_bytes, steps);
  }
  // The next per_step bytes of lines (K rows, then V rows), the same lines in the same order as
  // a byte counter over K then V, in fewer instructions: no K-or-V test per line (GQA 32/8 fp32,
  // AVX2, callgrind: 650 -> 590 instructions per key and kv head, the counter's step was 240 of
  // them; Zen 1: 1-4% less time per step, alternating builds of tools/cpp/bench_paged_attention).
  void step() {
    if (pend == 0) return;  // nothing left (a real range never ends at address 0)
    uintptr_t e = p + static_cast<uintptr_t>(per_step);
    if (e > pend) {  // this step crosses into the V rows
      for (; p < pend; p += 64) __builtin_prefetch(reinterpret_cast<const void*>(p), 0, 2);
      e = q + (e - pend);
      p = q, pend = qend, q = qend = 0;
      if (e > pend) e = pend;
    }
    for (; p < e; p += 64) __builtin_prefetch(reinterpret_cast<const void*>(p), 0, 2);
  }
};

// Walks the tiles of up to `tile` keys in [kmin, kmax), block by block. Tiles lie on the global
// grid of `tile` positions (a tile ends at the next multiple of `tile`), so with blocks that start
// on the grid (pages of a multiple of 32 positions) only the first tile of a call and the last of
// the range can be partial: page ends never split a tile. After next() returns true: j0 = first
// key, n = keys in the tile, end = the block's last key in range (exclusive), krows / vrows = row
// j0 of the block's K / V storage (quantized V: the row pair holding j0, vpar). peek() gives
// the following tile (in this block or the next), for the prefetcher to cross page ends. (A plain loop, not a callback: a lambda body sees its
// captures through a pointer, which measured 20% slower for MQA.)
struct TileCursor {
  const AttentionGroup& a;
  int64_t kmin, kmax, tile;
  size_t es;
  int64_t blk = -1, j0 = 0, n = 0, end = 0;
  const char* krows = nullptr;
  const char* vrows = nullptr;
  int64_t vpar = 0;  // quantized blocks: vrows is the V row pair holding j0, which is row vpar of it

  // The tile after (blk, j0, n) or the first one when blk < 0: false when there is none.
  bool locate(int64_t* b, int64_t* start, int64_t* count, int64_t* stop) const {
    int64_t bb = *b, s = *start, e = *stop;
    if (bb >= 0 && s < e) {
      // continue inside block bb from s
    } else {
      for (++bb; bb < a.num_blocks; ++bb) {
        const KVBlock& kb = a.blocks[bb];
        s = std::max(kmin, kb.first_position);
        e = std::min(kmax, kb.first_position + kb.num_rows);
        if (s < e) break;
      }
      if (bb >= a.num_blocks) return false;
    }
    *b = bb;
    *start = s;
    *stop = e;
    *count = std::min(e - s, tile - (s & (tile - 1)));  // tile: a power of two (W or kLaneTileKeys)
    return true;
  }
  bool next() {
    int64_t b = blk, s = blk >= 0 ? j0 + n : 0, e = end, c = 0;
    if (!locate(&b, &s, &c, &e)) return false;
    blk = b;
    j0 = s;
    end = e;
    n = c;
    rows_of(a.blocks[blk], j0, &krows, &vrows, &vpar);
    return true;
  }
  // K row of key j and its V row (native) or V row pair (quantized: the pair holding j, and
  // j's place in it), by the block's page row (kv_block.h).
  void rows_of(const KVBlock& kb, int64_t j, const char** k, const char** v, int64_t* par) const {
    const int64_t pr = kb.page_row + (j - kb.first_position);
    if (kb.encoding == KVEncoding::kInt4) {  // two codes per byte (kv_block.h)
      *k = static_cast<const char*>(kb.key) + static_cast<size_t>(pr * (a.head_dim / 2));
      *v = static_cast<const char*>(kb.value) + static_cast<size_t>((pr >> 1) * a.v_head_dim);
      *par = pr & 1;
      return;
    }
    *k = static_cast<const char*>(kb.key) + static_cast<size_t>(pr * a.head_dim) * es;
    if (kb.encoding == KVEncoding::kNative) {
      *v = static_cast<const char*>(kb.value) + static_cast<size_t>(pr * a.v_head_dim) * es;
      *par = 0;
    } else {
      *v = static_cast<const char*>(kb.value) + static_cast<size_t>((pr & ~int64_t{1}) * a.v_head_dim);
      *par = pr & 1;
    }
  }
  // The bytes of the block after the current one that the range reads, for a prefetch one
  // block ahead: its K rows (*k, *kb bytes) and its V rows (*v, *vb bytes; quantized blocks:
  // the V row pairs, extended over the page's scales and minimums when they follow the V codes
  // in the same page, as the cache lays them out: kvcache/quantize.h). *kb = *vb = 0 when there
  // is no next block in range.
  void next_block_bytes(const char** k, int64_t* kb, const char** v, int64_t* vb) const {
    *k = *v = nullptr;
    *kb = *vb = 0;
    int64_t nb = blk, s = 0, c = 0, e = 0;  // s >= e: locate takes the next block in range
    if (!locate(&nb, &s, &c, &e)) return;
    const KVBlock& b = a.blocks[nb];
    int64_t par = 0;
    rows_of(b, s, k, v, &par);
    const int64_t rows = e - s;
    if (b.encoding == KVEncoding::kNative) {
      *kb = rows * a.head_dim * static_cast<int64_t>(es);
      *vb = rows * a.v_head_dim * static_cast<int64_t>(es);
      return;
    }
    const bool int4 = b.encoding == KVEncoding::kInt4;
    const int64_t pairs = (par + rows + 1) / 2;
    *kb = rows * (int4 ? a.head_dim / 2 : a.head_dim);
    *vb = pairs * (int4 ? a.v_head_dim : 2 * a.v_head_dim);
    // the page's metadata after its V codes: up to the last scale (int4: minimum) of these rows
    const float* last = (int4 ? b.value_min : b.value_scale);
    if (last == nullptr) return;
    const uintptr_t vbeg = reinterpret_cast<uintptr_t>(*v);
    const uintptr_t mend = reinterpret_cast<uintptr_t>(last + b.page_row + (e - b.first_position));
    const uintptr_t vend = vbeg + static_cast<uintptr_t>(*vb);
    // (metadata elsewhere, as a test's hand-made block may have it: V codes only)
    const uintptr_t meta = static_cast<uintptr_t>(8 * (a.head_dim + b.page_row + b.num_rows) + 64);
    if (mend > vend && mend - vend <= meta) *vb = static_cast<int64_t>(mend - vbeg);
  }
  // Rows of the tile `ahead` tiles after the current one (1: the next), crossing into later
  // blocks: K at *k, V at *v, *count keys (0 past the end of the range).
  void peek(const char** k, const char** v, int64_t* count, int ahead = 1) const {
    int64_t b = blk, s = j0 + n, e = end, c = 0;
    for (int i = 0; i < ahead; ++i) {
      if (i > 0) s += c;
      if (!locate(&b, &s, &c, &e)) {
        *count = 0;
        return;
      }
    }
    int64_t par = 0;
    rows_of(a.blocks[b], s, k, v, &par);
    *count = c;
  }
};

}  // namespace
}  // namespace simd
}  // namespace kernels
}  // namespace olep
