#include "ops/tensor.h"

#include <cstring>
#include <stdexcept>

namespace olep {
namespace ops {

const char* elem_type_name(ElemType t) {
  switch (t) {
    case ElemType::kFloat32: return "float";
    case ElemType::kFloat16: return "float16";
    case ElemType::kBFloat16: return "bfloat16";
    case ElemType::kBool: return "bool";
    case ElemType::kInt32: return "int32";
    case ElemType::kInt64: return "int64";
    default: return "unsupported";
  }
}

bool is_float(ElemType t) { return t == ElemType::kFloat32 || t == ElemType::kFloat16 || t == ElemType::kBFloat16; }

DType to_dtype(ElemType t, const char* what) {
  switch (t) {
    case ElemType::kFloat32: return DType::kFloat32;
    case ElemType::kFloat16: return DType::kFloat16;
    case ElemType::kBFloat16: return DType::kBFloat16;
    default:
      throw std::invalid_argument(std::string(what) + " must be float, float16 or bfloat16; got " + elem_type_name(t));
  }
}

ElemType elem_type_of(DType t) {
  switch (t) {
    case DType::kFloat32: return ElemType::kFloat32;
    case DType::kFloat16: return ElemType::kFloat16;
    case DType::kBFloat16: return ElemType::kBFloat16;
  }
  return ElemType::kOther;
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

int64_t read_cache_handle(const Tensor& cache, const char* op) {
  if (cache.type != ElemType::kInt64 || cache.numel() != 1 || cache.data == nullptr)
    throw std::invalid_argument(std::string(op) + ": input 'cache' must be an int64 tensor with 1 element (a KVCache "
                                "handle); got " + elem_type_name(cache.type) + " " + shape_str(cache.shape));
  int64_t h;
  std::memcpy(&h, cache.data, sizeof(h));
  return h;
}

}  // namespace ops
}  // namespace olep
