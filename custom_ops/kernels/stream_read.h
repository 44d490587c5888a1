// The physical limit a decode step is measured against: one vectorized read of
// exactly `bytes` bytes (the K+V bytes attention must touch), with enough
// independent accumulators to saturate the load ports. Used by benchmarks.
#pragma once

#include <cstddef>
#include <cstdint>

namespace olep {
namespace kernels {

/// Reads every byte of [p, p + bytes) once with the widest vector loads the CPU
/// has (active_isa()); returns a checksum so the reads cannot be optimized away.
uint64_t stream_read(const void* p, size_t bytes);
uint64_t stream_read_avx512(const void* p, size_t bytes);
uint64_t stream_read_avx2(const void* p, size_t bytes);

}  // namespace kernels
}  // namespace olep
