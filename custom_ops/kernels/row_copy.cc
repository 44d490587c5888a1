#include "kernels/row_copy.h"

#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace olep {
namespace kernels {

void copy_rows(void* dst, const void* src, int64_t rows, size_t row_bytes, size_t src_stride, bool streaming) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
#if defined(__SSE2__)
  if (streaming && reinterpret_cast<uintptr_t>(d) % 64 == 0 && row_bytes % 64 == 0) {
    for (int64_t i = 0; i < rows; ++i) {
      const char* sr = s + static_cast<size_t>(i) * src_stride;
      char* dr = d + static_cast<size_t>(i) * row_bytes;
      for (size_t b = 0; b < row_bytes; b += 64) {  // one whole line per step
        const __m128i x0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sr + b));
        const __m128i x1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sr + b + 16));
        const __m128i x2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sr + b + 32));
        const __m128i x3 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sr + b + 48));
        _mm_stream_si128(reinterpret_cast<__m128i*>(dr + b), x0);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dr + b + 16), x1);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dr + b + 32), x2);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dr + b + 48), x3);
      }
    }
    return;
  }
#else
  (void)streaming;
#endif
  if (src_stride == row_bytes) {
    std::memcpy(d, s, static_cast<size_t>(rows) * row_bytes);
    return;
  }
  for (int64_t i = 0; i < rows; ++i)
    std::memcpy(d + static_cast<size_t>(i) * row_bytes, s + static_cast<size_t>(i) * src_stride, row_bytes);
}

void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

}  // namespace kernels
}  // namespace olep
