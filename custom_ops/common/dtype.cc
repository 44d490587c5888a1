#include "common/dtype.h"

#include <stdexcept>

namespace olep {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
  }
  return "unknown";
}

DType parse_dtype(const std::string& name, const char* what) {
  if (name == "float32" || name == "float" || name == "fp32") return DType::kFloat32;
  if (name == "float16" || name == "half" || name == "fp16") return DType::kFloat16;
  if (name == "bfloat16" || name == "bf16") return DType::kBFloat16;
  throw std::invalid_argument(std::string(what) + ": unsupported dtype; expected one of float32, float16, bfloat16, got '" +
                              name + "'");
}

void to_float(DType t, const void* src, float* dst, int64_t n) {
  switch (t) {
    case DType::kFloat32:
      std::memcpy(dst, src, static_cast<size_t>(n) * 4);
      return;
    case DType::kFloat16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = half_to_float(s[i]);
      return;
    }
    case DType::kBFloat16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(s[i]);
      return;
    }
  }
}

void from_float(DType t, const float* src, void* dst, int64_t n) {
  switch (t) {
    case DType::kFloat32:
      std::memcpy(dst, src, static_cast<size_t>(n) * 4);
      return;
    case DType::kFloat16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = float_to_half(src[i]);
      return;
    }
    case DType::kBFloat16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = float_to_bf16(src[i]);
      return;
    }
  }
}

}  // namespace olep
