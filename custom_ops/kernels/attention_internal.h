// Helpers shared by the attention kernels of every ISA level (internal).
#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>

#include "common/dtype.h"
#include "kernels/attention.h"

namespace olep {
namespace kernels {
namespace detail {

/// q . k is summed in partial sums over blocks of kScoreBlock elements of head_dim, then the
/// blocks added in order (the scalar level and the SIMD lanes path, simd_lanes.h): a single
/// float32 chain over all of head_dim (128) has ~2x the rounding error of blocked or pairwise
/// sums (rms 7.3e-6 against 3.5e-6 at |score| ~ 35), enough to exceed the fp32 tolerance at
/// large scores (tests/differential/test_large_scores.py).
/// (The SIMD row path's W lane accumulators are such blocks already.)
constexpr int64_t kScoreBlock = 16;

/// How finalize writes row r (row i of its head, `valid` valid rows) of state s, at every level:
/// out = acc * inv when inv != 0, else every element is `fill`: the default NaN when a NaN reached
/// the row's sum (ONNX Attention propagates it), zeros when no key was visible or the row is
/// padding. Neither case reads acc: acc * 0 is NaN where acc holds a NaN or inf, and acc * NaN
/// keeps whichever NaN payload the compiler's operand order picks (bfloat16 keeps payloads).
struct RowScale {
  float inv, fill;
};
inline RowScale finalize_row_scale(const AttentionState& s, int64_t r, int64_t i, int64_t valid) {
  if (i >= valid) return {0.0f, 0.0f};
  const float l = s.l[r];
  if (std::isnan(l)) return {0.0f, NAN};
  return {l > 0.0f ? 1.0f / l : 0.0f, 0.0f};
}

/// q . k in float32 by kScoreBlock partial sums.
inline float dot_blocked(const float* q, const float* k, int64_t D) {
  float s = 0.0f;
  for (int64_t d0 = 0; d0 < D; d0 += kScoreBlock) {
    const int64_t d1 = d0 + kScoreBlock < D ? d0 + kScoreBlock : D;
    float p = 0.0f;
    for (int64_t d = d0; d < d1; ++d) p += q[d] * k[d];
    s += p;
  }
  return s;
}

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

/// Whether quantized (int8, int4) blocks are attended in 16-bit fixed point (int8_query), or,
/// when not, by dequantized float K (every level decides the same way, over every quantized
/// block of the call): max |q| times the largest K scale (and int4 |minimum|) stays well inside
/// float32 (q is read in its storage type; scales are >= 0; a NaN in q: false, so the row's
/// scores are NaN as on native pages). A code 0 times an infinite q * scale would be NaN where
/// code * scale is 0.
inline bool int8_fixed_point(const AttentionGroup& a) {
  float ks = 0.0f;
  bool any = false;
  for (int64_t b = 0; b < a.num_blocks; ++b) {
    const KVBlock& kb = a.blocks[b];
    if (kb.encoding == KVEncoding::kNative) continue;
    any = true;
    for (int64_t d = 0; d < a.head_dim; ++d) ks = std::max(ks, kb.key_scale[d]);
    if (kb.encoding == KVEncoding::kInt4)
      for (int64_t d = 0; d < a.head_dim; ++d) ks = std::max(ks, std::fabs(kb.key_min[d]));
  }
  if (!any) return false;
  float qm = 0.0f;
  const int64_t valid = std::min(a.num_valid_rows, a.num_rows);
  for (int64_t h = 0; h < a.group_size; ++h)
    for (int64_t i = 0; i < valid; ++i)
      for (int64_t d = 0; d < a.head_dim; ++d) {
        const float x = std::fabs(load(a.dtype, a.q, h * a.q_head_stride + i * a.q_row_stride + d));
        if (std::isnan(x)) return false;  // (std::max would drop it and take the fixed point)
        qm = std::max(qm, x);
      }
  return qm * std::max(a.scale, 1.0f) * ks < 1e30f;
}

/// Largest |q16| of int8_query: int32 sums of head_dim products with |code| <= 127 stay below 2^31.
inline float int8_query_max(int64_t head_dim) {
  return static_cast<float>(std::min<int64_t>(32767, 2147483647 / (127 * head_dim)));
}

/// A query row in 16-bit fixed point against one int8 page (docs/API.md, "Quantized pages"):
/// x_d = qs[d] * key_scale[d] (float32; qs = q * scale, or q alone with softcap), m = max |x_d|,
/// q16[d] = round_half_even(x_d * (qmax / m)) (qmax = int8_query_max), returns sq = m / qmax, so
/// that q . k = sq * sum_d q16[d] * code[d] (exact int32 sums) up to |x_d - sq * q16[d]| <= sq / 2.
/// (A max below 2^-100 is first scaled by 2^100, exactly, and so is each x_d before the
/// multiply by qmax / m, so that no factor overflows.) The SIMD
/// levels compute the same q16 and sq with the same float32 operations.
inline float int8_query(const float* qs, const float* key_scale, int64_t D, int16_t* q16) {
  float m = 0.0f;
  for (int64_t d = 0; d < D; ++d) m = std::max(m, std::fabs(qs[d] * key_scale[d]));
  const float qmax = int8_query_max(D);
  const float pre = m < 0x1p-100f ? 0x1p100f : 1.0f;
  m *= pre;
  const float inv = m > 0.0f ? qmax / m : 0.0f;
  // x_d * pre first (exact), then * inv: pre * inv itself overflows float32 for m below about 2^-113
  for (int64_t d = 0; d < D; ++d) q16[d] = static_cast<int16_t>(std::nearbyint(((qs[d] * key_scale[d]) * pre) * inv));
  return m / qmax / pre;
}

/// int4 pages: the part of a score the K minimums give, sum_d qs[d] * key_min[d] (float32).
inline float int4_bias(const float* qs, const float* key_min, int64_t D) {
  float b = 0.0f;
  for (int64_t d = 0; d < D; ++d) b += qs[d] * key_min[d];
  return b;
}

}  // namespace detail
}  // namespace kernels
}  // namespace olep
