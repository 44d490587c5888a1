// Element types of cache storage and attention inputs, with scalar
// float16/bfloat16 <-> float32 conversions (IEEE 754 binary16; bfloat16 =
// upper 16 bits of binary32, round-to-nearest-even on narrowing).
// No ORT, no ONNX: plain C++17.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace olep {

/// Element type of K/V storage and of the attention tensors that feed it.
enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// The scalar conversions below are always inlined: the attention kernels' ISA translation
// units (compiled with -mavx2 / -mavx512*) call them, and an out-of-line copy there would be a
// weak symbol the linker may pick for every caller, AVX-512 code on an AVX2-only CPU
// (tests/cpp/check_isa_objects.cmake checks that none is emitted).
#if defined(__GNUC__)
#define OLEP_DTYPE_INLINE inline __attribute__((always_inline))
#else
#define OLEP_DTYPE_INLINE inline
#endif

/// Bytes per element.
inline size_t dtype_size(DType t) { return t == DType::kFloat32 ? 4 : 2; }

/// "float32", "float16" or "bfloat16".
const char* dtype_name(DType t);

/// Parses "float32"/"float"/"fp32", "float16"/"half"/"fp16", "bfloat16"/"bf16".
/// Throws std::invalid_argument naming `what` and the accepted values.
DType parse_dtype(const std::string& name, const char* what);

OLEP_DTYPE_INLINE float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      int e = -1;
      do { ++e; mant <<= 1; } while ((mant & 0x400u) == 0);
      bits = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

OLEP_DTYPE_INLINE uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t absx = x & 0x7fffffffu;
  if (absx >= 0x7f800000u) {  // inf or nan
    return static_cast<uint16_t>(sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u : 0u));
  }
  if (absx >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (absx < 0x38800000u) {  // subnormal half or zero
    if (absx < 0x33000000u) return sign;  // rounds to zero
    const uint32_t e = absx >> 23;
    const uint32_t m = (absx & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // 14..24
    // value = m * 2^(e-150); the half subnormal unit is 2^-24, so r = m >> (126 - e).
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  uint32_t r = ((absx >> 13) - ((127 - 15) << 10));
  const uint32_t rem = absx & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  return static_cast<uint16_t>(sign | r);
}

OLEP_DTYPE_INLINE float bf16_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

OLEP_DTYPE_INLINE uint16_t float_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet nan
  const uint32_t lsb = (x >> 16) & 1u;
  x += 0x7fffu + lsb;
  return static_cast<uint16_t>(x >> 16);
}

/// Converts `n` elements of type `t` at `src` to float32 at `dst`.
void to_float(DType t, const void* src, float* dst, int64_t n);
/// Converts `n` float32 values at `src` to type `t` at `dst` (round to nearest even).
void from_float(DType t, const float* src, void* dst, int64_t n);

}  // namespace olep
