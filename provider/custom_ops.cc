// Registration of the ai.onnx_light custom ops (CacheAttention, CacheExport, CacheCommit, CacheShape)
// with ORT: schemas, shape inference and CPU-EP kernels, so a converted model loads
// everywhere and runs on plain ORT. OnnxLightExecutionProvider, when selected, claims
// the nodes itself (ep_cache_ops.h); both paths run cache_kernels.h. Exceptions never
// cross the C ABI: every callback catches and returns an OrtStatus.
#include "provider/custom_ops.h"

#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "ops/cache_attention.h"
#include "provider/cache_kernels.h"
#include "provider/kernel_io.h"
#include "provider/ort_api.h"

namespace olep {
namespace provider {
namespace {

using ops::ElemType;
using ops::Tensor;

int64_t attr_int(const OrtKernelInfo* info, const char* name, int64_t dflt, bool* present = nullptr) {
  int64_t v = dflt;
  OrtStatus* st = api().KernelInfoGetAttribute_int64(info, name, &v);
  if (present) *present = st == nullptr;
  if (st) {
    api().ReleaseStatus(st);
    return dflt;
  }
  return v;
}

float attr_float(const OrtKernelInfo* info, const char* name, float dflt) {
  float v = dflt;
  OrtStatus* st = api().KernelInfoGetAttribute_float(info, name, &v);
  if (st) {
    api().ReleaseStatus(st);
    return dflt;
  }
  return v;
}

std::string node_name(const OrtKernelInfo* info) {
  size_t size = 0;
  OrtStatus* st = api().KernelInfo_GetNodeName(info, nullptr, &size);
  if (st) {
    api().ReleaseStatus(st);
    return "";
  }
  std::string s(size, '\0');
  st = api().KernelInfo_GetNodeName(info, &s[0], &size);
  if (st) {
    api().ReleaseStatus(st);
    return "";
  }
  if (!s.empty() && s.back() == '\0') s.pop_back();
  return s;
}

// ---------------------------------------------------------------------------
// Shape inference (raw C API so output element types can follow the inputs).

struct InferCtx {
  OrtShapeInferContext* ctx;

  bool input(size_t i, ONNXTensorElementDataType* type, std::vector<int64_t>* dims, std::vector<std::string>* syms) {
    size_t n = 0;
    check(api().ShapeInferContext_GetInputCount(ctx, &n));
    if (i >= n) return false;
    OrtTensorTypeAndShapeInfo* info = nullptr;
    check(api().ShapeInferContext_GetInputTypeShape(ctx, i, &info));  // owned by ORT: not released here
    if (info == nullptr) return false;
    check(api().GetTensorElementType(info, type));
    size_t rank = 0;
    check(api().GetDimensionsCount(info, &rank));
    dims->assign(rank, -1);
    std::vector<const char*> s(rank, nullptr);
    if (rank) {
      check(api().GetDimensions(info, dims->data(), rank));
      check(api().GetSymbolicDimensions(info, s.data(), rank));
    }
    syms->clear();
    for (size_t k = 0; k < rank; ++k) syms->push_back(s[k] ? s[k] : "");
    return true;
  }

  int64_t attr_int(const char* name, int64_t dflt) {
    const OrtOpAttr* a = nullptr;
    OrtStatus* st = api().ShapeInferContext_GetAttribute(ctx, name, &a);
    if (st || a == nullptr) {
      if (st) api().ReleaseStatus(st);
      return dflt;
    }
    int64_t v = dflt;
    size_t out = 0;
    st = api().ReadOpAttr(a, ORT_OP_ATTR_INT, &v, sizeof(v), &out);
    if (st) {
      api().ReleaseStatus(st);
      return dflt;
    }
    return v;
  }

  // An unknown dimension (-1) without a symbol gets a symbol of its own: ORT writes an unnamed
  // inferred dimension into the graph as the value -1 (OrtShapeInferContext::SetOutputTypeShape),
  // which then conflicts with any known value the model's value_info holds for that tensor ("Error
  // merging shape info for output ... source:{-1,-1,-1,-1} target:{-1,4,-1,16}. Falling back to
  // lenient merge" at every session of a converted optimum export) and with a graph output's actual
  // shape. A fresh name per dimension claims no equality with any other dimension.
  void set_output(size_t i, ONNXTensorElementDataType type, const std::vector<int64_t>& dims,
                  const std::vector<std::string>& syms) {
    static std::atomic<uint64_t> unknowns{0};
    OrtTensorTypeAndShapeInfo* info = nullptr;
    check(api().CreateTensorTypeAndShapeInfo(&info));
    std::unique_ptr<OrtTensorTypeAndShapeInfo, void (*)(OrtTensorTypeAndShapeInfo*)> guard(
        info, [](OrtTensorTypeAndShapeInfo* p) { api().ReleaseTensorTypeAndShapeInfo(p); });
    check(api().SetTensorElementType(info, type));
    check(api().SetDimensions(info, dims.data(), dims.size()));
    std::vector<std::string> named(syms);
    named.resize(dims.size());
    for (size_t k = 0; k < dims.size(); ++k)
      if (dims[k] < 0 && named[k].empty()) named[k] = "onnx_light_unk_" + std::to_string(unknowns++);
    std::vector<const char*> s;
    for (const auto& x : named) s.push_back(x.c_str());
    check(api().SetSymbolicDimensions(info, s.data(), s.size()));
    check(api().ShapeInferContext_SetOutputTypeShape(ctx, i, info));
  }
};

// Dimension `i` of an input, as (value, symbol); unknown = (-1, "").
struct Dim {
  int64_t v = -1;
  std::string s;
};

OrtStatus* infer_cache_attention(const OrtCustomOp*, OrtShapeInferContext* c) {
  try {
    InferCtx ic{c};
    ONNXTensorElementDataType qt, vt;
    std::vector<int64_t> qd, vd;
    std::vector<std::string> qs, vs;
    if (!ic.input(0, &qt, &qd, &qs)) return nullptr;
    if (elem_type(qt) != ElemType::kFloat32 && elem_type(qt) != ElemType::kFloat16 && elem_type(qt) != ElemType::kBFloat16)
      return make_status(ORT_INVALID_ARGUMENT, "CacheAttention: input 'query' must be float, float16 or bfloat16");
    // An absent optional input (empty name) may come without a type: treated as absent.
    auto present = [&](size_t i, ONNXTensorElementDataType* t, std::vector<int64_t>* d, std::vector<std::string>* s) {
      try {
        return ic.input(i, t, d, s) && *t != ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
      } catch (const std::exception&) {
        return false;
      }
    };
    ONNXTensorElementDataType kt;
    std::vector<int64_t> kd;
    std::vector<std::string> ks;
    const bool packed = !present(1, &kt, &kd, &ks) && !present(2, &vt, &vd, &vs);
    if (!packed && !present(2, &vt, &vd, &vs)) vd.clear();
    const int64_t hq = ic.attr_int("q_num_heads", 0), hkv = ic.attr_int("kv_num_heads", 0);
    if (packed) {  // [B, S, (Hq + 2*Hkv)*D] -> [B, S, Hq*D]
      std::vector<int64_t> od = {-1, -1, -1};
      std::vector<std::string> os = {"", "", ""};
      if (qd.size() == 3) {
        for (size_t i = 0; i < 2; ++i) {
          od[i] = qd[i];
          os[i] = qs[i];
        }
        const int64_t heads = hq + 2 * hkv;
        if (hq > 0 && hkv > 0 && qd[2] > 0 && qd[2] % heads == 0) od[2] = hq * (qd[2] / heads);
      }
      ic.set_output(0, qt, od, os);
      return nullptr;
    }
    // Y always gets the query's type. Rank 0 here means "rank unknown" (query is never a scalar):
    // then guess from the value's rank, else from the 3-D head attributes, with all dims unknown.
    size_t rank = qd.size();
    if (rank == 0) rank = vd.size() == 3 || vd.size() == 4 ? vd.size() : (hq > 0 ? 3 : 4);
    if (rank != 3 && rank != 4)
      return make_status(ORT_INVALID_ARGUMENT, "CacheAttention: input 'query' must have rank 3 or 4; got rank " +
                                                   std::to_string(rank));
    std::vector<int64_t> od(rank, -1);
    std::vector<std::string> os(rank, "");
    const bool q_known = qd.size() == rank, v_known = vd.size() == rank;
    if (rank == 4) {  // [B, Hq, S, Dv]
      for (size_t i = 0; i < 3 && q_known; ++i) {
        od[i] = qd[i];
        os[i] = qs[i];
      }
      if (v_known) {
        od[3] = vd[3];
        os[3] = vs[3];
      }
    } else {  // [B, S, Hq*Dv]
      for (size_t i = 0; i < 2 && q_known; ++i) {
        od[i] = qd[i];
        os[i] = qs[i];
      }
      if (v_known && hq > 0 && hkv > 0 && vd[2] > 0 && vd[2] % hkv == 0) od[2] = hq * (vd[2] / hkv);
    }
    ic.set_output(0, qt, od, os);
    return nullptr;
  } catch (const std::exception& e) {
    return make_status(ORT_INVALID_ARGUMENT, std::string("CacheAttention shape inference: ") + e.what());
  }
}

OrtStatus* infer_cache_export(const OrtCustomOp*, OrtShapeInferContext* c) {
  try {
    // The cache is a handle, so types and sizes come from optional attributes
    // written by the rewrite: dtype (TensorProto enum, default 1 = float),
    // kv_num_heads, head_dim, v_head_dim (unknown if absent).
    InferCtx ic{c};
    const int64_t dtype = ic.attr_int("dtype", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
    const auto t = static_cast<ONNXTensorElementDataType>(dtype);
    if (elem_type(t) != ElemType::kFloat32 && elem_type(t) != ElemType::kFloat16 && elem_type(t) != ElemType::kBFloat16)
      return make_status(ORT_INVALID_ARGUMENT, "CacheExport: attribute 'dtype' must be 1 (float), 10 (float16) or 16 "
                                               "(bfloat16)");
    const int64_t hkv = ic.attr_int("kv_num_heads", -1), d = ic.attr_int("head_dim", -1);
    const int64_t dv = ic.attr_int("v_head_dim", d);
    // Named symbols for the unknown sizes (an unnamed one reads as -1; see infer_cache_commit).
    ic.set_output(0, t, {-1, hkv, -1, d}, {"batch", "kv_num_heads", "total_sequence_length", "head_dim"});
    ic.set_output(1, t, {-1, hkv, -1, dv}, {"batch", "kv_num_heads", "total_sequence_length", "v_head_dim"});
    return nullptr;
  } catch (const std::exception& e) {
    return make_status(ORT_INVALID_ARGUMENT, std::string("CacheExport shape inference: ") + e.what());
  }
}

OrtStatus* infer_cache_commit(const OrtCustomOp*, OrtShapeInferContext* c) {
  try {
    // A named symbol, not an unnamed -1: ORT reads an unnamed inferred dimension as the value -1
    // and warns on every run that the graph output's {-1} does not match the actual shape.
    InferCtx{c}.set_output(0, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64, {-1}, {"batch"});
    return nullptr;
  } catch (const std::exception& e) {
    return make_status(ORT_INVALID_ARGUMENT, std::string("CacheCommit shape inference: ") + e.what());
  }
}

OrtStatus* infer_cache_shape(const OrtCustomOp*, OrtShapeInferContext* c) {
  try {
    InferCtx{c}.set_output(0, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64, {4}, {""});
    return nullptr;
  } catch (const std::exception& e) {
    return make_status(ORT_INVALID_ARGUMENT, std::string("CacheShape shape inference: ") + e.what());
  }
}

// ---------------------------------------------------------------------------
// OrtCustomOp definitions

enum class OpKind { kCacheAttention, kCacheExport, kCacheCommit, kCacheShape };

// Inputs: CacheAttention(query, [key], [value], cache, [attn_mask], [seqlens_k], [cos_cache],
// [sin_cache]) (key/value absent = packed QKV in query); CacheExport(cache,
// [after]); CacheCommit(cache, after...) with `after` variadic of any types (the graph outputs the
// commit must follow); CacheShape(cache) -> int64 [4].
struct OpInfo {
  const char* name;
  size_t inputs;
  uint32_t required;  // bit i: input i is required
  size_t cache_input;
  size_t outputs;
  bool variadic_tail;
};
const OpInfo& op_info(OpKind k) {
  static const OpInfo infos[] = {
      {"CacheAttention", 8, 0b1001, 3, 1, false},  // query and cache
      {"CacheExport", 2, 0b1, 0, 2, false},
      {"CacheCommit", 2, 0b11, 0, 1, true},
      {"CacheShape", 1, 0b1, 0, 1, false},
  };
  return infos[static_cast<int>(k)];
}

struct OpDef : OrtCustomOp {
  OpKind kind;
  const char* ep;  // nullptr = CPU EP

  OpDef(OpKind k, const char* ep_name) : OrtCustomOp{}, kind(k), ep(ep_name) {
    version = ORT_API_VERSION;
    CreateKernel = nullptr;
    KernelCompute = nullptr;
    GetName = [](const OrtCustomOp* op) { return op_info(static_cast<const OpDef*>(op)->kind).name; };
    GetExecutionProviderType = [](const OrtCustomOp* op) { return static_cast<const OpDef*>(op)->ep; };
    GetInputTypeCount = [](const OrtCustomOp* op) -> size_t { return op_info(static_cast<const OpDef*>(op)->kind).inputs; };
    GetInputType = [](const OrtCustomOp* op, size_t i) {
      return i == op_info(static_cast<const OpDef*>(op)->kind).cache_input ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64
                                                                          : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    };
    GetOutputTypeCount = [](const OrtCustomOp* op) -> size_t { return op_info(static_cast<const OpDef*>(op)->kind).outputs; };
    GetOutputType = [](const OrtCustomOp* op, size_t) {
      const OpKind k = static_cast<const OpDef*>(op)->kind;
      return k == OpKind::kCacheCommit || k == OpKind::kCacheShape ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64
                                                                   : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    };
    KernelDestroy = [](void* k) {
      // Every kernel type is destroyed through this one callback: tag dispatch.
      auto* base = static_cast<KernelHolder*>(k);
      delete base;
    };
    GetInputCharacteristic = [](const OrtCustomOp* op, size_t i) {
      const OpInfo& d = op_info(static_cast<const OpDef*>(op)->kind);
      if (d.variadic_tail && i == d.inputs - 1) return INPUT_OUTPUT_VARIADIC;
      return (d.required >> i) & 1u ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
    };
    GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; };
    GetInputMemoryType = [](const OrtCustomOp*, size_t) { return OrtMemTypeDefault; };
    GetVariadicInputMinArity = [](const OrtCustomOp*) { return 1; };
    GetVariadicInputHomogeneity = [](const OrtCustomOp* op) {
      return static_cast<const OpDef*>(op)->kind == OpKind::kCacheCommit ? 0 : 1;  // `after` mixes types
    };
    GetVariadicOutputMinArity = [](const OrtCustomOp*) { return 1; };
    GetVariadicOutputHomogeneity = [](const OrtCustomOp*) { return 1; };
    CreateKernelV2 = [](const OrtCustomOp* op, const OrtApi*, const OrtKernelInfo* info, void** out) -> OrtStatus* {
      const OpDef* d = static_cast<const OpDef*>(op);
      const std::string node = node_name(info);
      try {
        auto holder = std::make_unique<KernelHolder>();
        holder->kind = d->kind;
        if (d->kind == OpKind::kCacheAttention) {
          ops::CacheAttentionAttrs& a = holder->attention.attrs;
          bool has_layer = false;
          a.layer = attr_int(info, "layer", -1, &has_layer);
          if (!has_layer) throw std::invalid_argument("CacheAttention: attribute 'layer' is required");
          a.q_num_heads = attr_int(info, "q_num_heads", 0);
          a.kv_num_heads = attr_int(info, "kv_num_heads", 0);
          a.scale = attr_float(info, "scale", 0.0f);
          a.is_causal = attr_int(info, "is_causal", 0);
          a.softcap = attr_float(info, "softcap", 0.0f);
          a.local_window_size = attr_int(info, "local_window_size", -1);
          a.commit_node = attr_int(info, "commit_node", 0);
          a.rotary_interleaved = attr_int(info, "rotary_interleaved", 0);
          ops::validate(a);  // a bad model fails at session creation
          holder->attention.node = node;
          a.node_id = reinterpret_cast<uintptr_t>(holder.get());
        } else if (d->kind == OpKind::kCacheCommit) {
          holder->committer.node = node;
          const int64_t n = attr_int(info, "num_caches", 1);
          size_t inputs = 0;
          if (OrtStatus* st = api().KernelInfo_GetInputCount(info, &inputs)) return st;
          if (n < 1 || static_cast<size_t>(n) > inputs)
            throw std::invalid_argument("CacheCommit: attribute 'num_caches' must be in [1, inputs=" +
                                        std::to_string(inputs) + "]; got " + std::to_string(n));
          holder->committer.cache_in.clear();
          for (int64_t i = 0; i < n; ++i) holder->committer.cache_in.push_back(static_cast<int>(i));
        } else if (d->kind == OpKind::kCacheShape) {
          bool has_layer = false;
          holder->shaper.layer = attr_int(info, "layer", -1, &has_layer);
          if (!has_layer || holder->shaper.layer < 0)
            throw std::invalid_argument("CacheShape: attribute 'layer' is required and must be >= 0");
          const int64_t value = attr_int(info, "value", 0);
          if (value != 0 && value != 1)
            throw std::invalid_argument("CacheShape: attribute 'value' must be 0 (past key) or 1 (past value); got " +
                                        std::to_string(value));
          holder->shaper.value = value == 1;
          holder->shaper.node = node;
        } else {
          bool has_layer = false;
          holder->exporter.layer = attr_int(info, "layer", -1, &has_layer);
          if (!has_layer || holder->exporter.layer < 0)
            throw std::invalid_argument("CacheExport: attribute 'layer' is required and must be >= 0");
          holder->exporter.node = node;
        }
        *out = holder.release();
        return nullptr;
      } catch (const std::exception& e) {
        return to_status(e, node);
      }
    };
    KernelComputeV2 = [](void* k, OrtKernelContext* ctx) -> OrtStatus* {
      auto* h = static_cast<KernelHolder*>(k);
      switch (h->kind) {
        case OpKind::kCacheAttention: return h->attention.compute(ctx);
        case OpKind::kCacheExport: return h->exporter.compute(ctx);
        case OpKind::kCacheCommit: return h->committer.compute(ctx);
        case OpKind::kCacheShape: return h->shaper.compute(ctx);
      }
      return nullptr;
    };
    InferOutputShapeFn = kind == OpKind::kCacheAttention ? infer_cache_attention
                         : kind == OpKind::kCacheExport  ? infer_cache_export
                         : kind == OpKind::kCacheShape   ? infer_cache_shape
                                                         : infer_cache_commit;
    GetStartVersion = [](const OrtCustomOp*) { return 1; };
    GetEndVersion = [](const OrtCustomOp*) { return (1 << 30); };
    GetMayInplace = nullptr;
    ReleaseMayInplace = nullptr;
    GetAliasMap = nullptr;
    ReleaseAliasMap = nullptr;
  }

  struct KernelHolder {
    OpKind kind;
    CacheAttentionKernel attention;
    CacheExportKernel exporter;
    CacheCommitKernel committer;
    CacheShapeKernel shaper;
  };
};

const OpDef g_cpu_attention(OpKind::kCacheAttention, nullptr);
const OpDef g_cpu_export(OpKind::kCacheExport, nullptr);
const OpDef g_cpu_commit(OpKind::kCacheCommit, nullptr);
const OpDef g_cpu_shape(OpKind::kCacheShape, nullptr);

}  // namespace

OrtStatus* add_custom_op_domain(OrtSessionOptions* options) {
  // One domain object for the life of the process (the library is never unloaded: -z nodelete);
  // ORT requires it to outlive every session that uses it.
  static OrtCustomOpDomain* domain = nullptr;
  static std::once_flag once;
  static OrtStatus* init_error = nullptr;
  std::call_once(once, [] {
    OrtStatus* st = api().CreateCustomOpDomain(kDomain, &domain);
    for (const OpDef* op : {&g_cpu_attention, &g_cpu_export, &g_cpu_commit, &g_cpu_shape})
      if (st == nullptr) st = api().CustomOpDomain_Add(domain, op);
    if (st) {
      init_error = st;
      domain = nullptr;
    }
  });
  if (domain == nullptr)
    return make_status(ORT_FAIL, std::string("onnx_light: could not create the custom-op domain: ") +
                                     (init_error ? api().GetErrorMessage(init_error) : "unknown error"));
  return api().AddCustomOpDomain(options, domain);
}

}  // namespace provider
}  // namespace olep

namespace {
constexpr const char* kRegisteredKey = "onnx_light.custom_ops_registered";
}

extern "C" {

/// Custom-op library entry point (SessionOptions.register_custom_ops_library).
__attribute__((visibility("default"))) OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options,
                                                                                const OrtApiBase* api_base) {
  if (const char* err = olep::provider::init_api(api_base)) {
    const OrtApi* any = api_base ? api_base->GetApi(1) : nullptr;
    return any ? any->CreateStatus(ORT_FAIL, err) : nullptr;
  }
  // Idempotent per SessionOptions: ORT rejects a second ai.onnx_light domain on one session
  // ("Domain already set in registry"), and users (or register()) may call this twice.
  const OrtApi& a = olep::provider::api();
  int has = 0;
  if (OrtStatus* st = a.HasSessionConfigEntry(options, kRegisteredKey, &has)) return st;
  if (has) return nullptr;
  if (OrtStatus* st = olep::provider::add_custom_op_domain(options)) return st;
  return a.AddSessionConfigEntry(options, kRegisteredKey, "1");
}

}  // extern "C"
