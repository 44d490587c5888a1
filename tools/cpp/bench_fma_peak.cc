// The compute ceiling of one core: measured peak throughput of multiply-adds per ISA level.
//
//   bench_fma_peak [ms_per_trial=200] [trials=5]
//
// Prints, per level of bindings/fma_peak.h (fp32 FMA at 256 and 512 bits, the bf16 pair dot,
// int16 pair dots), the best of `trials` trials in GFMA/s: 1e9 multiply-adds per second of the
// thread's CPU time on one core, and the number of chains; a level the CPU lacks prints n/a.
// The same measurement is `onnx_light_ep._core.fma_peak(level, ms, trials)` in Python.
#include <cstdio>
#include <cstdlib>

#include "fma_peak.h"

int main(int argc, char** argv) {
  const double ms = argc > 1 ? std::atof(argv[1]) : 200.0;
  const int trials = argc > 2 ? std::atoi(argv[2]) : 5;
  std::printf("fma_peak one core, best of %d trials of %.0f ms thread CPU time; "
              "GFMA/s = 1e9 multiply-adds per second\n",
              trials, ms);
  for (const olep::bench::FmaLevel& l : olep::bench::fma_levels()) {
    if (!l.supported) {
      std::printf("  %-18s %10s GFMA/s  %s\n", l.name, "n/a", l.what);
      continue;
    }
    std::printf("  %-18s %10.1f GFMA/s  %s, %d chains\n", l.name, olep::bench::fma_peak(l.name, ms, trials), l.what,
                l.chains);
    std::fflush(stdout);
  }
  return 0;
}
