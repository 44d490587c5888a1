// GroupQueryAttention tensor semantics (ops/gqa_tensor.h) and rotary (kernels/rotary.h)
// through the ORT-free op API, against a naive double-precision reference of ORT's
// CPU kernel: first prompt with right padding (both padding-row rules), decode with
// separate and shared past/present buffers, packed QKV, rotary; validation texts.
// The differential tests compare with ORT itself; these run under ASan/UBSan.
#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "check.h"
#include "ops/gqa_tensor.h"
#include "kernels/rotary.h"

using namespace olep;
using namespace olep::ops;
using olep::kernels::rotary_row;

namespace {

Tensor tensor(ElemType t, const void* data, std::vector<int64_t> shape) {
  Tensor x;
  x.type = t;
  x.data = data;
  x.shape = std::move(shape);
  return x;
}

struct Case {
  int64_t B = 2, S = 5, Hq = 4, Hkv = 2, D = 16, window = -1;
  float softcap = 0.0f;
  bool packed = false, rotary = false;
};

// Rotary in double on one [D] row, non-interleaved, rotary_dim = D.
void rotate_ref(const float* x, const float* c, const float* s, int64_t D, double* y) {
  for (int64_t i = 0; i < D / 2; ++i) {
    y[i] = double(x[i]) * c[i] - double(x[i + D / 2]) * s[i];
    y[i + D / 2] = double(x[i + D / 2]) * c[i] + double(x[i]) * s[i];
  }
}

// Reference output [B, S, Hq*D] for K/V rows already in `pk`/`pv` ([B, Hkv, L, D]).
std::vector<double> ref_output(const Case& c, const std::vector<float>& qin, const std::vector<float>& cosv,
                               const std::vector<float>& sinv, const std::vector<float>& pk,
                               const std::vector<float>& pv, int64_t L, const std::vector<int64_t>& past,
                               const std::vector<int64_t>& total, bool clamp_padding) {
  const int64_t G = c.Hq / c.Hkv, heads = c.packed ? c.Hq + 2 * c.Hkv : c.Hq, D = c.D;
  std::vector<double> out(static_cast<size_t>(c.B * c.S * c.Hq * D), 0.0), q(static_cast<size_t>(D));
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t s = 0; s < c.S; ++s)
      for (int64_t h = 0; h < c.Hq; ++h) {
        const float* qr = qin.data() + ((b * c.S + s) * heads + h) * D;
        const int64_t pos = past[b] + s;
        if (c.rotary) {
          rotate_ref(qr, cosv.data() + pos * D / 2, sinv.data() + pos * D / 2, D, q.data());
        } else {
          for (int64_t d = 0; d < D; ++d) q[d] = qr[d];
        }
        int64_t hi = std::min(pos + 1, total[b]);
        int64_t lo = c.window > 0 ? std::max<int64_t>(0, (clamp_padding ? hi : pos + 1) - c.window) : 0;
        if (lo >= hi) continue;
        std::vector<double> sc;
        double m = -INFINITY;
        for (int64_t j = lo; j < hi; ++j) {
          const float* kr = pk.data() + ((b * c.Hkv + h / G) * L + j) * D;
          double x = 0;
          for (int64_t d = 0; d < D; ++d) x += q[d] * kr[d];
          x /= std::sqrt(double(D));
          if (c.softcap > 0) x = c.softcap * std::tanh(x / c.softcap);
          sc.push_back(x);
          m = std::max(m, x);
        }
        double den = 0;
        for (double& x : sc) den += (x = std::exp(x - m));
        for (int64_t j = lo; j < hi; ++j) {
          const float* vr = pv.data() + ((b * c.Hkv + h / G) * L + j) * D;
          for (int64_t d = 0; d < D; ++d)
            out[((b * c.S + s) * c.Hq + h) * D + d] += sc[j - lo] / den * vr[d];
        }
      }
  return out;
}

// Runs one step and checks output (tolerance) and that the stored K/V rows are the
// (rotated) new rows at P_b + s; `share` binds present to the past buffers.
void run_step(const Case& c, const std::vector<int32_t>& seqlens, int32_t total_len, std::vector<float>* past_k,
              std::vector<float>* past_v, int64_t P, bool share, uint32_t seed) {
  const int64_t heads = c.packed ? c.Hq + 2 * c.Hkv : c.Hq;
  const std::vector<float> q = randn(static_cast<size_t>(c.B * c.S * heads * c.D), seed);
  const std::vector<float> k = randn(static_cast<size_t>(c.B * c.S * c.Hkv * c.D), seed + 1);
  const std::vector<float> v = randn(static_cast<size_t>(c.B * c.S * c.Hkv * c.D), seed + 2);
  const int64_t M = 64;
  std::vector<float> cosv(static_cast<size_t>(M * c.D / 2)), sinv(cosv.size());
  for (int64_t p = 0; p < M; ++p)
    for (int64_t i = 0; i < c.D / 2; ++i) {
      cosv[p * c.D / 2 + i] = float(std::cos(p * std::pow(1e4, -2.0 * i / c.D)));
      sinv[p * c.D / 2 + i] = float(std::sin(p * std::pow(1e4, -2.0 * i / c.D)));
    }
  GqaAttrs a;
  a.num_heads = c.Hq;
  a.kv_num_heads = c.Hkv;
  a.local_window_size = c.window;
  a.softcap = c.softcap;
  a.do_rotary = c.rotary;
  const Tensor tq = tensor(ElemType::kFloat32, q.data(), {c.B, c.S, heads * c.D});
  const Tensor tk = tensor(ElemType::kFloat32, k.data(), {c.B, c.S, c.Hkv * c.D});
  const Tensor tv = tensor(ElemType::kFloat32, v.data(), {c.B, c.S, c.Hkv * c.D});
  const Tensor tpk = tensor(ElemType::kFloat32, past_k->data(), {c.B, c.Hkv, P, c.D});
  const Tensor tpv = tensor(ElemType::kFloat32, past_v->data(), {c.B, c.Hkv, P, c.D});
  const Tensor tsk = tensor(ElemType::kInt32, seqlens.data(), {c.B});
  const Tensor tts = tensor(ElemType::kInt32, &total_len, {});
  const Tensor tcos = tensor(ElemType::kFloat32, cosv.data(), {M, c.D / 2});
  const Tensor tsin = tensor(ElemType::kFloat32, sinv.data(), {M, c.D / 2});
  GqaInputs in;
  in.query = &tq;
  if (!c.packed) {
    in.key = &tk;
    in.value = &tv;
  }
  in.past_key = &tpk;
  in.past_value = &tpv;
  in.seqlens_k = &tsk;
  in.total_sequence_length = &tts;
  if (c.rotary) {
    in.cos_cache = &tcos;
    in.sin_cache = &tsin;
  }
  const GqaShapes s = gqa_shapes(a, in);
  const int64_t L = s.present_length;
  CHECK(!share || L == P);
  std::vector<float> y(static_cast<size_t>(c.B * c.S * c.Hq * c.D));
  std::vector<float> pk_out(static_cast<size_t>(c.B * c.Hkv * L * c.D), -7.0f), pv_out(pk_out.size(), -7.0f);
  const std::vector<float> before = *past_k;
  float* pk = share ? past_k->data() : pk_out.data();
  float* pv = share ? past_v->data() : pv_out.data();
  gqa_attention(a, in, s, y.data(), pk, pv, nullptr);
  // Stored rows: new rows (rotated K) at P_b + t; shared: all other rows untouched,
  // separate: [0, P_b) from past, zeros after.
  std::vector<double> kr(static_cast<size_t>(c.D));
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.Hkv; ++h)
      for (int64_t r = 0; r < L; ++r) {
        const int64_t t = r - s.past[b];
        const float* got = pk + ((b * c.Hkv + h) * L + r) * c.D;
        const float* kin = c.packed ? q.data() + ((b * c.S + t) * heads + c.Hq + h) * c.D
                                    : k.data() + ((b * c.S + t) * c.Hkv + h) * c.D;
        for (int64_t d = 0; d < c.D; ++d) {
          if (t >= 0 && t < c.S) {
            if (c.rotary) {
              rotate_ref(kin, cosv.data() + r * c.D / 2, sinv.data() + r * c.D / 2, c.D, kr.data());
              CHECK_NEAR(got[d], kr[d], 1e-5);
            } else {
              CHECK(got[d] == kin[d]);
            }
          } else if (share) {
            CHECK(got[d] == before[((b * c.Hkv + h) * L + r) * c.D + d]);
          } else {
            CHECK(got[d] == (r < s.past[b] ? before[((b * c.Hkv + h) * P + r) * c.D + d] : 0.0f));
          }
        }
      }
  const bool clamp = c.softcap > 0;  // float32: ORT's unfused kernel only with softcap
  const std::vector<double> want = ref_output(c, q, cosv, sinv, share ? *past_k : pk_out, share ? *past_v : pv_out,
                                              L, s.past, s.total, clamp);
  for (size_t i = 0; i < y.size(); ++i) CHECK_NEAR(y[i], want[i], 1e-5 + 1e-4 * std::fabs(want[i]));
  if (!share) {
    *past_k = pk_out;
    *past_v = pv_out;
  }
}

void test_decode_loops() {
  for (int variant = 0; variant < 4; ++variant) {
    Case c;
    c.packed = variant & 1;
    c.rotary = variant >= 2;
    c.window = variant == 1 || variant == 3 ? 3 : -1;
    c.softcap = variant == 3 ? 2.0f : 0.0f;
    for (bool share : {false, true}) {
      const int64_t cap = share ? 16 : 0;
      std::vector<float> pk = randn(static_cast<size_t>(c.B * c.Hkv * cap * c.D), 7);
      std::vector<float> pv = randn(pk.size(), 8);
      std::vector<int32_t> lens = {5, 2};  // row 1 right-padded
      c.S = 5;
      run_step(c, {lens[0] - 1, lens[1] - 1}, 5, &pk, &pv, cap, share, 100);
      int64_t P = share ? cap : 5;
      c.S = 1;
      for (int step = 1; step <= 4; ++step) {
        run_step(c, {lens[0] - 1 + step, lens[1] - 1 + step}, 5 + step, &pk, &pv, P, share, 200 + step);
        if (!share) P = 5 + step;
      }
    }
  }
}

void test_validation() {
  const std::vector<float> q(2 * 3 * 4 * 16), k(2 * 3 * 2 * 16);
  const std::vector<int32_t> sk = {2, 1};
  const int32_t total = 3;
  const Tensor tq = tensor(ElemType::kFloat32, q.data(), {2, 3, 64}), tk = tensor(ElemType::kFloat32, k.data(), {2, 3, 32});
  const Tensor tsk = tensor(ElemType::kInt32, sk.data(), {2}), tts = tensor(ElemType::kInt32, &total, {});
  GqaAttrs a;
  a.num_heads = 4;
  a.kv_num_heads = 2;
  GqaInputs in;
  in.query = &tq;
  in.key = &tk;
  in.value = &tk;
  in.seqlens_k = &tsk;
  in.total_sequence_length = &tts;
  const GqaShapes s = gqa_shapes(a, in);
  CHECK(s.first_prompt && s.present_length == 3 && s.output == (std::vector<int64_t>{2, 3, 64}));
  const std::vector<int32_t> bad = {3, 1};
  const Tensor tbad = tensor(ElemType::kInt32, bad.data(), {2});
  in.seqlens_k = &tbad;
  EXPECT_THROW(gqa_shapes(a, in), std::invalid_argument, "GroupQueryAttention: seqlens_k[0]; expected in [0, 3), got 3");
  in.seqlens_k = &tsk;
  const int32_t longer = 5;  // S = 3 > 1, S != total, batch 2
  const Tensor tlong = tensor(ElemType::kInt32, &longer, {1});
  in.total_sequence_length = &tlong;
  EXPECT_THROW(gqa_shapes(a, in), std::invalid_argument, "expected 1, got 2");
  in.total_sequence_length = &tts;
  a.do_rotary = true;
  EXPECT_THROW(gqa_shapes(a, in), std::invalid_argument, "cos_cache' and 'sin_cache' with do_rotary=1; expected present");
  a.do_rotary = false;
  a.num_heads = 3;
  EXPECT_THROW(gqa_shapes(a, in), std::invalid_argument, "num_heads % kv_num_heads == 0");
  a.num_heads = 4;
  in.value = nullptr;
  EXPECT_THROW(gqa_shapes(a, in), std::invalid_argument, "both present or both absent");
  // Present aliasing only one past buffer is refused.
  std::vector<float> pk(2 * 2 * 4 * 16), pv(pk.size()), y(q.size());
  const Tensor tpk = tensor(ElemType::kFloat32, pk.data(), {2, 2, 4, 16}), tpv = tensor(ElemType::kFloat32, pv.data(), {2, 2, 4, 16});
  in.value = &tk;
  in.past_key = &tpk;
  in.past_value = &tpv;
  const GqaShapes s2 = gqa_shapes(a, in);
  std::vector<float> other(pk.size());
  EXPECT_THROW(gqa_attention(a, in, s2, y.data(), pk.data(), other.data(), nullptr), std::invalid_argument,
               "only present_key shared");
}

void test_rotary_row() {
  const std::vector<float> x = randn(32, 3), c = randn(8, 4), s = randn(8, 5);
  for (bool inter : {false, true}) {
    std::vector<float> y(32);
    rotary_row(DType::kFloat32, x.data(), c.data(), s.data(), 16, 32, inter, y.data());
    for (int64_t i = 0; i < 8; ++i) {
      const int64_t ia = inter ? 2 * i : i, ib = inter ? 2 * i + 1 : i + 8;
      CHECK_NEAR(y[ia], double(x[ia]) * c[i] - double(x[ib]) * s[i], 1e-5);
      CHECK_NEAR(y[ib], double(x[ib]) * c[i] + double(x[ia]) * s[i], 1e-5);
    }
    for (int64_t i = 16; i < 32; ++i) CHECK(y[i] == x[i]);  // beyond rotary_dim: copied
  }
  std::vector<uint16_t> h(32), hc(8), hs(8), hy(32);
  for (int i = 0; i < 32; ++i) h[i] = float_to_half(x[i]);
  for (int i = 0; i < 8; ++i) hc[i] = float_to_half(c[i]), hs[i] = float_to_half(s[i]);
  rotary_row(DType::kFloat16, h.data(), hc.data(), hs.data(), 16, 32, false, hy.data());
  for (int64_t i = 0; i < 8; ++i) {
    const float a = half_to_float(h[i]), b = half_to_float(h[i + 8]);
    CHECK(hy[i] == float_to_half(a * half_to_float(hc[i]) - b * half_to_float(hs[i])));
  }
  // bfloat16: widened, rotated in float32 with separate products, rounded once (interleaved here).
  std::vector<uint16_t> b(32), bc(8), bs(8), by(32);
  for (int i = 0; i < 32; ++i) b[i] = float_to_bf16(x[i]);
  for (int i = 0; i < 8; ++i) bc[i] = float_to_bf16(c[i]), bs[i] = float_to_bf16(s[i]);
  rotary_row(DType::kBFloat16, b.data(), bc.data(), bs.data(), 16, 32, true, by.data());
  for (int64_t i = 0; i < 8; ++i) {
    const float a = bf16_to_float(b[2 * i]), bb = bf16_to_float(b[2 * i + 1]);
    const float ci = bf16_to_float(bc[i]), si = bf16_to_float(bs[i]);
    CHECK(by[2 * i] == float_to_bf16(a * ci - bb * si));
    CHECK(by[2 * i + 1] == float_to_bf16(bb * ci + a * si));
  }
  for (int64_t i = 16; i < 32; ++i) CHECK(by[i] == b[i]);
}

}  // namespace

int main() {
  test_rotary_row();
  test_validation();
  test_decode_loops();
  TEST_MAIN_END();
}
