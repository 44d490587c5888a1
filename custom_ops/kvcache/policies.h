// Sliding-window eviction arithmetic (positions are absolute; a block is
// page_tokens positions). Pure functions, no state.
#pragma once

#include <cstdint>

namespace olep {
namespace policies {

/// First block a sliding-window layer keeps once its sequence holds `len` positions: blocks
/// that lie wholly before len - window - rollback are released. 0 = keep all.
inline int64_t keep_from_block(int64_t len, int64_t window, int64_t rollback, int64_t page_tokens) {
  if (window <= 0) return 0;
  const int64_t keep_pos = len - window - rollback;
  return keep_pos <= 0 ? 0 : keep_pos / page_tokens;
}

/// Shortest non-zero length a table whose blocks start at `first_block` may be truncated to:
/// the query at that position sees keys (len - window, len], which must all still be held.
/// 0 when nothing was evicted.
inline int64_t earliest_length(int64_t first_block, int64_t window, int64_t page_tokens) {
  if (window <= 0 || first_block == 0) return 0;
  return first_block * page_tokens + window - 1;
}

}  // namespace policies
}  // namespace olep
