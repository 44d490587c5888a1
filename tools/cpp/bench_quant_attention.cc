// int8 cold pages vs native pages, the attention kernel alone (no ORT): one decode step (1 query
// row per query head; `group` query heads per kv head) over `heads` kv heads x enough layers for
// the native pages to exceed 256 MiB, the same K/V values stored as native pages (dtype) and as
// int8 pages (per-channel K scales, per-row V scales, the cache's layout: codes then scales),
// pages placed in decode order, measured interleaved round by round; and the read time of each
// layout's bytes (one sequential pass, stream_read) in the same rounds.
//
//   bench_quant_attention [dtype=f16|f32|bf16] [context=8192] [page_tokens=256] [heads=32]
//                         [group=1] [head_dim=128] [rounds=20] [qgroup=1] [layers]
//
// qgroup: int8 pages of that many consecutive blocks of one (layer, head) lie next to each
// other (one stream across them), as a cache that quantizes blocks in groups would place them.
//
// Prints the median and minimum ms per layer-step of each layout, int8 / native, and each
// layout against its own read time.
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench_util.h"
#include "kernels/attention.h"
#include "kernels/stream_read.h"

using namespace olep;
using namespace olep::kernels;

namespace {

using bench::huge_alloc;
using bench::kHuge;
using bench::median;

int8_t code(float x, float s) {
  if (s == 0.0f) return 0;
  return static_cast<int8_t>(std::max(-127.0f, std::min(127.0f, std::nearbyint(x / s))));
}

}  // namespace

int main(int argc, char** argv) {
  const bench::DecodeArgs args = bench::decode_args(argc, argv, 8192, 256, 20);
  const std::string& dt = args.dt;
  const int64_t T = args.T, P = args.P, heads = args.heads, G = args.G, D = args.D;
  const int rounds = args.rounds;
  const int64_t qgroup = argc > 8 ? std::atoll(argv[8]) : 1;
  const DType dtype = args.dtype;
  const size_t es = dtype_size(dtype);
  const size_t row = static_cast<size_t>(D) * es;
  const int64_t blocks = (T + P - 1) / P;
  const size_t npage = 2 * static_cast<size_t>(P) * row;
  const size_t qpage = (2 * static_cast<size_t>(P * D) + 4 * static_cast<size_t>(D + P) + 63) / 64 * 64;
  // layers: enough for the native pages to exceed 256 MiB, or argv[9] (1 with a small context and
  // few heads keeps everything in the caches: the compute time alone)
  const int64_t layers = argc > 9 ? std::atoll(argv[9])
                                  : std::max<int64_t>(1, (256ll << 20) / (static_cast<int64_t>(npage) * blocks * heads));
  const int64_t units = heads * layers;
  char* native = huge_alloc(static_cast<size_t>(units * blocks) * npage);
  char* quant = huge_alloc(static_cast<size_t>(units * ((blocks + qgroup - 1) / qgroup * qgroup)) * qpage);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  std::vector<float> k(static_cast<size_t>(P * D)), v(k.size()), ks(static_cast<size_t>(D)), vs(static_cast<size_t>(P));
  std::vector<std::vector<KVBlock>> nl(static_cast<size_t>(units)), ql(static_cast<size_t>(units));
  auto put = [&](char* dst, size_t i, float x) {
    if (dtype == DType::kFloat32) std::memcpy(dst + i * 4, &x, 4);
    else {
      const uint16_t b = dtype == DType::kFloat16 ? float_to_half(x) : float_to_bf16(x);
      std::memcpy(dst + i * 2, &b, 2);
    }
  };
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t u = 0; u < units; ++u) {
      const int64_t n = std::min(P, T - b * P);
      for (size_t i = 0; i < k.size(); ++i) {
        k[i] = nd(rng) * (i % static_cast<size_t>(D) == 3 ? 20.0f : 0.5f);
        v[i] = nd(rng) * 0.5f;
      }
      char* np = native + static_cast<size_t>(b * units + u) * npage;
      for (size_t i = 0; i < k.size(); ++i) {
        put(np, i, k[i]);
        put(np + npage / 2, i, v[i]);
      }
      // int8 pages of `qgroup` consecutive blocks of one (layer, head) adjacent in memory
      const int64_t slot = (b / qgroup * units + u) * qgroup + b % qgroup;
      char* qp = quant + static_cast<size_t>(slot) * qpage;
      int8_t* kq = reinterpret_cast<int8_t*>(qp);
      int8_t* vq = kq + P * D;
      float* kss = reinterpret_cast<float*>(qp + 2 * P * D);
      float* vss = kss + D;
      for (int64_t d = 0; d < D; ++d) {
        float m = 0;
        for (int64_t r = 0; r < P; ++r) m = std::max(m, std::fabs(k[static_cast<size_t>(r * D + d)]));
        kss[d] = m / 127.0f;
      }
      for (int64_t r = 0; r < P; ++r) {
        float m = 0;
        for (int64_t d = 0; d < D; ++d) m = std::max(m, std::fabs(v[static_cast<size_t>(r * D + d)]));
        vss[r] = m / 127.0f;
        for (int64_t d = 0; d < D; ++d) {
          kq[r * D + d] = code(k[static_cast<size_t>(r * D + d)], kss[d]);
          vq[int8_value_index(D, r, d)] = code(v[static_cast<size_t>(r * D + d)], vss[r]);
        }
      }
      nl[static_cast<size_t>(u)].push_back(KVBlock{np, np + npage / 2, b * P, n});
      KVBlock qb{kq, vq, b * P, n};
      qb.encoding = KVEncoding::kInt8;
      qb.key_scale = kss;
      qb.value_scale = vss;
      ql[static_cast<size_t>(u)].push_back(qb);
    }

  bench::DecodeStep dstep(args);
  const AttentionGroup& a = dstep.group;
  const int64_t sf = state_floats(a);
  std::vector<float> state(static_cast<size_t>(sf)), scratch(static_cast<size_t>(scratch_floats(a)) + 64);
  auto step = [&](const std::vector<std::vector<KVBlock>>& lists, int64_t l) {
    for (int64_t h = 0; h < heads; ++h) {
      AttentionGroup g = a;
      g.out = dstep.out_of(h, args);
      const auto& bl = lists[static_cast<size_t>(l * heads + h)];
      g.blocks = bl.data();
      g.num_blocks = static_cast<int64_t>(bl.size());
      AttentionState s;
      init_state(g, state.data(), &s);
      attend_range(g, 0, T, &s, scratch.data());
      finalize(g, s);
    }
  };
  struct Variant {
    const char* name;
    int kind;  // 0 native attention, 1 int8 attention, 2 read native bytes, 3 read int8 bytes
    std::vector<double> ms;
  };
  std::vector<Variant> vars = {{"native", 0, {}}, {"int8", 1, {}}, {"read native", 2, {}}, {"read int8", 3, {}}};
  const size_t nbytes_layer = static_cast<size_t>(heads * blocks) * npage;
  const size_t qbytes_layer = static_cast<size_t>(heads * blocks) * qpage;
  volatile uint64_t sink = 0;
  for (int r = 0; r < rounds; ++r)
    for (size_t i = 0; i < vars.size(); ++i) {
      Variant& var = vars[(i + static_cast<size_t>(r)) % vars.size()];
      const auto t0 = std::chrono::steady_clock::now();
      if (var.kind == 0 || var.kind == 1)
        for (int64_t l = 0; l < layers; ++l) step(var.kind == 0 ? nl : ql, l);
      else if (var.kind == 2)
        sink = sink + static_cast<uint64_t>(stream_read(native, nbytes_layer * static_cast<size_t>(layers)));
      else
        sink = sink + static_cast<uint64_t>(stream_read(quant, qbytes_layer * static_cast<size_t>(layers)));
      var.ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() /
                       static_cast<double>(layers));
    }
  std::printf("%s isa=%s T=%lld page_tokens=%lld heads=%lld group=%lld head_dim=%lld layers=%lld rounds=%d\n",
              dt.c_str(), isa_name(active_isa()), static_cast<long long>(T), static_cast<long long>(P),
              static_cast<long long>(heads), static_cast<long long>(G), static_cast<long long>(D),
              static_cast<long long>(layers), rounds);
  for (const Variant& var : vars)
    std::printf("  %-12s median %8.3f ms   min %8.3f ms\n", var.name, median(var.ms),
                *std::min_element(var.ms.begin(), var.ms.end()));
  std::printf("  int8 / native x%.3f (min x%.3f); native / its read x%.3f; int8 / its read x%.3f\n",
              median(vars[1].ms) / median(vars[0].ms),
              *std::min_element(vars[1].ms.begin(), vars[1].ms.end()) /
                  *std::min_element(vars[0].ms.begin(), vars[0].ms.end()),
              median(vars[0].ms) / median(vars[2].ms), median(vars[1].ms) / median(vars[3].ms));
  return 0;
}
