// The attention kernel on a compute-bound group (the lanes path: MQA, big GQA groups, prefill
// blocks), no ORT: one kv head's group of `group` query heads x `rows` query rows (the last rows
// of `context` keys, causal) over K/V in pages of `page_tokens` positions, two placements
// measured interleaved round by round in one run:
//
//   dram  enough (layer) units for >= 256 MiB of K/V, pages in decode order (page b of every
//         unit, then page b + 1), one unit per call: the K/V stream comes from memory
//   hot   one unit, called again and again: K/V from the caches (the arithmetic alone)
//
//   bench_lanes_attention [dtype=f32|f16|bf16] [context=4096] [group=32] [rows=1] [head_dim=128]
//                         [rounds=30] [page_tokens=256]
//
// Times are the thread's CPU time (CLOCK_THREAD_CPUTIME_ID, as bench_fma_peak measures the peak):
// on a shared machine wall time counts the slices other processes ran in.
// Prints per placement the median and minimum ms per call, and the call's multiply-adds
// (group x the visible keys of every row x (head_dim for q . k + head_dim for P . V)), so that
// a driver (tools/bench_lanes_kernel.py) can divide by the measured FMA peak and bandwidth.
#include <algorithm>
#include <cmath>
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench_util.h"
#include "kernels/attention.h"

using namespace olep;
using namespace olep::kernels;

namespace {
double cpu_ms() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) * 1e3 + static_cast<double>(t.tv_nsec) * 1e-6;
}
}  // namespace

int main(int argc, char** argv) {
  const std::string dt = argc > 1 ? argv[1] : "f32";
  const int64_t T = argc > 2 ? std::atoll(argv[2]) : 4096;
  const int64_t G = argc > 3 ? std::atoll(argv[3]) : 32;
  const int64_t S = argc > 4 ? std::atoll(argv[4]) : 1;
  const int64_t D = argc > 5 ? std::atoll(argv[5]) : 128;
  const int rounds = argc > 6 ? std::atoi(argv[6]) : 30;
  const int64_t P = argc > 7 ? std::atoll(argv[7]) : 256;
  const DType dtype = dt == "f32" ? DType::kFloat32 : dt == "bf16" ? DType::kBFloat16 : DType::kFloat16;
  if (S > T || S < 1 || G < 1 || D < 1 || P < 1) {
    std::fprintf(stderr, "bench_lanes_attention: need 1 <= rows <= context, group, head_dim, page_tokens >= 1\n");
    return 2;
  }
  const size_t es = dtype_size(dtype);
  const size_t row = static_cast<size_t>(D) * es;
  const int64_t per_unit = T * 2 * static_cast<int64_t>(row);
  const int64_t units = std::max<int64_t>(2, (256ll << 20) / per_unit);
  const int64_t blocks = (T + P - 1) / P;
  const size_t half = static_cast<size_t>(P) * row, page_bytes = 2 * half;
  char* pages = bench::huge_alloc(static_cast<size_t>(units * blocks) * page_bytes);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  std::vector<float> x(static_cast<size_t>(P * D));
  std::vector<std::vector<KVBlock>> lists(static_cast<size_t>(units));
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t u = 0; u < units; ++u) {
      const int64_t n = std::min(P, T - b * P);
      char* p = pages + static_cast<size_t>(b * units + u) * page_bytes;
      for (int kv = 0; kv < 2; ++kv) {
        for (float& f : x) f = nd(rng) * 0.5f;
        from_float(dtype, x.data(), p + kv * half, n * D);
      }
      lists[static_cast<size_t>(u)].push_back(KVBlock{p, p + half, b * P, n});
    }

  // Query: G heads x S rows, [G, S, D]; output likewise.
  std::vector<float> qf(static_cast<size_t>(G * S * D));
  for (float& f : qf) f = nd(rng) * 0.3f;
  std::vector<char> q(qf.size() * es), out(qf.size() * es);
  from_float(dtype, qf.data(), q.data(), static_cast<int64_t>(qf.size()));
  AttentionGroup a;
  a.dtype = dtype;
  a.q = q.data();
  a.q_head_stride = a.out_head_stride = S * D;
  a.q_row_stride = a.out_row_stride = D;
  a.out = out.data();
  a.group_size = G;
  a.num_rows = a.num_valid_rows = S;
  a.q_offset = T - S;
  a.num_keys = T;
  a.head_dim = a.v_head_dim = D;
  a.scale = 1.0f / std::sqrt(static_cast<float>(D));
  a.is_causal = true;
  std::vector<float> buf(static_cast<size_t>(attend_group_floats(a)) + 64);
  double macs = 0;
  for (int64_t i = 0; i < S; ++i) macs += static_cast<double>(G) * static_cast<double>(T - S + i + 1) * 2.0 * D;

  struct Variant {
    const char* name;
    bool hot;
    std::vector<double> ms;
  };
  std::vector<Variant> vs = {{"dram", false, {}}, {"hot", true, {}}};
  // Calls per timed sample: at least ~20 ms of work.
  const int64_t calls = std::max<int64_t>(units, static_cast<int64_t>(2e7 / macs) + 1);
  int64_t next = 0;
  for (int r = 0; r < rounds; ++r)
    for (size_t i = 0; i < vs.size(); ++i) {
      Variant& v = vs[(i + static_cast<size_t>(r)) % vs.size()];
      const double t0 = cpu_ms();
      for (int64_t c = 0; c < calls; ++c) {
        const auto& bl = lists[static_cast<size_t>(v.hot ? 0 : (next++ % units))];
        a.blocks = bl.data();
        a.num_blocks = static_cast<int64_t>(bl.size());
        attend_group(a, buf.data());
      }
      v.ms.push_back((cpu_ms() - t0) / static_cast<double>(calls));
    }
  std::printf("%s isa=%s context=%lld group=%lld rows=%lld head_dim=%lld page_tokens=%lld units=%lld rounds=%d "
              "macs=%.0f bytes=%lld\n",
              dt.c_str(), isa_name(active_isa()), static_cast<long long>(T), static_cast<long long>(G),
              static_cast<long long>(S), static_cast<long long>(D), static_cast<long long>(P),
              static_cast<long long>(units), rounds, macs, static_cast<long long>(per_unit));
  for (const Variant& v : vs)
    std::printf("  %-5s median %9.4f ms   min %9.4f ms\n", v.name, bench::median(v.ms),
                *std::min_element(v.ms.begin(), v.ms.end()));
  return 0;
}
