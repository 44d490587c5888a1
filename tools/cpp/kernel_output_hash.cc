// A fingerprint of the attention kernel's outputs over random cases, at the active ISA level
// (ONNX_LIGHT_ISA forces one): for refactors meant to keep the arithmetic, build before and
// after and compare the printed hashes level by level; equal hashes mean every output bit of
// every case is unchanged. Not a test of correctness (tests/cpp and tests/differential compare
// against references); a test of sameness.
//
// Cases (seeded, so two builds see the same inputs): dtype float32 / float16 / bfloat16,
// 1-40 query heads per kv head x 1-3 query rows, or 16 / 64 rows (prefill blocks, <= 64 rows),
// head_dim 64 or 128, 1-600 keys on pages of 32 or 64 positions, native, int8 or int4 pages
// (the cache's own codec, quant::quantize_page), causal or not, sometimes a window, softcap,
// right-padded rows, an additive mask (row path) and a key range split in two calls with one
// state (as the EP's split-KV). Both kernel paths are reached: the row path (few rows, masks)
// and the lanes path (many rows, no mask).
//
//   kernel_output_hash [cases=2000] [seed=7]
//
// Prints the ISA level, the number of cases and the 64-bit FNV-1a hash of every output byte.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "common/dtype.h"
#include "kernels/attention.h"
#include "kvcache/geometry.h"
#include "kvcache/quantize.h"

using namespace olep;
using namespace olep::kernels;

int main(int argc, char** argv) {
  const int cases = argc > 1 ? std::atoi(argv[1]) : 2000;
  const unsigned seed = argc > 2 ? static_cast<unsigned>(std::atoi(argv[2])) : 7u;
  if (cases < 1) {
    std::fprintf(stderr, "kernel_output_hash: cases must be >= 1\n");
    return 2;
  }
  uint64_t hash = 1469598103934665603ull;
  auto mix = [&](const void* p, size_t n) {
    const unsigned char* b = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) {
      hash ^= b[i];
      hash *= 1099511628211ull;
    }
  };
  std::mt19937 rng(seed);
  auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  std::normal_distribution<float> nd;
  for (int c = 0; c < cases; ++c) {
    const DType dt = uni(0, 2) == 0 ? DType::kFloat32 : uni(0, 1) ? DType::kFloat16 : DType::kBFloat16;
    const int64_t S = uni(0, 7) == 0 ? (uni(0, 1) ? 16 : 64) : uni(1, 3);
    // at most 64 rows per call for the prefill blocks, as the EP blocks them (ops/attention_core.cc)
    const int64_t G = S > 3 ? uni(1, static_cast<int>(64 / S)) : uni(0, 3) == 0 ? uni(9, 40) : uni(1, 8);
    const int64_t D = uni(0, 1) ? 128 : 64, P = uni(0, 1) ? 32 : 64;
    const int64_t T = std::max<int64_t>(S, uni(1, 600));
    const int enc = uni(0, 2);  // native, int8, int4
    const size_t es = dtype_size(dt);
    CacheGeometry g;
    g.head_dim = g.v_head_dim = D;
    g.max_sequence_length = T + P;
    g.dtype = dt;
    g.page_tokens = P;
    g.kv_quant = enc == 1 ? KVQuant::kInt8 : enc == 2 ? KVQuant::kInt4 : KVQuant::kNone;
    const int64_t nb = (T + P - 1) / P;
    const size_t npage = static_cast<size_t>(2 * P * D) * es;
    std::vector<std::vector<char>> pages;
    std::vector<KVBlock> blocks;
    std::vector<float> k(static_cast<size_t>(P * D)), v(k.size());
    const float kscale = uni(0, 3) == 0 ? 8.0f : 1.0f;  // large scores sometimes
    for (int64_t b = 0; b < nb; ++b) {
      for (auto& x : k) x = nd(rng) * kscale;
      for (auto& x : v) x = nd(rng);
      std::vector<char> np(npage);
      from_float(dt, k.data(), np.data(), P * D);
      from_float(dt, v.data(), np.data() + npage / 2, P * D);
      const int64_t n = std::min(P, T - b * P);
      if (enc == 0) {
        pages.push_back(std::move(np));
        blocks.push_back(KVBlock{pages.back().data(), pages.back().data() + npage / 2, b * P, n});
      } else {
        std::vector<char> qp(static_cast<size_t>(g.quant_page_bytes()));
        if (!quant::quantize_page(g, np.data(), qp.data())) {
          std::fprintf(stderr, "kernel_output_hash: a page did not quantize\n");
          return 1;
        }
        pages.push_back(std::move(qp));
        blocks.push_back(quant::quant_block(g, pages.back().data(), b * P, 0, n));
      }
    }
    std::vector<float> qf(static_cast<size_t>(G * S * D));
    for (auto& x : qf) x = nd(rng);
    std::vector<char> q(qf.size() * es), out(qf.size() * es);
    from_float(dt, qf.data(), q.data(), static_cast<int64_t>(qf.size()));
    AttentionGroup a;
    a.dtype = dt;
    a.q = q.data();
    a.q_head_stride = S * D;
    a.q_row_stride = D;
    a.out = out.data();
    a.out_head_stride = S * D;
    a.out_row_stride = D;
    a.group_size = G;
    a.num_rows = S;
    a.num_valid_rows = uni(0, 4) == 0 ? uni(0, static_cast<int>(S)) : S;
    a.q_offset = T - S;
    a.num_keys = T;
    a.blocks = blocks.data();
    a.num_blocks = nb;
    a.head_dim = D;
    a.v_head_dim = D;
    a.scale = uni(0, 1) ? 1.0f / std::sqrt(static_cast<float>(D)) : 0.3f;
    a.softcap = uni(0, 5) == 0 ? 30.0f : 0.0f;
    a.is_causal = uni(0, 1) != 0;
    a.local_window_size = uni(0, 4) == 0 ? uni(1, 300) : -1;
    std::vector<float> mask;
    if (G * S <= 64 && uni(0, 4) == 0) {
      mask.resize(static_cast<size_t>(G * S * T));
      for (auto& x : mask) x = uni(0, 9) == 0 ? -INFINITY : nd(rng);
      a.mask.kind = MaskKind::kAdditive;
      a.mask.dtype = DType::kFloat32;
      a.mask.data = mask.data();
      a.mask.head_stride = S * T;
      a.mask.row_stride = T;
      a.mask.key_stride = 1;
    }
    std::vector<float> state(static_cast<size_t>(state_floats(a))), scratch(static_cast<size_t>(scratch_floats(a)) + 64);
    AttentionState st;
    init_state(a, state.data(), &st);
    const int64_t split = uni(0, 2) == 0 ? (T / 2) / 16 * 16 : T;  // split ranges start on 16-key multiples
    attend_range(a, 0, split, &st, scratch.data());
    if (split < T) attend_range(a, split, T, &st, scratch.data());
    finalize(a, st);
    mix(out.data(), out.size());
  }
  std::printf("isa=%s cases=%d seed=%u hash=%016llx\n", isa_name(active_isa()), cases, seed,
              static_cast<unsigned long long>(hash));
  return 0;
}
