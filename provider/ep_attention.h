// The EP's tensor compatibility mode: standard ONNX Attention (opset 23/24)
// nodes of models that were NOT converted are claimed one node per fused
// graph and run on our kernels, producing Y and present_key/present_value
// exactly as ORT does (ops/attention_tensor.h). What is not supported is left
// to ORT with a reason the caller logs.
#pragma once

#include <string>

#include "provider/ort_api.h"

namespace olep {
namespace provider {

/// True if the EP runs `node` in tensor mode; otherwise `why` says why not
/// (empty when the node is simply not an attention op).
bool supports_standard_node(const OrtNode* node, std::string* why);

/// Builds the compute function of a fused graph that holds one supported node.
OrtStatus* compile_standard_node(const OrtGraph* graph, const OrtNode* fused_node, OrtNodeComputeInfo** out);

/// Frees what compile_standard_node created.
void release_compute_info(OrtNodeComputeInfo* info);

}  // namespace provider
}  // namespace olep
