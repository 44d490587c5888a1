// AVX-512 (F, BW, VL, DQ) vector traits of the SIMD attention kernel (attention_simd.h).
// Included only by the translation units compiled with those flags
// (attention_avx512.cc, attention_avx512_bf16.cc); each gets its own copy (anonymous
// namespace), so no inline function crosses a flag boundary.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace olep {
namespace kernels {
namespace {

struct Avx512 {
  static constexpr int W = 16;
  static constexpr int kRegs = 32;  // vector registers (zmm0-31)
  static constexpr bool kBf16Dot = false;  // see Avx512Bf16 (attention_avx512_bf16.cc)
  static int64_t row_ahead() { return 0; }  // (AVX2 only, simd_rows.h)
  using vf = __m512;
  static vf zero() { return _mm512_setzero_ps(); }
  static vf set1(float x) { return _mm512_set1_ps(x); }
  static vf load(const float* p) { return _mm512_loadu_ps(p); }
  // A 64-byte vector as two 32-byte loads (simd::HalfLineLoads, attention_simd.h).
  static constexpr bool kHalfLineLoads = true;
  static constexpr bool kVnni8 = false;  // see Avx512Bf16 (simd_quant4.h)
  static vf load_halves(const float* p) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(p)), _mm256_loadu_ps(p + 8), 1);
  }
  static void store(float* p, vf v) { _mm512_storeu_ps(p, v); }
  static vf load_i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  // W int16 as float
  static vf load_i16(const int16_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
  }
  // int4 codes (kv_block.h) as float: the low (high = false) or high nibbles of W bytes ...
  static vf nibbles(const uint8_t* p, bool high) {
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srl_epi32(x, _mm_cvtsi32_si128(high ? 4 : 0)), _mm512_set1_epi32(15)));
  }
  // ... or of byte 2 i + odd of W byte pairs (2 W bytes: int4 V row pairs)
  static vf pair_nibbles(const uint8_t* p, bool odd, bool high) {
    const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const int shift = (odd ? 8 : 0) + (high ? 4 : 0);
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srl_epi32(x, _mm_cvtsi32_si128(shift)), _mm512_set1_epi32(15)));
  }
  static vf load_f16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static vf load_bf16(const uint16_t* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  // W floats stored as float16 / bfloat16, bit for bit as olep::float_to_half / float_to_bf16
  // (common/dtype.h: round to nearest even; a NaN as the quiet NaN sign | 0x7e00, or its top
  // half | 0x40).
  static void store_f16(uint16_t* p, vf x) {
    __m256i h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __m256i q = _mm256_or_si256(_mm256_and_si256(h, _mm256_set1_epi16(static_cast<short>(0x8000))),
                                      _mm256_set1_epi16(0x7e00));
    h = _mm256_mask_blend_epi16(nan, h, q);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  }
  static void store_bf16(uint16_t* p, vf x) {
    const __m512i b = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(b, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x40)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  static vf fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
  static vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
  static vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
  static vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
  static vf div(vf a, vf b) { return _mm512_div_ps(a, b); }
  static vf max(vf a, vf b) { return _mm512_max_ps(a, b); }
  static vf abs(vf a) { return _mm512_abs_ps(a); }
  static vf copysign(vf mag, vf sign) {
    const __m512i m = _mm512_set1_epi32(0x80000000);
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_andnot_si512(m, _mm512_castps_si512(mag)),
                                               _mm512_and_si512(m, _mm512_castps_si512(sign))));
  }
  static float reduce_max(vf v) { return _mm512_reduce_max_ps(v); }
  static float reduce_add(vf v) { return _mm512_reduce_add_ps(v); }
  // Lanes t with lo <= j0 + t < hi, as bits.
  static unsigned key_range(int64_t j0, int64_t lo, int64_t hi) {
    if (hi <= lo) return 0;
    const int64_t a = lo - j0, b = hi - j0;
    const unsigned upto = b >= W ? 0xffffu : ((1u << b) - 1u);
    const unsigned from = a <= 0 ? 0xffffu : (0xffffu & ~((1u << a) - 1u));
    return upto & from;
  }
  static unsigned bool_bits(const uint8_t* p, int64_t n) {
    if (n == W) return _mm_cmpneq_epi8_mask(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), _mm_setzero_si128());
    unsigned bits = 0;
    for (int64_t t = 0; t < n; ++t) bits |= (p[t] != 0 ? 1u : 0u) << t;
    return bits;
  }
  static unsigned le_bits(vf v, float x) { return _mm512_cmp_ps_mask(v, _mm512_set1_ps(x), _CMP_LE_OQ); }
  static unsigned gt_bits(vf v, float x) { return _mm512_cmp_ps_mask(v, _mm512_set1_ps(x), _CMP_GT_OQ); }
  static unsigned nan_bits(vf v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); }
  static vf select(unsigned bits, vf if_set, vf otherwise) {
    return _mm512_mask_blend_ps(static_cast<__mmask16>(bits), otherwise, if_set);
  }
  __attribute__((always_inline)) static vf exp(vf x) {
    // Cephes expf: x = n ln2 + r, |r| <= ln2/2; exp(r) by a degree-6 polynomial; scale by 2^n.
    // Below -87.3 the result is a denormal (down to ~1.4e-45 at -103.3) and 0 below -103.97,
    // as std::exp gives: scalef rounds p * 2^n into the denormal range correctly. (A
    // probability that underflows to exactly 0 makes 0 * inf = NaN for an inf value, as in
    // the scalar level and ONNX's float softmax; a clamped tiny p would give inf.)
    x = _mm512_min_ps(_mm512_max_ps(x, set1(-104.0f)), set1(88.72283f));
    const vf n = _mm512_roundscale_ps(mul(x, set1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    vf r = _mm512_fnmadd_ps(n, set1(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, set1(-2.12194440e-4f), r);
    vf p = set1(1.9875691500e-4f);
    p = fma(p, r, set1(1.3981999507e-3f));
    p = fma(p, r, set1(8.3334519073e-3f));
    p = fma(p, r, set1(4.1665795894e-2f));
    p = fma(p, r, set1(1.6666665459e-1f));
    p = fma(p, r, set1(5.0000001201e-1f));
    p = fma(p, mul(r, r), add(r, set1(1.0f)));
    return _mm512_scalef_ps(p, n);
  }
  // 16-bit fixed point (int8 pages, simd_quant.h): int32 / int16 lanes carried in a vf.
  static __m512i ci(vf x) { return _mm512_castps_si512(x); }
  static vf cf(__m512i x) { return _mm512_castsi512_ps(x); }
  static vf load_raw_i16(const int16_t* p) { return cf(_mm512_loadu_si512(p)); }  // 2 * W int16
  // 2 * W int8 codes sign-extended to 2 * W int16.
  static vf widen_i8(const int8_t* p) {
    return cf(_mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
  }
  // 2 * W bytes zero-extended to 2 * W int16 (int4 codes, two per byte).
  static vf widen_u8(const uint8_t* p) {
    return cf(_mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
  }
  static vf low_nibbles(vf x) { return cf(_mm512_and_si512(ci(x), _mm512_set1_epi16(15))); }
  static vf high_nibbles(vf x) { return cf(_mm512_srli_epi16(ci(x), 4)); }  // of bytes widened by widen_u8
  // acc.i32[i] + a.i16[2i] * b.i16[2i] + a.i16[2i+1] * b.i16[2i+1] (exact, no saturation)
  static vf dot_i16(vf acc, vf a, vf b) { return cf(_mm512_add_epi32(ci(acc), _mm512_madd_epi16(ci(a), ci(b)))); }
  static vf add_i32(vf a, vf b) { return cf(_mm512_add_epi32(ci(a), ci(b))); }
  static vf cvt_i32(vf a) { return _mm512_cvtepi32_ps(ci(a)); }
  static vf set1_i32(int32_t x) { return cf(_mm512_set1_epi32(x)); }
  // W lanes rounded to the nearest integer (ties to even), saturated to int16.
  static void round_i16(int16_t* dst, vf x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(x)));
  }
  // The low / high int16 of every int32 lane, as float.
  static vf pair_lo(vf x) { return _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(ci(x), 16), 16)); }
  static vf pair_hi(vf x) { return _mm512_cvtepi32_ps(_mm512_srai_epi32(ci(x), 16)); }
  // The same on integer-typed vectors (accumulators kept as vi: no float <-> int register copies).
  using vi = __m512i;
  static vi izero() { return _mm512_setzero_si512(); }
  static vi iwiden_i8(const int8_t* p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static vi iwiden_u8(const uint8_t* p) { return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static vi ilow_nibbles(vi x) { return _mm512_and_si512(x, _mm512_set1_epi16(15)); }
  static vi ihigh_nibbles(vi x) { return _mm512_srli_epi16(x, 4); }
  static vi iset1(int32_t x) { return _mm512_set1_epi32(x); }
  static vi idot(vi acc, vi a, vi b) { return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b)); }
  static vf icvt(vi a) { return _mm512_cvtepi32_ps(a); }
  static vi iadd(vi a, vi b) { return _mm512_add_epi32(a, b); }
  // out[t] = sum of the lanes of acc[t], t = 0..15.
  // x[k] lane j <- x[j] lane k (a 16 x 16 transpose in registers).
  __attribute__((always_inline)) static void transpose_square(vf* x) {
    vf t[16], u[16];
    for (int k = 0; k < 8; ++k) {
      t[2 * k] = _mm512_unpacklo_ps(x[2 * k], x[2 * k + 1]);
      t[2 * k + 1] = _mm512_unpackhi_ps(x[2 * k], x[2 * k + 1]);
    }
    for (int k = 0; k < 4; ++k) {
      u[4 * k] = _mm512_shuffle_ps(t[4 * k], t[4 * k + 2], 0x44);
      u[4 * k + 1] = _mm512_shuffle_ps(t[4 * k], t[4 * k + 2], 0xee);
      u[4 * k + 2] = _mm512_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0x44);
      u[4 * k + 3] = _mm512_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0xee);
    }
    // u[4 g + c] holds, in each 128-bit lane L, column c of rows 4 g .. 4 g + 3 at columns 4 L + c.
    for (int k = 0; k < 4; ++k) {
      const vf a = _mm512_shuffle_f32x4(u[k], u[k + 4], 0x88), b = _mm512_shuffle_f32x4(u[k], u[k + 4], 0xdd);
      const vf c = _mm512_shuffle_f32x4(u[k + 8], u[k + 12], 0x88), d = _mm512_shuffle_f32x4(u[k + 8], u[k + 12], 0xdd);
      x[k] = _mm512_shuffle_f32x4(a, c, 0x88);
      x[k + 8] = _mm512_shuffle_f32x4(a, c, 0xdd);
      x[k + 4] = _mm512_shuffle_f32x4(b, d, 0x88);
      x[k + 12] = _mm512_shuffle_f32x4(b, d, 0xdd);
    }
  }
  // An RB x RB matrix of blocks of W / RB lanes, transposed in registers: on entry block rr of
  // x[g] holds row rr's part g, on exit block g of x[rr] (RB 2 or 4). scores_rows stores each
  // row's W scores as one vector with it.
  template <int RB>
  __attribute__((always_inline)) static void transpose_blocks(vf* x) {
    static_assert(RB == 2 || RB == 4, "transpose_blocks: 2 or 4 blocks");
    if constexpr (RB == 2) {
      const vf r0 = _mm512_shuffle_f32x4(x[0], x[1], 0x44), r1 = _mm512_shuffle_f32x4(x[0], x[1], 0xee);
      x[0] = r0;
      x[1] = r1;
    } else {
      const vf a = _mm512_shuffle_f32x4(x[0], x[1], 0x44), b = _mm512_shuffle_f32x4(x[0], x[1], 0xee);
      const vf c = _mm512_shuffle_f32x4(x[2], x[3], 0x44), d = _mm512_shuffle_f32x4(x[2], x[3], 0xee);
      x[0] = _mm512_shuffle_f32x4(a, c, 0x88);
      x[1] = _mm512_shuffle_f32x4(a, c, 0xdd);
      x[2] = _mm512_shuffle_f32x4(b, d, 0x88);
      x[3] = _mm512_shuffle_f32x4(b, d, 0xdd);
    }
  }
  // sum2(a, b) adds two vectors lane-wise: float lanes (add) or int32 lanes (add_i32).
  template <class Sum>
  __attribute__((always_inline)) static vf transpose_reduce_by(const vf* acc, Sum sum2) {
    vf w[8];
    for (int k = 0; k < 8; ++k)
      w[k] = sum2(_mm512_unpacklo_ps(acc[2 * k], acc[2 * k + 1]), _mm512_unpackhi_ps(acc[2 * k], acc[2 * k + 1]));
    vf x[4];
    for (int k = 0; k < 4; ++k) {
      const __m512d a = _mm512_castps_pd(w[2 * k]), b = _mm512_castps_pd(w[2 * k + 1]);
      x[k] = sum2(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    // x[k] lane L (128-bit) holds partial sums of acc[4k..4k+3] over lanes 4L..4L+3.
    const vf y = sum2(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xdd));
    const vf z = sum2(_mm512_shuffle_f32x4(x[2], x[3], 0x88), _mm512_shuffle_f32x4(x[2], x[3], 0xdd));
    return sum2(_mm512_shuffle_f32x4(y, z, 0x88), _mm512_shuffle_f32x4(y, z, 0xdd));
  }
  __attribute__((always_inline)) static vf transpose_reduce(const vf* acc) {
    return transpose_reduce_by(acc, [](vf a, vf b) { return add(a, b); });
  }
  // The same over int32 lanes carried in a vf (exact sums), converted to float once at the end.
  __attribute__((always_inline)) static vf transpose_reduce_i32(const vf* acc) {
    return cvt_i32(transpose_reduce_by(acc, [](vf a, vf b) { return add_i32(a, b); }));
  }
};


}  // namespace
}  // namespace kernels
}  // namespace olep
