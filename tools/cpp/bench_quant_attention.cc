// Quantized cold pages (int8, int4) vs native pages, the attention kernel alone (no ORT): one
// decode step (1 query row per query head; `group` query heads per kv head) over `heads` kv heads
// x enough layers for the native pages to exceed 256 MiB, the same K/V values stored as native
// pages (dtype) and as the cache's int8 and int4 pages (quant::quantize_page: the cache's own
// codec and layouts), pages placed in decode order, measured interleaved round by round; and the
// read time of each layout's bytes (one sequential pass, stream_read) in the same rounds.
//
//   bench_quant_attention [dtype=f16|f32|bf16] [context=8192] [page_tokens=256] [heads=32]
//                         [group=1] [head_dim=128] [rounds=20] [qgroup=1] [layers]
//
// qgroup: the pages (native and quantized) of that many consecutive blocks of one (layer, head)
// lie next to each other (one stream across them), as the cache places a prefill's pages and a
// commit's quantized pages (head by head, docs/API.md); 1: every page of a block's heads apart
// (the order a decode builds them, one page per head every page_tokens steps).
//
// Prints the median and minimum ms per layer-step of each layout (int4 when head_dim is a
// multiple of 32), each quantized layout / native, and each layout against its own read time.
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
#include "kvcache/quantize.h"

using namespace olep;
using namespace olep::kernels;

namespace {

using bench::huge_alloc;
using bench::kHuge;
using bench::median;

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
  // the cache's geometry for the codec (one layer, one head: only the page layout matters)
  CacheGeometry g;
  g.num_layers = g.batch_size = g.kv_num_heads = 1;
  g.head_dim = g.v_head_dim = D;
  g.max_sequence_length = T;
  g.dtype = dtype;
  g.page_tokens = P;
  const bool with_int4 = D % 32 == 0;
  std::vector<KVQuant> modes = {KVQuant::kInt8};
  if (with_int4) modes.push_back(KVQuant::kInt4);
  std::vector<size_t> qpage;
  for (KVQuant m : modes) {
    g.kv_quant = m;
    qpage.push_back(static_cast<size_t>(g.quant_page_bytes()));
  }
  // layers: enough for the native pages to exceed 256 MiB, or argv[9] (1 with a small context and
  // few heads keeps everything in the caches: the compute time alone)
  const int64_t layers = argc > 9 ? std::atoll(argv[9])
                                  : std::max<int64_t>(1, (256ll << 20) / (static_cast<int64_t>(npage) * blocks * heads));
  const int64_t units = heads * layers;
  const int64_t qslots = units * ((blocks + qgroup - 1) / qgroup * qgroup);
  char* native = huge_alloc(static_cast<size_t>(qslots) * npage);
  std::vector<char*> quant;
  for (size_t m = 0; m < modes.size(); ++m) quant.push_back(huge_alloc(static_cast<size_t>(qslots) * qpage[m]));
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  std::vector<float> k(static_cast<size_t>(P * D)), v(k.size());
  std::vector<std::vector<KVBlock>> nl(static_cast<size_t>(units));
  std::vector<std::vector<std::vector<KVBlock>>> ql(modes.size(), std::vector<std::vector<KVBlock>>(static_cast<size_t>(units)));
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t u = 0; u < units; ++u) {
      const int64_t n = std::min(P, T - b * P);
      for (size_t i = 0; i < k.size(); ++i) {
        k[i] = nd(rng) * (i % static_cast<size_t>(D) == 3 ? 20.0f : 0.5f);
        v[i] = nd(rng) * 0.5f;
      }
      // pages of `qgroup` consecutive blocks of one (layer, head) adjacent in memory
      const int64_t slot = (b / qgroup * units + u) * qgroup + b % qgroup;
      char* np = native + static_cast<size_t>(slot) * npage;
      from_float(dtype, k.data(), np, P * D);
      from_float(dtype, v.data(), np + npage / 2, P * D);
      nl[static_cast<size_t>(u)].push_back(KVBlock{np, np + npage / 2, b * P, n});
      for (size_t m = 0; m < modes.size(); ++m) {
        g.kv_quant = modes[m];
        char* qp = quant[m] + static_cast<size_t>(slot) * qpage[m];
        if (!quant::quantize_page(g, np, qp)) {
          std::fprintf(stderr, "bench_quant_attention: a page did not quantize\n");
          return 1;
        }
        ql[m][static_cast<size_t>(u)].push_back(quant::quant_block(g, qp, b * P, 0, n));
      }
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
    std::string name;
    int kind;  // 0 attention, 1 read
    int layout;  // 0 native, 1 + m: quantized mode m
    std::vector<double> ms;
  };
  std::vector<Variant> vars = {{"native", 0, 0, {}}, {"read native", 1, 0, {}}};
  for (size_t m = 0; m < modes.size(); ++m) {
    vars.push_back({kv_quant_name(modes[m]), 0, static_cast<int>(m) + 1, {}});
    vars.push_back({std::string("read ") + kv_quant_name(modes[m]), 1, static_cast<int>(m) + 1, {}});
  }
  const size_t nbytes_layer = static_cast<size_t>(heads * blocks) * npage;
  volatile uint64_t sink = 0;
  for (int r = 0; r < rounds; ++r)
    for (size_t i = 0; i < vars.size(); ++i) {
      Variant& var = vars[(i + static_cast<size_t>(r)) % vars.size()];
      const auto t0 = std::chrono::steady_clock::now();
      if (var.kind == 0) {
        for (int64_t l = 0; l < layers; ++l) step(var.layout == 0 ? nl : ql[static_cast<size_t>(var.layout - 1)], l);
      } else if (var.layout == 0) {
        sink = sink + static_cast<uint64_t>(stream_read(native, nbytes_layer * static_cast<size_t>(layers)));
      } else {
        const size_t m = static_cast<size_t>(var.layout - 1);
        sink = sink + static_cast<uint64_t>(stream_read(quant[m], static_cast<size_t>(heads * blocks) * qpage[m] *
                                                                      static_cast<size_t>(layers)));
      }
      var.ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() /
                       static_cast<double>(layers));
    }
  std::printf("%s isa=%s T=%lld page_tokens=%lld heads=%lld group=%lld head_dim=%lld layers=%lld rounds=%d\n",
              dt.c_str(), isa_name(active_isa()), static_cast<long long>(T), static_cast<long long>(P),
              static_cast<long long>(heads), static_cast<long long>(G), static_cast<long long>(D),
              static_cast<long long>(layers), rounds);
  for (const Variant& var : vars)
    std::printf("  %-12s median %8.4f ms   min %8.4f ms\n", var.name.c_str(), median(var.ms),
                *std::min_element(var.ms.begin(), var.ms.end()));
  auto mn = [](const std::vector<double>& x) { return *std::min_element(x.begin(), x.end()); };
  std::printf("  native / its read x%.3f\n", median(vars[0].ms) / median(vars[1].ms));
  for (size_t m = 0; m < modes.size(); ++m) {
    const Variant& q = vars[2 + 2 * m];
    const Variant& qr = vars[3 + 2 * m];
    std::printf("  %s / native x%.3f (min x%.3f); %s / its read x%.3f\n", q.name.c_str(), median(q.ms) / median(vars[0].ms),
                mn(q.ms) / mn(vars[0].ms), q.name.c_str(), median(q.ms) / median(qr.ms));
  }
  return 0;
}
