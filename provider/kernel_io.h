// Reading inputs and allocating outputs of an OrtKernelContext as ORT-free
// ops::Tensor views, ORT's intra-op thread pool as an ops::ParallelFor, and
// C++ exceptions as OrtStatus. Used by the custom-op kernels and by the EP's
// compiled nodes alike.
#pragma once

#include <exception>
#include <string>
#include <vector>

#include "ops/tensor.h"
#include "provider/ort_api.h"

namespace olep {
namespace provider {

ops::ElemType elem_type(ONNXTensorElementDataType t);
/// Throws std::runtime_error carrying ORT's message (and releases the status).
void check(OrtStatus* st);
/// Input `index` as a Tensor; false if the optional input is absent.
bool read_input(OrtKernelContext* ctx, size_t index, ops::Tensor* out);
/// Allocates output `index` with `shape` and returns its data pointer (null for zero elements);
/// `type`, if given, receives the output's element type as ORT allocated it.
void* alloc_output(OrtKernelContext* ctx, size_t index, const std::vector<int64_t>& shape,
                   ops::ElemType* type = nullptr);
bool has_output(OrtKernelContext* ctx, size_t index);
/// Runs tasks on the session's intra-op pool (KernelContext_ParallelFor); rethrows the first task exception.
ops::ParallelFor ort_parallel_for(OrtKernelContext* ctx);
/// std::invalid_argument -> ORT_INVALID_ARGUMENT, anything else -> ORT_FAIL; message prefixed with [node].
OrtStatus* to_status(const std::exception& e, const std::string& node);

}  // namespace provider
}  // namespace olep
