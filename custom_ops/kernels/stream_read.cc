#include "kernels/stream_read.h"

#include <cstring>

#include "kernels/attention.h"

namespace olep {
namespace kernels {

uint64_t stream_read(const void* p, size_t bytes) {
  switch (active_isa()) {
    case Isa::kAvx512Bf16:
    case Isa::kAvx512: return stream_read_avx512(p, bytes);
    case Isa::kAvx2: return stream_read_avx2(p, bytes);
    case Isa::kScalar: break;
  }
  const uint8_t* b = static_cast<const uint8_t*>(p);
  uint64_t acc[4] = {0, 0, 0, 0};
  size_t i = 0;
  for (; i + 32 <= bytes; i += 32)
    for (int k = 0; k < 4; ++k) {
      uint64_t x;
      std::memcpy(&x, b + i + 8 * k, 8);
      acc[k] ^= x;
    }
  for (; i < bytes; ++i) acc[0] ^= b[i];
  return acc[0] ^ acc[1] ^ acc[2] ^ acc[3];
}

}  // namespace kernels
}  // namespace olep
