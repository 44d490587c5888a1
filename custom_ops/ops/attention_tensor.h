// Standard ONNX Attention (opset 23 and 24, onnx.ai Operators/Attention) over
// tensors: the EP's tensor compatibility mode for models that were not
// converted. present_key/present_value = concat(past, new) along the sequence
// axis (that copy is the tensor contract's cost); attention then streams over
// the present rows with the same kernels as CacheAttention. ORT-free.
//
// Supported: Q/K/V rank 3 (with q_num_heads/kv_num_heads) or rank 4 (BNSH);
// past_key/past_value BNSH; attn_mask bool or additive, its last dimension
// shorter than the keys allowed (the missing keys are masked out, as opset 24
// pads it with -inf); is_causal (offset = past length with a past, 0 without,
// nonpad_kv_seqlen - S with nonpad_kv_seqlen); scale; softcap; GQA/MQA; float,
// float16 and bfloat16 (scores, softmax and sums in float32); opset-24
// nonpad_kv_seqlen (without past); the qk_matmul_output 4th output in every
// qk_matmul_output_mode (kernels::QkStage; docs/API.md).
// A query row whose keys are all masked returns zeros, as the spec's errata say
// (ORT: NaN); an additive mask value <= the lowest finite value of its type
// (finfo.min, as exporters write it) counts as -inf, so such rows are zeros too
// (the spec's softmax, and ORT, give the mean of V there). qk_matmul_output in
// mode 2 holds -inf where the causal frontier masks a key, as the spec's bias and
// function body do (ORT writes the lowest float).
#pragma once

#include <cstdint>
#include <vector>

#include "ops/attention_core.h"
#include "ops/tensor.h"

namespace olep {
namespace ops {

struct OnnxAttentionAttrs {
  int64_t is_causal = 0;
  int64_t q_num_heads = 0;
  int64_t kv_num_heads = 0;
  float scale = 0.0f;  // 0 = 1/sqrt(head_dim)
  float softcap = 0.0f;
  int64_t qk_matmul_output_mode = 0;  // 0..3: kernels::QkStage of the 4th output
};

/// Inputs in ONNX order; absent optional inputs are null.
struct OnnxAttentionInputs {
  const Tensor* q = nullptr;
  const Tensor* k = nullptr;
  const Tensor* v = nullptr;
  const Tensor* attn_mask = nullptr;
  const Tensor* past_key = nullptr;
  const Tensor* past_value = nullptr;
  const Tensor* nonpad_kv_seqlen = nullptr;
};

struct OnnxAttentionShapes {
  AttentionDims d;
  int64_t past = 0;   // P
  int64_t total = 0;  // P + key sequence length
  std::vector<int64_t> y, present_key, present_value;
  std::vector<int64_t> qk;  // qk_matmul_output [B, q_num_heads, S, total]
};

/// Validates the inputs; throws std::invalid_argument "Attention: ..." naming the input.
OnnxAttentionShapes onnx_attention_shapes(const OnnxAttentionAttrs& a, const OnnxAttentionInputs& in);

/// Writes Y and (when non-null) present_key/present_value and qk_matmul_output (the type of Q);
/// when the presents are null the concatenation goes to internal scratch.
void onnx_attention(const OnnxAttentionAttrs& a, const OnnxAttentionInputs& in, const OnnxAttentionShapes& s, void* y,
                    void* present_key, void* present_value, void* qk_matmul_output, const ParallelFor& parallel_for);

}  // namespace ops
}  // namespace olep
