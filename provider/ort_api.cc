#include "provider/ort_api.h"

#include <atomic>

namespace olep {
namespace provider {
namespace {
std::atomic<const OrtApi*> g_api{nullptr};
}

const char* init_api(const OrtApiBase* base) {
  if (g_api.load()) return nullptr;
  if (base == nullptr) return "onnx_light: ORT passed no OrtApiBase";
  const OrtApi* a = base->GetApi(ORT_API_VERSION);
  if (a == nullptr)
    return "onnx_light: this onnxruntime is older than 1.23 (it does not offer ORT API version 23); "
           "install onnxruntime>=1.23";
  g_api.store(a);
  return nullptr;
}

const OrtApi& api() { return *g_api.load(); }

OrtStatus* make_status(OrtErrorCode code, const std::string& msg) { return api().CreateStatus(code, msg.c_str()); }

}  // namespace provider
}  // namespace olep
