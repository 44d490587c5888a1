// kernels::copy_rows, the arena's append copy: streaming (non-temporal) and plain stores give
// the same bytes as a row-by-row memcpy, for contiguous and strided sources, destinations on and
// off the 64-byte grid, rows of whole lines and not, and touch no byte past the rows.
#include <cstring>
#include <vector>

#include "check.h"
#include "kernels/row_copy.h"

using namespace olep;

int main() {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> byte(0, 255);
  for (size_t row_bytes : {size_t{16}, size_t{64}, size_t{192}, size_t{512}, size_t{520}})
    for (size_t extra_stride : {size_t{0}, size_t{64}, size_t{3}})
      for (size_t dst_off : {size_t{0}, size_t{16}, size_t{1}})
        for (int64_t rows : {int64_t{0}, int64_t{1}, int64_t{63}, int64_t{64}, int64_t{130}})
          for (bool streaming : {false, true}) {
            const size_t stride = row_bytes + extra_stride;
            std::vector<unsigned char> src(static_cast<size_t>(rows) * stride + 64);
            for (auto& b : src) b = static_cast<unsigned char>(byte(rng));
            const size_t n = static_cast<size_t>(rows) * row_bytes;
            std::vector<unsigned char> buf(n + 256 + 64, 0xAB);  // room to place dst on any 64-byte offset
            unsigned char* base = buf.data() + (64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64;
            unsigned char* dst = base + 64 + dst_off;
            kernels::copy_rows(dst, src.data() + 1, rows, row_bytes, stride, streaming);
            kernels::stream_fence();
            bool same = true;
            for (int64_t r = 0; r < rows; ++r)
              same = same && std::memcmp(dst + static_cast<size_t>(r) * row_bytes,
                                         src.data() + 1 + static_cast<size_t>(r) * stride, row_bytes) == 0;
            CHECK(same);
            bool untouched = true;  // the bytes around the rows keep their fill
            for (unsigned char* p = buf.data(); p < dst; ++p) untouched = untouched && *p == 0xAB;
            for (unsigned char* p = dst + n; p < buf.data() + buf.size(); ++p) untouched = untouched && *p == 0xAB;
            CHECK(untouched);
          }
  TEST_MAIN_END();
}
