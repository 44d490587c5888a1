// Peak multiply-add throughput per ISA level (see fma_peak.h).
#include "fma_peak.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <stdexcept>

namespace olep {
namespace bench {
namespace {

// Each kernel is one asm block, the loop included, on named registers (the exact instruction
// stream: compilers turn arrays of vector accumulators into spills and register moves, and asm
// operands are limited to 30). `iters` >= 1 iterations; returns the multiply-adds done. The
// functions' target attributes let the compiler build them for that ISA; main() calls one only
// where the CPU supports it.
//
// Accumulators: ymm0-11 (AVX2), zmm0-23 (AVX-512); operands ymm12-13 / zmm28-29; vpmaddwd
// temporaries ymm14-15 / zmm24-27, which register renaming makes independent, so each chain
// depends only on its accumulator.

#define R12(p) p(0) p(1) p(2) p(3) p(4) p(5) p(6) p(7) p(8) p(9) p(10) p(11)
#define R24(p) R12(p) p(12) p(13) p(14) p(15) p(16) p(17) p(18) p(19) p(20) p(21) p(22) p(23)
#define CLOBBER_Y                                                                                     \
  "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", \
      "xmm12", "xmm13", "xmm14", "xmm15", "cc"
#define CLOBBER_Z                                                                                      \
  CLOBBER_Y, "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23", "xmm24", "xmm25", \
      "xmm26", "xmm27", "xmm28", "xmm29"
#define LOOP(body) "1:\n\t" body "dec %[n]\n\tjnz 1b\n\t"

constexpr int kAvx2Chains = 12;
constexpr int kAvx512Chains = 24;
const float kTiny = 1e-6f;   // acc += 1e-6 * 1e-6: no overflow, no subnormals
const int16_t kThree = 3, kFive = 5;

// acc += a * b
#define ZERO_Y(i) "vxorps %%ymm" #i ", %%ymm" #i ", %%ymm" #i "\n\t"
#define ZERO_Z(i) "vpxord %%zmm" #i ", %%zmm" #i ", %%zmm" #i "\n\t"
#define FMA_Y(i) "vfmadd231ps %%ymm12, %%ymm13, %%ymm" #i "\n\t"
#define FMA_Z(i) "vfmadd231ps %%zmm28, %%zmm29, %%zmm" #i "\n\t"

__attribute__((target("avx2,fma"))) uint64_t fma_avx2(uint64_t iters) {
  uint64_t n = iters;
  asm volatile("vbroadcastss %[a], %%ymm12\n\tvbroadcastss %[a], %%ymm13\n\t" R12(ZERO_Y) LOOP(R12(FMA_Y))
               : [n] "+r"(n)
               : [a] "m"(kTiny)
               : CLOBBER_Y);
  return iters * kAvx2Chains * 8;
}

__attribute__((target("avx512f"))) uint64_t fma_avx512(uint64_t iters) {
  uint64_t n = iters;
  asm volatile("vbroadcastss %[a], %%zmm28\n\tvbroadcastss %[a], %%zmm29\n\t" R24(ZERO_Z) LOOP(R24(FMA_Z))
               : [n] "+r"(n)
               : [a] "m"(kTiny)
               : CLOBBER_Z);
  return iters * kAvx512Chains * 16;
}

// t = vpmaddwd(x, y) (pairs of int16 products summed into int32 lanes), acc += t
#define MADD_Y(i, t) "vpmaddwd %%ymm12, %%ymm13, %%ymm" #t "\n\tvpaddd %%ymm" #t ", %%ymm" #i ", %%ymm" #i "\n\t"
#define MADD_Y2(i, j) MADD_Y(i, 14) MADD_Y(j, 15)
#define MADD_Z(i, t) "vpmaddwd %%zmm28, %%zmm29, %%zmm" #t "\n\tvpaddd %%zmm" #t ", %%zmm" #i ", %%zmm" #i "\n\t"
#define MADD_Z4(i, j, k, l) MADD_Z(i, 24) MADD_Z(j, 25) MADD_Z(k, 26) MADD_Z(l, 27)

__attribute__((target("avx2"))) uint64_t madd_avx2(uint64_t iters) {
  uint64_t n = iters;
  asm volatile("vpbroadcastw %[x], %%ymm12\n\tvpbroadcastw %[y], %%ymm13\n\t" R12(ZERO_Y)
                   LOOP(MADD_Y2(0, 1) MADD_Y2(2, 3) MADD_Y2(4, 5) MADD_Y2(6, 7) MADD_Y2(8, 9) MADD_Y2(10, 11))
               : [n] "+r"(n)
               : [x] "m"(kThree), [y] "m"(kFive)
               : CLOBBER_Y);
  return iters * kAvx2Chains * 16;
}

__attribute__((target("avx512f,avx512bw"))) uint64_t madd_avx512bw(uint64_t iters) {
  uint64_t n = iters;
  asm volatile("vpbroadcastw %[x], %%zmm28\n\tvpbroadcastw %[y], %%zmm29\n\t" R24(ZERO_Z)
                   LOOP(MADD_Z4(0, 1, 2, 3) MADD_Z4(4, 5, 6, 7) MADD_Z4(8, 9, 10, 11) MADD_Z4(12, 13, 14, 15)
                            MADD_Z4(16, 17, 18, 19) MADD_Z4(20, 21, 22, 23))
               : [n] "+r"(n)
               : [x] "m"(kThree), [y] "m"(kFive)
               : CLOBBER_Z);
  return iters * kAvx512Chains * 32;
}

// acc += dot2(x, y), fused
#define DPWSSD_Z(i) "vpdpwssd %%zmm29, %%zmm28, %%zmm" #i "\n\t"

__attribute__((target("avx512f,avx512bw,avx512vnni"))) uint64_t dpwssd_avx512vnni(uint64_t iters) {
  uint64_t n = iters;
  asm volatile("vpbroadcastw %[x], %%zmm28\n\tvpbroadcastw %[y], %%zmm29\n\t" R24(ZERO_Z) LOOP(R24(DPWSSD_Z))
               : [n] "+r"(n)
               : [x] "m"(kThree), [y] "m"(kFive)
               : CLOBBER_Z);
  return iters * kAvx512Chains * 32;
}

// acc += a.bf16[2i] * b.bf16[2i] + a.bf16[2i+1] * b.bf16[2i+1] (2 multiply-adds per fp32 lane)
#define DPBF16_Z(i) "vdpbf16ps %%zmm29, %%zmm28, %%zmm" #i "\n\t"
const uint32_t kTinyBf16Pair = 0x35863586u;  // two bf16 ~1e-6: no overflow, no denormals

__attribute__((target("avx512f,avx512bf16"))) uint64_t dpbf16_avx512bf16(uint64_t iters) {
  uint64_t n = iters;
  asm volatile("vpbroadcastd %[a], %%zmm28\n\tvpbroadcastd %[a], %%zmm29\n\t" R24(ZERO_Z) LOOP(R24(DPBF16_Z))
               : [n] "+r"(n)
               : [a] "m"(kTinyBf16Pair)
               : CLOBBER_Z);
  return iters * kAvx512Chains * 32;
}

/// Seconds of CPU time this thread has run: a register-only loop's throughput per second of it
/// does not count the time other processes of a shared machine take the core.
double thread_seconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

double measure(uint64_t (*run)(uint64_t), double ms, int trials) {
  uint64_t iters = 1 << 14;
  for (;;) {  // calibrate: iterations for ~ms
    const double t0 = thread_seconds();
    run(iters);
    const double dt = (thread_seconds() - t0) * 1e3;
    if (dt > ms / 4) {
      iters = static_cast<uint64_t>(static_cast<double>(iters) * ms / dt) + 1;
      break;
    }
    iters *= 4;
  }
  double best = 0;
  for (int t = 0; t < trials; ++t) {
    const double t0 = thread_seconds();
    const uint64_t macs = run(iters);
    best = std::max(best, static_cast<double>(macs) / (thread_seconds() - t0) / 1e9);
  }
  return best;
}

struct Entry {
  FmaLevel level;
  uint64_t (*run)(uint64_t);
};

std::vector<Entry> entries() {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512f = __builtin_cpu_supports("avx512f");
  const bool avx512bw = avx512f && __builtin_cpu_supports("avx512bw");
  const bool vnni = avx512f && __builtin_cpu_supports("avx512vnni");
  const bool bf16 = avx512f && __builtin_cpu_supports("avx512bf16");
  return {
      {{"fp32_avx2", "vfmadd231ps ymm (256-bit FMA)", kAvx2Chains, avx2}, fma_avx2},
      {{"fp32_avx512", "vfmadd231ps zmm (512-bit FMA)", kAvx512Chains, avx512f}, fma_avx512},
      {{"bf16_avx512bf16", "vdpbf16ps zmm (bf16 pair dot)", kAvx512Chains, bf16}, dpbf16_avx512bf16},
      {{"int16_avx2", "vpmaddwd+vpaddd ymm", kAvx2Chains, avx2}, madd_avx2},
      {{"int16_avx512bw", "vpmaddwd+vpaddd zmm", kAvx512Chains, avx512bw}, madd_avx512bw},
      {{"int16_avx512vnni", "vpdpwssd zmm", kAvx512Chains, vnni}, dpwssd_avx512vnni},
  };
}

}  // namespace

std::vector<FmaLevel> fma_levels() {
  std::vector<FmaLevel> out;
  for (const Entry& e : entries()) out.push_back(e.level);
  return out;
}

double fma_peak(const std::string& level, double ms, int trials) {
  if (!(ms > 0 && ms <= 10000))
    throw std::invalid_argument("fma_peak: ms; expected 0 < ms <= 10000, got " + std::to_string(ms));
  if (trials < 1 || trials > 1000)
    throw std::invalid_argument("fma_peak: trials; expected 1..1000, got " + std::to_string(trials));
  std::string names;
  for (const Entry& e : entries()) {
    if (level == e.level.name) return e.level.supported ? measure(e.run, ms, trials) : -1.0;
    names += (names.empty() ? "" : ", ") + std::string(e.level.name);
  }
  throw std::invalid_argument("fma_peak: level; expected one of " + names + ", got '" + level + "'");
}

}  // namespace bench
}  // namespace olep
