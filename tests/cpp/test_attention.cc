// Scalar streaming attention kernel against a naive double-precision
// reference (the semantics of docs/CASES.md's ref_attn): GQA grouping,
// causal offset, sliding window, softcap, bool/additive masks, fully masked
// rows, split blocks, fp16/bf16 storage with fp32 accumulation.
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "check.h"
#include "kernels/attention.h"
#include "kernels/simd_tiles.h"
#include "kvcache/quantize.h"

using namespace olep;
using namespace olep::kernels;

namespace {

// One decode step of G query heads over one KV head, float32 q [G, D] (out likewise, may be
// null and set later), causal, q at the last of T positions, over `nb` blocks.
AttentionGroup decode_group(const float* q, float* out, const KVBlock* blocks, int64_t nb, int64_t G, int64_t D,
                            int64_t T, float scale) {
  AttentionGroup a;
  a.dtype = DType::kFloat32;
  a.q = q; a.q_head_stride = D; a.q_row_stride = D;
  a.out = out; a.out_head_stride = D; a.out_row_stride = D;
  a.group_size = G; a.num_rows = 1; a.num_valid_rows = 1; a.q_offset = T - 1; a.num_keys = T;
  a.blocks = blocks; a.num_blocks = nb;
  a.head_dim = D; a.v_head_dim = D; a.scale = scale; a.is_causal = true;
  return a;
}

struct Case {
  int64_t G = 1, S = 1, P = 0, D = 8, Dv = 8;
  int64_t valid_rows = -1;  // -1 = S
  bool causal = true;
  int64_t window = -1;
  float softcap = 0.0f;
  int mask = 0;  // 0 none, 1 bool, 2 additive
  DType dtype = DType::kFloat32;
  int blocks = 1;  // split the keys into this many blocks
  int64_t page_rows = 0;  // > 0: blocks of this many rows instead (pages; the last one partial)
  float k_ramp = 0.0f;  // key j scaled by 1 + k_ramp * j: row maxima that keep rising (rescales)
};

// Output row (h, i) of the reference, all Dv values (zeros where nothing is visible).
std::vector<double> ref_row(const Case& c, const std::vector<float>& q, const std::vector<float>& k,
                            const std::vector<float>& v, const std::vector<uint8_t>& mb, const std::vector<float>& ma,
                            int64_t h, int64_t i) {
  const int64_t T = c.P + c.S;
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.D));
  std::vector<double> s(static_cast<size_t>(T), -INFINITY), out(static_cast<size_t>(c.Dv), 0.0);
  for (int64_t j = 0; j < T; ++j) {
    const int64_t pos = c.P + i;
    if (c.causal && j > pos) continue;
    if (c.window > 0 && j <= pos - c.window) continue;
    const size_t mo = static_cast<size_t>((h * c.S + i) * T + j);
    if (c.mask == 1 && !mb[mo]) continue;
    if (c.mask == 2 && !(ma[mo] > -std::numeric_limits<float>::max())) continue;
    double dot = 0;
    for (int64_t d = 0; d < c.D; ++d) dot += double(q[static_cast<size_t>((h * c.S + i) * c.D + d)]) * k[static_cast<size_t>(j * c.D + d)];
    dot *= scale;
    if (c.softcap > 0) dot = c.softcap * std::tanh(dot / c.softcap);
    if (c.mask == 2) dot += ma[mo];
    s[static_cast<size_t>(j)] = dot;
  }
  double m = -INFINITY;
  for (double x : s) m = std::max(m, x);
  if (!std::isfinite(m)) return out;
  double den = 0;
  for (int64_t j = 0; j < T; ++j) {
    const double e = std::exp(s[static_cast<size_t>(j)] - m);
    den += e;
    for (int64_t d = 0; d < c.Dv; ++d) out[static_cast<size_t>(d)] += e * v[static_cast<size_t>(j * c.Dv + d)];
  }
  for (double& x : out) x /= den;
  return out;
}

uint16_t enc(DType t, float f) { return t == DType::kFloat16 ? float_to_half(f) : float_to_bf16(f); }
float dec(DType t, uint16_t b) { return t == DType::kFloat16 ? half_to_float(b) : bf16_to_float(b); }

void run_case(const Case& c, uint32_t seed, double tol) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int64_t T = c.P + c.S;
  std::vector<float> q(static_cast<size_t>(c.G * c.S * c.D)), k(static_cast<size_t>(T * c.D)), v(static_cast<size_t>(T * c.Dv));
  for (auto* vec : {&q, &k, &v})
    for (size_t e = 0; e < vec->size(); ++e) {
      float& x = (*vec)[e];
      x = nd(rng);
      if (vec == &k) x *= 1.0f + c.k_ramp * static_cast<float>(e / static_cast<size_t>(c.D));
      if (c.dtype != DType::kFloat32) x = dec(c.dtype, enc(c.dtype, x));  // representable values
    }
  std::vector<uint8_t> mb(static_cast<size_t>(c.G * c.S * T), 1);
  std::vector<float> ma(mb.size(), 0.0f);
  for (size_t i = 0; i < mb.size(); ++i) {
    mb[i] = (rng() % 4) != 0;
    ma[i] = (rng() % 4) == 0 ? -INFINITY : ((rng() % 5) == 0 ? -std::numeric_limits<float>::max() : nd(rng));
  }
  // Storage in the case's dtype.
  const size_t es = dtype_size(c.dtype);
  auto pack = [&](const std::vector<float>& src) {
    std::vector<uint8_t> out(src.size() * es);
    for (size_t i = 0; i < src.size(); ++i) {
      if (c.dtype == DType::kFloat32) {
        std::memcpy(&out[i * 4], &src[i], 4);
      } else {
        const uint16_t b = enc(c.dtype, src[i]);
        std::memcpy(&out[i * 2], &b, 2);
      }
    }
    return out;
  };
  std::vector<uint8_t> qb = pack(q), kb = pack(k), vb = pack(v);
  std::vector<uint8_t> ob(static_cast<size_t>(c.G * c.S * c.Dv) * es, 0xff);
  std::vector<KVBlock> blocks;
  const int64_t per = c.page_rows > 0 ? c.page_rows : (T + c.blocks - 1) / c.blocks;
  for (int64_t start = 0; start < T; start += per) {
    KVBlock b;
    b.key = kb.data() + static_cast<size_t>(start * c.D) * es;
    b.value = vb.data() + static_cast<size_t>(start * c.Dv) * es;
    b.first_position = start;
    b.num_rows = std::min(per, T - start);
    blocks.push_back(b);
  }
  AttentionGroup a;
  a.dtype = c.dtype;
  a.q = qb.data();
  a.q_head_stride = c.S * c.D;
  a.q_row_stride = c.D;
  a.out = ob.data();
  a.out_head_stride = c.S * c.Dv;
  a.out_row_stride = c.Dv;
  a.group_size = c.G;
  a.num_rows = c.S;
  a.num_valid_rows = c.valid_rows < 0 ? c.S : c.valid_rows;
  a.q_offset = c.P;
  a.num_keys = T;
  a.blocks = blocks.data();
  a.num_blocks = static_cast<int64_t>(blocks.size());
  a.head_dim = c.D;
  a.v_head_dim = c.Dv;
  a.scale = 1.0f / std::sqrt(static_cast<float>(c.D));
  a.softcap = c.softcap;
  a.is_causal = c.causal;
  a.local_window_size = c.window;
  if (c.mask) {
    a.mask.kind = c.mask == 1 ? MaskKind::kBool : MaskKind::kAdditive;
    a.mask.dtype = DType::kFloat32;
    a.mask.data = c.mask == 1 ? static_cast<const void*>(mb.data()) : static_cast<const void*>(ma.data());
    a.mask.head_stride = c.S * T;
    a.mask.row_stride = T;
    a.mask.key_stride = 1;
  }
  std::vector<float> scratch(static_cast<size_t>(attend_group_floats(a)));
  attend_group(a, scratch.data());
  for (int64_t h = 0; h < c.G; ++h)
    for (int64_t i = 0; i < c.S; ++i) {
      const std::vector<double> want_row =
          i < a.num_valid_rows ? ref_row(c, q, k, v, mb, ma, h, i) : std::vector<double>(static_cast<size_t>(c.Dv), 0.0);
      for (int64_t d = 0; d < c.Dv; ++d) {
        const size_t o = static_cast<size_t>((h * c.S + i) * c.Dv + d);
        float got;
        if (c.dtype == DType::kFloat32) {
          std::memcpy(&got, &ob[o * 4], 4);
        } else {
          uint16_t b;
          std::memcpy(&b, &ob[o * 2], 2);
          got = dec(c.dtype, b);
        }
        const double want = want_row[static_cast<size_t>(d)];
        CHECK(std::isfinite(got));
        CHECK_NEAR(got, want, tol);
      }
    }
}

// Split-KV: a key range processed in pieces and merged equals one pass; so do consecutive
// ranges accumulated into one state. k_ramp > 0: key j scaled by 1 + k_ramp * j, so the row
// maxima keep rising and the softmax reference moves inside and between the calls.
void split_matches_single_pass(int64_t G, float k_ramp) {
  const int64_t D = 32, T = 200;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  std::vector<float> q(static_cast<size_t>(G * D)), k(static_cast<size_t>(T * D)), v(k.size()), o1(q.size()), o2(q.size());
  for (auto* x : {&q, &k, &v})
    for (auto& e : *x) e = nd(rng);
  for (size_t e = 0; e < k.size(); ++e) k[e] *= 1.0f + k_ramp * static_cast<float>(e / D);
  KVBlock blk{k.data(), v.data(), 0, T};
  AttentionGroup a = decode_group(q.data(), nullptr, &blk, 1, G, D, T, 0.2f);
  std::vector<float> s1(static_cast<size_t>(state_floats(a))), s2(s1.size()), s3(s1.size());
  std::vector<float> scratch(static_cast<size_t>(scratch_floats(a)));
  AttentionState whole, left, right;
  init_state(a, s1.data(), &whole);
  attend_range(a, 0, T, &whole, scratch.data());
  init_state(a, s2.data(), &left);
  init_state(a, s3.data(), &right);
  attend_range(a, 0, 80, &left, scratch.data());
  attend_range(a, 80, T, &right, scratch.data());
  merge_states(a, &left, right);
  a.out = o1.data();
  finalize(a, whole);
  a.out = o2.data();
  finalize(a, left);
  const double tol = k_ramp > 0 ? 2e-5 : 1e-6;
  for (size_t i = 0; i < o1.size(); ++i) CHECK_NEAR(o1[i], o2[i], tol);
  AttentionState chained;  // [0, 50), [50, 130), [130, T) into one state
  init_state(a, s2.data(), &chained);
  attend_range(a, 0, 50, &chained, scratch.data());
  attend_range(a, 50, 130, &chained, scratch.data());
  attend_range(a, 130, T, &chained, scratch.data());
  finalize(a, chained);
  for (size_t i = 0; i < o1.size(); ++i) CHECK_NEAR(o1[i], o2[i], tol);
}

// Large finite V (|v| ~ 1e35..1e37, fp32 range) with the row max rising in a later tile: the
// output stays finite and equal to the scalar level's. (A softmax reference lagging the max
// made p up to e^8 and overflowed acc to inf here.)
void large_values_stay_finite() {
  for (int64_t G : {1, 4}) {
    const int64_t D = 16, T = 40;
    std::vector<float> q(static_cast<size_t>(G * D), 0.0f), k(static_cast<size_t>(T * D), 0.0f), v(k.size(), 0.0f);
    for (int64_t h = 0; h < G; ++h) q[static_cast<size_t>(h * D)] = 1.0f;
    for (int64_t j = 0; j < T; ++j) k[static_cast<size_t>(j * D)] = j < 16 ? 0.0f : 7.9f;
    for (int64_t j = 16; j < T; ++j)
      for (int64_t d = 0; d < D; ++d) v[static_cast<size_t>(j * D + d)] = (d % 2 ? -1.0f : 1.0f) * 2e35f;
    KVBlock b{k.data(), v.data(), 0, T};
    AttentionGroup a = decode_group(q.data(), nullptr, &b, 1, G, D, T, 1.0f);
    std::vector<float> want(q.size()), got(q.size()), buf(static_cast<size_t>(attend_group_floats(a)));
    const Isa level = active_isa();
    set_isa(Isa::kScalar);
    a.out = want.data();
    attend_group(a, buf.data());
    set_isa(level);
    a.out = got.data();
    attend_group(a, buf.data());
    for (size_t i = 0; i < got.size(); ++i) {
      CHECK(std::isfinite(got[i]));
      CHECK_NEAR(got[i], want[i], 1e-5 * std::fabs(want[i]));
    }
  }
}

// An inf value at a key whose probability underflows: exp(s - max) = 0 for s - max < -103.97
// gives 0 * inf = NaN, a denormal probability (s - max = -95: 5.5e-42) gives inf - as float
// softmax followed by the weighted sum does (numpy, ORT), at every level and on both paths.
void inf_value_times_underflow() {
  for (float gap : {-200.0f, -95.0f})
    for (int64_t G : {1, 4, 16}) {
      const int64_t D = 16, T = 20;
      std::vector<float> q(static_cast<size_t>(G * D), 0.0f), k(static_cast<size_t>(T * D), 0.0f),
          v(static_cast<size_t>(T * D), 0.5f), out(q.size());
      for (int64_t h = 0; h < G; ++h) q[static_cast<size_t>(h * D)] = 1.0f;
      k[static_cast<size_t>(7 * D)] = gap;  // key 7: score gap below the others (all 0)
      v[static_cast<size_t>(7 * D + 3)] = INFINITY;
      KVBlock b{k.data(), v.data(), 0, T};
      AttentionGroup a;
      a.q = q.data(); a.q_head_stride = D; a.q_row_stride = D; a.out = out.data(); a.out_head_stride = D;
      a.out_row_stride = D; a.group_size = G; a.num_rows = 1; a.num_valid_rows = 1; a.q_offset = T - 1;
      a.num_keys = T; a.blocks = &b; a.num_blocks = 1; a.head_dim = D; a.v_head_dim = D; a.scale = 1.0f;
      a.is_causal = true;
      std::vector<float> buf(static_cast<size_t>(attend_group_floats(a)));
      attend_group(a, buf.data());
      for (int64_t h = 0; h < G; ++h)
        for (int64_t d = 0; d < D; ++d) {
          const float o = out[static_cast<size_t>(h * D + d)];
          if (d != 3) CHECK_NEAR(o, 0.5f, 1e-6);
          else if (gap < -150.0f) CHECK(std::isnan(o));
          else CHECK(std::isinf(o) && o > 0);
        }
    }
}

// NaN in a visible key makes the row NaN (as ONNX Attention); NaN beyond the visible range is never read.
void nan_propagates() {
  const int64_t D = 16, T = 40;
  std::vector<float> q(D, 0.1f), k(static_cast<size_t>(T * D), 0.2f), v(k.size(), 0.3f), out(D);
  k[static_cast<size_t>(5 * D + 3)] = NAN;  // key 5 visible to the query at position 30
  for (int64_t d = 0; d < D; ++d) k[static_cast<size_t>(35 * D + d)] = NAN;  // key 35: in the future (causal)
  KVBlock b{k.data(), v.data(), 0, T};
  AttentionGroup a;
  a.q = q.data(); a.q_head_stride = D; a.q_row_stride = D; a.out = out.data(); a.out_head_stride = D;
  a.out_row_stride = D; a.num_rows = 1; a.num_valid_rows = 1; a.q_offset = 30; a.num_keys = T;
  a.blocks = &b; a.num_blocks = 1; a.head_dim = D; a.v_head_dim = D; a.scale = 0.25f; a.is_causal = true;
  std::vector<float> buf(static_cast<size_t>(attend_group_floats(a)));
  attend_group(a, buf.data());
  for (float x : out) CHECK(std::isnan(x));
  k[static_cast<size_t>(5 * D + 3)] = 0.2f;
  attend_group(a, buf.data());
  for (float x : out) CHECK_NEAR(x, 0.3f, 1e-6);  // the future NaN key is not read
}

// Every register-block shape of the SIMD row path (4, 2 and 1 rows per block) and the lanes
// path (rows >= the vector width: padding lanes, several row blocks, prefill rows with
// different causal ranges, rows past num_valid_rows), over several 32-key tiles with a partial
// last tile, split blocks, masks, windows, softcap, fp16/bf16 and v_head_dim != head_dim.
void block_and_lane_paths() {
  uint32_t seed = 200;
  for (int64_t G : {2, 3, 5, 8, 16, 32})
    for (int64_t S : {1, 3}) {
      Case c;
      c.G = G; c.S = S; c.P = 77; c.D = 64; c.Dv = 32; c.blocks = 2;
      run_case(c, seed++, 2e-5);
      c.causal = false; c.window = 20;
      run_case(c, seed++, 2e-5);
      c.causal = true; c.window = -1; c.softcap = 3.0f;
      run_case(c, seed++, 2e-5);
      c.softcap = 0.0f; c.mask = 2;
      run_case(c, seed++, 2e-5);
    }
  for (int64_t G : {4, 16}) {
    Case c;  // D = Dv = 128: the 8-vector P.V chunks
    c.G = G; c.S = 2; c.valid_rows = 1; c.P = 40; c.D = 128; c.Dv = 128;
    run_case(c, seed++, 2e-5);
    for (DType t : {DType::kFloat16, DType::kBFloat16}) {
      c.dtype = t; c.valid_rows = -1; c.blocks = 3;
      run_case(c, seed++, t == DType::kFloat16 ? 2e-3 : 1.6e-2);
    }
  }
  Case pre;  // prefill block: 9 rows x 4 heads with per-row causal ranges, one 16-key window
  pre.G = 4; pre.S = 9; pre.P = 50; pre.D = 16; pre.Dv = 16; pre.window = 16;
  run_case(pre, seed++, 2e-5);
}

// The row path's register blocks and their remainders against the double reference: 3, 5, 6
// and 7 rows per KV head (4-row P.V blocks, then a pair, then one row), head_dim whose score
// loop ends in a single iteration and v_head_dim whose P.V ends in 1- and 2-vector chunks (the
// multiples of 8 run at AVX2 and fall back to scalar at AVX-512; the multiples of 16 run at
// both), keys over pages of 37 rows (partial tiles at every page end), masks and a window.
void row_block_remainders() {
  uint32_t seed = 500;
  const int64_t dims[][2] = {{24, 24}, {40, 56}, {8, 40}, {16, 48}, {48, 80}, {80, 112}, {16, 16}};
  for (DType t : {DType::kFloat32, DType::kFloat16, DType::kBFloat16})
    for (const auto& dd : dims)
      for (int64_t G : {3, 5, 6, 7}) {
        Case c;
        c.G = G; c.S = 1; c.P = 150; c.D = dd[0]; c.Dv = dd[1]; c.page_rows = 37; c.dtype = t;
        const double tol = t == DType::kFloat32 ? 2e-5 : t == DType::kFloat16 ? 2e-3 : 1.6e-2;
        run_case(c, seed++, tol);
        c.mask = 2; c.window = 60;
        run_case(c, seed++, tol);
        c.S = 2; c.valid_rows = 1; c.mask = 1; c.window = -1;  // one valid row of two
        run_case(c, seed++, tol);
      }
}

// One head group (G query heads, S rows at the end of T keys, causal) over one block of
// block_rows >= T rows of k/v (rows past T are capacity the kernel must not read).
AttentionGroup one_tile_group(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                              std::vector<float>& out, KVBlock* b, int64_t G, int64_t S, int64_t D, int64_t T,
                              int64_t block_rows = -1) {
  *b = KVBlock{k.data(), v.data(), 0, block_rows < 0 ? T : block_rows};
  AttentionGroup a;
  a.q = q.data(); a.q_head_stride = S * D; a.q_row_stride = D; a.out = out.data(); a.out_head_stride = S * D;
  a.out_row_stride = D; a.group_size = G; a.num_rows = S; a.num_valid_rows = S; a.q_offset = T - S;
  a.num_keys = T; a.blocks = b; a.num_blocks = 1; a.head_dim = D; a.v_head_dim = D; a.scale = 0.25f;
  a.is_causal = true;
  return a;
}

// Rows of a block past num_keys (cache capacity beyond the valid length) are never read: NaN
// there must not reach the output, for every path (1 row, 4-row blocks, lanes).
void poisoned_tail_unread() {
  for (int64_t G : {1, 4, 16, 32})
    for (int64_t T : {45, 64}) {
      const int64_t D = 32, cap = 96;
      std::vector<float> q(static_cast<size_t>(G * D)), k(static_cast<size_t>(cap * D), NAN), v(k.size(), NAN),
          out(q.size());
      std::mt19937 rng(static_cast<uint32_t>(G * 100 + T));
      std::normal_distribution<float> nd;
      for (auto& x : q) x = nd(rng);
      for (int64_t i = 0; i < T * D; ++i) {
        k[static_cast<size_t>(i)] = nd(rng);
        v[static_cast<size_t>(i)] = nd(rng);
      }
      KVBlock b;
      AttentionGroup a = one_tile_group(q, k, v, out, &b, G, 1, D, T, cap);
      std::vector<float> buf(static_cast<size_t>(attend_group_floats(a)));
      attend_group(a, buf.data());
      for (float x : out) CHECK(std::isfinite(x));
    }
}

// NaN in one query head makes only that head's rows NaN, in the lanes path too.
void nan_in_one_head() {
  const int64_t G = 16, D = 16, T = 50;
  std::vector<float> q(static_cast<size_t>(G * D), 0.1f), k(static_cast<size_t>(T * D), 0.2f), v(k.size(), 0.3f),
      out(q.size());
  q[static_cast<size_t>(5 * D + 2)] = NAN;
  KVBlock b;
  AttentionGroup a = one_tile_group(q, k, v, out, &b, G, 1, D, T);
  std::vector<float> buf(static_cast<size_t>(attend_group_floats(a)));
  attend_group(a, buf.data());
  for (int64_t h = 0; h < G; ++h)
    for (int64_t d = 0; d < D; ++d) {
      const float x = out[static_cast<size_t>(h * D + d)];
      if (h == 5) CHECK(std::isnan(x));
      else CHECK_NEAR(x, 0.3f, 1e-6);
    }
}

// NaN/inf semantics (API.md: "a NaN in a key, value, query or mask entry the row can see makes
// that row NaN ... slots the row cannot see are never read"), for the row path (G = 1) and the
// lanes path (G = 16: rows >= the vector width, no mask). Regressions from an adversarial review.
// softcap > 0 and a NaN in a visible key: the row is NaN (tanh_v once mapped NaN to +-1).
void nan_with_softcap() {
  for (int64_t G : {1, 16}) {
    const int64_t D = 16, T = 40;
    std::vector<float> q(static_cast<size_t>(G * D), 0.1f), k(static_cast<size_t>(T * D), 0.2f), v(k.size(), 0.3f),
        out(q.size());
    k[static_cast<size_t>(5 * D + 3)] = NAN;  // key 5: visible to the query at position 39
    KVBlock b;
    AttentionGroup a = one_tile_group(q, k, v, out, &b, G, 1, D, T);
    a.softcap = 5.0f;
    std::vector<float> buf(static_cast<size_t>(attend_group_floats(a)));
    attend_group(a, buf.data());
    int finite = 0;
    for (float x : out) finite += std::isnan(x) ? 0 : 1;
    if (finite) std::fprintf(stderr, "nan_with_softcap G=%ld: %d of %zu outputs not NaN\n", (long)G, finite, out.size());
    CHECK(finite == 0);
  }
}

// Prefill rows: a NaN in the value of key 31, which only the last row (position 31) can see
// (causal). Row 0 (position 30) stays finite (P.V once multiplied p = 0 by that NaN value).
void unseen_nan_value_not_read() {
  for (int64_t G : {1, 16}) {
    const int64_t D = 16, S = 2, T = 32;
    std::vector<float> q(static_cast<size_t>(G * S * D), 0.1f), k(static_cast<size_t>(T * D), 0.2f),
        v(k.size(), 0.3f), out(static_cast<size_t>(G * S * D));
    v[static_cast<size_t>(31 * D + 2)] = NAN;
    KVBlock b;
    AttentionGroup a = one_tile_group(q, k, v, out, &b, G, S, D, T);
    std::vector<float> buf(static_cast<size_t>(attend_group_floats(a)));
    attend_group(a, buf.data());
    int bad = 0;
    for (int64_t h = 0; h < G; ++h)
      for (int64_t d = 0; d < D; ++d) {
        const float x = out[static_cast<size_t>((h * S + 0) * D + d)];  // row 0 of head h
        bad += std::fabs(x - 0.3f) <= 1e-6f ? 0 : 1;
      }
    if (bad) std::fprintf(stderr, "unseen_nan_value_not_read G=%ld: %d outputs of row 0 wrong\n", (long)G, bad);
    CHECK(bad == 0);
  }
}

// One query row (MHA decode) with head_dim past the AVX2 level's 8 accumulators (its P.V goes
// key by key there, pv_row_keys): the V rows of keys a bool mask hides hold NaN, between visible
// keys of the same tiles (the first key of the first tile among them), and must not reach the
// output; at every level the result is the visible keys' common V row.
void unseen_nan_value_not_read_one_row() {
  for (int64_t D : {64, 128, 256}) {
    const int64_t T = 40;
    std::vector<float> q(static_cast<size_t>(D), 0.1f), k(static_cast<size_t>(T * D), 0.2f), v(k.size()),
        out(q.size());
    std::vector<uint8_t> mb(static_cast<size_t>(T));
    for (int64_t j = 0; j < T; ++j) {
      mb[static_cast<size_t>(j)] = j % 3 != 0;
      for (int64_t d = 0; d < D; ++d)
        v[static_cast<size_t>(j * D + d)] = mb[static_cast<size_t>(j)] ? 0.01f * static_cast<float>(d) : NAN;
    }
    KVBlock b;
    AttentionGroup a = one_tile_group(q, k, v, out, &b, 1, 1, D, T);
    a.mask.kind = MaskKind::kBool; a.mask.data = mb.data(); a.mask.key_stride = 1;
    std::vector<float> buf(static_cast<size_t>(attend_group_floats(a)));
    attend_group(a, buf.data());
    int bad = 0;
    for (int64_t d = 0; d < D; ++d) bad += std::fabs(out[static_cast<size_t>(d)] - 0.01f * d) <= 1e-6f ? 0 : 1;
    if (bad) std::fprintf(stderr, "unseen_nan_value_not_read_one_row D=%ld: %d outputs wrong\n", (long)D, bad);
    CHECK(bad == 0);
  }
}

// One or two visible keys with a +inf score (inf in K): softmax is inf - inf = NaN (ONNX
// Attention), at every level (the lanes path once gave finite values, the scalar level once
// returned the V row of a single +inf key).
void inf_scores_are_nan() {
  for (int inf_keys : {1, 2})
  for (int64_t G : {1, 16}) {
    const int64_t D = 16, T = 40;
    std::vector<float> q(static_cast<size_t>(G * D), 0.1f), k(static_cast<size_t>(T * D), 0.2f), v(k.size()),
        out(q.size());
    for (int64_t j = 0; j < T; ++j)
      for (int64_t d = 0; d < D; ++d) v[static_cast<size_t>(j * D + d)] = static_cast<float>(j);
    for (int64_t d = 0; d < D; ++d) {
      k[static_cast<size_t>(3 * D + d)] = INFINITY;
      if (inf_keys == 2) k[static_cast<size_t>(23 * D + d)] = INFINITY;
    }
    KVBlock b;
    AttentionGroup a = one_tile_group(q, k, v, out, &b, G, 1, D, T);
    std::vector<float> buf(static_cast<size_t>(attend_group_floats(a)));
    attend_group(a, buf.data());
    int finite = 0;
    for (float x : out) finite += std::isnan(x) ? 0 : 1;
    if (finite) std::fprintf(stderr, "inf_scores_are_nan G=%ld: %d outputs not NaN (out[0]=%g)\n", (long)G, finite, out[0]);
    CHECK(finite == 0);
  }
}

// Every ISA level against the scalar level on random groups with non-finite inputs: a NaN in
// one V entry (seen by some rows, not by others: prefill, window, mask), a +-inf in one K
// entry, huge q (probabilities that underflow), split key ranges merged afterwards. NaN must
// land on exactly the same outputs; finite outputs agree to float tolerance.
// bfloat16 (t): q, k, v stored as bf16 with head_dim mostly a multiple of 32 (the
// avx512_bf16 level's VDPBF16PS scores), sometimes 16 (its fallback); outputs compared
// at bf16 precision.
void nonfinite_matches_scalar(DType t) {
  if (active_isa() == Isa::kScalar) return;
  const Isa level = active_isa();
  const bool bf = t == DType::kBFloat16;
  std::mt19937 rng(bf ? 78 : 77);
  auto ri = [&](int lo, int hi) { return static_cast<int64_t>(std::uniform_int_distribution<int>(lo, hi)(rng)); };
  std::normal_distribution<float> nd;
  for (int it = 0; it < 200; ++it) {
    const int special = static_cast<int>(it % 4);
    const bool from_empty = special == 2 && it % 8 == 2;  // prefill from position 0: row 0 sees key 0 only
    const int64_t G = it % 3 == 0 ? ri(16, 20) : ri(1, 5), S = from_empty ? ri(2, 6) : ri(1, 6),
                  D = bf ? (it % 5 == 4 ? 16 : 32 * ri(1, 3)) : 16 * ri(1, 2),
                  T = from_empty ? S : ri(static_cast<int>(S), 70);
    std::vector<float> q(static_cast<size_t>(G * S * D)), k(static_cast<size_t>(T * D)), v(k.size());
    for (auto* x : {&q, &k, &v})
      for (auto& e : *x) e = nd(rng);
    int64_t split = ri(1, static_cast<int>(T));
    if (special == 1) {  // a NaN (or +-inf) value; with huge q its key's probability may underflow to 0
      // (inf only without huge q: near the underflow boundary, 0 vs a denormal p, and so NaN
      // vs inf, hangs on the last bit of a score; inf_value_times_underflow pins that down.)
      v[static_cast<size_t>(ri(0, static_cast<int>(v.size()) - 1))] =
          it % 3 == 1 && it % 8 != 1 ? (ri(0, 1) ? INFINITY : -INFINITY) : NAN;
      if (it % 8 == 1)
        for (auto& e : q) e *= 40.0f;
    }
    if (special == 2) {  // +-inf in key 0; a first range holding key 0 alone
      k[static_cast<size_t>(ri(0, static_cast<int>(D) - 1))] = ri(0, 1) ? INFINITY : -INFINITY;
      if (from_empty) split = 1;
    }
    if (special == 3)
      for (auto& e : q) e *= 40.0f;  // exp underflows for most keys
    std::vector<uint8_t> mb(static_cast<size_t>(G * S * T));
    for (auto& e : mb) e = ri(0, 3) != 0;
    std::vector<uint16_t> qh, kh, vh;  // bf16 storage
    if (bf)
      for (auto pr : {std::make_pair(&q, &qh), std::make_pair(&k, &kh), std::make_pair(&v, &vh)})
        for (float e : *pr.first) pr.second->push_back(float_to_bf16(e));
    KVBlock b{k.data(), v.data(), 0, T};
    if (bf) b = KVBlock{kh.data(), vh.data(), 0, T};
    AttentionGroup a;
    a.dtype = t;
    a.q = bf ? static_cast<const void*>(qh.data()) : static_cast<const void*>(q.data());
    a.q_head_stride = S * D; a.q_row_stride = D; a.out_head_stride = S * D; a.out_row_stride = D;
    a.group_size = G; a.num_rows = S; a.num_valid_rows = S; a.q_offset = T - S; a.num_keys = T; a.blocks = &b;
    a.num_blocks = 1; a.head_dim = D; a.v_head_dim = D; a.scale = 0.25f; a.is_causal = it % 2 == 0;
    a.local_window_size = it % 5 == 0 ? ri(1, 20) : -1;
    if (it % 7 == 0) {
      a.mask.kind = MaskKind::kBool; a.mask.data = mb.data(); a.mask.head_stride = S * T; a.mask.row_stride = T;
      a.mask.key_stride = 1;
    }
    std::vector<float> out[2];
    std::vector<uint16_t> outh(static_cast<size_t>(G * S * D));
    for (int pass = 0; pass < 2; ++pass) {
      set_isa(pass == 0 ? Isa::kScalar : level);
      out[pass].assign(static_cast<size_t>(G * S * D), 0.0f);
      a.out = bf ? static_cast<void*>(outh.data()) : static_cast<void*>(out[pass].data());
      std::vector<float> s0(static_cast<size_t>(state_floats(a))), s1(s0.size());
      std::vector<float> scratch(static_cast<size_t>(scratch_floats(a)));
      AttentionState st0, st1;
      init_state(a, s0.data(), &st0);
      init_state(a, s1.data(), &st1);
      attend_range(a, 0, split, &st0, scratch.data());
      attend_range(a, split, T, &st1, scratch.data());
      merge_states(a, &st0, st1);
      finalize(a, st0);
      if (bf)
        for (size_t i = 0; i < outh.size(); ++i) out[pass][i] = bf16_to_float(outh[i]);
    }
    set_isa(level);
    const double rel = bf ? 1.6e-2 : 1e-4;  // bf16: one output rounding step apart at most
    for (size_t i = 0; i < out[0].size(); ++i) {
      CHECK(std::isnan(out[0][i]) == std::isnan(out[1][i]));
      if (std::isinf(out[0][i])) CHECK(out[1][i] == out[0][i]);  // an inf value reached the row
      else if (!std::isnan(out[0][i])) CHECK_NEAR(out[1][i], out[0][i], rel * (1.0 + std::fabs(out[0][i])));
    }
  }
}

// One query row over pages (the row path reads each page of at most 1024 rows as one chunk:
// all its K rows, then all its V rows) gives the same bits as over one block read tile by
// tile: the chunking reorders memory reads, not arithmetic. Pages of a multiple of 32 rows
// (tiles on the global grid end on page ends), blocks of up to and beyond 1024 rows.
void pages_match_one_block() {
  const int64_t D = 64, T = 2600;
  for (DType t : {DType::kFloat32, DType::kFloat16, DType::kBFloat16})
    for (int mask : {0, 2})
      for (float softcap : {0.0f, 5.0f}) {
        std::mt19937 rng(static_cast<uint32_t>(7 + mask + static_cast<int>(t) * 3));
        std::normal_distribution<float> nd;
        const size_t es = dtype_size(t);
        std::vector<uint8_t> q(static_cast<size_t>(D) * es), k(static_cast<size_t>(T * D) * es), v(k.size());
        for (auto* x : {&q, &k, &v})
          for (size_t i = 0; i < x->size() / es; ++i) {
            const float f = nd(rng) * (x == &k ? 1.0f + 0.002f * static_cast<float>(i / D) : 1.0f);
            if (t == DType::kFloat32) std::memcpy(x->data() + i * 4, &f, 4);
            else {
              const uint16_t b = enc(t, f);
              std::memcpy(x->data() + i * 2, &b, 2);
            }
          }
        std::vector<float> bias(static_cast<size_t>(T));
        for (auto& b : bias) b = rng() % 5 == 0 ? -INFINITY : nd(rng);
        auto run = [&](int64_t page_rows) {
          std::vector<KVBlock> blocks;
          for (int64_t s0 = 0; s0 < T; s0 += page_rows)
            blocks.push_back(KVBlock{k.data() + static_cast<size_t>(s0 * D) * es, v.data() + static_cast<size_t>(s0 * D) * es, s0,
                                     std::min(page_rows, T - s0)});
          std::vector<uint8_t> out(static_cast<size_t>(D) * es);
          AttentionGroup a;
          a.dtype = t;
          a.q = q.data(); a.q_head_stride = D; a.q_row_stride = D;
          a.out = out.data(); a.out_head_stride = D; a.out_row_stride = D;
          a.num_rows = 1; a.num_valid_rows = 1; a.q_offset = T - 1; a.num_keys = T;
          a.blocks = blocks.data(); a.num_blocks = static_cast<int64_t>(blocks.size());
          a.head_dim = D; a.v_head_dim = D; a.scale = 0.125f; a.softcap = softcap; a.is_causal = true;
          if (mask) {
            a.mask.kind = MaskKind::kAdditive; a.mask.dtype = DType::kFloat32; a.mask.data = bias.data();
            a.mask.head_stride = T; a.mask.row_stride = T; a.mask.key_stride = 1;
          }
          std::vector<float> scratch(static_cast<size_t>(attend_group_floats(a)));
          attend_group(a, scratch.data());
          return out;
        };
        const std::vector<uint8_t> one = run(T);
        for (int64_t page_rows : {32, 96, 128, 512, 1024, 1056}) CHECK(run(page_rows) == one);
      }
}

// int8 blocks (KVEncoding::kInt8: per-channel K scales, per-row V scales, V codes in row pairs)
// mixed with native float32 blocks of one (sequence, head) against a float64 model of the
// documented arithmetic (docs/API.md, "Quantized pages"): on an int8 page the score is
// sq * sum_d q16[d] * code[d] with q16 = round_half_even(q * scale * key_scale[d] * qmax / m)
// (m = the row's max |q * scale * key_scale|, qmax = 32767, sq = m / qmax), native keys score
// q . k * scale, and values are code * value_scale; at the float32 tolerance plus, at the SIMD
// levels, the bound of the 16-bit P.V weights from the case's probabilities. Row path (1 and 4
// rows: int16 sums) and lanes path (32 rows: the same q16 as float), a ragged end, and a window
// whose first key is an even or an odd page row (a tile starting inside a V row pair).
void int8_blocks_match_model() {
  const int64_t D = 32, T = 300, P = 64;
  const float scale = 0.3f;
  for (int64_t window : {int64_t{-1}, int64_t{200}, int64_t{201}})
  for (int64_t G : {1, 4, 32}) {
    std::mt19937 rng(static_cast<uint32_t>(40 + G));
    std::normal_distribution<float> nd;
    std::uniform_int_distribution<int> code(-127, 127);
    std::vector<float> q(static_cast<size_t>(G * D));
    for (auto& x : q) x = nd(rng);
    std::vector<int8_t> k8(static_cast<size_t>(T * D)), v8(k8.size());
    std::vector<float> ks(static_cast<size_t>((T / P + 1) * D)), vs(static_cast<size_t>(T));
    for (auto& x : ks) x = 0.01f + 0.05f * std::fabs(nd(rng));
    for (auto& x : vs) x = 0.01f + 0.05f * std::fabs(nd(rng));
    std::vector<float> kn(k8.size()), vn(k8.size());  // native rows (blocks 0 and the last)
    for (auto& x : kn) x = nd(rng);
    for (auto& x : vn) x = nd(rng);
    std::vector<double> vmodel(k8.size());
    std::vector<KVBlock> mixed;
    std::vector<bool> quant_blk;
    for (int64_t s0 = 0, blk = 0; s0 < T; s0 += P, ++blk) {
      const int64_t n = std::min(P, T - s0);
      const bool quant = blk == 1 || blk == 2 || blk == 3;
      quant_blk.push_back(quant);
      for (int64_t r = s0; r < s0 + n; ++r)
        for (int64_t d = 0; d < D; ++d) {
          const size_t i = static_cast<size_t>(r * D + d);
          if (quant) {
            k8[i] = static_cast<int8_t>(code(rng));
            const int8_t vc = static_cast<int8_t>(code(rng));
            v8[static_cast<size_t>(s0 * D + int8_value_index(D, r - s0, d))] = vc;
            vmodel[i] = static_cast<double>(vc) * vs[static_cast<size_t>(r)];
          } else {
            vmodel[i] = vn[i];
          }
        }
      KVBlock b{nullptr, nullptr, s0, n};
      if (quant) {
        b.key = k8.data() + s0 * D;
        b.value = v8.data() + s0 * D;
        b.encoding = KVEncoding::kInt8;
        b.key_scale = ks.data() + blk * D;
        b.value_scale = vs.data() + s0;
      } else {
        b.key = kn.data() + s0 * D;
        b.value = vn.data() + s0 * D;
      }
      mixed.push_back(b);
    }
    std::vector<float> out(static_cast<size_t>(G * D));
    AttentionGroup a = decode_group(q.data(), out.data(), mixed.data(), static_cast<int64_t>(mixed.size()), G, D, T,
                                    scale);
    a.local_window_size = window;
    std::vector<float> scratch(static_cast<size_t>(attend_group_floats(a)));
    attend_group(a, scratch.data());
    const int64_t lo = window > 0 ? T - window : 0;
    for (int64_t h = 0; h < G; ++h) {
      std::vector<double> sc(static_cast<size_t>(T), -INFINITY);
      for (int64_t blk = 0; blk * P < T; ++blk) {
        const int64_t s0 = blk * P, n = std::min(P, T - s0);
        int16_t q16[D];
        float sq = 0.0f;
        if (quant_blk[static_cast<size_t>(blk)]) {  // the fixed-point query of this page, float32 steps
          float x[D], m = 0.0f;
          for (int64_t d = 0; d < D; ++d) {
            x[d] = (q[static_cast<size_t>(h * D + d)] * scale) * ks[static_cast<size_t>(blk * D + d)];
            m = std::max(m, std::fabs(x[d]));
          }
          const float f = 32767.0f / m;
          for (int64_t d = 0; d < D; ++d) q16[d] = static_cast<int16_t>(std::nearbyint(x[d] * f));
          sq = m / 32767.0f;
        }
        for (int64_t j = std::max(s0, lo); j < s0 + n; ++j) {
          double s = 0.0;
          for (int64_t d = 0; d < D; ++d) {
            const size_t i = static_cast<size_t>(j * D + d);
            s += quant_blk[static_cast<size_t>(blk)] ? static_cast<double>(q16[d]) * k8[i]
                                                      : static_cast<double>(q[static_cast<size_t>(h * D + d)]) * kn[i];
          }
          sc[static_cast<size_t>(j)] = quant_blk[static_cast<size_t>(blk)] ? s * sq : s * scale;
        }
      }
      double mx = -INFINITY, l = 0.0;
      for (double s : sc) mx = std::max(mx, s);
      std::vector<double> o(static_cast<size_t>(D), 0.0), p(static_cast<size_t>(T), 0.0);
      for (int64_t j = lo; j < T; ++j) {
        p[static_cast<size_t>(j)] = std::exp(sc[static_cast<size_t>(j)] - mx);
        l += p[static_cast<size_t>(j)];
        for (int64_t d = 0; d < D; ++d)
          o[static_cast<size_t>(d)] += p[static_cast<size_t>(j)] * vmodel[static_cast<size_t>(j * D + d)];
      }
      // float32 tolerance plus the bound of the 16-bit P.V weights (docs/API.md, "Quantized
      // pages"; none at the scalar level): per tile of W keys (j / W equal) of an int8 block, each
      // weight p_j * vs_j within 1/2 of M / 32767 (M the tile's largest), times 1 + 2^-6 (the
      // float32 steps), so |error[d]| <= (1 + 2^-6) / 65534 * sum_tiles M / l * sum_j |code[j, d]|.
      const int64_t W = active_isa() == Isa::kScalar ? 0 : active_isa() == Isa::kAvx2 ? 8 : 16;
      std::vector<double> pv(static_cast<size_t>(D), 0.0);
      for (int64_t t0 = 0; W > 0 && t0 < T; t0 += W) {
        if (!quant_blk[static_cast<size_t>(t0 / P)]) continue;  // W divides P: a tile lies in one block
        double m = 0.0;
        for (int64_t j = t0; j < t0 + W && j < T; ++j)
          m = std::max(m, p[static_cast<size_t>(j)] * vs[static_cast<size_t>(j)] / l);
        for (int64_t j = t0; j < t0 + W && j < T; ++j)
          if (p[static_cast<size_t>(j)] > 0.0)
            for (int64_t d = 0; d < D; ++d)
              pv[static_cast<size_t>(d)] += m * std::fabs(vmodel[static_cast<size_t>(j * D + d)]) / vs[static_cast<size_t>(j)];
      }
      for (int64_t d = 0; d < D; ++d) {
        const double want = o[static_cast<size_t>(d)] / l;
        CHECK_NEAR(out[static_cast<size_t>(h * D + d)], want,
                   1e-5 + 1e-4 * std::fabs(want) + (1.0 + 0x1p-6) / 65534.0 * pv[static_cast<size_t>(d)]);
      }
    }
  }
}

// An int8 block at an odd head_dim with an odd number of query rows (G * S * D odd): the scalar
// level's per-row float arrays after its int16 q16 rows must stay 4-byte aligned (UBSan), and
// the output matches a float64 model on the dequantized values (fixed-point scores: 1e-3).
void int8_odd_head_dim() {
  const int64_t D = 13, P = 64;
  for (int64_t G : {1, 3}) {
    std::mt19937 rng(static_cast<uint32_t>(70 + G));
    std::normal_distribution<float> nd;
    std::uniform_int_distribution<int> code(-127, 127);
    std::vector<float> q(static_cast<size_t>(G * D)), ks(static_cast<size_t>(D)), vs(static_cast<size_t>(P));
    for (auto& x : q) x = nd(rng);
    for (auto& x : ks) x = 0.01f + 0.05f * std::fabs(nd(rng));
    for (auto& x : vs) x = 0.01f + 0.05f * std::fabs(nd(rng));
    std::vector<int8_t> k8(static_cast<size_t>(P * D)), v8(k8.size());
    for (auto& c : k8) c = static_cast<int8_t>(code(rng));
    for (auto& c : v8) c = static_cast<int8_t>(code(rng));
    KVBlock b{k8.data(), v8.data(), 0, P};
    b.encoding = KVEncoding::kInt8;
    b.key_scale = ks.data();
    b.value_scale = vs.data();
    std::vector<float> out(static_cast<size_t>(G * D));
    AttentionGroup a = decode_group(q.data(), out.data(), &b, 1, G, D, P, 0.3f);
    std::vector<float> scratch(static_cast<size_t>(attend_group_floats(a)));
    attend_group(a, scratch.data());
    for (int64_t h = 0; h < G; ++h) {
      std::vector<double> sc(static_cast<size_t>(P));
      double mx = -INFINITY, l = 0.0;
      for (int64_t j = 0; j < P; ++j) {
        double s = 0.0;
        for (int64_t d = 0; d < D; ++d)
          s += static_cast<double>(q[static_cast<size_t>(h * D + d)]) * k8[static_cast<size_t>(j * D + d)] * ks[static_cast<size_t>(d)];
        sc[static_cast<size_t>(j)] = s * 0.3;
        mx = std::max(mx, sc[static_cast<size_t>(j)]);
      }
      std::vector<double> o(static_cast<size_t>(D), 0.0);
      for (int64_t j = 0; j < P; ++j) {
        const double p = std::exp(sc[static_cast<size_t>(j)] - mx);
        l += p;
        for (int64_t d = 0; d < D; ++d)
          o[static_cast<size_t>(d)] += p * v8[static_cast<size_t>(int8_value_index(D, j, d))] * vs[static_cast<size_t>(j)];
      }
      for (int64_t d = 0; d < D; ++d) CHECK_NEAR(out[static_cast<size_t>(h * D + d)], o[static_cast<size_t>(d)] / l, 1e-3);
    }
  }
}

// One valid row among padding rows (a ragged multi-row step, MHA): the row path must not take
// the one-row page chunk, whose scores scratch_floats sizes for a single row (ASan: overflow).
void one_valid_row_among_padding() {
  const int64_t D = 16, T = 1024, P = 256;
  std::mt19937 rng(91);
  std::normal_distribution<float> nd;
  std::vector<float> q(static_cast<size_t>(16 * D)), k(static_cast<size_t>(T * D)), v(k.size());
  for (auto* x : {&q, &k, &v})
    for (auto& f : *x) f = nd(rng);
  std::vector<KVBlock> blocks;
  for (int64_t s0 = 0; s0 < T; s0 += P) blocks.push_back(KVBlock{k.data() + s0 * D, v.data() + s0 * D, s0, P});
  auto run = [&](int64_t rows) {
    std::vector<float> out(static_cast<size_t>(rows * D), 7.0f);
    AttentionGroup a;
    a.dtype = DType::kFloat32;
    a.q = q.data(); a.q_head_stride = rows * D; a.q_row_stride = D;
    a.out = out.data(); a.out_head_stride = rows * D; a.out_row_stride = D;
    a.num_rows = rows; a.num_valid_rows = 1; a.q_offset = T - 1; a.num_keys = T;
    a.blocks = blocks.data(); a.num_blocks = static_cast<int64_t>(blocks.size());
    a.head_dim = D; a.v_head_dim = D; a.scale = 0.25f; a.is_causal = true;
    std::vector<float> scratch(static_cast<size_t>(attend_group_floats(a)));
    attend_group(a, scratch.data());
    return std::vector<float>(out.begin(), out.begin() + D);
  };
  const std::vector<float> one = run(1), padded = run(16);
  for (int64_t d = 0; d < D; ++d) CHECK_NEAR(padded[static_cast<size_t>(d)], one[static_cast<size_t>(d)], 1e-6);
}

}  // namespace

// int8 and int4 pages made by the cache's codec (quant::quantize_page), G query heads over one
// KV head at decode (1 row: the row path's one-row walk over codes; 4: its register blocks over
// codes; 20: the lanes path, K/V tiles unpacked to float), head_dim 64 / 128 / 192 / 256 (whole
// and partial vectors per K row at every level), a 50x outlier channel and a shifted one, q
// large enough that its fixed-point values span the int16 range, pages entered at an odd page
// row and cut short (zero-padded partial tiles): every level against the scalar level, and the
// avx512_bf16 level (VPDPWSSD) against the avx512 level (VPMADDWD + VPADDD, the same P.V code),
// which must agree to float summation order. A wrong channel, nibble or pair order is off by
// O(1); at the row path the two AVX-512 levels must agree bit for bit.
void quant_pages_match_scalar() {
  if (active_isa() == Isa::kScalar) return;
  const Isa level = active_isa();
  for (KVQuant mode : {KVQuant::kInt8, KVQuant::kInt4})
    for (int64_t D : {64, 128, 192, 256})
      for (int64_t G : {1, 4, 20}) {
        const int64_t P = 64, npages = 3;
        CacheGeometry g;
        g.num_layers = g.batch_size = g.kv_num_heads = 1;
        g.head_dim = g.v_head_dim = D;
        g.max_sequence_length = P * npages;
        g.page_tokens = P;
        g.kv_quant = mode;
        std::mt19937 rng(static_cast<uint32_t>(D + 7 * static_cast<int>(mode) + 1000 * G));
        std::normal_distribution<float> nd;
        std::vector<char> native(static_cast<size_t>(g.page_bytes())),
            quant(static_cast<size_t>(npages * g.quant_page_bytes()));
        std::vector<KVBlock> blocks;
        int64_t first = 0;
        for (int64_t pg = 0; pg < npages; ++pg) {
          float* k = reinterpret_cast<float*>(native.data());
          float* v = k + P * D;
          for (int64_t i = 0; i < P * D; ++i) {
            k[i] = nd(rng) * (i % D == 3 ? 50.0f : 1.0f) + (i % D == 5 ? 4.0f : 0.0f);
            v[i] = nd(rng) + (i % D == 7 ? 3.0f : 0.0f);
          }
          char* qp = quant.data() + pg * g.quant_page_bytes();
          CHECK(quant::quantize_page(g, native.data(), qp));
          // page 0 from row 1 (odd page row), page 1 whole, page 2 its first 37 rows
          const int64_t r0 = pg == 0 ? 1 : 0, r1 = pg == 2 ? 37 : P;
          blocks.push_back(quant::quant_block(g, qp, first, r0, r1));
          first += r1 - r0;
        }
        const int64_t T = first;
        // q at 30 sigma makes most rows' softmax one-hot (a score's last bits then move
        // nothing); q at sigma 1 / 8 keeps every key's weight in play
        for (float qsd : {30.0f, 0.125f}) {
          std::vector<float> q(static_cast<size_t>(G * D));
          for (auto& x : q) x = qsd * nd(rng);
          AttentionGroup a = decode_group(q.data(), nullptr, blocks.data(), static_cast<int64_t>(blocks.size()), G, D, T,
                                          1.0f / std::sqrt(static_cast<float>(D)));
          // scalar, this level, and (avx512_bf16) the avx512 level
          const Isa levels[3] = {Isa::kScalar, level, Isa::kAvx512};
          std::vector<float> out[3];
          const int passes = level == Isa::kAvx512Bf16 ? 3 : 2;
          for (int pass = 0; pass < passes; ++pass) {
            set_isa(levels[pass]);
            out[pass].assign(static_cast<size_t>(G * D), 0.0f);
            a.out = out[pass].data();
            std::vector<float> scratch(static_cast<size_t>(attend_group_floats(a)));
            attend_group(a, scratch.data());
          }
          set_isa(level);
          // The row path (1 and 4 rows) sums the codes exactly in int32 at both AVX-512 levels
          // (VPDPWSSD, and VPDPBUSD for one row's int4 scores, against VPMADDWD + VPADDD) and runs the
          // same float code on the totals: the results must be equal bit for bit, which a wrong byte
          // or nibble order in one channel's sums would break (a tolerance would not see it).
          const bool exact = passes == 3 && G < 16;
          for (size_t e = 0; e < static_cast<size_t>(G * D); ++e) {
            CHECK_NEAR(out[1][e], out[0][e], 1e-4 * (1.0 + std::fabs(out[0][e])));
            if (exact) CHECK(std::memcmp(&out[1][e], &out[2][e], sizeof(float)) == 0);
            else if (passes == 3) CHECK_NEAR(out[1][e], out[2][e], 2e-6 * (1.0 + std::fabs(out[2][e])));
          }
        }
      }
}

// A NaN in q over int8 / int4 pages makes the row NaN (docs/API.md, "Quantized pages": such a
// call scores its quantized pages on dequantized float32 K, as native pages): the fixed-point
// check must not drop the NaN (std::max did, and the scalar level then rounded NaN to int16).
// Every level, one and four query rows per KV head.
void nan_query_over_quant_pages() {
  const Isa level = active_isa();
  for (KVQuant mode : {KVQuant::kInt8, KVQuant::kInt4})
    for (int64_t G : {1, 4}) {
      const int64_t D = 64, P = 64;
      CacheGeometry g;
      g.num_layers = g.batch_size = g.kv_num_heads = 1;
      g.head_dim = g.v_head_dim = D;
      g.max_sequence_length = P;
      g.page_tokens = P;
      g.kv_quant = mode;
      std::mt19937 rng(static_cast<uint32_t>(300 + G + 10 * static_cast<int>(mode)));
      std::normal_distribution<float> nd;
      std::vector<char> native(static_cast<size_t>(g.page_bytes())), quant(static_cast<size_t>(g.quant_page_bytes()));
      float* kv = reinterpret_cast<float*>(native.data());
      for (int64_t i = 0; i < 2 * P * D; ++i) kv[i] = nd(rng);
      CHECK(quant::quantize_page(g, native.data(), quant.data()));
      const KVBlock b = quant::quant_block(g, quant.data(), 0, 0, P);
      std::vector<float> q(static_cast<size_t>(G * D), 0.5f), out(q.size());
      q[3] = NAN;  // row 0 (head 0) only
      AttentionGroup a = decode_group(q.data(), out.data(), &b, 1, G, D, P, 0.125f);
      for (Isa isa : {Isa::kScalar, level}) {
        set_isa(isa);
        std::fill(out.begin(), out.end(), 0.0f);
        std::vector<float> scratch(static_cast<size_t>(attend_group_floats(a)));
        attend_group(a, scratch.data());
        for (int64_t d = 0; d < D; ++d) CHECK(std::isnan(out[static_cast<size_t>(d)]));
        for (int64_t e = D; e < G * D; ++e) CHECK(std::isfinite(out[static_cast<size_t>(e)]));
      }
      set_isa(level);
    }
}

void run_all() {
  quant_pages_match_scalar();
  nan_query_over_quant_pages();
  int8_blocks_match_model();
  int8_odd_head_dim();
  one_valid_row_among_padding();
  uint32_t seed = 1;
  for (int64_t G : {1, 4})
    for (int64_t S : {1, 5})
      for (int64_t P : {0, 7})
        for (int mask : {0, 1, 2})
          for (int blocks : {1, 3}) {
            Case c;
            c.G = G; c.S = S; c.P = P; c.mask = mask; c.blocks = blocks;
            run_case(c, seed++, 1e-5);
            c.causal = false;
            run_case(c, seed++, 1e-5);
            c.causal = true;
            c.window = 3;
            run_case(c, seed++, 1e-5);
            c.window = -1;
            c.softcap = 2.0f;
            run_case(c, seed++, 1e-5);
          }
  Case r;  // right padding: rows >= valid are zeros
  r.G = 2; r.S = 4; r.P = 3; r.valid_rows = 2;
  run_case(r, 99, 1e-5);
  Case dv;  // v_head_dim != head_dim
  dv.G = 2; dv.S = 3; dv.P = 5; dv.D = 16; dv.Dv = 4;
  run_case(dv, 7, 1e-5);
  for (DType t : {DType::kFloat16, DType::kBFloat16}) {
    Case h;
    h.G = 4; h.S = 3; h.P = 9; h.dtype = t; h.mask = 2; h.blocks = 2;
    run_case(h, 5, t == DType::kFloat16 ? 2e-3 : 1.6e-2);
  }
  // C09: fp16 q.k would overflow in fp16 (q = k0 = 40, D = 64): fp32 accumulation gives ~v0.
  {
    const int64_t D = 64;
    std::vector<uint16_t> q(D, float_to_half(40.0f)), k(2 * D), v(2 * D), out(D);
    for (int64_t d = 0; d < D; ++d) {
      k[static_cast<size_t>(d)] = float_to_half(40.0f);
      k[static_cast<size_t>(D + d)] = float_to_half(39.0f);
      v[static_cast<size_t>(d)] = float_to_half(0.25f * static_cast<float>(d % 7));
      v[static_cast<size_t>(D + d)] = float_to_half(-3.0f);
    }
    KVBlock b{k.data(), v.data(), 0, 2};
    AttentionGroup a;
    a.dtype = DType::kFloat16;
    a.q = q.data(); a.q_head_stride = D; a.q_row_stride = D;
    a.out = out.data(); a.out_head_stride = D; a.out_row_stride = D;
    a.num_rows = 1; a.num_valid_rows = 1; a.q_offset = 1; a.num_keys = 2;
    a.blocks = &b; a.num_blocks = 1; a.head_dim = D; a.v_head_dim = D;
    a.scale = 1.0f / 8.0f; a.is_causal = true;
    std::vector<float> scratch(static_cast<size_t>(attend_group_floats(a)));
    attend_group(a, scratch.data());
    for (int64_t d = 0; d < D; ++d) CHECK_NEAR(half_to_float(out[static_cast<size_t>(d)]), 0.25f * (d % 7), 1e-3);
  }
  // Wider heads, long key ranges over several blocks and tiles, partial tiles.
  for (int64_t D : {16, 64, 128}) {
    Case w;
    w.G = 4; w.S = 1; w.P = 300; w.D = D; w.Dv = D; w.blocks = 3; w.mask = 2;
    run_case(w, 11 + static_cast<uint32_t>(D), 2e-5);
    w.S = 7; w.mask = 1; w.window = 100;
    run_case(w, 12 + static_cast<uint32_t>(D), 2e-5);
  }
  // Scores whose maxima keep rising over many tiles (up to ~|100|): the row path moves its
  // softmax reference lazily (only when a score exceeds it by more than e^8), so these cross
  // that threshold again and again, in fp32 and fp16, with and without a window and splits.
  for (DType t : {DType::kFloat32, DType::kFloat16})
    for (int64_t G : {1, 2, 4, 8}) {
      Case rise;
      rise.G = G; rise.S = 1; rise.P = 700; rise.D = 32; rise.Dv = 32; rise.blocks = 3;
      rise.k_ramp = 0.04f; rise.dtype = t;
      run_case(rise, 31 + static_cast<uint32_t>(G), t == DType::kFloat32 ? 2e-3 : 2e-2);
      rise.S = 3; rise.window = 250; rise.mask = 2;
      run_case(rise, 41 + static_cast<uint32_t>(G), t == DType::kFloat32 ? 2e-3 : 2e-2);
    }
  // bfloat16 with head_dim a multiple of 32 (avx512_bf16: VDPBF16PS scores) against the
  // double reference: row path (1..8 rows per KV head), masks, window, softcap, splits.
  for (int64_t D : {32, 64, 96, 128})
    for (int64_t G : {1, 2, 4, 8}) {
      Case b;
      b.G = G; b.S = 1; b.P = 200; b.D = D; b.Dv = D; b.blocks = 2; b.dtype = DType::kBFloat16;
      run_case(b, 61 + static_cast<uint32_t>(D + G), 1.6e-2);
      b.S = 3; b.mask = 2; b.window = 70; b.softcap = 3.0f;
      run_case(b, 71 + static_cast<uint32_t>(D + G), 1.6e-2);
      b.mask = 1; b.window = -1; b.softcap = 0.0f; b.k_ramp = 0.03f;
      run_case(b, 81 + static_cast<uint32_t>(D + G), 1.6e-2);
    }
  // ... and the lanes path (>= 16 rows per KV head, no mask tensor): MQA-like decode, prefill
  // rows with a window, softcap.
  for (int64_t D : {32, 64, 128})
    for (int64_t G : {16, 32}) {
      Case b;
      b.G = G; b.S = 1; b.P = 150; b.D = D; b.Dv = D; b.blocks = 2; b.dtype = DType::kBFloat16; b.k_ramp = 0.02f;
      run_case(b, 91 + static_cast<uint32_t>(D + G), 1.6e-2);
      b.S = 2; b.window = 60; b.softcap = 4.0f;
      run_case(b, 95 + static_cast<uint32_t>(D + G), 1.6e-2);
    }
  // One query row over pages (chunked reads of K then V per page) and over pages longer than a
  // chunk, partial last pages, pages that are not a multiple of the tile: the double reference.
  for (DType t : {DType::kFloat32, DType::kFloat16, DType::kBFloat16})
    for (int64_t page_rows : {17, 32, 128, 1024, 1100})
      for (int mask : {0, 1, 2}) {
        Case pg;
        pg.G = 1; pg.S = 1; pg.P = 2300; pg.D = 32; pg.Dv = 32; pg.page_rows = page_rows; pg.mask = mask;
        pg.dtype = t; pg.k_ramp = 0.001f;
        const double tol = t == DType::kFloat32 ? 2e-4 : t == DType::kFloat16 ? 2e-3 : 1.6e-2;
        run_case(pg, 101 + static_cast<uint32_t>(page_rows + mask), tol);
        pg.window = 700; pg.softcap = 3.0f;
        run_case(pg, 111 + static_cast<uint32_t>(page_rows + mask), tol);
      }
  pages_match_one_block();
  Case odd;  // head_dim not a multiple of the vector width: SIMD levels fall back to scalar
  odd.G = 2; odd.S = 2; odd.P = 5; odd.D = 12; odd.Dv = 12;
  run_case(odd, 21, 1e-5);
  for (int64_t G : {1, 4, 32})
    for (float ramp : {0.0f, 0.05f}) split_matches_single_pass(G, ramp);
  nan_propagates();
  large_values_stay_finite();
  inf_value_times_underflow();
  block_and_lane_paths();
  row_block_remainders();
  poisoned_tail_unread();
  nan_in_one_head();
  nan_with_softcap();
  unseen_nan_value_not_read();
  unseen_nan_value_not_read_one_row();
  inf_scores_are_nan();
  nonfinite_matches_scalar(DType::kFloat32);
  nonfinite_matches_scalar(DType::kBFloat16);
}

// ONNX_LIGHT_ISA values: a level the CPU lacks or an unknown name gives the best level and a
// warning naming the levels.
void isa_environment_values() {
  std::string w;
  CHECK(choose_isa(nullptr, Isa::kAvx2, &w) == Isa::kAvx2 && w.empty());
  CHECK(choose_isa("", Isa::kAvx2, &w) == Isa::kAvx2 && w.empty());
  CHECK(choose_isa("scalar", Isa::kAvx2, &w) == Isa::kScalar && w.empty());
  CHECK(choose_isa("avx512", Isa::kAvx2, &w) == Isa::kAvx2);
  CHECK(w.find("ONNX_LIGHT_ISA=avx512: this CPU does not support it") != std::string::npos &&
        w.find("using avx2") != std::string::npos);
  CHECK(choose_isa("bogus", Isa::kAvx512Bf16, &w) == Isa::kAvx512Bf16);
  CHECK(w.find("is not a level (scalar, avx2, avx512, avx512_bf16)") != std::string::npos);
  CHECK(choose_isa("avx512_bf16", Isa::kAvx512Bf16, &w) == Isa::kAvx512Bf16 && w.empty());
}

// TilePrefetch (simd_tiles.h): step() walks the K rows then the V rows, per_step bytes per call
// across the K -> V boundary, and has fetched everything after `steps` calls (here rows of 64-byte
// multiples: after c calls exactly min(c * per_step, kb + vb) bytes, K first).
void test_tile_prefetch() {
  static char pool[1 << 16];
  std::mt19937 rng(7);
  for (int it = 0; it < 2000; ++it) {
    const int64_t kb = 64 * static_cast<int64_t>(rng() % 40), vb = 64 * static_cast<int64_t>(rng() % 40);
    const int64_t steps = 1 + static_cast<int64_t>(rng() % 50);
    const char* k = pool + 64;
    const char* v = pool + 32768;
    kernels::simd::TilePrefetch pf;
    pf.reset(k, kb, v, vb, steps);
    auto fetched = [&]() -> int64_t {
      const uintptr_t p = pf.p, ku = reinterpret_cast<uintptr_t>(k), vu = reinterpret_cast<uintptr_t>(v);
      if (pf.pend == 0) return kb + vb;
      if (kb > 0 && p >= ku && p <= ku + static_cast<uintptr_t>(kb) && pf.pend == ku + static_cast<uintptr_t>(kb))
        return static_cast<int64_t>(p - ku);
      return kb + static_cast<int64_t>(p - vu);
    };
    for (int64_t c = 1; c <= steps + 3; ++c) {
      pf.step();
      const int64_t want = std::min(c * pf.per_step, kb + vb);
      if (fetched() != want) {
        std::fprintf(stderr, "TilePrefetch kb=%lld vb=%lld steps=%lld call %lld: fetched %lld, expected %lld\n",
                     static_cast<long long>(kb), static_cast<long long>(vb), static_cast<long long>(steps),
                     static_cast<long long>(c), static_cast<long long>(fetched()), static_cast<long long>(want));
        CHECK(false);
        break;
      }
    }
    CHECK(pf.pend == 0);  // all of K and V within the `steps` calls
  }
}

// TileCursor::next_block_bytes (simd_tiles.h): the bytes of the next block in range that the
// one-row code path prefetches while it computes the current one. Pages laid out as the cache
// lays them out (kvcache/quantize.h): int8 K [P, D], V pairs [P / 2, Dv, 2], K scales [D], V
// scales [P]; int4 K [P, D / 2], V pairs [P / 2, Dv], K scales, V scales, K minimums, V minimums.
void test_next_block_bytes() {
  constexpr int64_t P = 256, D = 128, Dv = 128;
  const int64_t i8_page = P * (D + Dv) + 4 * (D + P), i4_page = P * (D + Dv) / 2 + 8 * (D + P);
  std::vector<char> mem(static_cast<size_t>(4 * i8_page + 4096));
  char* base = mem.data();
  auto i8_block = [&](char* pg, int64_t first, int64_t page_row, int64_t rows) {
    KVBlock b{pg, pg + P * D, first, rows, KVEncoding::kInt8};
    b.key_scale = reinterpret_cast<const float*>(pg + P * (D + Dv));
    b.value_scale = b.key_scale + D;
    b.page_row = page_row;
    return b;
  };
  auto i4_block = [&](char* pg, int64_t first, int64_t page_row, int64_t rows) {
    KVBlock b{pg, pg + P * D / 2, first, rows, KVEncoding::kInt4};
    b.key_scale = reinterpret_cast<const float*>(pg + P * (D + Dv) / 2);
    b.value_scale = b.key_scale + D;
    b.key_min = b.value_scale + P;
    b.value_min = b.key_min + D;
    b.page_row = page_row;
    return b;
  };
  auto check = [&](const std::vector<KVBlock>& blocks, int64_t kmin, int64_t kmax, const char* k, int64_t kb,
                   const char* v, int64_t vb) {
    AttentionGroup a;
    a.blocks = blocks.data();
    a.num_blocks = static_cast<int64_t>(blocks.size());
    a.head_dim = D;
    a.v_head_dim = Dv;
    a.num_keys = kmax;
    kernels::simd::TileCursor tc{a, kmin, kmax, 16, 1};
    CHECK(tc.next());
    const char *gk, *gv;
    int64_t gkb, gvb;
    tc.next_block_bytes(&gk, &gkb, &gv, &gvb);
    if (gkb != kb || gvb != vb || (kb > 0 && gk != k) || (vb > 0 && gv != v)) {
      std::fprintf(stderr, "next_block_bytes: K %lld bytes at %+lld, V %lld at %+lld; expected %lld at %+lld, %lld at %+lld\n",
                   static_cast<long long>(gkb), static_cast<long long>(gk ? gk - base : -1), static_cast<long long>(gvb),
                   static_cast<long long>(gv ? gv - base : -1), static_cast<long long>(kb),
                   static_cast<long long>(k ? k - base : -1), static_cast<long long>(vb),
                   static_cast<long long>(v ? v - base : -1));
      CHECK(false);
    }
  };
  char* p0 = base;
  char* p1 = base + i8_page;
  // a full int8 page next: its K codes, then its V codes through its last V scale
  check({i8_block(p0, 0, 0, P), i8_block(p1, P, 0, P)}, 0, 2 * P, p1, P * D, p1 + P * D, P * Dv + 4 * (D + P));
  // the range ends 100 rows into it: those rows' K and V pairs (the scales lie past the unread V pairs)
  check({i8_block(p0, 0, 0, P), i8_block(p1, P, 0, P)}, 0, P + 100, p1, 100 * D, p1 + P * D, 50 * 2 * Dv);
  // a truncated page starting at page row 1: the pair holding it, K from row 1
  check({i8_block(p0, 0, 0, P), i8_block(p1, P, 1, P - 1)}, 0, 2 * P - 1, p1 + D, (P - 1) * D, p1 + P * D,
        P * Dv + 4 * (D + P));
  // int4: half the bytes per row, metadata through the last V minimum
  char* q1 = base + i4_page;
  check({i4_block(base, 0, 0, P), i4_block(q1, P, 0, P)}, 0, 2 * P, q1, P * D / 2, q1 + P * D / 2,
        P * Dv / 2 + 8 * (D + P));
  // a native block next (fp16: es = 2 is the cursor's, here 1: rows * D * es bytes each)
  KVBlock nat{p1, p1 + P * D, P, 64};
  check({i8_block(p0, 0, 0, P), nat}, 0, P + 64, p1, 64 * D, p1 + P * D, 64 * Dv);
  // scales in another allocation (a hand-made block): the V codes only
  KVBlock far = i8_block(p1, P, 0, P);
  std::vector<float> scales(static_cast<size_t>(D + P));
  far.key_scale = scales.data();
  far.value_scale = scales.data() + D;
  check({i8_block(p0, 0, 0, P), far}, 0, 2 * P, p1, P * D, p1 + P * D, P * Dv);
  // no next block, or one outside the range: nothing
  check({i8_block(p0, 0, 0, P)}, 0, P, nullptr, 0, nullptr, 0);
  check({i8_block(p0, 0, 0, P), i8_block(p1, P, 0, P)}, 0, P, nullptr, 0, nullptr, 0);
}

int main() {
  test_tile_prefetch();
  test_next_block_bytes();
  isa_environment_values();
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16}) {
    if (static_cast<int>(isa) > static_cast<int>(detected_isa())) {
      std::printf("ISA %s: not supported by this CPU, not run\n", isa_name(isa));
      continue;
    }
    set_isa(isa);
    const int before = failures();
    run_all();
    std::printf("ISA %s: %s\n", isa_name(isa), failures() == before ? "ok" : "FAILED");
  }
  TEST_MAIN_END();
}
