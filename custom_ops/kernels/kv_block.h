// A view of consecutive cached K/V rows: the unit the attention block
// iterator hands to kernels. Contiguous storage yields one block per
// (layer, sequence, kv head); paged or quantized storage will yield more.
#pragma once

#include <cstdint>

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

}  // namespace olep
