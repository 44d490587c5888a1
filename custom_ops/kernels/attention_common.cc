// AttentionState bookkeeping, exact merge, finalize and run-time ISA dispatch.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels/attention.h"
#include "kernels/attention_internal.h"

namespace olep {
namespace kernels {

int64_t state_floats(const AttentionGroup& a) {
  const int64_t R = a.group_size * a.num_rows;
  return R * (2 + a.v_head_dim);
}

void init_state(const AttentionGroup& a, float* buffer, AttentionState* s) {
  const int64_t R = a.group_size * a.num_rows;
  s->m = buffer;
  s->l = buffer + R;
  s->acc = buffer + 2 * R;
  std::fill(s->m, s->m + R, -INFINITY);
  std::fill(s->l, s->l + R, 0.0f);
  std::fill(s->acc, s->acc + R * a.v_head_dim, 0.0f);
}

void merge_states(const AttentionGroup& a, AttentionState* dst, const AttentionState& src) {
  const int64_t R = a.group_size * a.num_rows, Dv = a.v_head_dim;
  for (int64_t r = 0; r < R; ++r) {
    if (std::isnan(src.l[r])) {
      dst->l[r] = NAN;
      continue;
    }
    if (!(src.l[r] > 0.0f) || std::isnan(dst->l[r])) continue;
    const float m = std::max(dst->m[r], src.m[r]);
    const float cd = std::exp(dst->m[r] - m), cs = std::exp(src.m[r] - m);
    dst->l[r] = dst->l[r] * cd + src.l[r] * cs;
    float* o = dst->acc + r * Dv;
    const float* x = src.acc + r * Dv;
    for (int64_t d = 0; d < Dv; ++d) o[d] = o[d] * cd + x[d] * cs;
    dst->m[r] = m;
  }
}

void finalize(const AttentionGroup& a, const AttentionState& s) {
  // The SIMD rows for every output type where v_head_dim allows: 16-bit outputs' scalar
  // conversion took ~1.8 ns per element (Zen 4), ~7 us of an MQA 32/1 fp16 call in cache (4096
  // outputs), as much as a few hundred keys' attention; float32 ones (the same products) 3-5% of
  // a causal S=512 prefill in the scalar loop.
  const Isa isa = active_isa();
  if (isa >= Isa::kAvx512 && a.v_head_dim % 16 == 0) return finalize_avx512(a, s);
  if (isa >= Isa::kAvx2 && a.v_head_dim % 8 == 0) return finalize_avx2(a, s);
  finalize_scalar(a, s);
}

void finalize_scalar(const AttentionGroup& a, const AttentionState& s) {
  const int64_t G = a.group_size, S = a.num_rows, Dv = a.v_head_dim;
  const int64_t valid = std::min(a.num_valid_rows, S);
  for (int64_t h = 0; h < G; ++h)
    for (int64_t i = 0; i < S; ++i) {
      const int64_t r = h * S + i;
      const int64_t off = h * a.out_head_stride + i * a.out_row_stride;
      const detail::RowScale rs = detail::finalize_row_scale(s, r, i, valid);
      const float inv = rs.inv, fill = rs.fill;
      const float* acc = s.acc + r * Dv;
      if (a.dtype == DType::kFloat32) {
        float* o = static_cast<float*>(a.out) + off;
        for (int64_t d = 0; d < Dv; ++d) o[d] = inv == 0.0f ? fill : acc[d] * inv;
      } else {
        for (int64_t d = 0; d < Dv; ++d) detail::store(a.dtype, a.out, off + d, inv == 0.0f ? fill : acc[d] * inv);
      }
    }
}

int64_t scratch_floats(const AttentionGroup& a) {
  const int64_t R = a.group_size * a.num_rows;
  // Row path: q rows (pre-converted), one K/V tile of 16 keys converted to float, 16
  // probabilities per row, rescale factors. Lanes path: q transposed with rows padded to a
  // multiple of 16, the same K/V tile, 32 probabilities per padded row (tiles of 32 keys), m/l/corr per padded row.
  // Plus the row path's scores of one chunk of 1024 keys (simd::kChunkKeys) for one row.
  const int64_t Rp = R + 16;
  // Plus q times an int8 block's K scales, [R, head_dim] (row path on int8 codes).
  // Plus, for int4 blocks, a score term and a P.V term per row (row path) or per padded row (lanes).
  // Plus the lanes path's per row block key ranges (4 int64 per 16 rows and more).
  // Plus the lanes path's second K/V tile (16-bit rows: the next tile, converted during this one).
  return Rp * (2 * a.head_dim + 32 + 7) + 2 * 32 * (a.head_dim + a.v_head_dim) + a.head_dim + a.v_head_dim + 64 +
         1024;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return "scalar";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx512Bf16: return "avx512_bf16";
  }
  return "unknown";
}

Isa detected_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma"))
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni") ? Isa::kAvx512Bf16
                                                                                          : Isa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return Isa::kAvx2;
  return Isa::kScalar;
}

namespace {
std::atomic<int> g_isa{-1};
Isa from_env() {
  std::string warning;
  const Isa isa = choose_isa(std::getenv("ONNX_LIGHT_ISA"), detected_isa(), &warning);
  if (!warning.empty()) std::fprintf(stderr, "onnx_light_ep: %s\n", warning.c_str());
  return isa;
}
}  // namespace

Isa choose_isa(const char* value, Isa best, std::string* warning) {
  warning->clear();
  if (value == nullptr || *value == '\0') return best;
  const std::string s(value);
  Isa want;
  if (s == "scalar") want = Isa::kScalar;
  else if (s == "avx2") want = Isa::kAvx2;
  else if (s == "avx512") want = Isa::kAvx512;
  else if (s == "avx512_bf16") want = Isa::kAvx512Bf16;
  else {
    *warning = "ONNX_LIGHT_ISA=" + s + " is not a level (scalar, avx2, avx512, avx512_bf16); using " + isa_name(best);
    return best;
  }
  if (static_cast<int>(want) > static_cast<int>(best)) {
    *warning = "ONNX_LIGHT_ISA=" + s + ": this CPU does not support it (levels: scalar up to " + isa_name(best) +
               "); using " + isa_name(best);
    return best;
  }
  return want;
}

Isa active_isa() {
  int v = g_isa.load(std::memory_order_relaxed);
  if (v < 0) {
    v = static_cast<int>(from_env());
    g_isa.store(v, std::memory_order_relaxed);
  }
  return static_cast<Isa>(v);
}

void set_isa(Isa isa) {
  if (static_cast<int>(isa) > static_cast<int>(detected_isa()))
    throw std::invalid_argument(std::string("set_isa: this CPU does not support ") + isa_name(isa) + "; best is " +
                                isa_name(detected_isa()));
  g_isa.store(static_cast<int>(isa), std::memory_order_relaxed);
}

void attend_range(const AttentionGroup& a, int64_t key_begin, int64_t key_end, AttentionState* state, float* scratch) {
  switch (active_isa()) {
    case Isa::kAvx512Bf16: attend_range_avx512_bf16(a, key_begin, key_end, state, scratch); return;
    case Isa::kAvx512: attend_range_avx512(a, key_begin, key_end, state, scratch); return;
    case Isa::kAvx2: attend_range_avx2(a, key_begin, key_end, state, scratch); return;
    case Isa::kScalar: attend_range_scalar(a, key_begin, key_end, state, scratch); return;
  }
}

int64_t attend_group_floats(const AttentionGroup& a) { return state_floats(a) + scratch_floats(a); }

void attend_group(const AttentionGroup& a, float* buf) {
  AttentionState s;
  init_state(a, buf, &s);
  attend_range(a, 0, a.num_keys, &s, buf + state_floats(a));
  finalize(a, s);
}

}  // namespace kernels
}  // namespace olep
