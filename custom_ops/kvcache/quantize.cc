#include "kvcache/quantize.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "common/dtype.h"

namespace olep {
namespace quant {
namespace {

float load(DType t, const char* p, int64_t i) {
  switch (t) {
    case DType::kFloat32: return reinterpret_cast<const float*>(p)[i];
    case DType::kFloat16: return half_to_float(reinterpret_cast<const uint16_t*>(p)[i]);
    case DType::kBFloat16: return bf16_to_float(reinterpret_cast<const uint16_t*>(p)[i]);
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
  // Values of magnitude >= 2^126 stay native too: 127 * (max / 127) may round up to inf there.
  constexpr float kMax = 8.507059e37f;  // 2^126
  for (int64_t i = 0; i < P * D; ++i) {
    k[static_cast<size_t>(i)] = load(t, ksrc, i);
    if (!(std::fabs(k[static_cast<size_t>(i)]) < kMax)) return false;
  }
  for (int64_t i = 0; i < P * Dv; ++i) {
    v[static_cast<size_t>(i)] = load(t, vsrc, i);
    if (!(std::fabs(v[static_cast<size_t>(i)]) < kMax)) return false;
  }
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
    for (int64_t d = 0; d < Dv; ++d) vq[r * Dv + d] = code(v[static_cast<size_t>(r * Dv + d)], vs[r]);
  }
  const int64_t used = g.quant_scale_offset() + 4 * (D + P);
  std::memset(dst + used, 0, static_cast<size_t>(g.quant_page_bytes() - used));
  return true;
}

void dequantize_block(const CacheGeometry& g, const KVBlock& kb, void* k_out, void* v_out) {
  const int64_t D = g.head_dim, Dv = g.v_head_dim;
  const int8_t* kq = static_cast<const int8_t*>(kb.key);
  const int8_t* vq = static_cast<const int8_t*>(kb.value);
  for (int64_t r = 0; r < kb.num_rows; ++r) {
    for (int64_t d = 0; d < D; ++d) store(g.dtype, k_out, r * D + d, static_cast<float>(kq[r * D + d]) * kb.key_scale[d]);
    for (int64_t d = 0; d < Dv; ++d)
      store(g.dtype, v_out, r * Dv + d, static_cast<float>(vq[r * Dv + d]) * kb.value_scale[r]);
  }
}

KVBlock int8_block(const CacheGeometry& g, const char* page, int64_t first, int64_t row_begin, int64_t row_end) {
  KVBlock kb;
  kb.encoding = KVEncoding::kInt8;
  kb.key = page + row_begin * g.head_dim;
  kb.value = page + g.quant_value_offset() + row_begin * g.v_head_dim;
  kb.key_scale = reinterpret_cast<const float*>(page + g.quant_scale_offset());
  kb.value_scale = kb.key_scale + g.head_dim + row_begin;
  kb.first_position = first + row_begin;
  kb.num_rows = row_end - row_begin;
  return kb;
}

}  // namespace quant
}  // namespace olep
