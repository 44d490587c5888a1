// The plugin execution provider OnnxLightExecutionProvider: factory, device
// selection and the EP itself (ORT plugin-EP API, onnxruntime_ep_c_api.h,
// ORT >= 1.23).
//
// The EP claims every node it runs as a fused single-node graph
// (EpGraphSupportInfo_AddNodesToFuse) and compiles it: ai.onnx_light nodes
// onto the custom-op compute (ep_cache_ops.h, which also checks the graph's
// layers and commit node at session creation), standard attention nodes in
// tensor mode (ep_attention.h).
// It registers no allocator and no data transfer: inputs and outputs stay in
// ORT's CPU memory, zero-copy. OnRunStart/OnRunEnd bound each run for the
// cache arena: a step the run leaves incomplete is rolled back at its end.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kvcache/run_scope.h"
#include "provider/custom_ops.h"
#include "provider/ep_attention.h"
#include "provider/ep_cache_ops.h"
#include "provider/node_util.h"
#include "provider/ort_api.h"

namespace olep {
namespace provider {
namespace {

const OrtEpApi& ep_api() { return *api().GetEpApi(); }

void log(const OrtLogger* logger, OrtLoggingLevel level, const std::string& msg) {
  if (logger == nullptr) return;
  OrtStatus* st = api().Logger_LogMessage(logger, level, msg.c_str(), __FILE__, __LINE__, "OnnxLightEp");
  if (st) api().ReleaseStatus(st);
}

struct Ep : OrtEp {
  const OrtLogger* logger;
  bool tensor_mode;  // claim standard Attention nodes of unconverted models
  CacheGraphInfo cache_info;  // from GetCapability, for Compile

  Ep(const OrtLogger* lg, bool tensor) : OrtEp{}, logger(lg), tensor_mode(tensor) {
    ort_version_supported = ORT_API_VERSION;
    GetName = [](const OrtEp*) noexcept { return kEpName; };
    GetCapability = get_capability;
    Compile = [](OrtEp* self, const OrtGraph** graphs, const OrtNode** fused, size_t count, OrtNodeComputeInfo** infos,
                 OrtNode** ep_context_nodes) noexcept -> OrtStatus* {
      Ep* ep = static_cast<Ep*>(self);
      for (size_t i = 0; i < count; ++i) {
        if (ep_context_nodes) ep_context_nodes[i] = nullptr;
        infos[i] = nullptr;
      }
      for (size_t i = 0; i < count; ++i) {
        try {
          size_t n = 0;
          check(api().Graph_GetNumNodes(graphs[i], &n));
          const OrtNode* node = nullptr;
          if (n == 1) check(api().Graph_GetNodes(graphs[i], &node, 1));
          if (node && is_cache_node(node)) {
            infos[i] = compile_cache_node(node, fused[i], ep->cache_info);
            continue;
          }
        } catch (const std::exception& e) {
          return make_status(ORT_INVALID_ARGUMENT, e.what());
        }
        if (OrtStatus* st = compile_standard_node(graphs[i], fused[i], &infos[i])) return st;
      }
      return nullptr;
    };
    ReleaseNodeComputeInfos = [](OrtEp*, OrtNodeComputeInfo** infos, size_t n) noexcept {
      for (size_t i = 0; i < n; ++i)
        if (infos[i]) release_compute_info(infos[i]);
    };
    GetPreferredDataLayout = nullptr;
    ShouldConvertDataLayoutForOp = nullptr;
    SetDynamicOptions = nullptr;
    // Run boundaries for the arena (kvcache/run_scope.h): a step this run leaves incomplete is
    // rolled back at OnRunEnd (ORT calls it after a failed run too, without the status).
    OnRunStart = [](OrtEp*, const OrtRunOptions*) noexcept -> OrtStatus* {
      try {
        run_scope::begin(/*deferred=*/false);
        return nullptr;
      } catch (const std::exception& e) {
        return make_status(ORT_FAIL, e.what());
      }
    };
    OnRunEnd = [](OrtEp*, const OrtRunOptions*, bool) noexcept -> OrtStatus* {
      run_scope::end(/*ok=*/false);
      return nullptr;
    };
    CreateAllocator = nullptr;
    CreateSyncStreamForDevice = nullptr;
    GetCompiledModelCompatibilityInfo = nullptr;
  }

  static OrtStatus* ORT_API_CALL get_capability(OrtEp* self, const OrtGraph* graph, OrtEpGraphSupportInfo* info) noexcept {
    Ep* ep = static_cast<Ep*>(self);
    try {
      size_t n = 0;
      if (OrtStatus* st = api().Graph_GetNumNodes(graph, &n)) return st;
      std::vector<const OrtNode*> nodes(n);
      if (n)
        if (OrtStatus* st = api().Graph_GetNodes(graph, nodes.data(), n)) return st;
      OrtNodeFusionOptions fusion{};
      fusion.ort_version_supported = ORT_API_VERSION;
      fusion.drop_constant_initializers = false;
      check_cache_graph(nodes, &ep->cache_info);  // its error fails Compile, i.e. session creation
      for (const OrtNode* node : nodes) {
        const char* domain = nullptr;
        const char* op = nullptr;
        if (OrtStatus* st = api().Node_GetDomain(node, &domain)) return st;
        if (OrtStatus* st = api().Node_GetOperatorType(node, &op)) return st;
        if (domain && op && std::strcmp(domain, kDomain) == 0) {
          if (is_cache_node(node)) {
            const OrtNode* one[1] = {node};
            if (OrtStatus* st = ep_api().EpGraphSupportInfo_AddNodesToFuse(info, one, 1, &fusion)) return st;
          } else {
            log(ep->logger, ORT_LOGGING_LEVEL_VERBOSE, std::string("OnnxLightExecutionProvider: not claiming ") + op);
          }
          continue;
        }
        if (!ep->tensor_mode) continue;
        std::string why;
        if (supports_standard_node(node, &why)) {
          const OrtNode* one[1] = {node};
          if (OrtStatus* st = ep_api().EpGraphSupportInfo_AddNodesToFuse(info, one, 1, &fusion)) return st;
        } else if (!why.empty()) {
          log(ep->logger, ORT_LOGGING_LEVEL_VERBOSE, "OnnxLightExecutionProvider: leaving to ORT: " + why);
        }
      }
      return nullptr;
    } catch (const std::exception& e) {
      return make_status(ORT_FAIL, std::string("OnnxLightExecutionProvider: GetCapability: ") + e.what());
    }
  }
};

struct Factory : OrtEpFactory {
  std::string registered_name;
  const OrtLogger* default_logger;

  Factory(const char* name, const OrtLogger* lg) : OrtEpFactory{}, registered_name(name ? name : ""), default_logger(lg) {
    ort_version_supported = ORT_API_VERSION;
    GetName = [](const OrtEpFactory*) noexcept { return kEpName; };
    GetVendor = [](const OrtEpFactory*) noexcept { return kVendor; };
    GetSupportedDevices = get_supported_devices;
    CreateEp = create_ep;
    ReleaseEp = [](OrtEpFactory*, OrtEp* ep) noexcept { delete static_cast<Ep*>(ep); };
    GetVendorId = [](const OrtEpFactory*) noexcept -> uint32_t { return 0; };
    GetVersion = [](const OrtEpFactory*) noexcept { return kVersion; };
    ValidateCompiledModelCompatibilityInfo = [](OrtEpFactory*, const OrtHardwareDevice* const*, size_t, const char*,
                                                OrtCompiledModelCompatibility* out) noexcept -> OrtStatus* {
      *out = OrtCompiledModelCompatibility_EP_NOT_APPLICABLE;
      return nullptr;
    };
    CreateAllocator = [](OrtEpFactory*, const OrtMemoryInfo*, const OrtKeyValuePairs*, OrtAllocator** out) noexcept -> OrtStatus* {
      *out = nullptr;  // ORT's default CPU allocator
      return nullptr;
    };
    ReleaseAllocator = [](OrtEpFactory*, OrtAllocator*) noexcept {};
    CreateDataTransfer = [](OrtEpFactory*, OrtDataTransferImpl** out) noexcept -> OrtStatus* {
      *out = nullptr;  // CPU only: nothing to transfer
      return nullptr;
    };
    IsStreamAware = [](const OrtEpFactory*) noexcept { return false; };
    CreateSyncStreamForDevice = [](OrtEpFactory*, const OrtMemoryDevice*, const OrtKeyValuePairs*,
                                   OrtSyncStreamImpl** out) noexcept -> OrtStatus* {
      *out = nullptr;
      return nullptr;
    };
  }

  static OrtStatus* ORT_API_CALL get_supported_devices(OrtEpFactory* self, const OrtHardwareDevice* const* devices,
                                                       size_t num_devices, OrtEpDevice** ep_devices,
                                                       size_t max_ep_devices, size_t* num_ep_devices) noexcept {
    *num_ep_devices = 0;
    for (size_t i = 0; i < num_devices && *num_ep_devices < max_ep_devices; ++i) {
      if (api().HardwareDevice_Type(devices[i]) != OrtHardwareDeviceType_CPU) continue;
      OrtEpDevice* d = nullptr;
      if (OrtStatus* st = ep_api().CreateEpDevice(self, devices[i], nullptr, nullptr, &d)) return st;
      ep_devices[(*num_ep_devices)++] = d;
      break;  // one CPU device is enough
    }
    return nullptr;
  }

  static OrtStatus* ORT_API_CALL create_ep(OrtEpFactory*, const OrtHardwareDevice* const*,
                                           const OrtKeyValuePairs* const*, size_t, const OrtSessionOptions* so,
                                           const OrtLogger* logger, OrtEp** out) noexcept {
    try {
      // Provider options arrive as session config entries "ep.<lowercased ep name>.<key>".
      bool tensor_mode = true;
      const std::string value = session_option(so, "ep.onnxlightexecutionprovider.tensor_mode");
      if (!value.empty()) {
        if (value != "0" && value != "1")
          return make_status(ORT_INVALID_ARGUMENT, "OnnxLightExecutionProvider: option tensor_mode must be '0' or "
                                                   "'1'; got '" + value + "'");
        tensor_mode = value == "1";
      }
      *out = new Ep(logger, tensor_mode);
      return nullptr;
    } catch (const std::exception& e) {
      return make_status(ORT_FAIL, std::string("OnnxLightExecutionProvider: CreateEp failed: ") + e.what());
    }
  }

  static std::string session_option(const OrtSessionOptions* so, const char* key) {
    int has = 0;
    if (OrtStatus* st = api().HasSessionConfigEntry(so, key, &has)) {
      api().ReleaseStatus(st);
      return "";
    }
    if (!has) return "";
    size_t size = 0;
    if (OrtStatus* st = api().GetSessionConfigEntry(so, key, nullptr, &size)) api().ReleaseStatus(st);
    std::string v(size, '\0');
    if (OrtStatus* st = api().GetSessionConfigEntry(so, key, &v[0], &size)) {
      api().ReleaseStatus(st);
      return "";
    }
    if (!v.empty() && v.back() == '\0') v.pop_back();
    return v;
  }
};

}  // namespace
}  // namespace provider
}  // namespace olep

extern "C" {

/// Plugin-EP library entry point (onnxruntime.register_execution_provider_library).
__attribute__((visibility("default"))) OrtStatus* CreateEpFactories(const char* registered_name,
                                                                    const OrtApiBase* ort_api_base,
                                                                    const OrtLogger* default_logger,
                                                                    OrtEpFactory** factories, size_t max_factories,
                                                                    size_t* num_factories) {
  if (const char* err = olep::provider::init_api(ort_api_base)) {
    const OrtApi* any = ort_api_base ? ort_api_base->GetApi(1) : nullptr;
    return any ? any->CreateStatus(ORT_FAIL, err) : nullptr;
  }
  *num_factories = 0;
  if (max_factories < 1)
    return olep::provider::make_status(ORT_INVALID_ARGUMENT, "onnx_light: ORT offered no room for an EP factory");
  factories[0] = new olep::provider::Factory(registered_name, default_logger);
  *num_factories = 1;
  return nullptr;
}

__attribute__((visibility("default"))) OrtStatus* ReleaseEpFactory(OrtEpFactory* factory) {
  delete static_cast<olep::provider::Factory*>(factory);
  return nullptr;
}

}  // extern "C"
