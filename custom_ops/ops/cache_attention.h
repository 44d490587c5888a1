// ai.onnx_light::CacheAttention (since_version 1), CacheExport, CacheCommit and CacheShape: what the
// ops mean, their validation, and their execution against the KVCache arena.
// Semantics: ONNX Attention opset 23 (onnx.ai, Operators/Attention) with
// past_key/past_value taken from the cache; GQA head mapping, seqlens_k, packed
// QKV and rotary (cos_cache/sin_cache, rotary_interleaved) as in ORT
// com.microsoft.GroupQueryAttention with do_rotary=1 and RotaryEmbedding
// (docs/ContribOperators.md), rotary positions taken from the cache.
// Full contract: docs/API.md. No ORT here.
#pragma once

#include <cstdint>
#include <vector>

#include "ops/attention_core.h"
#include "ops/tensor.h"

namespace olep {
namespace ops {

/// CacheAttention attributes. scale 0 = default 1/sqrt(head_dim).
struct CacheAttentionAttrs {
  int64_t layer = -1;
  int64_t q_num_heads = 0;
  int64_t kv_num_heads = 0;
  float scale = 0.0f;
  int64_t is_causal = 0;
  float softcap = 0.0f;
  int64_t local_window_size = -1;
  /// 1: a CacheCommit node completes the run's step (the converter writes it); 0: the last layer does.
  int64_t commit_node = 0;
  /// Rotary pairing when cos_cache/sin_cache are given: 0 = halves (x[i], x[i + rotary_dim/2]),
  /// 1 = adjacent (x[2i], x[2i + 1]); GroupQueryAttention's rotary_interleaved.
  int64_t rotary_interleaved = 0;
  /// Not an attribute: the number of CacheAttention layers the EP saw on this node's cache input
  /// at session creation (0 = unknown, the CPU EP path). A cache whose num_layers differs fails
  /// the run before anything is written.
  int64_t graph_layers = 0;
  /// Not an attribute: an opaque id of the node (its kernel), 0 = unknown. On the plain CPU EP
  /// path, layer 0 of a node rolls back a step the same node left open on another cache in an
  /// earlier run on this thread (a failed run gives no other signal).
  uint64_t node_id = 0;
};

/// Throws std::invalid_argument ("CacheAttention: attribute '<name>' ...") for bad values.
void validate(const CacheAttentionAttrs& a);

/// The inputs of one CacheAttention call in schema order; absent optional inputs are null.
///   query      T [B, S, Hq*D] or [B, Hq, S, D]; packed QKV (key and value null): T
///              [B, S, (Hq + 2*Hkv)*D] holding q, k, v heads in that order (GroupQueryAttention).
///   key/value  T [B, S, Hkv*D] / [B, S, Hkv*Dv] or BNSH; both null = packed QKV.
///   cache      int64 [1] or scalar handle (required).
///   attn_mask, seqlens_k  as documented in docs/API.md.
///   cos_cache/sin_cache   T [max_position, rotary_dim/2], both or neither: rotary applied
///              to Q and the new K (K is cached rotated) at positions P_b + s, s < n_b.
struct CacheAttentionInputs {
  const Tensor* query = nullptr;
  const Tensor* key = nullptr;
  const Tensor* value = nullptr;
  const Tensor* cache = nullptr;
  const Tensor* attn_mask = nullptr;
  const Tensor* seqlens_k = nullptr;
  const Tensor* cos_cache = nullptr;
  const Tensor* sin_cache = nullptr;
};

/// Validates query/key/value (packed or not) and cos_cache/sin_cache against the attributes
/// and returns the dims (v_head_dim = head_dim for packed QKV). Touches no cache.
/// Throws std::invalid_argument "CacheAttention: <what>; expected <X>, got <Y>" naming the input.
AttentionDims cache_attention_dims(const CacheAttentionAttrs& a, const CacheAttentionInputs& in);

/// Appends the new K/V rows (rotated K with cos/sin) to layer a.layer of in.cache and writes Y
/// (query's dtype, output_shape(cache_attention_dims(a, in))) to `y`. Everything that can fail
/// (shapes, handle, geometry, seqlens_k range, a rotary position >= max_position) is checked
/// before anything is written. Throws std::invalid_argument (bad input), MemoryLimitError or
/// BusyError (kvcache/errors.h); the cache is unchanged then (the run's step is rolled back
/// when the run ends). Rotary costs O(B*S*(Hq+Hkv)*D) plus scratch for the rotated rows.
void cache_attention(const CacheAttentionAttrs& a, const CacheAttentionInputs& in, void* y,
                     const ParallelFor& parallel_for);

/// Appends key/value to layer a.layer of the cache named by `cache` and writes
/// Y (query's dtype, output_shape(d)) to `y`. mask and seqlens_k may be null.
/// Throws std::invalid_argument (bad input), MemoryLimitError or BusyError (kvcache/errors.h);
/// the cache is unchanged then (the run's step is rolled back when the run ends).
void cache_attention(const CacheAttentionAttrs& a, const Tensor& query, const Tensor& key, const Tensor& value,
                     const Tensor& cache, const Tensor* attn_mask, const Tensor* seqlens_k, void* y,
                     const ParallelFor& parallel_for);

/// Best effort, never throws: marks the calling thread's open step on the cache named by
/// `cache` as failed, for errors raised outside cache_attention (e.g. while preparing
/// outputs), so the short-model diagnosis does not count that run.
void note_failed_run(const Tensor& cache) noexcept;

/// CacheCommit: completes the current run's step on each of `caches` (every layer must have
/// appended in this run; all are checked before any commits) and writes the lengths the steps
/// give their sequences, cache after cache (int64 [sum of batches]), through `alloc(n)`.
/// Throws std::invalid_argument for a model with fewer attention layers than a cache (certain:
/// the node runs after every graph output), or for a cache named twice.
void cache_commit(const std::vector<Tensor>& caches, const std::function<int64_t*(int64_t n)>& alloc);

/// CacheExport: layer `layer` as BNSH present_key [B, Hkv, L, D], present_value
/// [B, Hkv, L, Dv], including this thread's pending rows of that layer.
/// `alloc(key_shape, value_shape, dtype)` returns the two output buffers, which must hold
/// elements of `dtype` (the cache's; the caller checks its outputs' type and throws
/// std::invalid_argument otherwise); this zero-fills them. Zero-size buffers may be null.
using ExportOutputs = std::function<std::pair<void*, void*>(const std::vector<int64_t>& key_shape,
                                                            const std::vector<int64_t>& value_shape, DType dtype)>;
void cache_export(int64_t layer, const Tensor& cache, const ExportOutputs& alloc);

/// CacheShape: the shape the past tensor of layer `layer` would have, read from the cache:
/// [batch_size, kv_num_heads, P, head_dim] (value = false: the past key) or [..., v_head_dim]
/// (value = true: the past value), P = the largest committed length max_b seq_lens[b] (the rows
/// of the runs that committed before this one; a run's own appended rows never count, wherever
/// the node runs in the graph), which is the length CacheExport gives and the key count
/// CacheAttention's mask columns start from (T_total = P + S). Writes the 4 values to `out`.
/// Throws std::invalid_argument (bad handle, layer out of range).
void cache_shape(int64_t layer, bool value, const Tensor& cache, int64_t out[4]);

}  // namespace ops
}  // namespace olep
