// AVX2 + FMA + F16C instantiation of the SIMD attention kernel. Compiled with
// -mavx2 -mfma -mf16c; only called after run-time detection.
#include <immintrin.h>

#include "kernels/attention_simd.h"

namespace olep {
namespace kernels {
namespace {

struct Avx2 {
  static constexpr int W = 8;
  static constexpr int kRegs = 16;  // vector registers (ymm0-15)
  static constexpr bool kBf16Dot = false;  // no VDPBF16PS at this level
  static constexpr bool kHalfLineLoads = false;  // (a vector is half a line already)
  static constexpr bool kVnni8 = false;  // no byte dot products (simd_quant4.h)
  // Software prefetch distance of one 16-bit query row's K/V stream (simd_rows.h, row_ahead):
  // measured a gain on Zen 3 and a loss on Zen 4 run at this level, so only on cores without
  // AVX-512.
  // (A read of libgcc's CPU model; level detection, attention_common.cc, ran __builtin_cpu_init.)
  static int64_t row_ahead() { return __builtin_cpu_supports("avx512f") ? 0 : 4096; }
  using vf = __m256;
  static vf zero() { return _mm256_setzero_ps(); }
  static vf set1(float x) { return _mm256_set1_ps(x); }
  static vf load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, vf v) { _mm256_storeu_ps(p, v); }
  static vf load_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static vf load_i16(const int16_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  // int4 codes as float (avx512_traits.h): low / high nibbles of W bytes, or of W byte pairs' byte 2 i + odd
  static vf nibbles(const uint8_t* p, bool high) {
    const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(x, _mm_cvtsi32_si128(high ? 4 : 0)), _mm256_set1_epi32(15)));
  }
  static vf pair_nibbles(const uint8_t* p, bool odd, bool high) {
    const __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const int shift = (odd ? 8 : 0) + (high ? 4 : 0);
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(x, _mm_cvtsi32_si128(shift)), _mm256_set1_epi32(15)));
  }
  static vf load_f16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static vf load_bf16(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  // W floats stored as float16 / bfloat16, bit for bit as the scalar conversions (avx512_traits.h)
  static void store_f16(uint16_t* p, vf x) {
    __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i nan32 = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m128i nan = _mm_packs_epi32(_mm256_castsi256_si128(nan32), _mm256_extracti128_si256(nan32, 1));
    const __m128i q = _mm_or_si128(_mm_and_si128(h, _mm_set1_epi16(static_cast<short>(0x8000))), _mm_set1_epi16(0x7e00));
    h = _mm_blendv_epi8(h, q, nan);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  }
  static void store_bf16(uint16_t* p, vf x) {
    const __m256i b = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(0x40)), nan);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);  // 16-bit lanes 0..7 in the low half
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static vf fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
  static vf add(vf a, vf b) { return _mm256_add_ps(a, b); }
  static vf sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
  static vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
  static vf div(vf a, vf b) { return _mm256_div_ps(a, b); }
  static vf max(vf a, vf b) { return _mm256_max_ps(a, b); }
  static vf abs(vf a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
  static vf copysign(vf mag, vf sign) {
    const vf m = _mm256_set1_ps(-0.0f);
    return _mm256_or_ps(_mm256_andnot_ps(m, mag), _mm256_and_ps(m, sign));
  }
  static float reduce_max(vf v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_shuffle_ps(x, x, 1));
    return _mm_cvtss_f32(x);
  }
  static float reduce_add(vf v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
    return _mm_cvtss_f32(x);
  }
  static unsigned key_range(int64_t j0, int64_t lo, int64_t hi) {
    if (hi <= lo) return 0;
    const int64_t a = lo - j0, b = hi - j0;
    const unsigned upto = b >= W ? 0xffu : ((1u << b) - 1u);
    const unsigned from = a <= 0 ? 0xffu : (0xffu & ~((1u << a) - 1u));
    return upto & from;
  }
  static unsigned bool_bits(const uint8_t* p, int64_t n) {
    if (n == W) {
      const __m128i z = _mm_cmpeq_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)), _mm_setzero_si128());
      return ~static_cast<unsigned>(_mm_movemask_epi8(z)) & 0xffu;
    }
    unsigned bits = 0;
    for (int64_t t = 0; t < n; ++t) bits |= (p[t] != 0 ? 1u : 0u) << t;
    return bits;
  }
  static unsigned le_bits(vf v, float x) {
    return static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(x), _CMP_LE_OQ)));
  }
  static unsigned gt_bits(vf v, float x) {
    return static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(x), _CMP_GT_OQ)));
  }
  static unsigned nan_bits(vf v) { return static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))); }
  static vf select(unsigned bits, vf if_set, vf otherwise) {
    const __m256i lanes = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i m = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), lanes), lanes);
    return _mm256_blendv_ps(otherwise, if_set, _mm256_castsi256_ps(m));
  }
  __attribute__((always_inline)) static vf exp(vf x) {
    // Down to -104: denormal results and 0 below -103.97, as std::exp (see avx512_traits.h).
    x = _mm256_min_ps(_mm256_max_ps(x, set1(-104.0f)), set1(88.72283f));
    const vf n = _mm256_round_ps(mul(x, set1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    vf r = _mm256_fnmadd_ps(n, set1(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, set1(-2.12194440e-4f), r);
    vf p = set1(1.9875691500e-4f);
    p = fma(p, r, set1(1.3981999507e-3f));
    p = fma(p, r, set1(8.3334519073e-3f));
    p = fma(p, r, set1(4.1665795894e-2f));
    p = fma(p, r, set1(1.6666665459e-1f));
    p = fma(p, r, set1(5.0000001201e-1f));
    p = fma(p, mul(r, r), add(r, set1(1.0f)));
    // p * 2^n for n in [-150, 128] as p * 2^a * 2^b, a = floor(n / 2), b = n - a, both in
    // [-75, 64] (normal powers of two built from exponent bits): exact but for the final
    // rounding, which lands in the denormal range for n < -126.
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i na = _mm256_srai_epi32(ni, 1);
    const __m256i nb = _mm256_sub_epi32(ni, na);
    const __m256i bias = _mm256_set1_epi32(127);
    const vf sa = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(na, bias), 23));
    const vf sb = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(nb, bias), 23));
    return mul(mul(p, sa), sb);
  }
  // 16-bit fixed point (int8 pages, simd_quant.h): int32 / int16 lanes carried in a vf.
  static __m256i ci(vf x) { return _mm256_castps_si256(x); }
  static vf cf(__m256i x) { return _mm256_castsi256_ps(x); }
  static vf load_raw_i16(const int16_t* p) { return cf(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static vf widen_i8(const int8_t* p) {
    return cf(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static vf widen_u8(const uint8_t* p) {
    return cf(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static vf low_nibbles(vf x) { return cf(_mm256_and_si256(ci(x), _mm256_set1_epi16(15))); }
  static vf high_nibbles(vf x) { return cf(_mm256_srli_epi16(ci(x), 4)); }
  static vf dot_i16(vf acc, vf a, vf b) { return cf(_mm256_add_epi32(ci(acc), _mm256_madd_epi16(ci(a), ci(b)))); }
  static vf add_i32(vf a, vf b) { return cf(_mm256_add_epi32(ci(a), ci(b))); }
  static vf cvt_i32(vf a) { return _mm256_cvtepi32_ps(ci(a)); }
  static vf set1_i32(int32_t x) { return cf(_mm256_set1_epi32(x)); }
  static void round_i16(int16_t* dst, vf x) {
    const __m256i i = _mm256_cvtps_epi32(x);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                     _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1)));
  }
  static vf pair_lo(vf x) { return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(ci(x), 16), 16)); }
  static vf pair_hi(vf x) { return _mm256_cvtepi32_ps(_mm256_srai_epi32(ci(x), 16)); }
  using vi = __m256i;
  static vi izero() { return _mm256_setzero_si256(); }
  static vi iwiden_i8(const int8_t* p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static vi iwiden_u8(const uint8_t* p) { return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static vi ilow_nibbles(vi x) { return _mm256_and_si256(x, _mm256_set1_epi16(15)); }
  static vi ihigh_nibbles(vi x) { return _mm256_srli_epi16(x, 4); }
  static vi iset1(int32_t x) { return _mm256_set1_epi32(x); }
  static vi idot(vi acc, vi a, vi b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
  static vf icvt(vi a) { return _mm256_cvtepi32_ps(a); }
  static vi iadd(vi a, vi b) { return _mm256_add_epi32(a, b); }
  // x[k] lane j <- x[j] lane k (an 8 x 8 transpose in registers).
  __attribute__((always_inline)) static void transpose_square(vf* x) {
    vf t[8], u[8];
    for (int k = 0; k < 4; ++k) {
      t[2 * k] = _mm256_unpacklo_ps(x[2 * k], x[2 * k + 1]);
      t[2 * k + 1] = _mm256_unpackhi_ps(x[2 * k], x[2 * k + 1]);
    }
    for (int k = 0; k < 2; ++k) {
      u[4 * k] = _mm256_shuffle_ps(t[4 * k], t[4 * k + 2], 0x44);
      u[4 * k + 1] = _mm256_shuffle_ps(t[4 * k], t[4 * k + 2], 0xee);
      u[4 * k + 2] = _mm256_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0x44);
      u[4 * k + 3] = _mm256_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0xee);
    }
    for (int k = 0; k < 4; ++k) {
      x[k] = _mm256_permute2f128_ps(u[k], u[k + 4], 0x20);
      x[k + 4] = _mm256_permute2f128_ps(u[k], u[k + 4], 0x31);
    }
  }
  // An RB x RB matrix of blocks of W / RB lanes, transposed in registers: on entry block rr of
  // x[g] holds row rr's part g, on exit block g of x[rr] (RB 2 or 4). scores_rows stores each
  // row's W scores as one vector with it.
  template <int RB>
  __attribute__((always_inline)) static void transpose_blocks(vf* x) {
    static_assert(RB == 2 || RB == 4, "transpose_blocks: 2 or 4 blocks");
    if constexpr (RB == 2) {
      const vf r0 = _mm256_permute2f128_ps(x[0], x[1], 0x20), r1 = _mm256_permute2f128_ps(x[0], x[1], 0x31);
      x[0] = r0;
      x[1] = r1;
    } else {
      const __m256d x0 = _mm256_castps_pd(x[0]), x1 = _mm256_castps_pd(x[1]);
      const __m256d x2 = _mm256_castps_pd(x[2]), x3 = _mm256_castps_pd(x[3]);
      const vf t0 = _mm256_castpd_ps(_mm256_unpacklo_pd(x0, x1)), t1 = _mm256_castpd_ps(_mm256_unpackhi_pd(x0, x1));
      const vf t2 = _mm256_castpd_ps(_mm256_unpacklo_pd(x2, x3)), t3 = _mm256_castpd_ps(_mm256_unpackhi_pd(x2, x3));
      x[0] = _mm256_permute2f128_ps(t0, t2, 0x20);
      x[1] = _mm256_permute2f128_ps(t1, t3, 0x20);
      x[2] = _mm256_permute2f128_ps(t0, t2, 0x31);
      x[3] = _mm256_permute2f128_ps(t1, t3, 0x31);
    }
  }
  // sum2(a, b) adds two vectors lane-wise: float lanes (add) or int32 lanes (add_i32).
  template <class Sum>
  __attribute__((always_inline)) static vf transpose_reduce_by(const vf* acc, Sum sum2) {
    vf w[4];
    for (int k = 0; k < 4; ++k)
      w[k] = sum2(_mm256_unpacklo_ps(acc[2 * k], acc[2 * k + 1]), _mm256_unpackhi_ps(acc[2 * k], acc[2 * k + 1]));
    vf x[2];
    for (int k = 0; k < 2; ++k) {
      const __m256d a = _mm256_castps_pd(w[2 * k]), b = _mm256_castps_pd(w[2 * k + 1]);
      x[k] = sum2(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
    }
    return sum2(_mm256_permute2f128_ps(x[0], x[1], 0x20), _mm256_permute2f128_ps(x[0], x[1], 0x31));
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

void attend_range_avx2(const AttentionGroup& a, int64_t key_begin, int64_t key_end, AttentionState* state,
                       float* scratch) {
  simd::attend_range<Avx2>(a, key_begin, key_end, state, scratch);
}

void finalize_avx2(const AttentionGroup& a, const AttentionState& s) { simd::finalize_rows<Avx2>(a, s); }

}  // namespace kernels
}  // namespace olep
