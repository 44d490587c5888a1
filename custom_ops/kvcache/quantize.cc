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

namespace {

bool finite_page(const std::vector<float>& k, const std::vector<float>& v);

bool quantize_page_int8(const CacheGeometry& g, const char* src, char* dst) {
  const int64_t P = g.page_tokens, D = g.head_dim, Dv = g.v_head_dim;
  const DType t = g.dtype;
  const char* ksrc = src;
  const char* vsrc = src + g.value_offset();
  std::vector<float> k(static_cast<size_t>(P * D)), v(static_cast<size_t>(P * Dv));
  to_float(t, ksrc, k.data(), P * D);
  to_float(t, vsrc, v.data(), P * Dv);
  // Values of magnitude >= 2^126 stay native too: 127 * (max / 127) may round up to inf there.
  if (!finite_page(k, v)) return false;
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
  const int64_t used = g.quant_scale_offset() + g.quant_meta_bytes();
  std::memset(dst + used, 0, static_cast<size_t>(g.quant_page_bytes() - used));
  return true;
}

bool finite_page(const std::vector<float>& k, const std::vector<float>& v) {
  constexpr float kMax = 8.507059e37f;  // 2^126
  for (const std::vector<float>* x : {&k, &v})
    for (float f : *x)
      if (!(std::fabs(f) < kMax)) return false;
  return true;
}

uint8_t code4(float x, float mn, float scale) {
  if (scale == 0.0f) return 0;
  float q = std::nearbyint((x - mn) / scale);
  q = q > 15.0f ? 15.0f : (q < 0.0f ? 0.0f : q);
  return static_cast<uint8_t>(q);
}

bool quantize_page_int4(const CacheGeometry& g, const char* src, char* dst) {
  const int64_t P = g.page_tokens, D = g.head_dim, Dv = g.v_head_dim;
  std::vector<float> k(static_cast<size_t>(P * D)), v(static_cast<size_t>(P * Dv));
  to_float(g.dtype, src, k.data(), P * D);
  to_float(g.dtype, src + g.value_offset(), v.data(), P * Dv);
  if (!finite_page(k, v)) return false;
  uint8_t* kq = reinterpret_cast<uint8_t*>(dst);
  uint8_t* vq = reinterpret_cast<uint8_t*>(dst + g.quant_value_offset());
  std::memset(dst, 0, static_cast<size_t>(g.quant_scale_offset()));
  float* ks = reinterpret_cast<float*>(dst + g.quant_scale_offset());
  float* vs = ks + D;
  float* kmin = vs + P;
  float* vmin = kmin + D;
  for (int64_t d = 0; d < D; ++d) {
    float lo = k[static_cast<size_t>(d)], hi = lo;
    for (int64_t r = 1; r < P; ++r) {
      lo = std::fmin(lo, k[static_cast<size_t>(r * D + d)]);
      hi = std::fmax(hi, k[static_cast<size_t>(r * D + d)]);
    }
    kmin[d] = lo;
    ks[d] = (hi - lo) / 15.0f;
  }
  bool high;
  for (int64_t r = 0; r < P; ++r)
    for (int64_t d = 0; d < D; ++d) {
      const int64_t at = int4_key_byte(D, r, d, &high);
      const uint8_t c = code4(k[static_cast<size_t>(r * D + d)], kmin[d], ks[d]);
      kq[at] = static_cast<uint8_t>(kq[at] | (high ? c << 4 : c));
    }
  for (int64_t r = 0; r < P; ++r) {
    float lo = v[static_cast<size_t>(r * Dv)], hi = lo;
    for (int64_t d = 1; d < Dv; ++d) {
      lo = std::fmin(lo, v[static_cast<size_t>(r * Dv + d)]);
      hi = std::fmax(hi, v[static_cast<size_t>(r * Dv + d)]);
    }
    vmin[r] = lo;
    vs[r] = (hi - lo) / 15.0f;
    for (int64_t d = 0; d < Dv; ++d) {
      const int64_t at = int4_value_byte(Dv, r, d, &high);
      const uint8_t c = code4(v[static_cast<size_t>(r * Dv + d)], vmin[r], vs[r]);
      vq[at] = static_cast<uint8_t>(vq[at] | (high ? c << 4 : c));
    }
  }
  const int64_t used = g.quant_scale_offset() + g.quant_meta_bytes();
  std::memset(dst + used, 0, static_cast<size_t>(g.quant_page_bytes() - used));
  return true;
}

}  // namespace

bool quantize_page(const CacheGeometry& g, const char* src, char* dst) {
  return g.kv_quant == KVQuant::kInt4 ? quantize_page_int4(g, src, dst) : quantize_page_int8(g, src, dst);
}

bool valid_page(const CacheGeometry& g, const char* page) {
  const int64_t D = g.head_dim, P = g.page_tokens;
  const bool int4 = g.kv_quant == KVQuant::kInt4;
  std::vector<float> meta(static_cast<size_t>((int4 ? 2 : 1) * (D + P)));
  std::memcpy(meta.data(), page + g.quant_scale_offset(), meta.size() * sizeof(float));
  const size_t scales = static_cast<size_t>(D + P);
  for (size_t i = 0; i < meta.size(); ++i) {
    const float x = meta[i];
    if (i < scales ? !(x >= 0.0f && x < 0x1p126f) : !(std::fabs(x) < 0x1p126f)) return false;
  }
  if (!int4) {
    const int8_t* codes = reinterpret_cast<const int8_t*>(page);
    for (int64_t i = 0; i < g.quant_scale_offset(); ++i)
      if (codes[i] == -128) return false;
  }
  return true;
}

void dequantize_block(const CacheGeometry& g, const KVBlock& kb, void* k_out, void* v_out) {
  const int64_t D = g.head_dim, Dv = g.v_head_dim;
  const size_t es = g.elem_bytes();
  std::vector<float> row(static_cast<size_t>(std::max(D, Dv)));
  for (int64_t r = 0; r < kb.num_rows; ++r) {
    const int64_t pr = kb.page_row + r;
    if (kb.encoding == KVEncoding::kInt4) {
      for (int64_t d = 0; d < D; ++d) {
        const int c = int4_key_code(kb.key, D, pr, d);
        row[static_cast<size_t>(d)] = kb.key_min[d] + static_cast<float>(c) * kb.key_scale[d];
      }
    } else {
      const int8_t* kq = static_cast<const int8_t*>(kb.key);
      for (int64_t d = 0; d < D; ++d) row[static_cast<size_t>(d)] = static_cast<float>(kq[pr * D + d]) * kb.key_scale[d];
    }
    from_float(g.dtype, row.data(), static_cast<char*>(k_out) + static_cast<size_t>(r * D) * es, D);
    if (kb.encoding == KVEncoding::kInt4) {
      for (int64_t d = 0; d < Dv; ++d) {
        const int c = int4_value_code(kb.value, Dv, pr, d);
        row[static_cast<size_t>(d)] = kb.value_min[pr] + static_cast<float>(c) * kb.value_scale[pr];
      }
    } else {
      const int8_t* vq = static_cast<const int8_t*>(kb.value);
      for (int64_t d = 0; d < Dv; ++d)
        row[static_cast<size_t>(d)] = static_cast<float>(vq[int8_value_index(Dv, pr, d)]) * kb.value_scale[pr];
    }
    from_float(g.dtype, row.data(), static_cast<char*>(v_out) + static_cast<size_t>(r * Dv) * es, Dv);
  }
}

KVBlock quant_block(const CacheGeometry& g, const char* page, int64_t first, int64_t row_begin, int64_t row_end) {
  KVBlock kb;
  kb.encoding = g.kv_quant == KVQuant::kInt4 ? KVEncoding::kInt4 : KVEncoding::kInt8;
  kb.key = page;
  kb.value = page + g.quant_value_offset();
  kb.key_scale = reinterpret_cast<const float*>(page + g.quant_scale_offset());
  kb.value_scale = kb.key_scale + g.head_dim;
  if (kb.encoding == KVEncoding::kInt4) {
    kb.key_min = kb.value_scale + g.page_tokens;
    kb.value_min = kb.key_min + g.head_dim;
  }
  kb.page_row = row_begin;
  kb.first_position = first + row_begin;
  kb.num_rows = row_end - row_begin;
  return kb;
}

}  // namespace quant
}  // namespace olep
