// Registration of the ai.onnx_light custom-op domain (schemas, shape inference and
// CPU-EP kernels of CacheAttention, CacheExport, CacheCommit, CacheShape) on a session's options.
#pragma once

#include "provider/ort_api.h"

namespace olep {
namespace provider {

/// Adds the process-wide ai.onnx_light domain to `options`. init_api() must have run.
OrtStatus* add_custom_op_domain(OrtSessionOptions* options);

}  // namespace provider
}  // namespace olep
