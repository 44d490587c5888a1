// Helpers shared by the C++ benchmark drivers (not tests): 2 MiB-aligned memory with huge pages
// requested, and the median of samples.
#pragma once

#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "kernels/attention.h"

namespace bench {

constexpr size_t kHuge = size_t{2} << 20;

/// `bytes` rounded up to 2 MiB, 2 MiB-aligned, MADV_HUGEPAGE, zero-filled (faulted in). Never freed.
inline char* huge_alloc(size_t bytes) {
  bytes = (bytes + kHuge - 1) / kHuge * kHuge;
  void* p = mmap(nullptr, bytes + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    std::perror("mmap");
    std::exit(1);
  }
  char* b = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(p) + kHuge - 1) / kHuge * kHuge);
  madvise(b, bytes, MADV_HUGEPAGE);
  std::memset(b, 0, bytes);
  return b;
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// The decode-step drivers' common arguments: [dtype=f16|f32|bf16] [context] [page_tokens]
/// [heads] [group] [head_dim] [rounds], defaults given per driver.
struct DecodeArgs {
  std::string dt;
  int64_t T, P, heads, G, D;
  int rounds;
  olep::DType dtype;
};

inline DecodeArgs decode_args(int argc, char** argv, int64_t T, int64_t P, int rounds) {
  DecodeArgs a;
  a.dt = argc > 1 ? argv[1] : "f16";
  a.T = argc > 2 ? std::atoll(argv[2]) : T;
  a.P = argc > 3 ? std::atoll(argv[3]) : P;
  a.heads = argc > 4 ? std::atoll(argv[4]) : 32;
  a.G = argc > 5 ? std::atoll(argv[5]) : 1;
  a.D = argc > 6 ? std::atoll(argv[6]) : 128;
  a.rounds = argc > 7 ? std::atoi(argv[7]) : rounds;
  a.dtype = a.dt == "f32" ? olep::DType::kFloat32 : a.dt == "bf16" ? olep::DType::kBFloat16 : olep::DType::kFloat16;
  return a;
}

/// One decode step's query (0.1 everywhere, in the storage type) and output buffers for `heads`
/// kv heads of `G` query heads each, and the AttentionGroup every head shares (blocks and out
/// are set per head): one query row at position T - 1 over keys [0, T), causal.
struct DecodeStep {
  std::vector<float> q, out;
  std::vector<uint16_t> q16, out16;
  olep::kernels::AttentionGroup group;

  DecodeStep(const DecodeArgs& a) : q(static_cast<size_t>(a.G * a.D), 0.1f), out(static_cast<size_t>(a.heads * a.G * a.D)) {
    const bool f16 = a.dtype == olep::DType::kFloat16;
    q16.assign(q.size(), f16 ? olep::float_to_half(0.1f) : olep::float_to_bf16(0.1f));
    out16.resize(out.size());
    olep::kernels::AttentionGroup& g = group;
    g.dtype = a.dtype;
    g.q = a.dtype == olep::DType::kFloat32 ? static_cast<const void*>(q.data()) : static_cast<const void*>(q16.data());
    g.q_head_stride = g.out_head_stride = a.D;
    g.q_row_stride = g.out_row_stride = a.G * a.D;
    g.group_size = a.G;
    g.num_rows = g.num_valid_rows = 1;
    g.q_offset = a.T - 1;
    g.num_keys = a.T;
    g.head_dim = g.v_head_dim = a.D;
    g.scale = 0.088f;
    g.is_causal = true;
  }
  /// Where head h writes its output.
  void* out_of(int64_t h, const DecodeArgs& a) {
    const size_t off = static_cast<size_t>(h * a.G * a.D);
    return a.dtype == olep::DType::kFloat32 ? static_cast<void*>(out.data() + off) : static_cast<void*>(out16.data() + off);
  }
};

}  // namespace bench
