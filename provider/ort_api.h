// The only place C++ sees ORT's headers (API version 23, from Debian's
// libonnxruntime-dev 1.23.2). The OrtApi comes from the OrtApiBase that ORT
// hands to RegisterCustomOps / CreateEpFactories: this library never links
// libonnxruntime (that would map a second ORT into the process).
#pragma once

#include <onnxruntime_c_api.h>
// onnxruntime_c_api.h includes onnxruntime_ep_c_api.h (which has no include guard).

#include <string>

namespace olep {
namespace provider {

constexpr const char* kEpName = "OnnxLightExecutionProvider";
constexpr const char* kDomain = "ai.onnx_light";
constexpr const char* kVendor = "onnx-light";
constexpr const char* kVersion = "0.2.0";

/// Initializes the API table from ORT's base (GetApi(ORT_API_VERSION)).
/// Returns an error message if this ORT is older than the headers (API 23 = ORT 1.23).
const char* init_api(const OrtApiBase* base);
const OrtApi& api();

/// Wraps a message in an OrtStatus (ORT takes ownership).
OrtStatus* make_status(OrtErrorCode code, const std::string& msg);

}  // namespace provider
}  // namespace olep
