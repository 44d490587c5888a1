// Row copies into cache pages (the arena's append): plain stores for a few rows, streaming
// (non-temporal) stores for many.
#pragma once

#include <cstddef>
#include <cstdint>

namespace olep {
namespace kernels {

/// Rows of an append at or above which copy_rows streams (a prefill chunk); a decode step's
/// rows stay cached for the attention that reads them next.
constexpr int64_t kStreamCopyRows = 64;

/// Copies `rows` rows of `row_bytes` bytes from `src` (rows `src_stride` bytes apart) to `dst`
/// (rows back to back). With `streaming` (and dst 64-byte aligned, row_bytes a multiple of 64),
/// dst is written with non-temporal stores, whole lines: no read for ownership of lines that
/// are about to be overwritten (a prefill's K/V rows into freshly faulted pages: half the memory
/// traffic), and the rows leave the caches; otherwise memcpy. The
/// caller issues stream_fence() before anything else may read dst (another thread included).
void copy_rows(void* dst, const void* src, int64_t rows, size_t row_bytes, size_t src_stride, bool streaming);
/// Orders the streaming stores of copy_rows before later stores (SFENCE; a no-op without SSE2).
void stream_fence();

}  // namespace kernels
}  // namespace olep
