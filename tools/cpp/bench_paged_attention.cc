// Paged vs one-block attention, the kernel alone (no ORT): one decode step (1 query row per
// head, MHA; or a GQA group) over `heads` kv heads x enough layers to exceed the last-level
// cache, K/V laid out several ways, all measured interleaved round by round in one run:
//
//   one        one contiguous block per (layer, kv head): K [T, D] then V [T, D]
//   paged      pages of page_tokens positions, K rows then V rows, in the order a decode builds
//              them (page b of every (layer, head), then page b+1), read head by head
//   paged_row  the same pages read page row by page row: page b of every head of a layer, then
//              page b+1 (each head's online-softmax state carried across calls of attend_range)
//   paged_run  the pages of one (layer, head) one after another within 2 MiB slabs, the slabs in
//              shuffled order: the layout the arena gives a prefill (a step's pages head by head)
//   paged_split  paged_run's pages attended as the EP splits a long key range when a step has few
//              (sequence, kv head) items (ops/attention_core.cc): `splits` ranges of whole 16-key
//              multiples, each a kernel call with its own state, merged in order (only with
//              splits >= 2)
//   read       the read floor: the layer's K+V bytes read once, sequentially, with no arithmetic
//              (stream_read over the one-block copy, as the decode benchmark's `limit`)
//
//   bench_paged_attention [dtype=f16|f32|bf16] [context=4096] [page_tokens=128] [heads=32]
//                         [group=1] [head_dim=128] [rounds=30] [working_set_mib=256] [flush_mib=0]
//                         [splits=0]
//
// working_set_mib: layers enough for at least that many MiB of K/V (1 with a small context and
// few heads: one layer that stays in the caches, the compute time alone).
// flush_mib: that many MiB of another buffer read before every layer-step, outside the timing,
// as a real decode step's weight MatMuls read between two layers' attention (L2 cold: the code's
// scratch, q and the first K/V lines start from L3 or DRAM); 0: layers back to back.
//
// Prints the median and the minimum ms per layer-step of each layout, their ratios to one
// block (the minimum is the figure least disturbed by other load on a shared machine) and to
// the read floor (`/ read`: time / read time, median and minimum).
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
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

}  // namespace

int main(int argc, char** argv) {
  const bench::DecodeArgs args = bench::decode_args(argc, argv, 4096, 128, 30);
  const std::string& dt = args.dt;
  const int64_t T = args.T, P = args.P, heads = args.heads, G = args.G, D = args.D;
  const int rounds = args.rounds;
  const DType dtype = args.dtype;
  const size_t es = dtype_size(dtype);
  const size_t row = static_cast<size_t>(D) * es;
  const int64_t per_head = T * 2 * static_cast<int64_t>(row);
  const int64_t ws_mib = argc > 8 ? std::atoll(argv[8]) : 256;
  const size_t flush = argc > 9 ? static_cast<size_t>(std::atoll(argv[9])) << 20 : 0;
  const int64_t splits = argc > 10 ? std::atoll(argv[10]) : 0;
  const int64_t layers = std::max<int64_t>(1, ((ws_mib << 20) + per_head * heads - 1) / (per_head * heads));
  const int64_t units = heads * layers;  // unit u = layer * heads + head
  const int64_t blocks = (T + P - 1) / P;
  const size_t half = static_cast<size_t>(P) * row;
  const size_t page_bytes = 2 * half;
  const size_t unit_bytes = (static_cast<size_t>(per_head) + kHuge - 1) / kHuge * kHuge;
  char* contig = huge_alloc(static_cast<size_t>(units) * unit_bytes);
  char* paged = huge_alloc(static_cast<size_t>(units * blocks) * page_bytes);
  // paged_run: the pages of one (layer, head) consecutive within 2 MiB slabs, the slabs in a
  // shuffled order (as a prefill's pages come from the pool: one run per head, slab by slab).
  const size_t slab_bytes = (page_bytes + kHuge - 1) / kHuge * kHuge;
  const int64_t per_slab = std::max<int64_t>(1, static_cast<int64_t>(slab_bytes / page_bytes));
  const int64_t slabs_per_unit = (blocks + per_slab - 1) / per_slab;
  char* runs = huge_alloc(static_cast<size_t>(units * slabs_per_unit) * slab_bytes);
  std::vector<int64_t> slab_order(static_cast<size_t>(units * slabs_per_unit));
  for (size_t i = 0; i < slab_order.size(); ++i) slab_order[i] = static_cast<int64_t>(i);
  std::shuffle(slab_order.begin(), slab_order.end(), std::mt19937(7));
  auto run_page = [&](int64_t u, int64_t b) {
    const int64_t s = slab_order[static_cast<size_t>(u * slabs_per_unit + b / per_slab)];
    return runs + static_cast<size_t>(s) * slab_bytes + static_cast<size_t>(b % per_slab) * page_bytes;
  };
  auto cbase = [&](int64_t u) { return contig + static_cast<size_t>(u) * unit_bytes; };
  auto page = [&](char* base, int64_t u, int64_t b) { return base + static_cast<size_t>(b * units + u) * page_bytes; };

  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  for (int64_t u = 0; u < units; ++u) {
    std::vector<float> x(static_cast<size_t>(per_head) / es);
    for (float& f : x) f = nd(rng) * 0.5f;
    from_float(dtype, x.data(), cbase(u), static_cast<int64_t>(x.size()));
  }
  std::vector<std::vector<KVBlock>> one(static_cast<size_t>(units)), pg(static_cast<size_t>(units)),
      pr(static_cast<size_t>(units));
  for (int64_t u = 0; u < units; ++u) {
    char* k = cbase(u);
    char* v = k + static_cast<size_t>(T) * row;
    one[static_cast<size_t>(u)].push_back(KVBlock{k, v, 0, T});
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t n = std::min(P, T - b * P);
      char* p = page(paged, u, b);
      std::memcpy(p, k + static_cast<size_t>(b * P) * row, static_cast<size_t>(n) * row);
      std::memcpy(p + half, v + static_cast<size_t>(b * P) * row, static_cast<size_t>(n) * row);
      pg[static_cast<size_t>(u)].push_back(KVBlock{p, p + half, b * P, n});
      char* q = run_page(u, b);
      std::memcpy(q, p, page_bytes);
      pr[static_cast<size_t>(u)].push_back(KVBlock{q, q + half, b * P, n});
    }
  }

  bench::DecodeStep dstep(args);
  const AttentionGroup& a = dstep.group;
  std::vector<AttentionGroup> ga(static_cast<size_t>(heads), a);
  for (int64_t h = 0; h < heads; ++h) ga[static_cast<size_t>(h)].out = dstep.out_of(h, args);
  std::vector<AttentionState> st(static_cast<size_t>(heads));
  const int64_t sf = state_floats(a);
  std::vector<float> states(static_cast<size_t>(sf * heads)), scratch(static_cast<size_t>(scratch_floats(a)) + 64);

  // paged_split: one state per split range (the EP's split_range: whole 16-key multiples)
  std::vector<float> split_states(static_cast<size_t>(sf * std::max<int64_t>(splits, 1)));
  std::vector<AttentionState> ss(static_cast<size_t>(std::max<int64_t>(splits, 1)));
  const int64_t split_chunk = splits >= 2 ? ((T + splits - 1) / splits + 15) / 16 * 16 : T;
  auto split_head = [&](AttentionGroup& g) {
    for (int64_t sp = 0; sp < splits; ++sp) {
      init_state(g, split_states.data() + sp * sf, &ss[static_cast<size_t>(sp)]);
      const int64_t k0 = std::min(T, sp * split_chunk), k1 = std::min(T, (sp + 1) * split_chunk);
      if (k0 < k1) attend_range(g, k0, k1, &ss[static_cast<size_t>(sp)], scratch.data());
    }
    for (int64_t sp = 1; sp < splits; ++sp) merge_states(g, &ss[0], ss[static_cast<size_t>(sp)]);
    finalize(g, ss[0]);
  };

  // One layer-step over layer l's heads, head by head or page row by page row.
  auto step = [&](const std::vector<std::vector<KVBlock>>& lists, int64_t l, bool by_row, bool split = false) {
    for (int64_t h = 0; h < heads; ++h) {
      AttentionGroup& g = ga[static_cast<size_t>(h)];
      const auto& bl = lists[static_cast<size_t>(l * heads + h)];
      g.blocks = bl.data();
      g.num_blocks = static_cast<int64_t>(bl.size());
      if (split) {
        split_head(g);
        continue;
      }
      init_state(g, states.data() + h * sf, &st[static_cast<size_t>(h)]);
      if (!by_row) {
        attend_range(g, 0, T, &st[static_cast<size_t>(h)], scratch.data());
        finalize(g, st[static_cast<size_t>(h)]);
      }
    }
    if (!by_row) return;
    for (int64_t b = 0; b < blocks; ++b)
      for (int64_t h = 0; h < heads; ++h)
        attend_range(ga[static_cast<size_t>(h)], b * P, std::min(T, (b + 1) * P), &st[static_cast<size_t>(h)],
                     scratch.data());
    for (int64_t h = 0; h < heads; ++h) finalize(ga[static_cast<size_t>(h)], st[static_cast<size_t>(h)]);
  };
  struct Variant {
    const char* name;
    const std::vector<std::vector<KVBlock>>* lists;  // null: the read floor
    bool by_row;
    std::vector<double> ms;
    bool split = false;
  };
  std::vector<Variant> vs = {{"one", &one, false, {}},
                             {"paged", &pg, false, {}},
                             {"paged_row", &pg, true, {}},
                             {"paged_run", &pr, false, {}}};
  if (splits >= 2) vs.push_back({"paged_split", &pr, false, {}, true});
  vs.push_back({"read", nullptr, false, {}});
  volatile uint64_t sink = 0;
  char* flush_buf = flush > 0 ? huge_alloc(flush) : nullptr;
  for (int r = 0; r < rounds; ++r)
    for (size_t i = 0; i < vs.size(); ++i) {
      Variant& v = vs[(i + static_cast<size_t>(r)) % vs.size()];
      double ms = 0.0;
      if (flush > 0) {  // layer by layer, each after a flush read (not timed)
        for (int64_t l = 0; l < layers; ++l) {
          sink = sink + stream_read(flush_buf, flush);
          const auto t0 = std::chrono::steady_clock::now();
          if (v.lists) step(*v.lists, l, v.by_row, v.split);
          else
            for (int64_t h = 0; h < heads; ++h)
              sink = sink + stream_read(cbase(l * heads + h), static_cast<size_t>(per_head));
          ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        }
      } else {
        const auto t0 = std::chrono::steady_clock::now();
        if (v.lists) {
          for (int64_t l = 0; l < layers; ++l) step(*v.lists, l, v.by_row, v.split);
        } else {
          for (int64_t u = 0; u < units; ++u) sink = sink + stream_read(cbase(u), static_cast<size_t>(per_head));
        }
        ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      }
      v.ms.push_back(ms / static_cast<double>(layers));
    }
  std::printf("%s isa=%s T=%lld page_tokens=%lld heads=%lld group=%lld head_dim=%lld layers=%lld rounds=%d\n",
              dt.c_str(), isa_name(active_isa()), static_cast<long long>(T), static_cast<long long>(P),
              static_cast<long long>(heads), static_cast<long long>(G), static_cast<long long>(D),
              static_cast<long long>(layers), rounds);
  const double base = median(vs[0].ms);
  const double base_min = *std::min_element(vs[0].ms.begin(), vs[0].ms.end());
  const double rd = median(vs.back().ms);
  const double rd_min = *std::min_element(vs.back().ms.begin(), vs.back().ms.end());
  for (const Variant& v : vs) {
    const double mn = *std::min_element(v.ms.begin(), v.ms.end());
    std::printf("  %-11s median %9.4f ms x%.3f   min %9.4f ms x%.3f   / read x%.3f (min x%.3f)\n", v.name,
                median(v.ms), median(v.ms) / base, mn, mn / base_min, median(v.ms) / rd, mn / rd_min);
  }
  return 0;
}
