// A view of consecutive cached K/V rows: the unit the attention block
// iterator hands to kernels. Contiguous storage yields one block per
// (layer, sequence, kv head); paged storage yields one per page.
#pragma once

#include <cstdint>
#include <vector>

namespace olep {

/// Row r of the block holds absolute key position first_position + r. K rows
/// are head_dim elements apart, V rows v_head_dim elements apart, in the
/// cache element type.
struct KVBlock {
  const void* key = nullptr;
  const void* value = nullptr;
  int64_t first_position = 0;
  int64_t num_rows = 0;
};

/// The K/V blocks of every (sequence b, kv head h) of one attention call: blocks
/// [offsets[b * Hkv + h], offsets[b * Hkv + h + 1]) of `blocks`. Invariants: per (b, h) the
/// blocks are sorted by position and disjoint; a position no block covers is an absent key
/// (never read). Built once per call by the op's block source (dense tensors, or the cache's
/// page tables) and read-only while the kernels run.
struct BlockList {
  std::vector<KVBlock> blocks;
  std::vector<int64_t> offsets;  // [B * Hkv + 1]
};

}  // namespace olep
