// Helpers shared by the attention kernels of every ISA level (internal).
#pragma once

#include <cfloat>
#include <cstdint>

#include "common/dtype.h"
#include "kernels/attention.h"

namespace olep {
namespace kernels {
namespace detail {

inline float lowest_of(DType t) {
  switch (t) {
    case DType::kFloat32: return -FLT_MAX;
    case DType::kFloat16: return -65504.0f;
    case DType::kBFloat16: return bf16_to_float(0xff7fu);
  }
  return -FLT_MAX;
}

inline float load(DType t, const void* p, int64_t i) {
  switch (t) {
    case DType::kFloat32: return static_cast<const float*>(p)[i];
    case DType::kFloat16: return half_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::kBFloat16: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
  }
  return 0.0f;
}

inline void store(DType t, void* p, int64_t i, float v) {
  switch (t) {
    case DType::kFloat32: static_cast<float*>(p)[i] = v; return;
    case DType::kFloat16: static_cast<uint16_t*>(p)[i] = float_to_half(v); return;
    case DType::kBFloat16: static_cast<uint16_t*>(p)[i] = float_to_bf16(v); return;
  }
}

/// Additive bias of key j for (head h, row i), or -inf when masked out.
inline float mask_bias(const MaskView& m, int64_t h, int64_t i, int64_t j, float lowest) {
  if (m.kind == MaskKind::kNone) return 0.0f;
  const int64_t o = h * m.head_stride + i * m.row_stride + j * m.key_stride;
  if (m.kind == MaskKind::kBool) return static_cast<const uint8_t*>(m.data)[o] ? 0.0f : -INFINITY;
  const float b = load(m.dtype, m.data, o);
  return b <= lowest ? -INFINITY : b;  // NaN stays NaN (and makes the row NaN)
}

/// Keys visible to query row i: [lo, hi), ignoring the mask tensor.
inline void visible_range(const AttentionGroup& a, int64_t i, int64_t* lo, int64_t* hi) {
  const int64_t pos = a.q_offset + i;
  *hi = a.is_causal ? (pos + 1 < a.num_keys ? pos + 1 : a.num_keys) : a.num_keys;
  *lo = a.local_window_size > 0 && pos - a.local_window_size + 1 > 0 ? pos - a.local_window_size + 1 : 0;
}

/// Union of the visible ranges of rows 0..num_valid_rows-1: [*lo, *hi) (empty: lo >= hi).
inline void visible_union(const AttentionGroup& a, int64_t* lo, int64_t* hi) {
  const int64_t valid = a.num_valid_rows < a.num_rows ? a.num_valid_rows : a.num_rows;
  *lo = a.num_keys;
  *hi = 0;
  for (int64_t i = 0; i < valid; ++i) {
    int64_t l, h;
    visible_range(a, i, &l, &h);
    *lo = l < *lo ? l : *lo;
    *hi = h > *hi ? h : *hi;
  }
}

}  // namespace detail
}  // namespace kernels
}  // namespace olep
