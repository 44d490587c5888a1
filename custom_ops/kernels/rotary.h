// Rotary position embedding (RoPE) of one head row, as ONNX Runtime applies it
// for com.microsoft RotaryEmbedding and GroupQueryAttention(do_rotary=1)
// (ORT contrib ops doc docs/ContribOperators.md, RotaryEmbedding and
// GroupQueryAttention; ORT's CPU path calls MLAS MlasRotaryEmbedOneRow per
// head row). Pure compute: no ORT, no allocation, no threads.
//
// For a row x of head_dim elements and the cos/sin cache rows c, s of the
// token's position (rotary_dim/2 elements each):
//   non-interleaved: pairs (x[i], x[i + rotary_dim/2]), i < rotary_dim/2
//   interleaved:     pairs (x[2i], x[2i + 1]),        i < rotary_dim/2
//   (a, b) -> (a*c[i] - b*s[i], b*c[i] + a*s[i]); x[rotary_dim, head_dim) copied.
// Arithmetic in float32 for every element type, rounded once to the storage
// type. The float32 rounding follows ORT's CPU kernel bit for bit: where MLAS
// uses its AVX2 kernel (CPU with AVX2 and FMA) the first product of each output
// is fused (fma(a, c, -(b*s)), fma(a, s, b*c)); elsewhere products are rounded
// separately. float16 and bfloat16 always use the separate-product form (ORT's
// CPU GroupQueryAttention has no bfloat16 kernel: that form is ours).
#pragma once

#include <cstdint>

#include "common/dtype.h"

namespace olep {
namespace kernels {

/// True when ORT's float32 rotary on this CPU fuses the first product (AVX2 + FMA present).
/// Detected once; thread-safe.
bool ort_rotary_fused_fp32();

/// Rotates one row. `in`, `out`: head_dim elements of `dt`; `cos`, `sin`: rotary_dim/2
/// elements of `dt`. Requires 0 < rotary_dim <= head_dim, rotary_dim even (the caller
/// validates); `out` must not overlap `in`. O(head_dim), never throws.
void rotary_row(DType dt, const void* in, const void* cos, const void* sin, int64_t rotary_dim, int64_t head_dim,
                bool interleaved, void* out);

}  // namespace kernels
}  // namespace olep
