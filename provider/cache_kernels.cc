#include "provider/cache_kernels.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "provider/kernel_io.h"

namespace olep {
namespace provider {
namespace {

using ops::Tensor;

bool input(OrtKernelContext* ctx, int index, Tensor* t) {
  return index >= 0 && read_input(ctx, static_cast<size_t>(index), t);
}

}  // namespace

OrtStatus* CacheAttentionKernel::compute(OrtKernelContext* ctx) const {
  Tensor t[8];
  ops::CacheAttentionInputs ins;
  const Tensor** slots[8] = {&ins.query, &ins.key, &ins.value, &ins.cache, &ins.attn_mask, &ins.seqlens_k,
                             &ins.cos_cache, &ins.sin_cache};
  try {
    for (int i = 0; i < 8; ++i)
      if (input(ctx, in[i], &t[i])) *slots[i] = &t[i];
    if (!ins.query || !ins.cache)
      throw std::invalid_argument("CacheAttention: inputs 'query' and 'cache' are required");
    const ops::AttentionDims d = ops::cache_attention_dims(attrs, ins);
    // Validate everything that can fail before allocating Y and touching the cache.
    void* y = alloc_output(ctx, static_cast<size_t>(out), ops::output_shape(d));
    ops::cache_attention(attrs, ins, y, ort_parallel_for(ctx));
    return nullptr;
  } catch (const std::exception& e) {
    if (ins.cache) ops::note_failed_run(*ins.cache);
    return to_status(e, node);
  }
}

OrtStatus* CacheExportKernel::compute(OrtKernelContext* ctx) const {
  Tensor cache;
  try {
    if (!input(ctx, cache_in, &cache)) throw std::invalid_argument("CacheExport: input 'cache' is required");
    // An output nobody reads may be absent (a fused node keeps only the outputs in use): the
    // export then writes that half into scratch.
    std::vector<char> scratch[2];
    ops::cache_export(layer, cache, [&](const std::vector<int64_t>& ks, const std::vector<int64_t>& vs, DType dt) {
      const ops::ElemType want = ops::elem_type_of(dt);
      ops::ElemType got[2] = {want, want};
      void* data[2] = {nullptr, nullptr};
      const std::vector<int64_t>* shapes[2] = {&ks, &vs};
      for (int i = 0; i < 2; ++i) {
        if (out[i] >= 0 && has_output(ctx, static_cast<size_t>(out[i]))) {
          data[i] = alloc_output(ctx, static_cast<size_t>(out[i]), *shapes[i], &got[i]);
        } else {
          int64_t n = 1;
          for (int64_t x : *shapes[i]) n *= x;
          scratch[i].resize(static_cast<size_t>(n) * dtype_size(dt) + 1);
          data[i] = scratch[i].data();
        }
      }
      void* kd = data[0];
      void* vd = data[1];
      const ops::ElemType got_k = got[0], got_v = got[1];
      if (got_k != want || got_v != want)
        throw std::invalid_argument(std::string("CacheExport: outputs must have the cache's type ") +
                                    ops::elem_type_name(want) + "; got present_key " + ops::elem_type_name(got_k) +
                                    ", present_value " + ops::elem_type_name(got_v) +
                                    " (set attribute 'dtype' to the cache's TensorProto type)");
      return std::make_pair(kd, vd);
    });
    return nullptr;
  } catch (const std::exception& e) {
    if (cache.data) ops::note_failed_run(cache);
    return to_status(e, node);
  }
}

OrtStatus* CacheShapeKernel::compute(OrtKernelContext* ctx) const {
  Tensor cache;
  try {
    if (!input(ctx, cache_in, &cache)) throw std::invalid_argument("CacheShape: input 'cache' is required");
    int64_t shape[4];
    ops::cache_shape(layer, value, cache, shape);
    auto* y = static_cast<int64_t*>(alloc_output(ctx, static_cast<size_t>(out), {4}));
    std::copy(shape, shape + 4, y);
    return nullptr;
  } catch (const std::exception& e) {
    if (cache.data) ops::note_failed_run(cache);  // the run fails: its open step, if any, is a failure
    return to_status(e, node);
  }
}

OrtStatus* CacheCommitKernel::compute(OrtKernelContext* ctx) const {
  std::vector<Tensor> caches(cache_in.size());
  try {
    for (size_t i = 0; i < cache_in.size(); ++i)
      if (!input(ctx, cache_in[i], &caches[i]))
        throw std::invalid_argument("CacheCommit: input " + std::to_string(i) + " (a cache) is required");
    ops::cache_commit(caches, [&](int64_t n) {
      return static_cast<int64_t*>(alloc_output(ctx, static_cast<size_t>(out), {n}));
    });
    return nullptr;
  } catch (const std::exception& e) {
    for (const Tensor& t : caches)
      if (t.data) ops::note_failed_run(t);
    return to_status(e, node);
  }
}

}  // namespace provider
}  // namespace olep
