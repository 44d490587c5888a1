// Helpers shared by the C++ benchmark drivers (not tests): 2 MiB-aligned memory with huge pages
// requested, and the median of samples.
#pragma once

#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

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

}  // namespace bench
