// ORT-free tensor descriptors used by op semantics: the provider fills them
// from OrtValues, tests fill them from plain buffers.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/dtype.h"

namespace olep {
namespace ops {

enum class ElemType { kFloat32, kFloat16, kBFloat16, kBool, kInt32, kInt64, kOther };

const char* elem_type_name(ElemType t);

/// True for the attention element types (float, float16, bfloat16).
bool is_float(ElemType t);
/// The DType of a float element type. Throws std::invalid_argument("<what>: ... got <type>")
/// for any other type (never a silent float32).
DType to_dtype(ElemType t, const char* what);
/// The element type of a DType.
ElemType elem_type_of(DType t);

/// A read-only tensor: element type, shape, row-major contiguous data.
struct Tensor {
  ElemType type = ElemType::kOther;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
};

std::string shape_str(const std::vector<int64_t>& s);

/// Runs fn(i) for i in [0, n), possibly in parallel (the provider passes ORT's
/// intra-op pool through KernelContext_ParallelFor). Null = serial.
using ParallelFor = std::function<void(int64_t n, const std::function<void(int64_t)>& fn)>;

/// Reads the int64 handle from a `cache` input (int64, 1 element). Throws std::invalid_argument.
int64_t read_cache_handle(const Tensor& cache, const char* op);

}  // namespace ops
}  // namespace olep
