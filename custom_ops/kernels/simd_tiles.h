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

// Keys per tile of the lanes path (32: halves the per-tile accumulator load/rescale/store
// against 16, measured 5-7% faster for MQA; scratch_floats in attention_common.cc sizes for it).
constexpr int kLaneTileKeys = 32;

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

}  // namespace simd
}  // namespace kernels
}  // namespace olep
