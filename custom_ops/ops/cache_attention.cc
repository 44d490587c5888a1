#include "ops/cache_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/attention.h"
#include "kvcache/errors.h"
#include "kvcache/registry.h"
#include "kvcache/run_scope.h"

namespace olep {
namespace ops {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument("CacheAttention: " + msg); }

}  // namespace

void validate(const CacheAttentionAttrs& a) {
  if (a.layer < 0) fail("attribute 'layer' is required and must be >= 0; got " + str(a.layer));
  if (a.q_num_heads < 0) fail("attribute 'q_num_heads' must be >= 0; got " + str(a.q_num_heads));
  if (a.kv_num_heads < 0) fail("attribute 'kv_num_heads' must be >= 0; got " + str(a.kv_num_heads));
  if (a.q_num_heads > 0 && a.kv_num_heads > 0 && a.q_num_heads % a.kv_num_heads != 0)
    fail("attribute 'q_num_heads' (" + str(a.q_num_heads) + ") must be a multiple of 'kv_num_heads' (" +
         str(a.kv_num_heads) + ")");
  if (!(a.scale >= 0.0f) || std::isinf(a.scale)) fail("attribute 'scale' must be finite and >= 0 (0 = 1/sqrt(head_dim))");
  if (a.is_causal != 0 && a.is_causal != 1) fail("attribute 'is_causal' must be 0 or 1; got " + str(a.is_causal));
  if (!(a.softcap >= 0.0f) || std::isinf(a.softcap)) fail("attribute 'softcap' must be finite and >= 0 (0 = off)");
  if (a.local_window_size == 0 || a.local_window_size < -1)
    fail("attribute 'local_window_size' must be -1 (none) or >= 1; got " + str(a.local_window_size));
  if (a.commit_node != 0 && a.commit_node != 1) fail("attribute 'commit_node' must be 0 or 1; got " + str(a.commit_node));
}

namespace {
void cache_attention_impl(const CacheAttentionAttrs& a, const Tensor& query, const Tensor& key, const Tensor& value,
                          const std::shared_ptr<KVCache>& cache, const Tensor* mask, const Tensor* seqlens_k, void* y,
                          const ParallelFor& parallel_for);
}  // namespace

namespace {
std::shared_ptr<KVCache> cache_of(const Tensor& cache_t, const char* op) {
  const int64_t handle = read_cache_handle(cache_t, op);
  try {
    return Registry::instance().cache(handle);
  } catch (...) {
    rethrow_with_prefix(std::string(op) + ": input 'cache': ");
  }
}
}  // namespace

void cache_attention(const CacheAttentionAttrs& a, const Tensor& query, const Tensor& key, const Tensor& value,
                     const Tensor& cache_t, const Tensor* mask, const Tensor* seqlens_k, void* y,
                     const ParallelFor& parallel_for) {
  std::shared_ptr<KVCache> cache = cache_of(cache_t, "CacheAttention");
  if (a.layer == 0 && a.node_id != 0 && !run_scope::current().bounded())
    Registry::instance().drop_stale_steps_of_node(std::this_thread::get_id(), a.node_id, cache.get());
  try {
    cache_attention_impl(a, query, key, value, cache, mask, seqlens_k, y, parallel_for);
  } catch (...) {
    cache->mark_step_failed();  // this run's unfinished step is a failure, not a short model
    throw;
  }
}

void note_failed_run(const Tensor& cache_t) noexcept {
  try {
    cache_of(cache_t, "CacheAttention")->mark_step_failed();
  } catch (...) {
  }
}

namespace {
void cache_attention_impl(const CacheAttentionAttrs& a, const Tensor& query, const Tensor& key, const Tensor& value,
                          const std::shared_ptr<KVCache>& cache, const Tensor* mask, const Tensor* seqlens_k, void* y,
                          const ParallelFor& parallel_for) {
  validate(a);
  const AttentionDims d = resolve_dims("CacheAttention", a.q_num_heads, a.kv_num_heads, query, key, value);
  const CacheGeometry& g = cache->geometry();
  const DType dt = to_dtype(query.type, "CacheAttention: input 'query'");
  if (g.dtype != dt)
    fail(std::string("input 'cache' stores ") + dtype_name(g.dtype) + " but 'query' is " + elem_type_name(query.type));
  if (g.kv_num_heads != d.kv_heads)
    fail("input 'cache' has kv_num_heads=" + str(g.kv_num_heads) + " but 'key' has " + str(d.kv_heads));
  if (g.head_dim != d.head_dim)
    fail("input 'cache' has head_dim=" + str(g.head_dim) + " but 'key' has " + str(d.head_dim));
  if (g.v_head_dim != d.v_head_dim)
    fail("input 'cache' has v_head_dim=" + str(g.v_head_dim) + " but 'value' has " + str(d.v_head_dim));
  if (g.batch_size != d.batch)
    fail("input 'cache' has batch_size=" + str(g.batch_size) + " but 'query' has batch " + str(d.batch));
  if (a.layer >= g.num_layers)
    fail("attribute 'layer' (" + str(a.layer) + ") must be < num_layers of input 'cache' (" + str(g.num_layers) + ")");

  if (a.graph_layers > 0 && a.graph_layers != g.num_layers)
    fail(std::string("the model has ") + (a.graph_layers < g.num_layers ? "fewer" : "more") +
         " attention layers than the cache: " + str(a.graph_layers) + " on this cache input, but input 'cache' "
         "has num_layers=" + str(g.num_layers) + " (create the cache with KVCache.for_model, or num_layers=" +
         str(a.graph_layers) + "); nothing was appended");
  const int64_t cache_window = g.window(a.layer);
  if (cache_window > 0 && (a.local_window_size <= 0 || a.local_window_size > cache_window))
    fail("layer " + str(a.layer) + " of input 'cache' keeps only the last sliding_window=" + str(cache_window) +
         " positions (plus rollback_tokens) but this node attends " +
         (a.local_window_size <= 0 ? std::string("without a window (local_window_size=-1)")
                                   : "to local_window_size=" + str(a.local_window_size) + " keys") +
         "; the node needs local_window_size <= " + str(cache_window) +
         ", or a cache without sliding_window on this layer");

  auto lock = cache->lock();
  const std::vector<int64_t> past = cache->lengths_locked();

  // Valid new rows per sequence.
  std::vector<int64_t> num_new(static_cast<size_t>(d.batch), d.seq);
  if (seqlens_k) {
    const bool shape_ok = (seqlens_k->shape.size() == 1 && seqlens_k->shape[0] == d.batch) ||
                          (seqlens_k->shape.size() == 2 && seqlens_k->shape[0] == d.batch && seqlens_k->shape[1] == 1);
    if (!shape_ok || (seqlens_k->type != ElemType::kInt32 && seqlens_k->type != ElemType::kInt64))
      fail("input 'seqlens_k' must be int32 or int64 [" + str(d.batch) + "] or [" + str(d.batch) + ", 1]; got " +
           elem_type_name(seqlens_k->type) + " " + shape_str(seqlens_k->shape));
    for (int64_t b = 0; b < d.batch; ++b) {
      const int64_t sk = seqlens_k->type == ElemType::kInt32 ? static_cast<const int32_t*>(seqlens_k->data)[b]
                                                             : static_cast<const int64_t*>(seqlens_k->data)[b];
      // sk must be in [P - 1, P + S - 1]; P <= 2^24 and S is a tensor dimension, so the bounds
      // cannot overflow, and n = sk - (P - 1) is computed only once sk is inside them.
      const int64_t lo = past[static_cast<size_t>(b)] - 1, hi = past[static_cast<size_t>(b)] + d.seq - 1;
      if (sk < lo || sk > hi)
        fail("input 'seqlens_k'[" + str(b) + "] = " + str(sk) + " must be in [" + str(lo) + ", " + str(hi) +
             "] (total valid length - 1; the cache holds " + str(past[static_cast<size_t>(b)]) + " tokens and S=" +
             str(d.seq) + ")");
      num_new[static_cast<size_t>(b)] = sk - lo;
    }
  }
  int64_t max_keys = 0;
  for (int64_t b = 0; b < d.batch; ++b)
    max_keys = std::max(max_keys, past[static_cast<size_t>(b)] + num_new[static_cast<size_t>(b)]);

  MaskSpec mask_spec;
  if (mask) mask_spec = parse_mask("CacheAttention", *mask, d, max_keys);

  // Nothing has been written yet; from here on the run's step changes (invisible until it commits).
  try {
    cache->begin_layer_append(a.layer, d.seq, num_new, a.commit_node != 0, a.node_id);
  } catch (...) {
    rethrow_with_prefix("CacheAttention: input 'cache': ");
  }
  int64_t ks[3], vs[3];
  layout_strides(d.rank, d.kv_heads, d.seq, d.head_dim, ks);
  layout_strides(d.rank, d.kv_heads, d.seq, d.v_head_dim, vs);
  NewRows rows;
  rows.key = key.data;
  rows.value = value.data;
  std::copy(ks, ks + 3, rows.key_strides);
  std::copy(vs, vs + 3, rows.value_strides);
  rows.sequence_length = d.seq;
  rows.num_new = num_new.data();
  cache->append_rows(a.layer, rows);

  AttentionCall call;
  call.d = d;
  call.dtype = dt;
  call.q = query.data;
  call.y = y;
  call.scale = a.scale;
  call.softcap = a.softcap;
  call.is_causal = a.is_causal != 0;
  call.local_window_size = a.local_window_size;
  call.q_offset = past;
  call.num_valid_rows = num_new;
  call.num_keys.resize(static_cast<size_t>(d.batch));
  for (int64_t b = 0; b < d.batch; ++b)
    call.num_keys[static_cast<size_t>(b)] = past[static_cast<size_t>(b)] + num_new[static_cast<size_t>(b)];
  call.mask = mask ? &mask_spec : nullptr;
  // With a window, keys before the first row's window are never read: leave their pages out.
  std::vector<int64_t> first_key;
  if (a.local_window_size > 0)
    for (int64_t b = 0; b < d.batch; ++b)
      first_key.push_back(std::max<int64_t>(0, past[static_cast<size_t>(b)] - a.local_window_size + 1));
  cache->block_list(a.layer, first_key, call.num_keys, &call.blocks);
  run_attention(call, parallel_for);
  cache->finish_layer_append(a.layer);
}
}  // namespace

void cache_export(int64_t layer, const Tensor& cache_t, const ExportOutputs& alloc) {
  if (layer < 0) throw std::invalid_argument("CacheExport: attribute 'layer' is required and must be >= 0");
  std::shared_ptr<KVCache> cache = cache_of(cache_t, "CacheExport");
  const CacheGeometry& g = cache->geometry();
  if (layer >= g.num_layers)
    throw std::invalid_argument("CacheExport: attribute 'layer' (" + str(layer) + ") must be < num_layers of input "
                                "'cache' (" + str(g.num_layers) + ")");
  const size_t es = dtype_size(g.dtype);
  cache->export_layer(layer, /*include_pending=*/true, [&](int64_t L) {
    const std::vector<int64_t> ks = {g.batch_size, g.kv_num_heads, L, g.head_dim};
    const std::vector<int64_t> vs = {g.batch_size, g.kv_num_heads, L, g.v_head_dim};
    std::pair<void*, void*> out = alloc(ks, vs, g.dtype);
    const size_t kn = static_cast<size_t>(g.batch_size * g.kv_num_heads * L);
    if (kn) {
      std::memset(out.first, 0, kn * static_cast<size_t>(g.head_dim) * es);
      std::memset(out.second, 0, kn * static_cast<size_t>(g.v_head_dim) * es);
    }
    return out;
  });
}

void cache_shape(int64_t layer, bool value, const Tensor& cache_t, int64_t out[4]) {
  if (layer < 0) throw std::invalid_argument("CacheShape: attribute 'layer' is required and must be >= 0");
  std::shared_ptr<KVCache> cache = cache_of(cache_t, "CacheShape");
  const CacheGeometry& g = cache->geometry();
  if (layer >= g.num_layers)
    throw std::invalid_argument("CacheShape: attribute 'layer' (" + str(layer) + ") must be < num_layers of input "
                                "'cache' (" + str(g.num_layers) + ")");
  int64_t past = 0;
  {
    auto lock = cache->lock();  // committed lengths only: an open step (this run's or a stale one) adds nothing
    for (int64_t len : cache->lengths_locked()) past = std::max(past, len);
  }
  out[0] = g.batch_size;
  out[1] = g.kv_num_heads;
  out[2] = past;
  out[3] = value ? g.v_head_dim : g.head_dim;
}

void cache_commit(const std::vector<Tensor>& caches_t, const std::function<int64_t*(int64_t n)>& alloc) {
  std::vector<std::shared_ptr<KVCache>> caches;
  for (const Tensor& t : caches_t) {
    caches.push_back(cache_of(t, "CacheCommit"));
    for (size_t i = 0; i + 1 < caches.size(); ++i)
      if (caches[i] == caches.back())
        throw std::invalid_argument("CacheCommit: input " + str(static_cast<int64_t>(caches.size()) - 1) +
                                    " names the same cache as input " + str(static_cast<int64_t>(i)));
  }
  // Check every cache before committing any, so a refusal commits none of them. (One lock at a
  // time: the steps belong to this run, which other runs and methods leave alone meanwhile.)
  for (auto& c : caches) {
    auto lock = c->lock();
    try {
      c->check_step_complete();
    } catch (...) {
      rethrow_with_prefix("CacheCommit: input 'cache': ");
    }
  }
  std::vector<int64_t> lens;
  for (auto& c : caches) {
    auto lock = c->lock();
    try {
      const std::vector<int64_t> l = c->complete_step();
      lens.insert(lens.end(), l.begin(), l.end());
    } catch (...) {
      rethrow_with_prefix("CacheCommit: input 'cache': ");
    }
  }
  int64_t* out = alloc(static_cast<int64_t>(lens.size()));
  std::copy(lens.begin(), lens.end(), out);
}

}  // namespace ops
}  // namespace olep
