// The EP's tensor compatibility mode: standard attention nodes of models that
// were NOT converted are claimed one node per fused graph and run on our
// kernels, producing the outputs and present_key/present_value exactly as ORT
// does:
//   - ONNX Attention, opset 23/24 (ops/attention_tensor.h): float, float16, bfloat16,
//     qk_matmul_output in every mode; left to ORT: other opsets (25 adds windows), Q/K/V/past
//     of different types, integer masks, scale <= 0, softmax_precision below float32;
//   - com.microsoft GroupQueryAttention as onnxruntime-genai emits it: packed
//     or separate Q/K/V, do_rotary with cos/sin caches, local_window_size,
//     softcap, scale, separate or shared (IOBinding) past/present buffers
//     (ops/gqa_tensor.h).
// What is not supported is left to ORT with a reason the caller logs (e.g.
// GQA smooth_softmax, qk_output, quantized caches, position_ids,
// attention_bias, head_sink, unknown attributes).
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
