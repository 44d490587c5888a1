#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>

#include "kernels/attention.h"

namespace olep {
namespace kernels {
namespace {

float lowest_of(DType t) {
  switch (t) {
    case DType::kFloat32: return -FLT_MAX;
    case DType::kFloat16: return -65504.0f;
    case DType::kBFloat16: return bf16_to_float(0xff7fu);
  }
  return -FLT_MAX;
}

float load(DType t, const void* p, int64_t i) {
  switch (t) {
    case DType::kFloat32: return static_cast<const float*>(p)[i];
    case DType::kFloat16: return half_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::kBFloat16: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
  }
  return 0.0f;
}

void store(DType t, void* p, int64_t i, float v) {
  switch (t) {
    case DType::kFloat32: static_cast<float*>(p)[i] = v; return;
    case DType::kFloat16: static_cast<uint16_t*>(p)[i] = float_to_half(v); return;
    case DType::kBFloat16: static_cast<uint16_t*>(p)[i] = float_to_bf16(v); return;
  }
}

}  // namespace

int64_t attend_scratch_floats(const AttentionGroup& a) {
  const int64_t rows = a.group_size * a.num_rows;
  return rows * (a.head_dim + a.v_head_dim + 2) + a.head_dim + a.v_head_dim;
}

void attend_group_scalar(const AttentionGroup& a, float* scratch) {
  const int64_t G = a.group_size, S = a.num_rows, D = a.head_dim, Dv = a.v_head_dim;
  const int64_t R = G * S;  // state rows, index r = h * S + i
  float* qf = scratch;
  float* acc = qf + R * D;
  float* mx = acc + R * Dv;
  float* sum = mx + R;
  float* kf = sum + R;
  float* vf = kf + D;
  const int64_t valid = std::min(a.num_valid_rows, S);
  for (int64_t h = 0; h < G; ++h)
    for (int64_t i = 0; i < S; ++i) {
      const int64_t r = h * S + i;
      const int64_t off = h * a.q_head_stride + i * a.q_row_stride;
      for (int64_t d = 0; d < D; ++d) qf[r * D + d] = load(a.dtype, a.q, off + d);
      mx[r] = -INFINITY;
      sum[r] = 0.0f;
      std::fill(acc + r * Dv, acc + (r + 1) * Dv, 0.0f);
    }
  const float mask_lowest = lowest_of(a.mask.dtype);
  for (int64_t blk = 0; blk < a.num_blocks; ++blk) {
    const KVBlock& kb = a.blocks[blk];
    for (int64_t row = 0; row < kb.num_rows; ++row) {
      const int64_t j = kb.first_position + row;
      if (j >= a.num_keys) break;
      bool loaded = false;
      for (int64_t i = 0; i < valid; ++i) {
        const int64_t qpos = a.q_offset + i;
        if (a.is_causal && j > qpos) continue;
        if (a.local_window_size > 0 && j <= qpos - a.local_window_size) continue;
        if (!loaded) {
          to_float(a.dtype, static_cast<const char*>(kb.key) + row * D * static_cast<int64_t>(dtype_size(a.dtype)), kf, D);
          to_float(a.dtype, static_cast<const char*>(kb.value) + row * Dv * static_cast<int64_t>(dtype_size(a.dtype)), vf,
                   Dv);
          loaded = true;
        }
        for (int64_t h = 0; h < G; ++h) {
          float bias = 0.0f;
          if (a.mask.kind != MaskKind::kNone) {
            const int64_t mo = h * a.mask.head_stride + i * a.mask.row_stride + j * a.mask.key_stride;
            if (a.mask.kind == MaskKind::kBool) {
              if (static_cast<const uint8_t*>(a.mask.data)[mo] == 0) continue;
            } else {
              bias = load(a.mask.dtype, a.mask.data, mo);
              if (bias <= mask_lowest) continue;
            }
          }
          const int64_t r = h * S + i;
          const float* q = qf + r * D;
          float s = 0.0f;
          for (int64_t d = 0; d < D; ++d) s += q[d] * kf[d];
          s *= a.scale;
          if (a.softcap > 0.0f) s = a.softcap * std::tanh(s / a.softcap);
          s += bias;
          if (!(s > -INFINITY)) continue;  // -inf (or NaN) contributes nothing
          float* o = acc + r * Dv;
          if (s > mx[r]) {
            const float c = std::exp(mx[r] - s);  // exp(-inf) = 0 on the first key
            sum[r] = sum[r] * c + 1.0f;
            for (int64_t d = 0; d < Dv; ++d) o[d] = o[d] * c + vf[d];
            mx[r] = s;
          } else {
            const float p = std::exp(s - mx[r]);
            sum[r] += p;
            for (int64_t d = 0; d < Dv; ++d) o[d] += p * vf[d];
          }
        }
      }
    }
  }
  for (int64_t h = 0; h < G; ++h)
    for (int64_t i = 0; i < S; ++i) {
      const int64_t r = h * S + i;
      const int64_t off = h * a.out_head_stride + i * a.out_row_stride;
      const float inv = (i < valid && sum[r] > 0.0f) ? 1.0f / sum[r] : 0.0f;
      for (int64_t d = 0; d < Dv; ++d) store(a.dtype, a.out, off + d, acc[r * Dv + d] * inv);
    }
}

}  // namespace kernels
}  // namespace olep
