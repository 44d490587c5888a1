// The EP's side of the ai.onnx_light ops: it claims each CacheAttention,
// CacheExport, CacheCommit and CacheShape node as a fused single-node graph and compiles
// it onto the same compute as the custom-op kernels (cache_kernels.h). Seeing
// the whole graph first (GetCapability), it checks what only the graph can
// tell and fails session creation with the reason:
//   - per cache input, the CacheAttention layers are 0..N-1, each once;
//   - commit_node=1 on a cache's layers comes with exactly one CacheCommit on
//     that cache, and a CacheCommit only with layers that defer to it;
//   - a CacheShape names a layer that a CacheAttention on its cache input has;
// and it gives every CacheAttention the number of layers on its cache input,
// so a cache whose num_layers differs fails the first run with a certain
// diagnosis (before anything is appended).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "provider/node_util.h"
#include "provider/ort_api.h"

namespace olep {
namespace provider {

/// What GetCapability learned about the ai.onnx_light nodes of the graphs it saw.
struct CacheGraphInfo {
  std::string error;                      // first problem found; Compile fails with it
  std::map<std::string, int64_t> layers;  // cache input name -> CacheAttention layers (0 = ambiguous)
};

/// True for CacheAttention, CacheExport, CacheCommit and CacheShape of domain ai.onnx_light.
bool is_cache_node(const OrtNode* node);
/// Checks the ai.onnx_light nodes among `nodes` (one graph) and merges the result into *info.
void check_cache_graph(const std::vector<const OrtNode*>& nodes, CacheGraphInfo* info);
/// The compute of a fused graph holding one ai.onnx_light node. Throws std::invalid_argument
/// (with info.error, or a bad attribute) so session creation fails.
NodeComputeInfo* compile_cache_node(const OrtNode* node, const OrtNode* fused_node, const CacheGraphInfo& info);

}  // namespace provider
}  // namespace olep
