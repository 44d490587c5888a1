// Rotary position embedding (RoPE) of one head row, as ORT applies it for
// com.microsoft RotaryEmbedding and GroupQueryAttention(do_rotary=1)
// (ORT contrib ops doc, RotaryEmbedding; MLAS MlasRotaryEmbedOneRow). ORT-free.
//
// For a row x of head_dim elements, a cos/sin cache row c, s of rotary_dim/2
// elements (the cache row of the token's position):
//   non-interleaved: pairs (x[i], x[i + rotary_dim/2]), i < rotary_dim/2
//   interleaved:     pairs (x[2i], x[2i + 1]),        i < rotary_dim/2
//   (a, b) -> (a*c[i] - b*s[i], b*c[i] + a*s[i]); x[rotary_dim, head_dim) copied.
// Arithmetic in float32, rounded once to the storage type. The rounding of the
// float32 case follows ORT's CPU kernel bit for bit: where MLAS uses its AVX2
// kernel (CPU with AVX2 and FMA) the first product of each output is fused
// (fma(a, c, -(b*s)), fma(a, s, b*c)); elsewhere products are rounded
// separately. float16 always uses the separate-product form.
#pragma once

#include <cstdint>

#include "common/dtype.h"

namespace olep {
namespace ops {

/// True when ORT's float32 rotary on this CPU fuses the first product (AVX2 + FMA present).
/// Detected once; thread-safe.
bool ort_rotary_fused_fp32();

/// Rotates one row. `in`, `out`: head_dim elements of `dt` (float32 or float16);
/// `cos`, `sin`: rotary_dim/2 elements of `dt`. Requires 0 < rotary_dim <= head_dim,
/// rotary_dim even; `out` must not overlap `in`. Throws std::invalid_argument for bfloat16.
void rotary_row(DType dt, const void* in, const void* cos, const void* sin, int64_t rotary_dim, int64_t head_dim,
                bool interleaved, void* out);

}  // namespace ops
}  // namespace olep
