#include "provider/ep_attention.h"

#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "ops/attention_tensor.h"
#include "provider/kernel_io.h"

namespace olep {
namespace provider {
namespace {

void release(OrtStatus* st) {
  if (st) api().ReleaseStatus(st);
}

bool node_attr_int(const OrtNode* n, const char* name, int64_t* v) {
  const OrtOpAttr* a = nullptr;
  OrtStatus* st = api().Node_GetAttributeByName(n, name, &a);
  if (st || a == nullptr) {
    release(st);
    return false;
  }
  size_t out = 0;
  st = api().ReadOpAttr(a, ORT_OP_ATTR_INT, v, sizeof(*v), &out);
  if (st) {
    release(st);
    return false;
  }
  return true;
}

bool node_attr_float(const OrtNode* n, const char* name, float* v) {
  const OrtOpAttr* a = nullptr;
  OrtStatus* st = api().Node_GetAttributeByName(n, name, &a);
  if (st || a == nullptr) {
    release(st);
    return false;
  }
  size_t out = 0;
  st = api().ReadOpAttr(a, ORT_OP_ATTR_FLOAT, v, sizeof(*v), &out);
  if (st) {
    release(st);
    return false;
  }
  return true;
}

// Names of a node's inputs or outputs ("" for an omitted optional one).
std::vector<std::string> value_names(const OrtNode* n, bool inputs) {
  size_t count = 0;
  check(inputs ? api().Node_GetNumInputs(n, &count) : api().Node_GetNumOutputs(n, &count));
  std::vector<const OrtValueInfo*> vi(count, nullptr);
  if (count) check(inputs ? api().Node_GetInputs(n, vi.data(), count) : api().Node_GetOutputs(n, vi.data(), count));
  std::vector<std::string> names;
  for (const OrtValueInfo* v : vi) {
    const char* name = nullptr;
    if (v) check(api().GetValueInfoName(v, &name));
    names.push_back(name ? name : "");
  }
  return names;
}

ONNXTensorElementDataType input_type(const OrtNode* n, size_t index) {
  size_t count = 0;
  check(api().Node_GetNumInputs(n, &count));
  if (index >= count) return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  std::vector<const OrtValueInfo*> vi(count, nullptr);
  check(api().Node_GetInputs(n, vi.data(), count));
  if (!vi[index]) return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  const OrtTypeInfo* ti = nullptr;
  check(api().GetValueInfoTypeInfo(vi[index], &ti));
  const OrtTensorTypeAndShapeInfo* tsi = nullptr;
  check(api().CastTypeInfoToTensorInfo(ti, &tsi));
  if (!tsi) return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  ONNXTensorElementDataType t;
  check(api().GetTensorElementType(tsi, &t));
  return t;
}

constexpr int kInputs = 7;   // Q, K, V, attn_mask, past_key, past_value, nonpad_kv_seqlen
constexpr int kOutputs = 3;  // Y, present_key, present_value

struct AttentionComputeInfo : OrtNodeComputeInfo {
  ops::OnnxAttentionAttrs attrs;
  int in_index[kInputs];    // fused-node input index of each ONNX input, -1 = absent
  int out_index[kOutputs];  // fused-node output index, -1 = not requested
  std::string node;

  AttentionComputeInfo() : OrtNodeComputeInfo{} {
    ort_version_supported = ORT_API_VERSION;
    CreateState = [](OrtNodeComputeInfo* self, OrtNodeComputeContext*, void** state) noexcept -> OrtStatus* {
      *state = self;
      return nullptr;
    };
    Compute = [](OrtNodeComputeInfo* self, void*, OrtKernelContext* ctx) noexcept -> OrtStatus* {
      return static_cast<AttentionComputeInfo*>(self)->run(ctx);
    };
    ReleaseState = [](OrtNodeComputeInfo*, void*) noexcept {};
  }

  OrtStatus* run(OrtKernelContext* ctx) noexcept {
    try {
      ops::Tensor t[kInputs];
      const ops::Tensor* p[kInputs] = {};
      for (int i = 0; i < kInputs; ++i)
        if (in_index[i] >= 0 && read_input(ctx, static_cast<size_t>(in_index[i]), &t[i])) p[i] = &t[i];
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
      ops::onnx_attention(attrs, in, s, y, pk, pv, ort_parallel_for(ctx));
      return nullptr;
    } catch (const std::exception& e) {
      return to_status(e, node);
    }
  }
};

}  // namespace

bool supports_standard_node(const OrtNode* node, std::string* why) {
  why->clear();
  const char* domain = nullptr;
  const char* op = nullptr;
  check(api().Node_GetDomain(node, &domain));
  check(api().Node_GetOperatorType(node, &op));
  if (!domain || !op || domain[0] != '\0' || std::strcmp(op, "Attention") != 0) return false;
  int since = 0;
  check(api().Node_GetSinceVersion(node, &since));
  if (since != 23 && since != 24) {
    *why = "Attention since_version " + std::to_string(since) + " (supported: 23, 24)";
    return false;
  }
  const std::vector<std::string> outs = value_names(node, false);
  if (outs.size() > 3 && !outs[3].empty()) {
    *why = "Attention output qk_matmul_output is requested";
    return false;
  }
  int64_t mode = 0;
  if (node_attr_int(node, "qk_matmul_output_mode", &mode) && mode != 0) {
    *why = "Attention qk_matmul_output_mode=" + std::to_string(mode);
    return false;
  }
  const ONNXTensorElementDataType t = input_type(node, 0);
  if (t != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && t != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16) {
    *why = "Attention input Q type " + std::to_string(static_cast<int>(t)) + " (supported: float, float16)";
    return false;
  }
  return true;
}

OrtStatus* compile_standard_node(const OrtGraph* graph, const OrtNode* fused_node, OrtNodeComputeInfo** out) {
  try {
    size_t n = 0;
    check(api().Graph_GetNumNodes(graph, &n));
    if (n != 1) return make_status(ORT_FAIL, "OnnxLightExecutionProvider: expected one node per fused graph");
    const OrtNode* node = nullptr;
    check(api().Graph_GetNodes(graph, &node, 1));
    auto info = std::make_unique<AttentionComputeInfo>();
    node_attr_int(node, "is_causal", &info->attrs.is_causal);
    node_attr_int(node, "q_num_heads", &info->attrs.q_num_heads);
    node_attr_int(node, "kv_num_heads", &info->attrs.kv_num_heads);
    node_attr_float(node, "scale", &info->attrs.scale);
    node_attr_float(node, "softcap", &info->attrs.softcap);
    const char* name = nullptr;
    check(api().Node_GetName(node, &name));
    info->node = name ? name : "";
    // ORT deduplicates and reorders a fused node's inputs: map them by name.
    const std::vector<std::string> ins = value_names(node, true), outs = value_names(node, false);
    const std::vector<std::string> fins = value_names(fused_node, true), fouts = value_names(fused_node, false);
    auto find = [](const std::vector<std::string>& v, const std::string& s) -> int {
      if (s.empty()) return -1;
      for (size_t i = 0; i < v.size(); ++i)
        if (v[i] == s) return static_cast<int>(i);
      return -1;
    };
    for (int i = 0; i < kInputs; ++i) info->in_index[i] = i < static_cast<int>(ins.size()) ? find(fins, ins[static_cast<size_t>(i)]) : -1;
    for (int i = 0; i < kOutputs; ++i)
      info->out_index[i] = i < static_cast<int>(outs.size()) ? find(fouts, outs[static_cast<size_t>(i)]) : -1;
    if (info->out_index[0] < 0) return make_status(ORT_FAIL, "OnnxLightExecutionProvider: Attention output Y not found");
    *out = info.release();
    return nullptr;
  } catch (const std::exception& e) {
    return make_status(ORT_FAIL, std::string("OnnxLightExecutionProvider: Compile: ") + e.what());
  }
}

void release_compute_info(OrtNodeComputeInfo* info) { delete static_cast<AttentionComputeInfo*>(info); }

}  // namespace provider
}  // namespace olep
