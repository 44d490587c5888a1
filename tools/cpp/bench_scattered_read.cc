// The physical floor of paged reads: DRAM read bandwidth of one core for the access patterns of
// decode attention, no arithmetic (one 8-byte load per 64-byte line), 512 MiB of 2 MiB-aligned
// memory with huge pages requested, patterns interleaved round by round:
//
//   sequential   one stream over everything
//   one_block    units of `unit` bytes, each read as two streams advancing 4 KiB at a time (K
//                rows and V rows of one contiguous block, as the kernel reads them tile by tile)
//   pages        runs of `page` bytes, placed page b of every unit then page b + 1 (the order a
//                decode allocates them), each read as one stream, unit by unit
//   pages_2      the same pages, each read as two streams (its two halves) advancing 4 KiB at a
//                time
//
//   bench_scattered_read [page_bytes=65536] [unit_bytes=2097152] [rounds=15]
//
// pages / one_block is the least a paged layout can cost against one contiguous block on this
// machine, whatever the kernel does.
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "bench_util.h"

namespace {

using bench::kHuge;
constexpr size_t kStep = 4096;

uint64_t read_run(const char* p, size_t bytes) {
  uint64_t s = 0;
  for (size_t o = 0; o < bytes; o += 64) s += *reinterpret_cast<const volatile uint64_t*>(p + o);
  return s;
}

// Two halves of [p, p + bytes) advancing kStep at a time.
uint64_t read_two(const char* p, size_t bytes) {
  uint64_t s = 0;
  const size_t half = bytes / 2;
  for (size_t o = 0; o < half; o += kStep) {
    const size_t n = std::min(kStep, half - o);
    s += read_run(p + o, n);
    s += read_run(p + half + o, n);
  }
  return s;
}

using bench::median;

}  // namespace

int main(int argc, char** argv) {
  const size_t page = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 65536;
  const size_t unit = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : kHuge;
  const int rounds = argc > 3 ? std::atoi(argv[3]) : 15;
  if (page == 0 || unit % page != 0 || page % (2 * kStep) != 0) {
    std::fprintf(stderr, "unit_bytes must be a multiple of page_bytes, page_bytes a multiple of 8192\n");
    return 2;
  }
  const size_t total = size_t{512} << 20;
  const size_t units = total / unit, pages_per_unit = unit / page;
  char* base = bench::huge_alloc(total);
  std::memset(base, 1, total);
  auto page_at = [&](size_t u, size_t b) { return base + (b * units + u) * page; };

  struct Pattern {
    const char* name;
    int kind;
    std::vector<double> gbs;
  };
  std::vector<Pattern> ps = {{"sequential", 0, {}}, {"one_block", 1, {}}, {"pages", 2, {}}, {"pages_2", 3, {}}};
  uint64_t sink = 0;
  for (int r = 0; r < rounds; ++r)
    for (size_t i = 0; i < ps.size(); ++i) {
      Pattern& p = ps[(i + static_cast<size_t>(r)) % ps.size()];
      const auto t0 = std::chrono::steady_clock::now();
      if (p.kind == 0) sink += read_run(base, total);
      if (p.kind == 1)
        for (size_t u = 0; u < units; ++u) sink += read_two(base + u * unit, unit);
      if (p.kind >= 2)
        for (size_t u = 0; u < units; ++u)
          for (size_t b = 0; b < pages_per_unit; ++b)
            sink += p.kind == 2 ? read_run(page_at(u, b), page) : read_two(page_at(u, b), page);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      p.gbs.push_back(static_cast<double>(total) / s / 1e9);
    }
  std::printf("page_bytes=%zu unit_bytes=%zu rounds=%d (sink %llu)\n", page, unit, rounds,
              static_cast<unsigned long long>(sink & 1));
  const double ref_med = median(ps[1].gbs), ref_max = *std::max_element(ps[1].gbs.begin(), ps[1].gbs.end());
  for (const Pattern& p : ps) {
    const double med = median(p.gbs), mx = *std::max_element(p.gbs.begin(), p.gbs.end());
    std::printf("  %-10s median %6.1f GB/s  best %6.1f GB/s   time vs one_block: median x%.3f best x%.3f\n", p.name, med,
                mx, ref_med / med, ref_max / mx);
  }
  return 0;
}
