// The compute of the ai.onnx_light ops on an OrtKernelContext: shared by the
// custom-op kernels (custom_ops.cc, inputs and outputs in schema order) and
// the EP's compiled nodes (ep_cache_ops.cc, whose fused node deduplicates and
// reorders them: the index maps say where each schema input and output is).
// Exceptions never leave compute(): they become an OrtStatus whose message
// starts with the arena's error kind when there is one (kernel_io.h).
#pragma once

#include <string>
#include <vector>

#include "ops/cache_attention.h"
#include "provider/ort_api.h"

namespace olep {
namespace provider {

/// CacheAttention(query, [key], [value], cache, [attn_mask], [seqlens_k], [cos_cache], [sin_cache]) -> Y.
struct CacheAttentionKernel {
  ops::CacheAttentionAttrs attrs;
  std::string node;
  int in[8] = {0, 1, 2, 3, 4, 5, 6, 7};  // context input index per schema input, -1 = absent
  int out = 0;
  OrtStatus* compute(OrtKernelContext* ctx) const;
};

/// CacheExport(cache, [after]) -> present_key, present_value.
struct CacheExportKernel {
  int64_t layer = -1;
  std::string node;
  int cache_in = 0;
  int out[2] = {0, 1};
  OrtStatus* compute(OrtKernelContext* ctx) const;
};

/// CacheShape(cache) -> shape (int64 [4]); attribute value: 0 = past key shape, 1 = past value.
struct CacheShapeKernel {
  int64_t layer = -1;
  bool value = false;
  std::string node;
  int cache_in = 0;
  int out = 0;
  OrtStatus* compute(OrtKernelContext* ctx) const;
};

/// CacheCommit(cache, after...) -> seq_lens; attribute num_caches (default 1): the first
/// num_caches inputs are caches, committed together.
struct CacheCommitKernel {
  std::string node;
  std::vector<int> cache_in = {0};  // context input index of each cache
  int out = 0;
  OrtStatus* compute(OrtKernelContext* ctx) const;
};

}  // namespace provider
}  // namespace olep
