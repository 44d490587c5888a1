// float16 / bfloat16 conversions against known bit patterns.
#include <cstring>
#include <limits>

#include "check.h"
#include "common/dtype.h"

using namespace olep;

static uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

int main() {
  // Exact values and their binary16 encodings.
  struct { float f; uint16_t h; } cases[] = {
      {0.0f, 0x0000}, {-0.0f, 0x8000}, {1.0f, 0x3c00}, {-2.0f, 0xc000}, {65504.0f, 0x7bff},
      {6.103515625e-05f, 0x0400} /* smallest normal */, {5.960464477539063e-08f, 0x0001} /* smallest subnormal */,
      {0.333251953125f, 0x3555}};
  for (auto& c : cases) {
    CHECK(float_to_half(c.f) == c.h);
    CHECK(bits(half_to_float(c.h)) == bits(c.f));
  }
  CHECK(float_to_half(1e6f) == 0x7c00);                   // overflow -> inf
  CHECK(float_to_half(-1e6f) == 0xfc00);
  CHECK(float_to_half(2.9802322387695312e-08f) == 0x0000);  // half of the smallest subnormal: ties to even (0)
  CHECK(float_to_half(1.0f + 1.0f / 2048.0f) == 0x3c00);     // tie -> even
  CHECK(float_to_half(1.0f + 3.0f / 2048.0f) == 0x3c02);     // tie -> even (up)
  CHECK((float_to_half(std::numeric_limits<float>::quiet_NaN()) & 0x7c00) == 0x7c00);
  CHECK(std::isnan(half_to_float(0x7e00)));
  CHECK(std::isinf(half_to_float(0x7c00)));
  // Every half value round-trips through float.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff)) continue;  // NaNs
    CHECK(float_to_half(half_to_float(static_cast<uint16_t>(h))) == h);
  }
  // bfloat16
  CHECK(float_to_bf16(1.0f) == 0x3f80);
  CHECK(bf16_to_float(0x3f80) == 1.0f);
  CHECK(float_to_bf16(1.00390625f) == 0x3f80);  // tie to even
  CHECK(float_to_bf16(1.01171875f) == 0x3f82);  // tie to even (up)
  CHECK(std::isnan(bf16_to_float(float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  for (uint32_t b = 0; b < 0x10000; ++b) {
    if ((b & 0x7f80) == 0x7f80 && (b & 0x7f)) continue;
    CHECK(float_to_bf16(bf16_to_float(static_cast<uint16_t>(b))) == b);
  }
  EXPECT_THROW(parse_dtype("int8", "KVCache: dtype"), std::invalid_argument, "expected one of float32");
  CHECK(parse_dtype("bf16", "x") == DType::kBFloat16);
  TEST_MAIN_END();
}
