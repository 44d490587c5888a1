// Built with -ffp-contract=off (CMakeLists.txt): the separate-product form must
// not be contracted into FMAs by the compiler, the fused form uses std::fma.
#include "ops/rotary.h"

#include <cmath>
#include <cstring>
#include <stdexcept>

namespace olep {
namespace ops {
namespace {

// Pair index i -> positions (ia, ib) of its two elements.
inline void pair_at(int64_t i, int64_t half, bool interleaved, int64_t* ia, int64_t* ib) {
  if (interleaved) {
    *ia = 2 * i;
    *ib = 2 * i + 1;
  } else {
    *ia = i;
    *ib = i + half;
  }
}

void rotate_f32(const float* x, const float* c, const float* s, int64_t rotary_dim, bool interleaved, bool fused,
                float* y) {
  const int64_t half = rotary_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    int64_t ia, ib;
    pair_at(i, half, interleaved, &ia, &ib);
    const float a = x[ia], b = x[ib];
    if (fused) {
      y[ia] = std::fma(a, c[i], -(b * s[i]));
      y[ib] = std::fma(a, s[i], b * c[i]);
    } else {
      const float ac = a * c[i], bs = b * s[i], bc = b * c[i], as = a * s[i];
      y[ia] = ac - bs;
      y[ib] = bc + as;
    }
  }
}

void rotate_f16(const uint16_t* x, const uint16_t* c, const uint16_t* s, int64_t rotary_dim, bool interleaved,
                uint16_t* y) {
  const int64_t half = rotary_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    int64_t ia, ib;
    pair_at(i, half, interleaved, &ia, &ib);
    const float a = half_to_float(x[ia]), b = half_to_float(x[ib]);
    const float cf = half_to_float(c[i]), sf = half_to_float(s[i]);
    const float ac = a * cf, bs = b * sf, bc = b * cf, as = a * sf;
    y[ia] = float_to_half(ac - bs);
    y[ib] = float_to_half(bc + as);
  }
}

bool detect_fused() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

}  // namespace

bool ort_rotary_fused_fp32() {
  static const bool fused = detect_fused();
  return fused;
}

void rotary_row(DType dt, const void* in, const void* cos, const void* sin, int64_t rotary_dim, int64_t head_dim,
                bool interleaved, void* out) {
  const size_t es = dtype_size(dt);
  if (dt == DType::kFloat32) {
    rotate_f32(static_cast<const float*>(in), static_cast<const float*>(cos), static_cast<const float*>(sin),
               rotary_dim, interleaved, ort_rotary_fused_fp32(), static_cast<float*>(out));
  } else if (dt == DType::kFloat16) {
    rotate_f16(static_cast<const uint16_t*>(in), static_cast<const uint16_t*>(cos), static_cast<const uint16_t*>(sin),
               rotary_dim, interleaved, static_cast<uint16_t*>(out));
  } else {
    throw std::invalid_argument(std::string("rotary_row: element type; expected float32 or float16, got ") +
                                dtype_name(dt));
  }
  if (rotary_dim < head_dim)
    std::memcpy(static_cast<char*>(out) + static_cast<size_t>(rotary_dim) * es,
                static_cast<const char*>(in) + static_cast<size_t>(rotary_dim) * es,
                static_cast<size_t>(head_dim - rotary_dim) * es);
}

}  // namespace ops
}  // namespace olep
