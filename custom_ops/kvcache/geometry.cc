#include "kvcache/geometry.h"

#include <stdexcept>
#include <string>

namespace olep {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

void in_range(int64_t v, int64_t lo, int64_t hi, const char* name) {
  if (v < lo || v > hi)
    throw std::invalid_argument(std::string(name) + " must be in [" + str(lo) + ", " + str(hi) + "]; got " + str(v));
}

}  // namespace

const char* kv_quant_name(KVQuant q) {
  switch (q) {
    case KVQuant::kNone: return "none";
    case KVQuant::kInt8: return "int8";
    case KVQuant::kInt4: return "int4";
  }
  return "unknown";
}

KVQuant parse_kv_quant(const std::string& s) {
  if (s.empty() || s == "none") return KVQuant::kNone;
  if (s == "int8") return KVQuant::kInt8;
  if (s == "int4") return KVQuant::kInt4;
  throw std::invalid_argument("kv_quant must be None, 'int8' or 'int4'; got '" + s + "'");
}

int64_t default_page_tokens(int64_t head_dim, int64_t v_head_dim, DType dtype) {
  in_range(head_dim, 1, 4096, "head_dim");
  in_range(v_head_dim, 1, 4096, "v_head_dim");
  const int64_t row = (head_dim + v_head_dim) * static_cast<int64_t>(dtype_size(dtype));
  int64_t t = kMinDefaultPageTokens;
  while (t < kMaxDefaultPageTokens && t * row < kDefaultPageBytes) t *= 2;
  return t;
}

void CacheGeometry::validate() const {
  in_range(num_layers, 1, 4096, "num_layers");
  in_range(batch_size, 1, 65536, "batch_size");
  in_range(kv_num_heads, 1, 4096, "kv_num_heads");
  in_range(head_dim, 1, 4096, "head_dim");
  in_range(v_head_dim, 1, 4096, "v_head_dim");
  in_range(max_sequence_length, 1, int64_t{1} << 24, "max_sequence_length");
  if (memory_limit_bytes < 0)
    throw std::invalid_argument("memory_limit_bytes must be >= 0 (0 = no limit); got " + str(memory_limit_bytes));
  in_range(page_tokens, kPageTokenMultiple, int64_t{1} << 16, "page_tokens");
  if (page_tokens % kPageTokenMultiple != 0)
    throw std::invalid_argument("page_tokens must be a multiple of " + str(kPageTokenMultiple) + "; got " +
                                str(page_tokens));
  if (!sliding_window.empty() && static_cast<int64_t>(sliding_window.size()) != num_layers)
    throw std::invalid_argument("sliding_window must have num_layers=" + str(num_layers) + " entries; got " +
                                str(static_cast<int64_t>(sliding_window.size())));
  // A window wider than max_sequence_length is allowed: it never evicts.
  for (size_t l = 0; l < sliding_window.size(); ++l)
    if (sliding_window[l] < 0 || sliding_window[l] > (int64_t{1} << 24))
      throw std::invalid_argument("sliding_window[" + str(static_cast<int64_t>(l)) + "] must be 0 (none) or in [1, " +
                                  "16777216]; got " + str(sliding_window[l]));
  in_range(rollback_tokens, 0, max_sequence_length, "rollback_tokens");
  if (kv_quant != KVQuant::kNone && kv_quant != KVQuant::kInt8 && kv_quant != KVQuant::kInt4)
    throw std::invalid_argument("kv_quant must be none, int8 or int4; got " + str(static_cast<int64_t>(kv_quant)));
  if (kv_quant == KVQuant::kInt4 && (head_dim % 32 != 0 || v_head_dim % 32 != 0))
    throw std::invalid_argument("kv_quant='int4' needs head_dim and v_head_dim multiples of 32 (its code layout); got " +
                                str(head_dim) + " and " + str(v_head_dim));
  in_range(recent_tokens, 0, int64_t{1} << 24, "recent_tokens");
  in_range(sink_tokens, 0, int64_t{1} << 24, "sink_tokens");
}

}  // namespace olep
