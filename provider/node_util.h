// Helpers for the EP's node handling: reading a graph node's attributes, input and output
// names and types (OrtNode, plugin-EP graph API), mapping a node's inputs to the fused node's
// deduplicated and reordered ones by name, and the compute-info base every compiled node uses.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ops/tensor.h"
#include "provider/kernel_io.h"
#include "provider/ort_api.h"

namespace olep {
namespace provider {

/// An attribute of a graph node; false when absent or of another type.
bool node_attr_int(const OrtNode* n, const char* name, int64_t* v);
bool node_attr_float(const OrtNode* n, const char* name, float* v);
bool node_attr_string(const OrtNode* n, const char* name, std::string* v);
/// Names of the attributes a node carries.
std::vector<std::string> attribute_names(const OrtNode* n);
/// Names of a node's inputs or outputs ("" for an omitted optional one).
std::vector<std::string> value_names(const OrtNode* n, bool inputs);
/// Element type of input `index` (UNDEFINED when absent or not a tensor).
ONNXTensorElementDataType input_type(const OrtNode* n, size_t index);
/// Domain and operator type of a node ("" when unknown).
std::string node_domain(const OrtNode* n);
std::string node_op_type(const OrtNode* n);
std::string node_name(const OrtNode* n);

/// Fused-node index of each of the node's `names` ("" = omitted), -1 when absent.
/// ORT deduplicates and reorders a fused node's inputs: map them by name.
template <size_t N>
void map_by_name(const std::vector<std::string>& names, const std::vector<std::string>& fused, int (&out)[N]) {
  for (size_t i = 0; i < N; ++i) {
    out[i] = -1;
    if (i >= names.size() || names[i].empty()) continue;
    for (size_t j = 0; j < fused.size(); ++j)
      if (fused[j] == names[i]) {
        out[i] = static_cast<int>(j);
        break;
      }
  }
}

/// Common part of the compute infos: ORT sees the OrtNodeComputeInfo base only. A derived
/// `Self` has `OrtStatus* run(OrtKernelContext*) noexcept` and is created by init(new Self).
struct NodeComputeInfo : OrtNodeComputeInfo {
  void (*destroy)(NodeComputeInfo*) = nullptr;
  std::string node;

  template <typename Self>
  static NodeComputeInfo* init(Self* self) {
    self->ort_version_supported = ORT_API_VERSION;
    self->CreateState = [](OrtNodeComputeInfo* info, OrtNodeComputeContext*, void** state) noexcept -> OrtStatus* {
      *state = info;
      return nullptr;
    };
    self->Compute = [](OrtNodeComputeInfo* info, void*, OrtKernelContext* ctx) noexcept -> OrtStatus* {
      return static_cast<Self*>(static_cast<NodeComputeInfo*>(info))->run(ctx);
    };
    self->ReleaseState = [](OrtNodeComputeInfo*, void*) noexcept {};
    self->destroy = [](NodeComputeInfo* info) { delete static_cast<Self*>(info); };
    return self;
  }
  NodeComputeInfo() : OrtNodeComputeInfo{} {}
};

/// Reads the mapped inputs; p[i] is null for an absent one.
template <size_t N>
void read_inputs(OrtKernelContext* ctx, const int (&index)[N], ops::Tensor (&t)[N], const ops::Tensor* (&p)[N]) {
  for (size_t i = 0; i < N; ++i) {
    p[i] = nullptr;
    if (index[i] >= 0 && read_input(ctx, static_cast<size_t>(index[i]), &t[i])) p[i] = &t[i];
  }
}

}  // namespace provider
}  // namespace olep
