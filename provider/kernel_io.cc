#include "provider/kernel_io.h"

#include <memory>
#include <mutex>
#include <stdexcept>

#include "kvcache/errors.h"

namespace olep {
namespace provider {

using ops::ElemType;
using ops::Tensor;

ElemType elem_type(ONNXTensorElementDataType t) {
  switch (t) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return ElemType::kFloat32;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return ElemType::kFloat16;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return ElemType::kBFloat16;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL: return ElemType::kBool;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32: return ElemType::kInt32;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64: return ElemType::kInt64;
    default: return ElemType::kOther;
  }
}

// Throws std::runtime_error carrying ORT's message.
void check(OrtStatus* st) {
  if (st == nullptr) return;
  std::string msg = api().GetErrorMessage(st);
  api().ReleaseStatus(st);
  throw std::runtime_error(msg);
}

// Input `index` as a Tensor; returns false if the optional input is absent.
bool read_input(OrtKernelContext* ctx, size_t index, Tensor* out) {
  size_t count = 0;
  check(api().KernelContext_GetInputCount(ctx, &count));
  if (index >= count) return false;
  const OrtValue* v = nullptr;
  check(api().KernelContext_GetInput(ctx, index, &v));
  if (v == nullptr) return false;
  OrtTensorTypeAndShapeInfo* info = nullptr;
  check(api().GetTensorTypeAndShape(v, &info));
  std::unique_ptr<OrtTensorTypeAndShapeInfo, void (*)(OrtTensorTypeAndShapeInfo*)> guard(
      info, [](OrtTensorTypeAndShapeInfo* p) { api().ReleaseTensorTypeAndShapeInfo(p); });
  ONNXTensorElementDataType t;
  check(api().GetTensorElementType(info, &t));
  size_t rank = 0;
  check(api().GetDimensionsCount(info, &rank));
  out->shape.assign(rank, 0);
  if (rank) check(api().GetDimensions(info, out->shape.data(), rank));
  out->type = elem_type(t);
  void* data = nullptr;
  check(api().GetTensorMutableData(const_cast<OrtValue*>(v), &data));
  out->data = data;
  return true;
}

void* alloc_output(OrtKernelContext* ctx, size_t index, const std::vector<int64_t>& shape, ElemType* type) {
  OrtValue* out = nullptr;
  check(api().KernelContext_GetOutput(ctx, index, shape.data(), shape.size(), &out));
  if (type) {
    OrtTensorTypeAndShapeInfo* info = nullptr;
    check(api().GetTensorTypeAndShape(out, &info));
    ONNXTensorElementDataType t = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    OrtStatus* st = api().GetTensorElementType(info, &t);
    api().ReleaseTensorTypeAndShapeInfo(info);
    check(st);
    *type = elem_type(t);
  }
  void* data = nullptr;
  check(api().GetTensorMutableData(out, &data));
  return data;
}

bool has_output(OrtKernelContext* ctx, size_t index) {
  size_t count = 0;
  check(api().KernelContext_GetOutputCount(ctx, &count));
  return index < count;
}

ops::ParallelFor ort_parallel_for(OrtKernelContext* ctx) {
  return [ctx](int64_t n, const std::function<void(int64_t)>& fn) {
    struct Ctx {
      const std::function<void(int64_t)>* fn;
      std::mutex mu;
      std::exception_ptr error;
    } c{&fn, {}, nullptr};
    auto tramp = [](void* p, size_t i) {
      Ctx* cc = static_cast<Ctx*>(p);
      try {
        (*cc->fn)(static_cast<int64_t>(i));
      } catch (...) {
        std::lock_guard<std::mutex> lk(cc->mu);
        if (!cc->error) cc->error = std::current_exception();
      }
    };
    check(api().KernelContext_ParallelFor(ctx, tramp, static_cast<size_t>(n), 0, &c));
    if (c.error) std::rethrow_exception(c.error);
  };
}

OrtStatus* to_status(const std::exception& e, const std::string& node) {
  // The arena's error kind leads the message ("KVCacheMemoryError: ...", "KVCacheBusyError: ..."),
  // so Python (onnx_light_ep.InferenceSession) and any C host can tell a memory limit from a bad
  // argument; the node name follows it.
  const std::string kind = error_kind(e);
  const bool bad_input = kind == "ValueError";
  const std::string prefix = bad_input || kind.empty() ? "" : kind + ": ";
  return make_status(bad_input ? ORT_INVALID_ARGUMENT : ORT_FAIL, prefix + "[" + node + "] " + e.what());
}

}  // namespace provider
}  // namespace olep
