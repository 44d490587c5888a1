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

}  // namespace bench
