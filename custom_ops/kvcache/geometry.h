// CacheGeometry: the shape, limits and policies of one KVCache, and the byte
// sizes derived from it. No ORT, no ONNX.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/dtype.h"

namespace olep {

/// The default page holds at least this many bytes of K and V: at 64 KiB a page read from a
/// new address costs 1.12-1.14x the same bytes read in one contiguous block on Zen 4, at 128
/// KiB 1.00-1.03x (tools/cpp/bench_scattered_read; BENCHMARKS.md, "paged vs one block"); on
/// another Zen 4 host 1.06-1.08x at 128 KiB and 1.00-1.02x at 256 KiB. A prefill's pages of one
/// head are consecutive (step.cc), so only the pages a decode adds one at a time pay it; a
/// larger page would double the copy-on-write of a forked tail and the slack per head.
constexpr int64_t kDefaultPageBytes = int64_t{128} << 10;
/// Fewest and most positions of a default page (the most: the row path's one-chunk block).
constexpr int64_t kMinDefaultPageTokens = 128;
constexpr int64_t kMaxDefaultPageTokens = 1024;
/// Default page_tokens for rows of head_dim + v_head_dim elements of `dtype`: the smallest power
/// of two in [128, 1024] whose page holds kDefaultPageBytes (256 for fp16/bf16 and head_dim 128,
/// 128 for float32, 512 for fp16 and head_dim 64). head_dim, v_head_dim >= 1.
int64_t default_page_tokens(int64_t head_dim, int64_t v_head_dim, DType dtype);
/// Default page_tokens before this geometry's sizes are known (C++ callers that set no size).
constexpr int64_t kDefaultPageTokens = 128;
/// page_tokens must be a multiple of this (the kernels' key tile, so tiles end on page ends).
constexpr int64_t kPageTokenMultiple = 32;

/// Quantization of cold pages (docs/API.md, "Quantized pages"): kNone keeps every page in the
/// cache dtype; kInt8 stores pages that left the recent window as int8 with per-page scales,
/// kInt4 as 4-bit codes with per-page minimums and scales (head_dim and v_head_dim multiples
/// of 32). The value is the page's KVEncoding.
enum class KVQuant : int { kNone = 0, kInt8 = 1, kInt4 = 2 };
const char* kv_quant_name(KVQuant q);
/// "none" (or ""), "int8", "int4"; std::invalid_argument naming the accepted values otherwise.
KVQuant parse_kv_quant(const std::string& s);

/// Shape, limits and policies of a cache. Counts are >= 1 unless noted.
struct CacheGeometry {
  int64_t num_layers = 0;
  int64_t batch_size = 0;
  int64_t kv_num_heads = 0;
  int64_t head_dim = 0;
  int64_t v_head_dim = 0;
  int64_t max_sequence_length = 0;  // tokens per sequence (a limit; nothing is reserved for it)
  DType dtype = DType::kFloat32;
  int64_t memory_limit_bytes = 0;   // quota on the cache's page bytes; 0 = none
  int64_t page_tokens = kDefaultPageTokens;
  /// Per layer: 0 = keep every position; W > 0 = sliding-window eviction of positions that lie
  /// before seq_len - W - rollback_tokens (whole pages). Empty = no layer evicts.
  std::vector<int64_t> sliding_window;
  int64_t rollback_tokens = 0;      // >= 0: positions kept beyond the window for truncate
  /// Cold-page quantization: a block whose positions all lie at or after sink_tokens and before
  /// seq_len - recent_tokens is quantized when a step commits (whole pages: a page holding any
  /// sink position stays native).
  KVQuant kv_quant = KVQuant::kNone;
  int64_t recent_tokens = 0;        // >= 0: newest positions kept native
  int64_t sink_tokens = 0;          // >= 0: first positions kept native (attention sinks)

  /// Throws std::invalid_argument naming the first bad field and its accepted range.
  void validate() const;
  int64_t window(int64_t layer) const {
    return sliding_window.empty() ? 0 : sliding_window[static_cast<size_t>(layer)];
  }
  bool evicts() const {
    for (int64_t w : sliding_window)
      if (w > 0) return true;
    return false;
  }
  size_t elem_bytes() const { return dtype_size(dtype); }
  /// Bytes of one page: K rows [page_tokens, head_dim] then V rows [page_tokens, v_head_dim].
  int64_t page_bytes() const { return page_tokens * (head_dim + v_head_dim) * static_cast<int64_t>(elem_bytes()); }
  /// Offset of the V rows within a page.
  int64_t value_offset() const { return page_tokens * head_dim * static_cast<int64_t>(elem_bytes()); }
  /// Bytes of one quantized page (quantize.h has the layouts): the codes (int8: one byte per
  /// element, int4: half a byte), then the float32 metadata (int8: K scales [head_dim], V scales
  /// [page_tokens]; int4: K minimums and scales [head_dim] each, V minimums and scales
  /// [page_tokens] each); rounded up to 64.
  int64_t quant_page_bytes() const { return (quant_scale_offset() + quant_meta_bytes() + 63) / 64 * 64; }
  int64_t quant_value_offset() const { return kv_quant == KVQuant::kInt4 ? page_tokens * head_dim / 2 : page_tokens * head_dim; }
  int64_t quant_scale_offset() const {
    const int64_t codes = page_tokens * (head_dim + v_head_dim);
    return kv_quant == KVQuant::kInt4 ? codes / 2 : codes;
  }
  int64_t quant_meta_bytes() const { return (kv_quant == KVQuant::kInt4 ? 8 : 4) * (head_dim + page_tokens); }
  /// First block that may be quantized (blocks holding a sink position stay native).
  int64_t first_quant_block() const { return (sink_tokens + page_tokens - 1) / page_tokens; }
  /// K+V bytes of one position over all kv heads of one layer.
  int64_t row_bytes() const { return kv_num_heads * (head_dim + v_head_dim) * static_cast<int64_t>(elem_bytes()); }
};

}  // namespace olep
