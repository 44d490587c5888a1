// AVX-512 (F, BW, VL, DQ) instantiation of the SIMD attention kernel.
// Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c; only
// called after run-time detection (kernels/attention_common.cc).
#include <immintrin.h>

#include "kernels/attention_simd.h"
#include "kernels/avx512_traits.h"

namespace olep {
namespace kernels {

void attend_range_avx512(const AttentionGroup& a, int64_t key_begin, int64_t key_end, AttentionState* state,
                         float* scratch) {
  simd::attend_range<Avx512>(a, key_begin, key_end, state, scratch);
}

void finalize_avx512(const AttentionGroup& a, const AttentionState& s) { simd::finalize_rows<Avx512>(a, s); }

}  // namespace kernels
}  // namespace olep
