// finalize (kernels/attention.h): out = acc / l written as float16 / bfloat16 at every ISA level
// with the scalar level's bits (common/dtype.h float_to_half / float_to_bf16: round to nearest
// even, NaN as the canonical quiet NaN), for values at every edge of the conversions: rounding
// ties, overflow to inf at 65520, fp16 subnormals and the tie to zero below them, infinities,
// NaNs with payloads, random bit patterns; plus the zero rows of padding and of nothing visible,
// the NaN row of a NaN sum, and v_head_dim not a multiple of the vector width (the scalar path).
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "check.h"
#include "common/dtype.h"
#include "kernels/attention.h"

using namespace olep;
using namespace olep::kernels;

namespace {

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Rows x Dv outputs of one group (group_size 2 x num_rows), the acc values from `vals` in turn.
std::vector<uint16_t> run(DType dt, int64_t Dv, const std::vector<float>& vals, const std::vector<float>& l,
                          int64_t valid) {
  AttentionGroup a;
  a.dtype = dt;
  a.group_size = 2;
  a.num_rows = static_cast<int64_t>(l.size()) / 2;
  a.num_valid_rows = valid;
  a.head_dim = a.v_head_dim = Dv;
  a.num_keys = 1;
  const int64_t R = 2 * a.num_rows;
  std::vector<uint16_t> out(static_cast<size_t>(R * Dv), 0xdead);
  a.out = out.data();
  a.out_head_stride = a.num_rows * Dv;
  a.out_row_stride = Dv;
  std::vector<float> m(static_cast<size_t>(R), 0.0f), ls = l, acc(static_cast<size_t>(R * Dv));
  for (size_t i = 0; i < acc.size(); ++i) acc[i] = vals[i % vals.size()];
  AttentionState s{m.data(), ls.data(), acc.data()};
  finalize(a, s);
  return out;
}

}  // namespace

int main() {
  std::vector<float> vals = {0.0f, -0.0f, 1.0f, -2.5f, 65504.0f, 65519.99f, 65520.0f, -65520.0f, 1e6f,
                             std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                             1.0f + 1.0f / 2048.0f, 1.0f + 3.0f / 2048.0f, 6.103515625e-05f, 5.960464477539063e-08f,
                             2.9802322387695312e-08f, 2.98023259e-08f, 1e-40f, -1e-45f, 3.0e38f,
                             from_bits(0x7fc00001u), from_bits(0xffc12345u), from_bits(0x7fa00000u) /* signaling */,
                             1.00390625f /* bf16 tie */, 1.01171875f /* bf16 tie, odd */, from_bits(0x3f80ffffu)};
  std::mt19937 rng(7);
  for (int i = 0; i < 998; ++i) vals.push_back(from_bits(rng()));
  // rows: l = 1, 0.75, 0 (nothing visible: zeros), NaN (NaN row), then padding rows past `valid`
  const std::vector<float> l = {1.0f, 0.75f, 0.0f, NAN, 1.0f, 1.0f, 0.5f, 2.0f, 1.0f, 1.0f};
  for (DType dt : {DType::kFloat16, DType::kBFloat16})
    for (int64_t Dv : {16, 64, 128, 40, 12}) {
      set_isa(Isa::kScalar);
      const std::vector<uint16_t> ref = run(dt, Dv, vals, l, 4);
      // the reference itself: element by element from the scalar conversions
      const int64_t S = static_cast<int64_t>(l.size()) / 2;
      for (int64_t r = 0; r < 2 * S; ++r) {
        const int64_t i = r % S;
        const bool nan_row = i < 4 && std::isnan(l[r]);  // the default NaN, whatever acc holds
        const float inv = i >= 4 || nan_row ? 0.0f : (l[r] > 0.0f ? 1.0f / l[r] : 0.0f);
        for (int64_t d = 0; d < Dv; ++d) {
          // zero sums and padding rows: zeros even where acc holds NaN or inf
          const float x = nan_row ? NAN : inv == 0.0f ? 0.0f : vals[static_cast<size_t>(r * Dv + d) % vals.size()] * inv;
          const uint16_t want = dt == DType::kFloat16 ? float_to_half(x) : float_to_bf16(x);
          CHECK(ref[static_cast<size_t>(r * Dv + d)] == want);
        }
      }
      for (Isa isa : {Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16}) {
        if (static_cast<int>(isa) > static_cast<int>(detected_isa())) continue;
        set_isa(isa);
        const std::vector<uint16_t> got = run(dt, Dv, vals, l, 4);
        int bad = 0;
        for (size_t e = 0; e < got.size(); ++e)
          if (got[e] != ref[e] && bad++ < 3)
            std::fprintf(stderr, "%s %s Dv=%lld element %zu: 0x%04x, scalar 0x%04x\n", isa_name(isa),
                         dt == DType::kFloat16 ? "fp16" : "bf16", static_cast<long long>(Dv), e, got[e], ref[e]);
        CHECK(bad == 0);
      }
    }
  for (Isa isa : {Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16})
    if (static_cast<int>(isa) > static_cast<int>(detected_isa()))
      std::printf("ISA %s: not supported by this CPU, not run\n", isa_name(isa));
  TEST_MAIN_END();
}
