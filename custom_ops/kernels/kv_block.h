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
  /// int8, symmetric, over a whole page of page_tokens rows (an even number): with page row
  /// pr = page_row + r, K element (r, d) = key[pr * head_dim + d] * key_scale[d] (one scale per
  /// channel of the page) and V element (r, d) = value[int8_value_index(v_head_dim, pr, d)] *
  /// value_scale[pr] (one scale per row). V codes are stored in row pairs, channel-interleaved
  /// ([page_tokens / 2, v_head_dim, 2]: rows 2k and 2k + 1 of channel d side by side), so that a
  /// 16-bit pair dot product (VPDPWSSD / VPMADDWD) weighs two keys' codes of one channel at once.
  kInt8 = 1,
  /// 4-bit, asymmetric, over a whole page (page_tokens even): with page row pr = page_row + r,
  /// K element (r, d) = key_min[d] + code * key_scale[d] and V element (r, d) = value_min[pr] +
  /// code * value_scale[pr], codes in [0, 15] (int4_key_byte / int4_value_byte: two codes per
  /// byte, laid out for 16-bit unpacking; V in row pairs like kInt8).
  kInt4 = 2,
};

/// Row r of the block holds absolute key position first_position + r, stored as `encoding`
/// says. Native blocks: key / value point at the block's row 0, page_row is 0, key_scale /
/// value_scale are null. Quantized blocks: key, value, key_scale and value_scale point at the
/// page's row 0 (its codes and scales), and the block's row 0 is page row page_row.
struct KVBlock {
  const void* key = nullptr;
  const void* value = nullptr;
  int64_t first_position = 0;
  int64_t num_rows = 0;
  KVEncoding encoding = KVEncoding::kNative;
  const float* key_scale = nullptr;    // [head_dim]
  const float* value_scale = nullptr;  // [page_tokens] (quantized), indexed by page row
  int64_t page_row = 0;
  const float* key_min = nullptr;      // kInt4: [head_dim]
  const float* value_min = nullptr;    // kInt4: [page_tokens], indexed by page row
};

/// Index of V element (page row pr, channel d) in an int8 page's V codes (KVEncoding::kInt8).
inline int64_t int8_value_index(int64_t v_head_dim, int64_t pr, int64_t d) {
  return (pr >> 1) * 2 * v_head_dim + 2 * d + (pr & 1);
}

/// int4 K codes (KVEncoding::kInt4): row pr holds head_dim / 2 bytes; in each group of 32
/// channels g, byte 16 g + i holds channel 32 g + i (low nibble) and 32 g + 16 + i (high).
/// The byte holding K element (pr, d), and whether it is the high nibble.
inline int64_t int4_key_byte(int64_t head_dim, int64_t pr, int64_t d, bool* high) {
  *high = (d & 16) != 0;
  return pr * (head_dim / 2) + (d >> 5) * 16 + (d & 15);
}
/// int4 V codes: row pair k = pr / 2 holds v_head_dim bytes; in each group of 32 channels g,
/// byte 32 g + 2 i + (pr & 1) holds channel 32 g + i (low nibble) and 32 g + 16 + i (high) of
/// row pr, so bytes zero-extended to 16 bits give (row 2k, row 2k+1) pairs per 32-bit lane.
inline int64_t int4_value_byte(int64_t v_head_dim, int64_t pr, int64_t d, bool* high) {
  *high = (d & 16) != 0;
  return (pr >> 1) * v_head_dim + (d >> 5) * 32 + 2 * (d & 15) + (pr & 1);
}
/// The code of int4 K element (pr, d) / V element (pr, d).
inline int int4_key_code(const void* codes, int64_t head_dim, int64_t pr, int64_t d) {
  bool high;
  const uint8_t b = static_cast<const uint8_t*>(codes)[int4_key_byte(head_dim, pr, d, &high)];
  return high ? b >> 4 : b & 15;
}
inline int int4_value_code(const void* codes, int64_t v_head_dim, int64_t pr, int64_t d) {
  bool high;
  const uint8_t b = static_cast<const uint8_t*>(codes)[int4_value_byte(v_head_dim, pr, d, &high)];
  return high ? b >> 4 : b & 15;
}

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
