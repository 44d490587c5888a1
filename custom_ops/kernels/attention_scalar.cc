// Scalar reference attention: the oracle every ISA level is tested against.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/attention.h"
#include "kernels/attention_internal.h"

namespace olep {
namespace kernels {

void attend_range_scalar(const AttentionGroup& a, int64_t key_begin, int64_t key_end, AttentionState* st,
                         float* scratch) {
  using namespace detail;
  const int64_t G = a.group_size, S = a.num_rows, D = a.head_dim, Dv = a.v_head_dim;
  const int64_t valid = std::min(a.num_valid_rows, S);
  float* qf = scratch;        // [G * S, D]
  float* kf = qf + G * S * D;  // [D]
  float* vf = kf + D;          // [Dv]
  for (int64_t h = 0; h < G; ++h)
    for (int64_t i = 0; i < valid; ++i)
      for (int64_t d = 0; d < D; ++d) qf[(h * S + i) * D + d] = load(a.dtype, a.q, h * a.q_head_stride + i * a.q_row_stride + d);
  // int8 blocks: q in 16-bit fixed point per (row, block) (int8_query), as every SIMD level;
  // q16 [G * S, D] and sq [G * S] after vf, for the block in q16_blk
  const bool fixed = int8_fixed_point(a);
  int16_t* q16 = reinterpret_cast<int16_t*>(vf + Dv);
  float* sq = reinterpret_cast<float*>(q16 + (G * S * D + 1) / 2 * 2);  // 4-byte aligned (G * S * D may be odd)
  float* qbias = sq + G * S;  // int4: sum_d q[d] * scale * key_min[d] per row
  int64_t q16_blk = -1;
  const float lowest = lowest_of(a.mask.dtype);
  const int64_t es = static_cast<int64_t>(dtype_size(a.dtype));
  key_end = std::min(key_end, a.num_keys);
  for (int64_t blk = 0; blk < a.num_blocks; ++blk) {
    const KVBlock& kb = a.blocks[blk];
    const int64_t first = std::max(key_begin, kb.first_position);
    const int64_t last = std::min(key_end, kb.first_position + kb.num_rows);
    const bool codes = fixed && kb.encoding != KVEncoding::kNative;
    const bool int4 = kb.encoding == KVEncoding::kInt4;
    if (codes && first < last && q16_blk != blk) {
      for (int64_t h = 0; h < G; ++h)
        for (int64_t i = 0; i < valid; ++i) {
          const int64_t r = h * S + i;
          float* x = kf;  // q * scale (or q with softcap), as the SIMD levels scale it
          for (int64_t d = 0; d < D; ++d) x[d] = qf[r * D + d] * (a.softcap > 0.0f ? 1.0f : a.scale);
          sq[r] = int8_query(x, kb.key_scale, D, q16 + r * D);
          qbias[r] = int4 ? int4_bias(x, kb.key_min, D) : 0.0f;
        }
      q16_blk = blk;
    }
    for (int64_t j = first; j < last; ++j) {
      const int64_t row = j - kb.first_position;
      bool loaded = false;
      for (int64_t i = 0; i < valid; ++i) {
        int64_t lo, hi;
        visible_range(a, i, &lo, &hi);
        if (j < lo || j >= hi) continue;
        if (!loaded) {
          if (int4) {
            const int64_t pr = kb.page_row + row;
            for (int64_t d = 0; d < D; ++d)
              kf[d] = kb.key_min[d] + static_cast<float>(int4_key_code(kb.key, D, pr, d)) *
                                          kb.key_scale[d];
            for (int64_t d = 0; d < Dv; ++d)
              vf[d] = kb.value_min[pr] +
                      static_cast<float>(int4_value_code(kb.value, Dv, pr, d)) *
                          kb.value_scale[pr];
          } else if (kb.encoding == KVEncoding::kInt8) {
            const int64_t pr = kb.page_row + row;
            const int8_t* k8 = static_cast<const int8_t*>(kb.key) + pr * D;
            const int8_t* v8 = static_cast<const int8_t*>(kb.value);
            for (int64_t d = 0; d < D; ++d) kf[d] = static_cast<float>(k8[d]) * kb.key_scale[d];
            for (int64_t d = 0; d < Dv; ++d) vf[d] = static_cast<float>(v8[int8_value_index(Dv, pr, d)]) * kb.value_scale[pr];
          } else {
            to_float(a.dtype, static_cast<const char*>(kb.key) + row * D * es, kf, D);
            to_float(a.dtype, static_cast<const char*>(kb.value) + row * Dv * es, vf, Dv);
          }
          loaded = true;
        }
        for (int64_t h = 0; h < G; ++h) {
          const float bias = mask_bias(a.mask, h, i, j, lowest);
          if (bias == -INFINITY) continue;
          const int64_t r = h * S + i;
          float s = 0.0f;
          if (codes) {  // exact int32 sum of q16 x codes, times sq (scale included unless softcap)
            const int64_t pr = kb.page_row + row;
            const int16_t* qq = q16 + r * D;
            int64_t sum = 0;
            if (int4) {
              for (int64_t d = 0; d < D; ++d)
                sum += static_cast<int64_t>(qq[d]) * int4_key_code(kb.key, D, pr, d);
            } else {
              const int8_t* k8 = static_cast<const int8_t*>(kb.key) + pr * D;
              for (int64_t d = 0; d < D; ++d) sum += static_cast<int64_t>(qq[d]) * k8[d];
            }
            s = sq[r] * static_cast<float>(sum) + qbias[r];
            if (a.softcap > 0.0f) s *= a.scale;
          } else {
            const float* q = qf + r * D;
            s = dot_blocked(q, kf, D) * a.scale;
          }
          if (a.softcap > 0.0f) s = a.softcap * std::tanh(s / a.softcap);
          s += bias;
          if (s != s || s == INFINITY) {  // NaN or +inf (q, k, mask): the row is NaN, as ONNX softmax gives
            st->l[r] = NAN;
            continue;
          }
          if (!(s > -INFINITY)) continue;  // -inf contributes nothing
          float* o = st->acc + r * Dv;
          if (s > st->m[r]) {
            const float c = std::exp(st->m[r] - s);  // exp(-inf) = 0 on the first key
            st->l[r] = st->l[r] * c + 1.0f;
            for (int64_t d = 0; d < Dv; ++d) o[d] = o[d] * c + vf[d];
            st->m[r] = s;
          } else {
            const float p = std::exp(s - st->m[r]);
            st->l[r] += p;
            for (int64_t d = 0; d < Dv; ++d) o[d] += p * vf[d];
          }
        }
      }
    }
  }
}

}  // namespace kernels
}  // namespace olep
