// The compute ceiling of one core: measured peak multiply-add throughput per ISA level.
//
// Shared by the `_core.fma_peak` binding (so an installed package can measure it) and the
// tools/cpp/bench_fma_peak executable (tools/bench_kv_quant.py parses its output). No ORT, no
// kernels: each level is one asm loop of independent multiply-add chains on named registers,
// compiled with its own target attribute and run only where the CPU reports the feature.
//
// Levels (names are stable; the Python benchmarks key on them):
//   fp32_avx2         vfmadd231ps ymm, 12 chains (1 multiply-add per fp32 lane)
//   fp32_avx512       vfmadd231ps zmm, 24 chains
//   bf16_avx512bf16   vdpbf16ps zmm, 24 chains (2 multiply-adds per fp32 lane: a bf16 pair)
//   int16_avx2        vpmaddwd + vpaddd ymm, 12 chains (2 multiply-adds per int32 lane)
//   int16_avx512bw    vpmaddwd + vpaddd zmm, 24 chains
//   int16_avx512vnni  vpdpwssd zmm, 24 chains
// More chains than FMA latency x pipes of current x86 cores (Zen 3/4 and Intel: 4 cycles x 2
// pipes; Zen 4 double-pumps 512-bit ops, which the measurement shows rather than assumes).
//
// Units: GFMA/s = 1e9 multiply-adds per second of the calling thread's CPU time
// (CLOCK_THREAD_CPUTIME_ID), so time other processes take the core on a shared machine does
// not count. Thread safety: reentrant (no shared state); one call occupies its thread only.
#pragma once

#include <string>
#include <vector>

namespace olep {
namespace bench {

struct FmaLevel {
  const char* name;  // one token, see the list above
  const char* what;  // the instruction, for reports
  int chains;        // independent accumulators
  bool supported;    // the CPU has the instructions (checked at run time)
};

/// Every level, in the order above, with `supported` filled for this CPU.
std::vector<FmaLevel> fma_levels();

/// Best GFMA/s of `trials` trials of about `ms` milliseconds of thread CPU time each.
/// Returns a negative value when the CPU lacks the level. Throws std::invalid_argument for an
/// unknown level name, ms <= 0 or > 10000, or trials < 1 or > 1000.
double fma_peak(const std::string& level, double ms, int trials);

}  // namespace bench
}  // namespace olep
