// A view of consecutive cached K/V rows: the unit the attention block
// iterator hands to kernels. Contiguous storage yields one block per
// (layer, sequence, kv head); paged storage yields one per page.
#pragma once

#include <cstdint>
#include <vector>

namespace olep {

/// How a block's rows are stored (docs/API.md, "Quantized pages").
enum class KVEncoding : uint8_t {
  /// The cache element type: K rows head_dim elements apart, V rows v_head_dim apart.
  kNative = 0,
  /// int8, symmetric: K element (r, d) = key[r * head_dim + d] * key_scale[d] (one scale per
  /// channel of the page), V element (r, d) = value[r * v_head_dim + d] * value_scale[r] (one
  /// scale per row).
  kInt8 = 1,
};

/// Row r of the block holds absolute key position first_position + r, stored as `encoding`
/// says; key_scale / value_scale are null for native blocks, and value_scale points at the
/// scale of the block's row 0.
struct KVBlock {
  const void* key = nullptr;
  const void* value = nullptr;
  int64_t first_position = 0;
  int64_t num_rows = 0;
  KVEncoding encoding = KVEncoding::kNative;
  const float* key_scale = nullptr;    // [head_dim]
  const float* value_scale = nullptr;  // [num_rows]
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
