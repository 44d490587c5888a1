#include <immintrin.h>

#include "kernels/stream_read.h"

namespace olep {
namespace kernels {

uint64_t stream_read_avx512(const void* p, size_t bytes) {
  const uint8_t* b = static_cast<const uint8_t*>(p);
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  size_t i = 0;
  for (; i + 256 <= bytes; i += 256) {
    a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(b + i));
    a1 = _mm512_xor_si512(a1, _mm512_loadu_si512(b + i + 64));
    a2 = _mm512_xor_si512(a2, _mm512_loadu_si512(b + i + 128));
    a3 = _mm512_xor_si512(a3, _mm512_loadu_si512(b + i + 192));
  }
  uint64_t r = static_cast<uint64_t>(_mm512_reduce_or_epi64(_mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3))));
  for (; i < bytes; ++i) r ^= b[i];
  return r;
}

}  // namespace kernels
}  // namespace olep
