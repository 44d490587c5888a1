#include "provider/ep_attention.h"

#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "ops/attention_tensor.h"
#include "ops/gqa_tensor.h"
#include "provider/kernel_io.h"
#include "provider/node_util.h"

namespace olep {
namespace provider {
namespace {

// ---- ONNX Attention (opset 23/24) ---------------------------------------------

constexpr size_t kAttnInputs = 7;   // Q, K, V, attn_mask, past_key, past_value, nonpad_kv_seqlen
constexpr size_t kAttnOutputs = 4;  // Y, present_key, present_value, qk_matmul_output

struct AttentionComputeInfo : NodeComputeInfo {
  ops::OnnxAttentionAttrs attrs;
  int in_index[kAttnInputs];    // fused-node input index of each ONNX input, -1 = absent
  int out_index[kAttnOutputs];  // fused-node output index, -1 = not requested

  OrtStatus* run(OrtKernelContext* ctx) noexcept {
    try {
      ops::Tensor t[kAttnInputs];
      const ops::Tensor* p[kAttnInputs];
      read_inputs(ctx, in_index, t, p);
      ops::OnnxAttentionInputs in;
      in.q = p[0];
      in.k = p[1];
      in.v = p[2];
      in.attn_mask = p[3];
      in.past_key = p[4];
      in.past_value = p[5];
      in.nonpad_kv_seqlen = p[6];
      const ops::OnnxAttentionShapes s = ops::onnx_attention_shapes(attrs, in);
      void* y = alloc_output(ctx, static_cast<size_t>(out_index[0]), s.y);
      void* pk = out_index[1] >= 0 ? alloc_output(ctx, static_cast<size_t>(out_index[1]), s.present_key) : nullptr;
      void* pv = out_index[2] >= 0 ? alloc_output(ctx, static_cast<size_t>(out_index[2]), s.present_value) : nullptr;
      void* qk = out_index[3] >= 0 ? alloc_output(ctx, static_cast<size_t>(out_index[3]), s.qk) : nullptr;
      ops::onnx_attention(attrs, in, s, y, pk, pv, qk, ort_parallel_for(ctx));
      return nullptr;
    } catch (const std::exception& e) {
      return to_status(e, node);
    }
  }
};

bool is_float_type(ONNXTensorElementDataType t) {
  return t == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || t == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 ||
         t == ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16;
}

bool supports_onnx_attention(const OrtNode* node, std::string* why) {
  auto refuse = [why](const std::string& m) {
    *why = "Attention: " + m;
    return false;
  };
  int since = 0;
  check(api().Node_GetSinceVersion(node, &since));
  if (since != 23 && since != 24) return refuse("since_version " + std::to_string(since) + " (supported: 23, 24)");
  // Attributes: an allow-list (opset 23/24), so that anything else is left to ORT.
  static const char* const known[] = {"is_causal", "kv_num_heads",     "q_num_heads",      "qk_matmul_output_mode",
                                      "scale",     "softcap",          "softmax_precision"};
  for (const std::string& name : attribute_names(node)) {
    bool ok = false;
    for (const char* k : known) ok = ok || name == k;
    if (!ok) return refuse("unknown attribute '" + name + "'");
  }
  int64_t v = 0;
  if (node_attr_int(node, "qk_matmul_output_mode", &v) && (v < 0 || v > 3))
    return refuse("qk_matmul_output_mode=" + std::to_string(v) + " (supported: 0, 1, 2, 3)");
  v = 0;
  if (node_attr_int(node, "is_causal", &v) && v != 0 && v != 1) return refuse("is_causal=" + std::to_string(v));
  float scale = 1.0f;
  if (node_attr_float(node, "scale", &scale) && !(scale > 0.0f))  // the kernels read <= 0 as the default
    return refuse("scale=" + std::to_string(scale) + " (supported: > 0)");
  const ONNXTensorElementDataType t = input_type(node, 0);
  if (!is_float_type(t))
    return refuse("input Q type " + std::to_string(static_cast<int>(t)) + " (supported: float, float16, bfloat16)");
  // T1 = Q, K, past_key; T2 = V, past_value: one type for all of them here (the kernels read one).
  const std::vector<std::string> ins = value_names(node, true);
  for (size_t i : {size_t{1}, size_t{2}, size_t{4}, size_t{5}}) {
    if (i >= ins.size() || ins[i].empty()) continue;
    if (input_type(node, i) != t) return refuse("input #" + std::to_string(i) + " has another type than Q");
  }
  if (ins.size() > 3 && !ins[3].empty()) {
    const ONNXTensorElementDataType m = input_type(node, 3);
    if (m != ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL && !is_float_type(m))
      return refuse("attn_mask type " + std::to_string(static_cast<int>(m)) + " (supported: bool, float, float16, bfloat16)");
  }
  // softmax_precision: the kernels' softmax is float32. Claimed when that is at least the asked
  // precision: absent, FLOAT (1), DOUBLE (11: float32 instead, rounded to T1 <= float32 anyway)
  // or T1 itself (what absent means); FLOAT16/BFLOAT16 below a float32 T1 are left to ORT.
  v = 0;
  if (node_attr_int(node, "softmax_precision", &v) && v != 1 && v != 11 && v != static_cast<int64_t>(t))
    return refuse("softmax_precision=" + std::to_string(v) + " below the float32 softmax of the kernels");
  return true;
}

NodeComputeInfo* compile_onnx_attention(const OrtNode* node, const OrtNode* fused_node) {
  auto info = std::make_unique<AttentionComputeInfo>();
  node_attr_int(node, "is_causal", &info->attrs.is_causal);
  node_attr_int(node, "q_num_heads", &info->attrs.q_num_heads);
  node_attr_int(node, "kv_num_heads", &info->attrs.kv_num_heads);
  node_attr_int(node, "qk_matmul_output_mode", &info->attrs.qk_matmul_output_mode);
  node_attr_float(node, "scale", &info->attrs.scale);
  node_attr_float(node, "softcap", &info->attrs.softcap);
  map_by_name(value_names(node, true), value_names(fused_node, true), info->in_index);
  map_by_name(value_names(node, false), value_names(fused_node, false), info->out_index);
  if (info->out_index[0] < 0) throw std::runtime_error("Attention output Y not found");
  return NodeComputeInfo::init(info.release());
}

// ---- com.microsoft GroupQueryAttention ---------------------------------------------

// query, key, value, past_key, past_value, seqlens_k, total_sequence_length, cos_cache, sin_cache
constexpr size_t kGqaInputs = 9;
constexpr size_t kGqaOutputs = 3;  // output, present_key, present_value
const char* const kGqaExtraInputs[] = {"position_ids", "attention_bias", "head_sink", "k_scale",
                                       "v_scale", "q_norm_weight", "k_norm_weight", "query_seqlens"};

struct GqaComputeInfo : NodeComputeInfo {
  ops::GqaAttrs attrs;
  int in_index[kGqaInputs];
  int out_index[kGqaOutputs];

  OrtStatus* run(OrtKernelContext* ctx) noexcept {
    try {
      ops::Tensor t[kGqaInputs];
      const ops::Tensor* p[kGqaInputs];
      read_inputs(ctx, in_index, t, p);
      ops::GqaInputs in;
      in.query = p[0];
      in.key = p[1];
      in.value = p[2];
      in.past_key = p[3];
      in.past_value = p[4];
      in.seqlens_k = p[5];
      in.total_sequence_length = p[6];
      in.cos_cache = p[7];
      in.sin_cache = p[8];
      const ops::GqaShapes s = ops::gqa_shapes(attrs, in);
      void* y = alloc_output(ctx, static_cast<size_t>(out_index[0]), s.output);
      // With an IOBinding of one OrtValue to past_key and present_key, ORT hands that
      // buffer back here: gqa_attention then updates it in place (ORT's shared-buffer mode).
      void* pk = out_index[1] >= 0 ? alloc_output(ctx, static_cast<size_t>(out_index[1]), s.present) : nullptr;
      void* pv = out_index[2] >= 0 ? alloc_output(ctx, static_cast<size_t>(out_index[2]), s.present) : nullptr;
      ops::gqa_attention(attrs, in, s, y, pk, pv, ort_parallel_for(ctx));
      return nullptr;
    } catch (const std::exception& e) {
      return to_status(e, node);
    }
  }
};

bool supports_gqa(const OrtNode* node, std::string* why) {
  auto refuse = [why](const std::string& m) {
    *why = "GroupQueryAttention: " + m;
    return false;
  };
  int since = 0;
  check(api().Node_GetSinceVersion(node, &since));
  if (since != 1) return refuse("since_version " + std::to_string(since) + " (supported: 1)");
  // Attributes: an allow-list, so that anything a newer ORT adds is left to ORT.
  static const char* const known[] = {"num_heads", "kv_num_heads", "scale", "softcap", "local_window_size",
                                      "do_rotary", "rotary_interleaved", "smooth_softmax", "qk_output", "causal",
                                      "kv_cache_bit_width", "k_quant_type", "v_quant_type", "sliding_window_cache",
                                      "qk_norm_epsilon", "q_norm_epsilon", "k_norm_epsilon"};
  for (const std::string& name : attribute_names(node)) {
    bool ok = false;
    for (const char* k : known) ok = ok || name == k;
    if (!ok) return refuse("unknown attribute '" + name + "'");
  }
  int64_t v = 0;
  auto attr_is = [&](const char* name, int64_t dflt, std::initializer_list<int64_t> allowed) {
    v = dflt;
    node_attr_int(node, name, &v);
    for (int64_t x : allowed)
      if (v == x) return true;
    return false;
  };
  if (!attr_is("smooth_softmax", 0, {0, -1})) return refuse("smooth_softmax=" + std::to_string(v) + " (supported: 0, -1 = off)");
  if (!attr_is("qk_output", 0, {0})) return refuse("qk_output=" + std::to_string(v) + " (supported: 0)");
  if (!attr_is("causal", 1, {1})) return refuse("causal=" + std::to_string(v) + " (supported: 1)");
  if (!attr_is("kv_cache_bit_width", 0, {0})) return refuse("kv_cache_bit_width=" + std::to_string(v) + " (quantized cache)");
  if (!attr_is("sliding_window_cache", 0, {0})) return refuse("sliding_window_cache=" + std::to_string(v) + " (supported: 0)");
  if (!attr_is("do_rotary", 0, {0, 1})) return refuse("do_rotary=" + std::to_string(v));
  if (!attr_is("rotary_interleaved", 0, {0, 1})) return refuse("rotary_interleaved=" + std::to_string(v));
  int64_t heads = 0, kv_heads = 0, window = -1;
  node_attr_int(node, "num_heads", &heads);
  node_attr_int(node, "kv_num_heads", &kv_heads);
  node_attr_int(node, "local_window_size", &window);
  if (heads <= 0 || kv_heads <= 0 || heads % kv_heads != 0)
    return refuse("num_heads=" + std::to_string(heads) + ", kv_num_heads=" + std::to_string(kv_heads));
  if (window != -1 && window <= 0) return refuse("local_window_size=" + std::to_string(window) + " (supported: -1, > 0)");
  float scale = 0.0f;
  if (node_attr_float(node, "scale", &scale) && scale < 0.0f) return refuse("negative scale");
  for (const char* name : {"k_quant_type", "v_quant_type"}) {
    std::string q;
    if (node_attr_string(node, name, &q) && !q.empty() && q != "NONE")
      return refuse(std::string(name) + "=" + q + " (quantized cache)");
  }
  const std::vector<std::string> ins = value_names(node, true), outs = value_names(node, false);
  for (size_t i = kGqaInputs; i < ins.size(); ++i)
    if (!ins[i].empty())
      return refuse(std::string("input ") + (i - kGqaInputs < 8 ? kGqaExtraInputs[i - kGqaInputs] : "#" + std::to_string(i)) +
                    " is given (not supported)");
  if (outs.size() > 3 && !outs[3].empty()) return refuse("output output_qk is requested");
  if (outs.size() < 3 || outs[1].empty() || outs[2].empty()) return refuse("present_key/present_value not both requested");
  const ONNXTensorElementDataType t = input_type(node, 0);
  if (t != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && t != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16)
    return refuse("query type " + std::to_string(static_cast<int>(t)) + " (supported: float, float16)");
  for (size_t i : {size_t{3}, size_t{4}}) {
    if (i >= ins.size() || ins[i].empty()) continue;
    const ONNXTensorElementDataType c = input_type(node, i);
    if (c != t) return refuse("past cache type " + std::to_string(static_cast<int>(c)) + " differs from query type (quantized cache)");
  }
  return true;
}

NodeComputeInfo* compile_gqa(const OrtNode* node, const OrtNode* fused_node) {
  auto info = std::make_unique<GqaComputeInfo>();
  int64_t v = 0;
  node_attr_int(node, "num_heads", &info->attrs.num_heads);
  node_attr_int(node, "kv_num_heads", &info->attrs.kv_num_heads);
  node_attr_int(node, "local_window_size", &info->attrs.local_window_size);
  node_attr_float(node, "scale", &info->attrs.scale);
  node_attr_float(node, "softcap", &info->attrs.softcap);
  info->attrs.do_rotary = node_attr_int(node, "do_rotary", &v) && v == 1;
  v = 0;
  info->attrs.rotary_interleaved = node_attr_int(node, "rotary_interleaved", &v) && v == 1;
  map_by_name(value_names(node, true), value_names(fused_node, true), info->in_index);
  map_by_name(value_names(node, false), value_names(fused_node, false), info->out_index);
  if (info->out_index[0] < 0) throw std::runtime_error("GroupQueryAttention output not found");
  return NodeComputeInfo::init(info.release());
}

// Which standard op a node is: 1 = ONNX Attention, 2 = com.microsoft GroupQueryAttention, 0 = neither.
int standard_kind(const OrtNode* node) {
  const char* domain = nullptr;
  const char* op = nullptr;
  check(api().Node_GetDomain(node, &domain));
  check(api().Node_GetOperatorType(node, &op));
  if (!domain || !op) return 0;
  if (domain[0] == '\0' && std::strcmp(op, "Attention") == 0) return 1;
  if (std::strcmp(domain, "com.microsoft") == 0 && std::strcmp(op, "GroupQueryAttention") == 0) return 2;
  return 0;
}

}  // namespace

bool supports_standard_node(const OrtNode* node, std::string* why) {
  why->clear();
  switch (standard_kind(node)) {
    case 1: return supports_onnx_attention(node, why);
    case 2: return supports_gqa(node, why);
    default: return false;
  }
}

OrtStatus* compile_standard_node(const OrtGraph* graph, const OrtNode* fused_node, OrtNodeComputeInfo** out) {
  try {
    size_t n = 0;
    check(api().Graph_GetNumNodes(graph, &n));
    if (n != 1) return make_status(ORT_FAIL, "OnnxLightExecutionProvider: expected one node per fused graph");
    const OrtNode* node = nullptr;
    check(api().Graph_GetNodes(graph, &node, 1));
    const int kind = standard_kind(node);
    if (kind == 0) return make_status(ORT_FAIL, "OnnxLightExecutionProvider: fused node is not an attention op");
    NodeComputeInfo* info = kind == 1 ? compile_onnx_attention(node, fused_node) : compile_gqa(node, fused_node);
    const char* name = nullptr;
    check(api().Node_GetName(node, &name));
    info->node = name ? name : "";
    *out = info;
    return nullptr;
  } catch (const std::exception& e) {
    return make_status(ORT_FAIL, std::string("OnnxLightExecutionProvider: Compile: ") + e.what());
  }
}

void release_compute_info(OrtNodeComputeInfo* info) {
  NodeComputeInfo* n = static_cast<NodeComputeInfo*>(info);
  n->destroy(n);
}

}  // namespace provider
}  // namespace olep
