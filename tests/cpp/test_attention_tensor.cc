// ONNX Attention over tensors (ops/attention_tensor.h), the EP's tensor mode: qk_matmul_output in
// every qk_matmul_output_mode against a double-precision computation of the opset-23/24 text;
// attn_mask shorter than the keys equals the mask padded with "masked"; bfloat16 Q/K/V give the
// float32 result of the same (rounded) values within bf16 output rounding. Every ISA level.
#include <cmath>
#include <limits>
#include <vector>

#include "check.h"
#include "kernels/attention.h"
#include "ops/attention_tensor.h"

using namespace olep;
using namespace olep::ops;
using olep::kernels::Isa;

namespace {

Tensor tensor(ElemType t, const void* data, std::vector<int64_t> shape) {
  Tensor x;
  x.type = t;
  x.shape = std::move(shape);
  x.data = data;
  return x;
}

constexpr double kInf = std::numeric_limits<double>::infinity();

// The opset-23 text for BNSH float32 inputs with a past, a float mask [S, T] and is_causal:
// stage `mode` of score (b, h, i, j), double precision.
double spec_stage(const std::vector<float>& q, const std::vector<float>& pk, const std::vector<float>& k,
                  const std::vector<float>& mask, int64_t Hq, int64_t Hkv, int64_t S, int64_t P, int64_t D, float softcap,
                  int mode, int64_t b, int64_t h, int64_t i, int64_t j) {
  const int64_t T = P + S, kh = h / (Hq / Hkv);
  auto score = [&](int64_t jj) {
    double dot = 0.0;
    for (int64_t d = 0; d < D; ++d) {
      const double kv = jj < P ? pk[static_cast<size_t>(((b * Hkv + kh) * P + jj) * D + d)]
                               : k[static_cast<size_t>(((b * Hkv + kh) * S + jj - P) * D + d)];
      dot += q[static_cast<size_t>(((b * Hq + h) * S + i) * D + d)] * kv;
    }
    double s = dot / std::sqrt(static_cast<double>(D));
    if (mode == 0) return s;
    if (softcap > 0.0f) s = softcap * std::tanh(s / softcap);
    if (mode == 1) return s;
    return s + mask[static_cast<size_t>(i * T + jj)] + (jj <= i + P ? 0.0 : -kInf);
  };
  if (mode < 3) return score(j);
  double m = -kInf, l = 0.0;
  for (int64_t jj = 0; jj < T; ++jj) m = std::max(m, score(jj));
  for (int64_t jj = 0; jj < T; ++jj) l += std::exp(score(jj) - m);
  return std::exp(score(j) - m) / l;
}

void test_qk_matmul_output_modes() {
  const int64_t B = 2, Hq = 4, Hkv = 2, S = 3, P = 4, D = 8, T = P + S;
  auto q = randn(B * Hq * S * D, 1), k = randn(B * Hkv * S * D, 2), v = randn(B * Hkv * S * D, 3);
  auto pk = randn(B * Hkv * P * D, 4), pv = randn(B * Hkv * P * D, 5), mask = randn(S * T, 6);
  for (auto& x : q) x *= 2.0f;  // scores beyond the softcap
  const Tensor tq = tensor(ElemType::kFloat32, q.data(), {B, Hq, S, D}), tk = tensor(ElemType::kFloat32, k.data(), {B, Hkv, S, D}),
               tv = tensor(ElemType::kFloat32, v.data(), {B, Hkv, S, D}), tpk = tensor(ElemType::kFloat32, pk.data(), {B, Hkv, P, D}),
               tpv = tensor(ElemType::kFloat32, pv.data(), {B, Hkv, P, D}), tm = tensor(ElemType::kFloat32, mask.data(), {S, T});
  OnnxAttentionInputs in;
  in.q = &tq;
  in.k = &tk;
  in.v = &tv;
  in.attn_mask = &tm;
  in.past_key = &tpk;
  in.past_value = &tpv;
  for (int mode = 0; mode < 4; ++mode) {
    OnnxAttentionAttrs a;
    a.is_causal = 1;
    a.softcap = 1.5f;
    a.qk_matmul_output_mode = mode;
    const OnnxAttentionShapes s = onnx_attention_shapes(a, in);
    CHECK((s.qk == std::vector<int64_t>{B, Hq, S, T}));
    std::vector<float> y(static_cast<size_t>(B * Hq * S * D)), qk(static_cast<size_t>(B * Hq * S * T), 7.0f);
    onnx_attention(a, in, s, y.data(), nullptr, nullptr, qk.data(), nullptr);
    int neg_inf = 0;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < Hq; ++h)
        for (int64_t i = 0; i < S; ++i)
          for (int64_t j = 0; j < T; ++j) {
            const double want = spec_stage(q, pk, k, mask, Hq, Hkv, S, P, D, a.softcap, mode, b, h, i, j);
            const float got = qk[static_cast<size_t>(((b * Hq + h) * S + i) * T + j)];
            if (std::isinf(want)) {
              CHECK(got == -std::numeric_limits<float>::infinity());
              ++neg_inf;
            } else {
              CHECK_NEAR(got, want, 1e-5 + 1e-5 * std::fabs(want));
            }
          }
    CHECK(neg_inf == (mode == 2 ? B * Hq * 3 : 0));  // causal: rows 0 and 1 miss keys 5, 6 and 6
  }
  OnnxAttentionAttrs bad;
  bad.qk_matmul_output_mode = 4;
  EXPECT_THROW(onnx_attention_shapes(bad, in), std::invalid_argument, "qk_matmul_output_mode");
}

void test_short_mask_is_padded_with_masked_keys() {
  const int64_t B = 2, H = 2, S = 3, P = 3, D = 8, T = P + S, M = 4;
  auto q = randn(B * H * S * D, 11), k = randn(B * H * S * D, 12), v = randn(B * H * S * D, 13);
  auto pk = randn(B * H * P * D, 14), pv = randn(B * H * P * D, 15);
  std::vector<uint8_t> mshort(static_cast<size_t>(S * M)), mfull(static_cast<size_t>(S * T), 0);
  for (int64_t i = 0; i < S; ++i)
    for (int64_t j = 0; j < M; ++j) mshort[static_cast<size_t>(i * M + j)] = mfull[static_cast<size_t>(i * T + j)] = (i + j) % 3 != 1;
  const Tensor tq = tensor(ElemType::kFloat32, q.data(), {B, H, S, D}), tk = tensor(ElemType::kFloat32, k.data(), {B, H, S, D}),
               tv = tensor(ElemType::kFloat32, v.data(), {B, H, S, D}), tpk = tensor(ElemType::kFloat32, pk.data(), {B, H, P, D}),
               tpv = tensor(ElemType::kFloat32, pv.data(), {B, H, P, D}), ts = tensor(ElemType::kBool, mshort.data(), {S, M}),
               tf = tensor(ElemType::kBool, mfull.data(), {S, T});
  std::vector<float> y_short(q.size()), y_full(q.size()), qk(static_cast<size_t>(B * H * S * T));
  for (const Tensor* m : {&ts, &tf}) {
    OnnxAttentionInputs in;
    in.q = &tq;
    in.k = &tk;
    in.v = &tv;
    in.attn_mask = m;
    in.past_key = &tpk;
    in.past_value = &tpv;
    OnnxAttentionAttrs a;
    a.qk_matmul_output_mode = 2;
    onnx_attention(a, in, onnx_attention_shapes(a, in), m == &ts ? y_short.data() : y_full.data(), nullptr, nullptr,
                   qk.data(), nullptr);
    for (int64_t r = 0; r < B * H * S; ++r)
      for (int64_t j = M; j < T; ++j) CHECK(qk[static_cast<size_t>(r * T + j)] == -std::numeric_limits<float>::infinity());
  }
  CHECK(y_short == y_full);
}

void test_bf16_matches_float32_of_the_same_values() {
  const int64_t B = 1, Hq = 8, Hkv = 2, S = 5, P = 6, D = 64;
  auto q = randn(B * Hq * S * D, 21), k = randn(B * Hkv * S * D, 22), v = randn(B * Hkv * S * D, 23);
  auto pk = randn(B * Hkv * P * D, 24), pv = randn(B * Hkv * P * D, 25);
  auto to_bf16 = [](std::vector<float>& x) {  // rounds x to bf16 in place, returns the bits
    std::vector<uint16_t> bits(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      bits[i] = float_to_bf16(x[i]);
      x[i] = bf16_to_float(bits[i]);
    }
    return bits;
  };
  auto bq = to_bf16(q), bk = to_bf16(k), bv = to_bf16(v), bpk = to_bf16(pk), bpv = to_bf16(pv);
  std::vector<float> y32(q.size());
  std::vector<uint16_t> y16(q.size()), pk16(static_cast<size_t>(B * Hkv * (P + S) * D));
  for (bool bf : {false, true}) {
    const ElemType t = bf ? ElemType::kBFloat16 : ElemType::kFloat32;
    const Tensor tq = tensor(t, bf ? static_cast<const void*>(bq.data()) : q.data(), {B, Hq, S, D}),
                 tk = tensor(t, bf ? static_cast<const void*>(bk.data()) : k.data(), {B, Hkv, S, D}),
                 tv = tensor(t, bf ? static_cast<const void*>(bv.data()) : v.data(), {B, Hkv, S, D}),
                 tpk = tensor(t, bf ? static_cast<const void*>(bpk.data()) : pk.data(), {B, Hkv, P, D}),
                 tpv = tensor(t, bf ? static_cast<const void*>(bpv.data()) : pv.data(), {B, Hkv, P, D});
    OnnxAttentionInputs in;
    in.q = &tq;
    in.k = &tk;
    in.v = &tv;
    in.past_key = &tpk;
    in.past_value = &tpv;
    OnnxAttentionAttrs a;
    a.is_causal = 1;
    const OnnxAttentionShapes s = onnx_attention_shapes(a, in);
    onnx_attention(a, in, s, bf ? static_cast<void*>(y16.data()) : y32.data(), bf ? pk16.data() : nullptr, nullptr,
                   nullptr, nullptr);
  }
  for (size_t i = 0; i < y32.size(); ++i) CHECK_NEAR(bf16_to_float(y16[i]), y32[i], 1e-2 + 8e-3 * std::fabs(y32[i]));
  for (int64_t h = 0; h < Hkv; ++h)  // present_key = concat(past, new), bit for bit
    for (int64_t r = 0; r < P + S; ++r)
      for (int64_t d = 0; d < D; ++d)
        CHECK(pk16[static_cast<size_t>((h * (P + S) + r) * D + d)] ==
              (r < P ? bpk[static_cast<size_t>((h * P + r) * D + d)] : bk[static_cast<size_t>((h * S + r - P) * D + d)]));
}

}  // namespace

int main() {
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16}) {
    if (static_cast<int>(isa) > static_cast<int>(kernels::detected_isa())) {
      std::printf("ISA %s: not supported by this CPU, not run\n", kernels::isa_name(isa));
      continue;
    }
    kernels::set_isa(isa);
    const int before = failures();
    test_qk_matmul_output_modes();
    test_short_mask_is_padded_with_masked_keys();
    test_bf16_matches_float32_of_the_same_values();
    std::printf("ISA %s: %s\n", kernels::isa_name(isa), failures() == before ? "ok" : "FAILED");
  }
  TEST_MAIN_END();
}
