// CacheAttention / CacheExport / CacheShape op semantics through the ORT-free op API:
// validation names the input and leaves the cache intact; 3-D (BSNH) and 4-D
// (BNSH) inputs give the same result; seqlens_k right padding; export.
#include <cmath>
#include <random>
#include <vector>

#include "check.h"
#include "kernels/rotary.h"
#include "kvcache/registry.h"
#include "ops/cache_attention.h"

using namespace olep;
using namespace olep::ops;

namespace {

Tensor f32(const std::vector<float>& v, std::vector<int64_t> shape) {
  Tensor t;
  t.type = ElemType::kFloat32;
  t.shape = std::move(shape);
  t.data = v.data();
  return t;
}

Tensor i64(const int64_t* v, std::vector<int64_t> shape) {
  Tensor t;
  t.type = ElemType::kInt64;
  t.shape = std::move(shape);
  t.data = v;
  return t;
}

// BNSH [B, H, S, D] -> [B, S, H*D]
std::vector<float> to_bsnh(const std::vector<float>& x, int64_t B, int64_t H, int64_t S, int64_t D) {
  std::vector<float> y(x.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t s = 0; s < S; ++s)
        for (int64_t d = 0; d < D; ++d)
          y[static_cast<size_t>(((b * S + s) * H + h) * D + d)] = x[static_cast<size_t>(((b * H + h) * S + s) * D + d)];
  return y;
}

int64_t make_cache(int64_t layers, int64_t B, int64_t Hkv, int64_t D, int64_t cap) {
  CacheGeometry g;
  g.num_layers = layers;
  g.batch_size = B;
  g.kv_num_heads = Hkv;
  g.head_dim = D;
  g.v_head_dim = D;
  g.max_sequence_length = cap;
  return Registry::instance().add_cache(std::make_shared<KVCache>(g, nullptr));
}

// cache_export's allocator: K and V land in kk / vv (sized by the shapes it is given).
auto grab(std::vector<float>& kk, std::vector<float>& vv) {
  return [&](const std::vector<int64_t>& ks, const std::vector<int64_t>& vs, DType) {
    kk.assign(static_cast<size_t>(ks[0] * ks[1] * ks[2] * ks[3]), 1.0f);
    vv.assign(static_cast<size_t>(vs[0] * vs[1] * vs[2] * vs[3]), 1.0f);
    return std::make_pair<void*, void*>(kk.data(), vv.data());
  };
}

void test_validation_names_inputs() {
  const int64_t B = 2, Hq = 4, Hkv = 2, S = 3, D = 8;
  const int64_t h = make_cache(1, B, Hkv, D, 16);
  auto q = randn(B * Hq * S * D, 1), k = randn(B * Hkv * S * D, 2), v = randn(B * Hkv * S * D, 3);
  std::vector<float> y(q.size());
  CacheAttentionAttrs a;
  a.layer = 0;
  a.is_causal = 1;
  const Tensor cache = i64(&h, {1});
  cache_attention(a, f32(q, {B, Hq, S, D}), f32(k, {B, Hkv, S, D}), f32(v, {B, Hkv, S, D}), cache, nullptr, nullptr,
                  y.data(), nullptr);
  auto c = Registry::instance().cache(h);
  CHECK((c->seq_lens() == std::vector<int64_t>{3, 3}));

  auto k_bad = randn(B * Hkv * S * 4, 4);
  EXPECT_THROW(cache_attention(a, f32(q, {B, Hq, S, D}), f32(k_bad, {B, Hkv, S, 4}), f32(v, {B, Hkv, S, D}), cache,
                               nullptr, nullptr, y.data(), nullptr),
               std::invalid_argument, "input 'key'");
  EXPECT_THROW(cache_attention(a, f32(q, {B, Hq, S, D}), f32(k, {B, Hkv, S, D}), f32(v, {B, Hkv, S, D}), f32(q, {1}),
                               nullptr, nullptr, y.data(), nullptr),
               std::invalid_argument, "input 'cache' must be an int64");
  const int64_t bogus = h + 1000;
  EXPECT_THROW(cache_attention(a, f32(q, {B, Hq, S, D}), f32(k, {B, Hkv, S, D}), f32(v, {B, Hkv, S, D}),
                               i64(&bogus, {1}), nullptr, nullptr, y.data(), nullptr),
               std::invalid_argument, "is unknown or released");
  CacheAttentionAttrs a2 = a;
  a2.layer = 1;
  EXPECT_THROW(cache_attention(a2, f32(q, {B, Hq, S, D}), f32(k, {B, Hkv, S, D}), f32(v, {B, Hkv, S, D}), cache,
                               nullptr, nullptr, y.data(), nullptr),
               std::invalid_argument, "attribute 'layer' (1) must be < num_layers");
  auto kv1 = randn(B * 1 * S * D, 5);
  EXPECT_THROW(cache_attention(a, f32(q, {B, Hq, S, D}), f32(kv1, {B, 1, S, D}), f32(kv1, {B, 1, S, D}), cache,
                               nullptr, nullptr, y.data(), nullptr),
               std::invalid_argument, "kv_num_heads=2");
  std::vector<float> mask(static_cast<size_t>(B * 3 * S * 6), 0.0f);
  const Tensor bad_mask = f32(mask, {B, 3, S, 6});
  EXPECT_THROW(cache_attention(a, f32(q, {B, Hq, S, D}), f32(k, {B, Hkv, S, D}), f32(v, {B, Hkv, S, D}), cache,
                               &bad_mask, nullptr, y.data(), nullptr),
               std::invalid_argument, "input 'attn_mask'");
  std::vector<float> short_mask(static_cast<size_t>(S * 5), 0.0f);
  const Tensor short_m = f32(short_mask, {S, 5});
  EXPECT_THROW(cache_attention(a, f32(q, {B, Hq, S, D}), f32(k, {B, Hkv, S, D}), f32(v, {B, Hkv, S, D}), cache,
                               &short_m, nullptr, y.data(), nullptr),
               std::invalid_argument, ">= 6");
  const int32_t sk[2] = {9, 1};
  Tensor seq;
  seq.type = ElemType::kInt32;
  seq.shape = {2};
  seq.data = sk;
  EXPECT_THROW(cache_attention(a, f32(q, {B, Hq, S, D}), f32(k, {B, Hkv, S, D}), f32(v, {B, Hkv, S, D}), cache,
                               nullptr, &seq, y.data(), nullptr),
               std::invalid_argument, "input 'seqlens_k'[0] = 9");
  CacheAttentionAttrs bad = a;
  bad.local_window_size = 0;
  EXPECT_THROW(validate(bad), std::invalid_argument, "local_window_size");
  bad = a;
  bad.layer = -1;
  EXPECT_THROW(validate(bad), std::invalid_argument, "attribute 'layer' is required");
  CHECK((c->seq_lens() == std::vector<int64_t>{3, 3}));  // nothing above touched the cache
  Registry::instance().release_cache(h);
}

void test_3d_equals_4d_and_export() {
  const int64_t B = 2, Hq = 6, Hkv = 3, D = 4;
  const int64_t h4 = make_cache(1, B, Hkv, D, 32), h3 = make_cache(1, B, Hkv, D, 32);
  CacheAttentionAttrs a4;
  a4.layer = 0;
  a4.is_causal = 1;
  CacheAttentionAttrs a3 = a4;
  a3.q_num_heads = Hq;
  a3.kv_num_heads = Hkv;
  uint32_t seed = 10;
  for (int64_t S : {5, 1, 1, 2}) {
    auto q = randn(B * Hq * S * D, seed++), k = randn(B * Hkv * S * D, seed++), v = randn(B * Hkv * S * D, seed++);
    std::vector<float> y4(q.size()), y3(q.size());
    cache_attention(a4, f32(q, {B, Hq, S, D}), f32(k, {B, Hkv, S, D}), f32(v, {B, Hkv, S, D}), i64(&h4, {1}), nullptr,
                    nullptr, y4.data(), nullptr);
    auto q3 = to_bsnh(q, B, Hq, S, D), k3 = to_bsnh(k, B, Hkv, S, D), v3 = to_bsnh(v, B, Hkv, S, D);
    cache_attention(a3, f32(q3, {B, S, Hq * D}), f32(k3, {B, S, Hkv * D}), f32(v3, {B, S, Hkv * D}), i64(&h3, {1}),
                    nullptr, nullptr, y3.data(), nullptr);
    const auto y4t = to_bsnh(y4, B, Hq, S, D);
    for (size_t i = 0; i < y3.size(); ++i) CHECK(y3[i] == y4t[i]);
  }
  std::vector<float> k4, v4, k3, v3;
  cache_export(0, i64(&h4, {1}), grab(k4, v4));
  cache_export(0, i64(&h3, {1}), grab(k3, v3));
  CHECK(k4.size() == static_cast<size_t>(B * Hkv * 9 * D));
  CHECK(k4 == k3 && v4 == v3);
  EXPECT_THROW(cache_export(1, i64(&h4, {1}), grab(k4, v4)), std::invalid_argument, "attribute 'layer' (1)");
  Registry::instance().release_cache(h4);
  Registry::instance().release_cache(h3);
}

void test_seqlens_k_right_padding() {
  // Prompt lengths [4, 2] right-padded to S = 4, then one decode token each (CASES C03 shape).
  const int64_t B = 2, Hq = 4, Hkv = 2, D = 8;
  const int64_t h = make_cache(1, B, Hkv, D, 8);
  CacheAttentionAttrs a;
  a.layer = 0;
  a.is_causal = 1;
  int32_t sk[2] = {3, 1};
  Tensor seq;
  seq.type = ElemType::kInt32;
  seq.shape = {2, 1};
  seq.data = sk;
  auto q = randn(B * Hq * 4 * D, 30), k = randn(B * Hkv * 4 * D, 31), v = randn(B * Hkv * 4 * D, 32);
  std::vector<float> y(q.size());
  cache_attention(a, f32(q, {B, Hq, 4, D}), f32(k, {B, Hkv, 4, D}), f32(v, {B, Hkv, 4, D}), i64(&h, {1}), nullptr,
                  &seq, y.data(), nullptr);
  auto c = Registry::instance().cache(h);
  CHECK((c->seq_lens() == std::vector<int64_t>{4, 2}));
  for (int64_t hq = 0; hq < Hq; ++hq)  // padded query rows of sequence 1 are zeros
    for (int64_t s = 2; s < 4; ++s)
      for (int64_t d = 0; d < D; ++d) CHECK(y[static_cast<size_t>(((1 * Hq + hq) * 4 + s) * D + d)] == 0.0f);
  sk[0] = 4;
  sk[1] = 2;
  seq.shape = {2};
  auto q1 = randn(B * Hq * D, 33), k1 = randn(B * Hkv * D, 34), v1 = randn(B * Hkv * D, 35);
  std::vector<float> y1(q1.size());
  cache_attention(a, f32(q1, {B, Hq, 1, D}), f32(k1, {B, Hkv, 1, D}), f32(v1, {B, Hkv, 1, D}), i64(&h, {1}), nullptr,
                  &seq, y1.data(), nullptr);
  CHECK((c->seq_lens() == std::vector<int64_t>{5, 3}));
  // The decode token of sequence 1 sits at slot 2 (not 4).
  std::vector<float> ke, ve;
  cache_export(0, i64(&h, {1}), [&](const std::vector<int64_t>& ks, const std::vector<int64_t>& vs, DType) {
    ke.assign(static_cast<size_t>(ks[0] * ks[1] * ks[2] * ks[3]), 0.0f);
    ve.assign(static_cast<size_t>(vs[0] * vs[1] * vs[2] * vs[3]), 0.0f);
    return std::make_pair<void*, void*>(ke.data(), ve.data());
  });
  for (int64_t hk = 0; hk < Hkv; ++hk)
    for (int64_t d = 0; d < D; ++d) {
      CHECK(ke[static_cast<size_t>(((1 * Hkv + hk) * 5 + 2) * D + d)] == k1[static_cast<size_t>((1 * Hkv + hk) * D + d)]);
      CHECK(ke[static_cast<size_t>(((1 * Hkv + hk) * 5 + 3) * D + d)] == 0.0f);
    }
  Registry::instance().release_cache(h);
}

void test_cache_shape() {
  // [B, Hkv, max_b committed length, D or Dv]: a run's open step adds nothing until it commits.
  const int64_t B = 2, Hq = 4, Hkv = 2, D = 8, Dv = 4;
  CacheGeometry g;
  g.num_layers = 2;
  g.batch_size = B;
  g.kv_num_heads = Hkv;
  g.head_dim = D;
  g.v_head_dim = Dv;
  g.max_sequence_length = 16;
  const int64_t h = Registry::instance().add_cache(std::make_shared<KVCache>(g, nullptr));
  int64_t shape[4] = {-1, -1, -1, -1};
  cache_shape(1, false, i64(&h, {1}), shape);
  CHECK(shape[0] == B && shape[1] == Hkv && shape[2] == 0 && shape[3] == D);
  CacheAttentionAttrs a;
  a.is_causal = 1;
  int32_t sk[2] = {3, 1};  // right padding: lengths 4 and 2 after the prefill
  Tensor seq;
  seq.type = ElemType::kInt32;
  seq.shape = {2};
  seq.data = sk;
  auto q = randn(B * Hq * 4 * D, 40), k = randn(B * Hkv * 4 * D, 41), v = randn(B * Hkv * 4 * Dv, 42);
  std::vector<float> y(static_cast<size_t>(B * Hq * 4 * Dv));
  for (int64_t layer = 0; layer < 2; ++layer) {
    a.layer = layer;
    cache_attention(a, f32(q, {B, Hq, 4, D}), f32(k, {B, Hkv, 4, D}), f32(v, {B, Hkv, 4, Dv}), i64(&h, {1}), nullptr,
                    &seq, y.data(), nullptr);
    cache_shape(0, true, i64(&h, {1}), shape);  // after layer 0 the step is open: still 0
    CHECK(shape[2] == (layer == 0 ? 0 : 4) && shape[3] == Dv);
  }
  cache_shape(1, false, i64(&h, {1}), shape);
  CHECK(shape[0] == B && shape[1] == Hkv && shape[2] == 4 && shape[3] == D);
  EXPECT_THROW(cache_shape(2, false, i64(&h, {1}), shape), std::invalid_argument, "attribute 'layer' (2)");
  const int64_t unknown = h + 1000;
  EXPECT_THROW(cache_shape(0, false, i64(&unknown, {1}), shape), std::invalid_argument, "CacheShape: input 'cache'");
  Registry::instance().release_cache(h);
}

void test_packed_rotary_equals_prerotated() {
  // Packed QKV + cos/sin (the fused GroupQueryAttention form) against separate Q/K/V rotated
  // beforehand with the same kernel at positions P_b + s: bit-identical Y and cache, for a
  // right-padded prompt (lengths 3 and 2) and two decode steps; then a position past the table.
  const int64_t B = 2, Hq = 4, Hkv = 2, D = 16, R = 8, M = 8;  // rotary_dim R < D: partial
  const int64_t W = (Hq + 2 * Hkv) * D;
  std::vector<float> cos(static_cast<size_t>(M * R / 2)), sin(cos.size());
  for (int64_t p = 0; p < M; ++p)
    for (int64_t i = 0; i < R / 2; ++i) {
      cos[static_cast<size_t>(p * R / 2 + i)] = std::cos(0.3f * static_cast<float>(p * (i + 1)));
      sin[static_cast<size_t>(p * R / 2 + i)] = std::sin(0.3f * static_cast<float>(p * (i + 1)));
    }
  for (int64_t inter : {0, 1}) {
    const int64_t hf = make_cache(1, B, Hkv, D, 16), hr = make_cache(1, B, Hkv, D, 16);
    CacheAttentionAttrs a;
    a.layer = 0;
    a.is_causal = 1;
    a.q_num_heads = Hq;
    a.kv_num_heads = Hkv;
    a.rotary_interleaved = inter;
    std::vector<int64_t> past = {0, 0};
    uint32_t seed = 50;
    for (int64_t S : {3, 1, 1}) {
      // Sequence 1 has 2 valid rows of the 3-row prompt (right padding), then 1 per step.
      std::vector<int32_t> sk = {static_cast<int32_t>(past[0] + S - 1),
                                 static_cast<int32_t>(past[1] + (S == 3 ? 1 : 0))};
      Tensor seq;
      seq.type = ElemType::kInt32;
      seq.shape = {B};
      seq.data = sk.data();
      const auto x = randn(static_cast<size_t>(B * S * W), seed++);
      std::vector<float> q(static_cast<size_t>(B * S * Hq * D)), k(static_cast<size_t>(B * S * Hkv * D)), v(k.size());
      for (int64_t b = 0; b < B; ++b)
        for (int64_t s = 0; s < S; ++s) {
          const float* row = x.data() + (b * S + s) * W;
          const bool valid = s <= sk[static_cast<size_t>(b)] - past[static_cast<size_t>(b)];
          const size_t pos = static_cast<size_t>(past[static_cast<size_t>(b)] + s);
          auto put = [&](const float* src, float* dst) {
            if (valid) {
              kernels::rotary_row(DType::kFloat32, src, cos.data() + pos * R / 2, sin.data() + pos * R / 2, R, D,
                                  inter != 0, dst);
            } else {
              std::copy(src, src + D, dst);
            }
          };
          for (int64_t h = 0; h < Hq; ++h) put(row + h * D, q.data() + ((b * S + s) * Hq + h) * D);
          for (int64_t h = 0; h < Hkv; ++h) {
            put(row + (Hq + h) * D, k.data() + ((b * S + s) * Hkv + h) * D);
            std::copy(row + (Hq + Hkv + h) * D, row + (Hq + Hkv + h + 1) * D, v.data() + ((b * S + s) * Hkv + h) * D);
          }
        }
      const Tensor tx = f32(x, {B, S, W}), tc = f32(cos, {M, R / 2}), ts = f32(sin, {M, R / 2});
      const Tensor cf = i64(&hf, {1});
      CacheAttentionInputs in;
      in.query = &tx;
      in.cache = &cf;
      in.seqlens_k = &seq;
      in.cos_cache = &tc;
      in.sin_cache = &ts;
      std::vector<float> yf(static_cast<size_t>(B * S * Hq * D)), yr(yf.size());
      CHECK((output_shape(cache_attention_dims(a, in)) == std::vector<int64_t>{B, S, Hq * D}));
      cache_attention(a, in, yf.data(), nullptr);
      CacheAttentionAttrs plain = a;
      plain.rotary_interleaved = 0;
      cache_attention(plain, f32(q, {B, S, Hq * D}), f32(k, {B, S, Hkv * D}), f32(v, {B, S, Hkv * D}), i64(&hr, {1}),
                      nullptr, &seq, yr.data(), nullptr);
      CHECK(yf == yr);
      for (int64_t b = 0; b < B; ++b) past[static_cast<size_t>(b)] = sk[static_cast<size_t>(b)] + 1;
    }
    std::vector<float> kf, vf, kr, vr;
    cache_export(0, i64(&hf, {1}), grab(kf, vf));
    cache_export(0, i64(&hr, {1}), grab(kr, vr));
    CHECK(kf == kr && vf == vr);
    // Past lengths are now {5, 4}: 4 new rows of sequence 0 reach position 8 = the table's length.
    const int64_t S = 4;
    std::vector<int32_t> sk = {8, 4};
    Tensor seq;
    seq.type = ElemType::kInt32;
    seq.shape = {B};
    seq.data = sk.data();
    const auto x = randn(static_cast<size_t>(B * S * W), 99);
    const Tensor tx = f32(x, {B, S, W}), tc = f32(cos, {M, R / 2}), ts = f32(sin, {M, R / 2});
    const Tensor cf = i64(&hf, {1});
    CacheAttentionInputs in;
    in.query = &tx;
    in.cache = &cf;
    in.seqlens_k = &seq;
    in.cos_cache = &tc;
    in.sin_cache = &ts;
    std::vector<float> y(static_cast<size_t>(B * S * Hq * D));
    EXPECT_THROW(cache_attention(a, in, y.data(), nullptr), std::invalid_argument,
                 "rotary position 8 of sequence 0 (past length 5 + 4 new rows - 1); expected < max_position = 8");
    CHECK((Registry::instance().cache(hf)->seq_lens() == std::vector<int64_t>{5, 4}));
    Registry::instance().release_cache(hf);
    Registry::instance().release_cache(hr);
  }
}

}  // namespace

int main() {
  test_validation_names_inputs();
  test_3d_equals_4d_and_export();
  test_seqlens_k_right_padding();
  test_cache_shape();
  test_packed_rotary_equals_prerotated();
  TEST_MAIN_END();
}
