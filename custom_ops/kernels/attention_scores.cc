// ONNX Attention's qk_matmul_output (kernels/attention.h, qk_scores): the score matrix of one
// work item at one stage, in float32, scalar. attend_range never materializes scores; this is
// the debug output's own path, with the same score, mask and visibility rules.
#include <cmath>

#include "kernels/attention.h"
#include "kernels/attention_internal.h"

namespace olep {
namespace kernels {

void qk_scores(const AttentionGroup& a, QkStage stage, const void* key, int64_t total_keys, void* out,
               int64_t out_head_stride, int64_t out_row_stride, float* scratch) {
  using namespace detail;
  const int64_t D = a.head_dim;
  const float lowest = lowest_of(a.mask.dtype);
  float* s = scratch;  // [total_keys] one row
  for (int64_t h = 0; h < a.group_size; ++h)
    for (int64_t i = 0; i < a.num_rows; ++i) {
      const int64_t o = h * out_head_stride + i * out_row_stride;
      if (i >= a.num_valid_rows) {
        for (int64_t j = 0; j < total_keys; ++j) store(a.dtype, out, o + j, 0.0f);
        continue;
      }
      const int64_t qo = h * a.q_head_stride + i * a.q_row_stride;
      for (int64_t j = 0; j < total_keys; ++j) {
        float dot = 0.0f;
        for (int64_t d = 0; d < D; ++d) dot += load(a.dtype, a.q, qo + d) * load(a.dtype, key, j * D + d);
        float x = dot * a.scale;
        if (stage != QkStage::kMatMul && a.softcap > 0.0f) x = a.softcap * std::tanh(x / a.softcap);
        s[j] = x;
      }
      if (stage == QkStage::kMatMul || stage == QkStage::kSoftcap) {
        for (int64_t j = 0; j < total_keys; ++j) store(a.dtype, out, o + j, s[j]);
        continue;
      }
      int64_t lo, hi;
      visible_range(a, i, &lo, &hi);  // hi <= num_keys: padding keys are outside too
      if (stage == QkStage::kBiased) {
        for (int64_t j = 0; j < total_keys; ++j) {
          float b = -INFINITY;
          if (j >= lo && j < hi) {
            const int64_t mo = h * a.mask.head_stride + i * a.mask.row_stride + j * a.mask.key_stride;
            if (a.mask.kind == MaskKind::kNone) b = 0.0f;
            else if (a.mask.kind == MaskKind::kBool) b = static_cast<const uint8_t*>(a.mask.data)[mo] ? 0.0f : -INFINITY;
            else b = load(a.mask.dtype, a.mask.data, mo);  // the value as given, as the spec adds it
          }
          store(a.dtype, out, o + j, s[j] + b);
        }
        continue;
      }
      // kSoftmax: attend_range's rules, two passes over the row.
      float m = -INFINITY;
      bool nan = false;
      for (int64_t j = 0; j < total_keys; ++j) {
        const float b = j >= lo && j < hi ? mask_bias(a.mask, h, i, j, lowest) : -INFINITY;
        if (b == -INFINITY) {
          s[j] = -INFINITY;
          continue;
        }
        s[j] += b;
        if (s[j] != s[j] || s[j] == INFINITY) nan = true;
        else if (s[j] > m) m = s[j];
      }
      float l = 0.0f;
      for (int64_t j = 0; j < total_keys; ++j) {
        s[j] = s[j] > -INFINITY && !nan ? std::exp(s[j] - m) : 0.0f;
        l += s[j];
      }
      const float inv = nan ? NAN : (l > 0.0f ? 1.0f / l : 0.0f);
      for (int64_t j = 0; j < total_keys; ++j) store(a.dtype, out, o + j, nan ? NAN : s[j] * inv);
    }
}

}  // namespace kernels
}  // namespace olep
