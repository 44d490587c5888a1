// AVX-512 + AVX512_BF16 instantiation of the SIMD attention kernel: the avx512 level plus
// VDPBF16PS for q . k when the cache (and so q) is bfloat16, and VPDPWSSD for the 16-bit
// fixed-point dot products of int8 pages. Compiled with the avx512 flags, -mavx512bf16 and
// -mavx512vnni; only called after run-time detection of both (attention_common.cc).
//
// VDPBF16PS multiplies pairs of bf16 elements and adds both products to a float32 lane:
// a bf16 x bf16 product is exact in float32 (8 x 8 significand bits), so the scores are the
// float32 dot products the avx512 level computes, with half the instructions and no
// bf16 -> float32 conversion of K. Differences: the instruction treats denormal inputs and
// results as zero (|x| < 1.2e-38, far below anything a score can resolve), and q is used
// unscaled (the scale multiplies the finished scores). P . V stays in float32 FMAs
// (rounding the probabilities to bf16 would cost accuracy). Other dtypes run exactly the
// avx512 code.
#include <immintrin.h>

#include "kernels/attention_simd.h"
#include "kernels/avx512_traits.h"

namespace olep {
namespace kernels {
namespace {

struct Avx512Bf16 : Avx512 {
  static constexpr bool kBf16Dot = true;
  // 2 * W raw bf16 elements as one vector (no conversion).
  static vf load_raw(const uint16_t* p) { return _mm512_castsi512_ps(_mm512_loadu_si512(p)); }
  // The pair p[0], p[1] in every 32-bit lane.
  static vf set1_pair(const uint16_t* p) {
    uint32_t x;
    __builtin_memcpy(&x, p, sizeof(x));
    return _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(x)));
  }
  // acc[i] += a.bf16[2i] * b.bf16[2i] + a.bf16[2i+1] * b.bf16[2i+1]
  static vf dot_bf16(vf acc, vf a, vf b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }
  // VPDPWSSD (AVX512_VNNI, which every AVX512_BF16 CPU has): the pair dot and the add in one,
  // written as inline asm that accumulates in place ("+v"). GCC 12's _mm512_dpwssd_epi32 is not
  // tied to its accumulator: in the register-blocked loops every VPDPWSSD came with one or two
  // zmm register copies and, in the P.V loops, stack spills (objdump of attend_impl<LoadI8>:
  // 176 VPDPWSSD, 509 zmm-to-zmm moves, 24 spills).
  static __m512i vpdpwssd(__m512i acc, __m512i a, __m512i b) {
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "vm"(b));
    return acc;
  }
  static vf dot_i16(vf acc, vf a, vf b) { return cf(vpdpwssd(ci(acc), ci(a), ci(b))); }
  static vi idot(vi acc, vi a, vi b) { return vpdpwssd(acc, a, b); }

  // Byte dot products (VPDPBUSD, AVX512_VNNI) for one query row over int4 codes (simd_quant4.h,
  // scores_i4_walk_vnni): acc[i] += sum over the 4 bytes j of lane i of u8[4i + j] * s8[4i + j],
  // exact in int32 (no saturation), accumulating in place as vpdpwssd above.
  static constexpr bool kVnni8 = true;
  static __m512i dpbusd(__m512i acc, __m512i u8, __m512i s8) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "vm"(s8));
    return acc;
  }
  static vi iload(const void* p) { return _mm512_loadu_si512(p); }
  static vi iset1_i8(int8_t x) { return _mm512_set1_epi8(x); }
  static vi iand(vi a, vi b) { return _mm512_and_si512(a, b); }
  static vi ishl8_i32(vi a) { return _mm512_slli_epi32(a, 8); }
  static vi isrl4_i16(vi a) { return _mm512_srli_epi16(a, 4); }
  // 2 W int16 at a and 2 W at b as 4 W bytes: their high bytes (x >> 8, signed) and their low
  // bytes (x & 0xff, unsigned), a's then b's, in order.
  static void split_i16(const int16_t* a, const int16_t* b, vi* hi, vi* lo) {
    const __m512i x = _mm512_loadu_si512(a), y = _mm512_loadu_si512(b);
    *hi = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(_mm512_srai_epi16(x, 8))),
                             _mm512_cvtepi16_epi8(_mm512_srai_epi16(y, 8)), 1);
    *lo = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(x)), _mm512_cvtepi16_epi8(y), 1);
  }
};

}  // namespace

void attend_range_avx512_bf16(const AttentionGroup& a, int64_t key_begin, int64_t key_end, AttentionState* state,
                              float* scratch) {
  simd::attend_range<Avx512Bf16>(a, key_begin, key_end, state, scratch);
}

}  // namespace kernels
}  // namespace olep
