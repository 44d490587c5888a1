#include "kvcache/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/dtype.h"

namespace olep {
namespace quant {
namespace {

int8_t code(float x, float scale) {
  if (scale == 0.0f) return 0;
  float q = std::nearbyint(x / scale);  // round half to even (default rounding mode)
  q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
  return static_cast<int8_t>(q);
}

}  // namespace

bool quantize_page_int8(const CacheGeometry& g, const char* src, char* dst) {
  const int64_t P = g.page_tokens, D = g.head_dim, Dv = g.v_head_dim;
  const DType t = g.dtype;
  const char* ksrc = src;
  const char* vsrc = src + g.value_offset();
  std::vector<float> k(static_cast<size_t>(P * D)), v(static_cast<size_t>(P * Dv));
  to_float(t, ksrc, k.data(), P * D);
  to_float(t, vsrc, v.data(), P * Dv);
  // Values of magnitude >= 2^126 stay native too: 127 * (max / 127) may round up to inf there.
  constexpr float kMax = 8.507059e37f;  // 2^126
  for (const std::vector<float>* x : {&k, &v})
    for (float f : *x)
      if (!(std::fabs(f) < kMax)) return false;
  int8_t* kq = reinterpret_cast<int8_t*>(dst);
  int8_t* vq = reinterpret_cast<int8_t*>(dst + g.quant_value_offset());
  float* ks = reinterpret_cast<float*>(dst + g.quant_scale_offset());
  float* vs = ks + D;
  for (int64_t d = 0; d < D; ++d) {
    float m = 0.0f;
    for (int64_t r = 0; r < P; ++r) m = std::fmax(m, std::fabs(k[static_cast<size_t>(r * D + d)]));
    ks[d] = m / 127.0f;
  }
  for (int64_t r = 0; r < P; ++r)
    for (int64_t d = 0; d < D; ++d) kq[r * D + d] = code(k[static_cast<size_t>(r * D + d)], ks[d]);
  for (int64_t r = 0; r < P; ++r) {
    float m = 0.0f;
    for (int64_t d = 0; d < Dv; ++d) m = std::fmax(m, std::fabs(v[static_cast<size_t>(r * Dv + d)]));
    vs[r] = m / 127.0f;
    for (int64_t d = 0; d < Dv; ++d) vq[int8_value_index(Dv, r, d)] = code(v[static_cast<size_t>(r * Dv + d)], vs[r]);
  }
  const int64_t used = g.quant_scale_offset() + 4 * (D + P);
  std::memset(dst + used, 0, static_cast<size_t>(g.quant_page_bytes() - used));
  return true;
}

void dequantize_block(const CacheGeometry& g, const KVBlock& kb, void* k_out, void* v_out) {
  const int64_t D = g.head_dim, Dv = g.v_head_dim;
  const int8_t* kq = static_cast<const int8_t*>(kb.key);
  const int8_t* vq = static_cast<const int8_t*>(kb.value);
  const size_t es = g.elem_bytes();
  std::vector<float> row(static_cast<size_t>(std::max(D, Dv)));
  for (int64_t r = 0; r < kb.num_rows; ++r) {
    const int64_t pr = kb.page_row + r;
    for (int64_t d = 0; d < D; ++d) row[static_cast<size_t>(d)] = static_cast<float>(kq[pr * D + d]) * kb.key_scale[d];
    from_float(g.dtype, row.data(), static_cast<char*>(k_out) + static_cast<size_t>(r * D) * es, D);
    for (int64_t d = 0; d < Dv; ++d)
      row[static_cast<size_t>(d)] = static_cast<float>(vq[int8_value_index(Dv, pr, d)]) * kb.value_scale[pr];
    from_float(g.dtype, row.data(), static_cast<char*>(v_out) + static_cast<size_t>(r * Dv) * es, Dv);
  }
}

KVBlock int8_block(const CacheGeometry& g, const char* page, int64_t first, int64_t row_begin, int64_t row_end) {
  KVBlock kb;
  kb.encoding = KVEncoding::kInt8;
  kb.key = page;
  kb.value = page + g.quant_value_offset();
  kb.key_scale = reinterpret_cast<const float*>(page + g.quant_scale_offset());
  kb.value_scale = kb.key_scale + g.head_dim;
  kb.page_row = row_begin;
  kb.first_position = first + row_begin;
  kb.num_rows = row_end - row_begin;
  return kb;
}

}  // namespace quant
}  // namespace olep
