// Built with -ffp-contract=off (CMakeLists.txt): the separate-product form must
// not be contracted into FMAs by the compiler, the fused form uses std::fma.
#include "kernels/rotary.h"

#include <cmath>
#include <cstring>

namespace olep {
namespace kernels {
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

// 16-bit storage (float16 or bfloat16): widen, separate products in float32, round once.
template <float (*Load)(uint16_t), uint16_t (*Store)(float)>
void rotate_16(const uint16_t* x, const uint16_t* c, const uint16_t* s, int64_t rotary_dim, bool interleaved,
               uint16_t* y) {
  const int64_t half = rotary_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    int64_t ia, ib;
    pair_at(i, half, interleaved, &ia, &ib);
    const float a = Load(x[ia]), b = Load(x[ib]);
    const float cf = Load(c[i]), sf = Load(s[i]);
    const float ac = a * cf, bs = b * sf, bc = b * cf, as = a * sf;
    y[ia] = Store(ac - bs);
    y[ib] = Store(bc + as);
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
  const auto* x16 = static_cast<const uint16_t*>(in);
  const auto* c16 = static_cast<const uint16_t*>(cos);
  const auto* s16 = static_cast<const uint16_t*>(sin);
  switch (dt) {
    case DType::kFloat32:
      rotate_f32(static_cast<const float*>(in), static_cast<const float*>(cos), static_cast<const float*>(sin),
                 rotary_dim, interleaved, ort_rotary_fused_fp32(), static_cast<float*>(out));
      break;
    case DType::kFloat16:
      rotate_16<half_to_float, float_to_half>(x16, c16, s16, rotary_dim, interleaved, static_cast<uint16_t*>(out));
      break;
    case DType::kBFloat16:
      rotate_16<bf16_to_float, float_to_bf16>(x16, c16, s16, rotary_dim, interleaved, static_cast<uint16_t*>(out));
      break;
  }
  if (rotary_dim < head_dim)
    std::memcpy(static_cast<char*>(out) + static_cast<size_t>(rotary_dim) * es,
                static_cast<const char*>(in) + static_cast<size_t>(rotary_dim) * es,
                static_cast<size_t>(head_dim - rotary_dim) * es);
}

}  // namespace kernels
}  // namespace olep
