// SIMD kernel building blocks shared by the row and lanes paths (internal; included only by
// the per-ISA translation units through attention_simd.h): inlining macros, tanh, K/V row
// loaders and conversion, the q . k dot policies and the unseen-key marker.
#pragma once

#include <algorithm>
#include <cmath>
#include <cfloat>
#include <cstring>
#include <type_traits>

#include "kernels/attention.h"
#include "kernels/attention_internal.h"

namespace olep {
namespace kernels {
namespace simd {
namespace {  // internal linkage: each ISA translation unit its own copy (attention_simd.h)

// The hot helpers below must inline into the tile loops (GCC otherwise outlines some of
// them once the kernels grow, costing a call and register spills per tile).
#define OLEP_HOT inline __attribute__((always_inline))
#define OLEP_COLD_REGS __attribute__((noinline))
// The same for a lambda: `[&](...) OLEP_LAMBDA_HOT { ... }`.
#define OLEP_LAMBDA_HOT __attribute__((always_inline))

template <class V>
OLEP_HOT typename V::vf tanh_v(typename V::vf y) {
  // tanh(y) = sign(y) * (1 - e) / (1 + e), e = exp(-2|y|) <= 1 (no overflow).
  const typename V::vf ay = V::abs(y);
  const typename V::vf e = V::exp(V::mul(ay, V::set1(-2.0f)));
  const typename V::vf one = V::set1(1.0f);
  const typename V::vf t = V::div(V::sub(one, e), V::add(one, e));
  return V::select(V::nan_bits(y), y, V::copysign(t, y));  // V::exp clamps: keep NaN a NaN
}

// finalize (attention.h) for v_head_dim a multiple of W: out = acc / l per row, stored W at a
// time (16-bit: V::store_f16 / store_bf16, the scalar level's bits).
template <class V>
void finalize_rows(const AttentionGroup& a, const AttentionState& s) {
  constexpr int W = V::W;
  const int64_t G = a.group_size, S = a.num_rows, Dv = a.v_head_dim;
  const int64_t valid = std::min(a.num_valid_rows, S);
  for (int64_t h = 0; h < G; ++h)
    for (int64_t i = 0; i < S; ++i) {
      const int64_t r = h * S + i;
      const int64_t off = h * a.out_head_stride + i * a.out_row_stride;
      const detail::RowScale rs = detail::finalize_row_scale(s, r, i, valid);
      const bool fill = rs.inv == 0.0f;
      const typename V::vf vi = V::set1(rs.inv), vfill = V::set1(rs.fill);
      const float* acc = s.acc + r * Dv;
      if (a.dtype == DType::kFloat32) {
        float* o = static_cast<float*>(a.out) + off;
        for (int64_t d = 0; d < Dv; d += W) V::store(o + d, fill ? vfill : V::mul(V::load(acc + d), vi));
      } else {
        uint16_t* o = static_cast<uint16_t*>(a.out) + off;
        const bool bf16 = a.dtype == DType::kBFloat16;
        for (int64_t d = 0; d < Dv; d += W) {
          const typename V::vf x = fill ? vfill : V::mul(V::load(acc + d), vi);
          if (bf16) V::store_bf16(o + d, x);
          else V::store_f16(o + d, x);
        }
      }
    }
}

// Rows [0, n) of `cols` elements (storage type t) as float; rows n..rows-1 zero.
template <class V>
inline void convert_rows(DType t, const void* src, int64_t n, int64_t cols, int64_t rows, float* dst) {
  constexpr int W = V::W;
  if (t == DType::kFloat32) {
    std::memcpy(dst, src, static_cast<size_t>(n * cols) * sizeof(float));
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (int64_t e = 0; e < n * cols; e += W)
      V::store(dst + e, t == DType::kFloat16 ? V::load_f16(s + e) : V::load_bf16(s + e));
  }
  if (n < rows) std::memset(dst + n * cols, 0, static_cast<size_t>((rows - n) * cols) * sizeof(float));
}

// Rows [0, n) of int8 elements, `cols` per row, as float times col_scale[c] (per channel), or
// times row_scale[r] (per row), or as they are (both null); rows n..rows-1 zero.
template <class V>
inline void dequant_rows_i8(const int8_t* src, int64_t n, int64_t cols, int64_t rows, const float* col_scale,
                            const float* row_scale, float* dst) {
  constexpr int W = V::W;
  for (int64_t r = 0; r < n; ++r) {
    const int8_t* s = src + r * cols;
    float* o = dst + r * cols;
    if (col_scale) {
      for (int64_t c = 0; c < cols; c += W) V::store(o + c, V::mul(V::load_i8(s + c), V::load(col_scale + c)));
    } else if (!row_scale) {
      for (int64_t c = 0; c < cols; c += W) V::store(o + c, V::load_i8(s + c));
    } else {
      const typename V::vf rs = V::set1(row_scale[r]);
      for (int64_t c = 0; c < cols; c += W) V::store(o + c, V::mul(V::load_i8(s + c), rs));
    }
  }
  if (n < rows) std::memset(dst + n * cols, 0, static_cast<size_t>((rows - n) * cols) * sizeof(float));
}

// The K (or V) rows of the cursor's current tile, n of them, as float in dst ([rows, cols],
// rows n..rows-1 zero), whatever the block's encoding: the tile conversion of both paths.
// int8 K with `codes`: the codes alone (the K scales are in the fixed-point q, int8_query).
template <class V, class Cursor>
inline void convert_k_tile(const AttentionGroup& a, const Cursor& c, int64_t n, int64_t rows, float* dst,
                           bool codes = false) {
  const KVBlock& b = a.blocks[c.blk];
  if (b.encoding == KVEncoding::kInt4) {  // codes, or min + code * scale
    constexpr int W = V::W;
    static_assert(16 % W == 0, "W channels of a K row are the low or high nibbles of W consecutive bytes");
    const int64_t D = a.head_dim, pr0 = b.page_row + (c.j0 - b.first_position);
    const uint8_t* k4 = static_cast<const uint8_t*>(b.key);
    for (int64_t r = 0; r < n; ++r) {
      float* o = dst + r * D;
      if (D % 32 == 0) {  // whole 32-channel groups (every cache page): channel d is byte 16 (d / 32) + d % 16
        const uint8_t* kr = k4 + (pr0 + r) * (D / 2);
        for (int64_t d = 0; d < D; d += W) {
          const typename V::vf code = V::nibbles(kr + 16 * (d / 32) + d % 16, (d & 16) != 0);
          V::store(o + d, codes ? code : V::add(V::load(b.key_min + d), V::mul(code, V::load(b.key_scale + d))));
        }
      } else {
        for (int64_t d = 0; d < D; ++d) {
          const float code = static_cast<float>(int4_key_code(b.key, D, pr0 + r, d));
          o[d] = codes ? code : b.key_min[d] + code * b.key_scale[d];
        }
      }
    }
    if (n < rows) std::memset(dst + n * D, 0, static_cast<size_t>((rows - n) * D) * sizeof(float));
  } else if (b.encoding == KVEncoding::kInt8)
    dequant_rows_i8<V>(reinterpret_cast<const int8_t*>(c.krows), n, a.head_dim, rows, codes ? nullptr : b.key_scale,
                       nullptr, dst);
  else
    convert_rows<V>(a.dtype, c.krows, n, a.head_dim, rows, dst);
}
// Rows [0, n) of int8 V codes stored in row pairs (kv_block.h) as float times row_scale[r];
// `pairs` is the row pair holding row 0, which is row `par` of it; rows n..rows-1 zero.
template <class V>
inline void dequant_pairs_i8(const int8_t* pairs, int64_t par, int64_t n, int64_t cols, int64_t rows,
                             const float* row_scale, float* dst) {
  constexpr int W = V::W;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t pr = par + r;
    const int8_t* s = pairs + (pr >> 1) * 2 * cols;
    float* o = dst + r * cols;
    const typename V::vf rs = V::set1(row_scale[r]);
    for (int64_t c = 0; c < cols; c += W) {
      const typename V::vf x = V::widen_i8(s + 2 * c);  // channels c..c+W-1 of both rows
      V::store(o + c, V::mul((pr & 1) ? V::pair_hi(x) : V::pair_lo(x), rs));
    }
  }
  if (n < rows) std::memset(dst + n * cols, 0, static_cast<size_t>((rows - n) * cols) * sizeof(float));
}

template <class V, class Cursor>
inline void convert_v_tile(const AttentionGroup& a, const Cursor& c, int64_t n, int64_t rows, float* dst) {
  const KVBlock& b = a.blocks[c.blk];
  if (b.encoding == KVEncoding::kInt4) {  // min + code * scale, per row
    constexpr int W = V::W;
    const int64_t Dv = a.v_head_dim, pr0 = b.page_row + (c.j0 - b.first_position);
    const uint8_t* v4 = static_cast<const uint8_t*>(b.value);
    for (int64_t r = 0; r < n; ++r) {
      const int64_t pr = pr0 + r;
      float* o = dst + r * Dv;
      if (Dv % 32 == 0) {  // channel d of row pr: byte 2 (d % 16) + (pr & 1) of its pair's group d / 32
        const uint8_t* pair = v4 + (pr >> 1) * Dv;
        const typename V::vf mn = V::set1(b.value_min[pr]), sc = V::set1(b.value_scale[pr]);
        for (int64_t d = 0; d < Dv; d += W)
          V::store(o + d, V::add(mn, V::mul(V::pair_nibbles(pair + 32 * (d / 32) + 2 * (d % 16), (pr & 1) != 0,
                                                             (d & 16) != 0), sc)));
      } else {
        for (int64_t d = 0; d < Dv; ++d) {
          const float code = static_cast<float>(int4_value_code(b.value, Dv, pr, d));
          o[d] = b.value_min[pr] + code * b.value_scale[pr];
        }
      }
    }
    if (n < rows) std::memset(dst + n * Dv, 0, static_cast<size_t>((rows - n) * Dv) * sizeof(float));
  } else if (b.encoding == KVEncoding::kInt8)
    dequant_pairs_i8<V>(reinterpret_cast<const int8_t*>(c.vrows), c.vpar, n, a.v_head_dim, rows,
                        b.value_scale + b.page_row + (c.j0 - b.first_position), dst);
  else
    convert_rows<V>(a.dtype, c.vrows, n, a.v_head_dim, rows, dst);
}

// Bytes of one stored element of a run of blocks in `enc` (the tile cursor's row addressing).
// (int4: 1, its rows are addressed by TileCursor::rows_of; prefetch then over-reads 2x.)
inline size_t stored_elem_bytes(DType t, KVEncoding enc) { return enc != KVEncoding::kNative ? 1 : dtype_size(t); }

// How the inner loops read K/V rows of a storage type (converted to float on load).
template <class V>
struct LoadF32 {
  using elem = float;
  static typename V::vf load(const float* p) { return V::load(p); }
};
template <class V>
struct LoadF16 {
  using elem = uint16_t;
  static typename V::vf load(const uint16_t* p) { return V::load_f16(p); }
};
// int8 codes (KVEncoding::kInt8) read as codes: the row path's 16-bit fixed-point loops
// (simd_rows.h, I16Dot, simd_pv.h pv_rows_i16); never converted element by element to float.
template <class V>
struct LoadI8 {
  using elem = int8_t;
};
// int4 codes (KVEncoding::kInt4), two per byte, read as codes likewise (simd_quant4.h).
template <class V>
struct LoadI4 {
  using elem = uint8_t;
};
template <class V>
struct LoadBF16 {
  using elem = uint16_t;
  static typename V::vf load(const uint16_t* p) { return V::load_bf16(p); }
};

// How the score loops multiply q by K, kStep elements per vector:
// FloatDot: float q (pre-scaled) times K loaded through KL (converted to float), FMAs.
// Bf16Dot (levels with V::kBf16Dot): raw bf16 q (unscaled) and K rows, V::dot_bf16
// (VDPBF16PS: two exact bf16 products per float lane), 2 * W elements per vector.
// I16Dot (int8 blocks): q in 16-bit fixed point (detail::int8_query) times K codes widened to
// int16, exact int32 pair sums (V::dot_i16), 2 * W elements per vector.
// add() sums two partial accumulators; reduce(acc) turns W accumulators into one vector of their
// W totals as float (I16Dot: exact int32 totals, each converted once).
template <class V, class KL>
struct FloatDot {
  using vf = typename V::vf;
  using qelem = float;
  using kelem = typename KL::elem;
  static constexpr int kStep = V::W;
  static vf load_q(const float* p) { return V::load(p); }
  static vf load_k(const kelem* p) { return KL::load(p); }
  static vf mul(vf q, vf k) { return V::mul(q, k); }
  static vf madd(vf acc, vf q, vf k) { return V::fma(q, k, acc); }
  static vf add(vf a, vf b) { return V::add(a, b); }
  static vf reduce(const vf* acc) { return V::transpose_reduce(acc); }
};
template <class V>
struct I16Dot {
  using vf = typename V::vf;
  using qelem = int16_t;
  using kelem = int8_t;
  static constexpr int kStep = 2 * V::W;
  static vf load_q(const int16_t* p) { return V::load_raw_i16(p); }
  static vf load_k(const int8_t* p) { return V::widen_i8(p); }
  static vf mul(vf q, vf k) { return V::dot_i16(V::zero(), q, k); }
  static vf madd(vf acc, vf q, vf k) { return V::dot_i16(acc, q, k); }
  static vf add(vf a, vf b) { return V::add_i32(a, b); }
  static vf reduce(const vf* acc) { return V::transpose_reduce_i32(acc); }
};
template <class V>
struct Bf16Dot {
  using vf = typename V::vf;
  using qelem = uint16_t;
  using kelem = uint16_t;
  static constexpr int kStep = 2 * V::W;
  static vf load_q(const uint16_t* p) { return V::load_raw(p); }
  static vf load_k(const uint16_t* p) { return V::load_raw(p); }
  static vf mul(vf q, vf k) { return V::dot_bf16(V::zero(), q, k); }
  static vf madd(vf acc, vf q, vf k) { return V::dot_bf16(acc, q, k); }
  static vf add(vf a, vf b) { return V::add(a, b); }
  static vf reduce(const vf* acc) { return V::transpose_reduce(acc); }
};


// One row of q (`q`, scaled) in 16-bit fixed point against a page's K scales `ks`: x_d = q_d *
// ks_d, q16 = round(x * qmax / max |x|) (detail::int8_query's float32 operations, element for
// element, so every level gets the same q16 and scale); returns the scale m / qmax. `t` holds D
// floats of scratch; D a multiple of W.
template <class V>
OLEP_HOT float fixed_query_row(const float* q, const float* ks, int64_t D, int16_t* q16, float* t) {
  using vf = typename V::vf;
  constexpr int W = V::W;
  const float qmax = detail::int8_query_max(D);
  vf mx = V::zero();
  for (int64_t d = 0; d < D; d += W) {
    const vf x = V::mul(V::load(q + d), V::load(ks + d));
    V::store(t + d, x);
    mx = V::max(mx, V::abs(x));
  }
  float m = V::reduce_max(mx);
  // (a tiny max is first scaled up by 2^100, exactly, so qmax / m stays finite)
  const float pre = m < 0x1p-100f ? 0x1p100f : 1.0f;
  m *= pre;
  const float inv = m > 0.0f ? qmax / m : 0.0f;
  for (int64_t d = 0; d < D; d += W) V::round_i16(q16 + d, V::mul(V::mul(V::load(t + d), V::set1(pre)), V::set1(inv)));
  return m / qmax / pre;
}

// int4 pages: the part of a score the K minimums give, sum_d q_d * key_min_d (q scaled), in
// float32, summed in W lanes, then across them (detail::int4_bias is the scalar level's serial
// sum: the two differ in rounding only). D a multiple of W.
template <class V>
OLEP_HOT float int4_query_bias(const float* q, const float* key_min, int64_t D) {
  typename V::vf b = V::zero();
  for (int64_t d = 0; d < D; d += V::W) b = V::fma(V::load(q + d), V::load(key_min + d), b);
  return V::reduce_add(b);
}

// Probabilities of keys a row cannot see are stored as -0.0f (kUnseen); a visible key's
// probability is >= +0.0f (exp may underflow to +0).
constexpr float kUnseen = -0.0f;

}  // namespace
}  // namespace simd
}  // namespace kernels
}  // namespace olep
