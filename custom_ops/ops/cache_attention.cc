#include "ops/cache_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/attention.h"
#include "kernels/rotary.h"
#include "kvcache/errors.h"
#include "kvcache/registry.h"
#include "kvcache/run_scope.h"

namespace olep {
namespace ops {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument("CacheAttention: " + msg); }

[[noreturn]] void fail(const std::string& what, const std::string& expected, const std::string& got) {
  fail(what + "; expected " + expected + ", got " + got);
}

std::string desc(const Tensor& t) { return std::string(elem_type_name(t.type)) + " " + shape_str(t.shape); }

void run_n(const ParallelFor& pf, int64_t n, const std::function<void(int64_t)>& fn) {
  if (pf && n > 1) {
    pf(n, fn);
  } else {
    for (int64_t i = 0; i < n; ++i) fn(i);
  }
}

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
  if (a.rotary_interleaved != 0 && a.rotary_interleaved != 1)
    fail("attribute 'rotary_interleaved'", "0 or 1", str(a.rotary_interleaved));
}

AttentionDims cache_attention_dims(const CacheAttentionAttrs& a, const CacheAttentionInputs& in) {
  if (in.query == nullptr) fail("input 'query'", "present", "absent");
  const Tensor& q = *in.query;
  if ((in.key == nullptr) != (in.value == nullptr))
    fail("inputs 'key' and 'value'", "both present or both absent (packed QKV in 'query')",
         in.key ? "'value' absent" : "'key' absent");
  AttentionDims d;
  if (in.key) {
    d = resolve_dims("CacheAttention", a.q_num_heads, a.kv_num_heads, q, *in.key, *in.value);
  } else {
    // Packed QKV (GroupQueryAttention with key/value absent): [B, S, (Hq + 2*Hkv)*D], q, k, v heads.
    if (!is_float(q.type)) fail("input 'query' type", "float, float16 or bfloat16", elem_type_name(q.type));
    if (q.shape.size() != 3)
      fail("input 'query' with 'key'/'value' absent (packed QKV)",
           "rank 3 [B, S, (q_num_heads + 2*kv_num_heads)*head_dim]", desc(q));
    if (a.q_num_heads <= 0 || a.kv_num_heads <= 0 || a.q_num_heads % a.kv_num_heads != 0)
      fail("attributes 'q_num_heads'/'kv_num_heads' with packed QKV", "positive, q_num_heads % kv_num_heads == 0",
           str(a.q_num_heads) + "/" + str(a.kv_num_heads));
    const int64_t heads = a.q_num_heads + 2 * a.kv_num_heads;
    if (q.shape[0] < 1 || q.shape[1] < 1 || q.shape[2] <= 0 || q.shape[2] % heads != 0)
      fail("input 'query' (packed QKV) shape",
           "[B >= 1, S >= 1, a positive multiple of q_num_heads + 2*kv_num_heads = " + str(heads) + "]", desc(q));
    d.rank = 3;
    d.batch = q.shape[0];
    d.seq = q.shape[1];
    d.q_heads = a.q_num_heads;
    d.kv_heads = a.kv_num_heads;
    d.head_dim = d.v_head_dim = q.shape[2] / heads;
  }
  if ((in.cos_cache == nullptr) != (in.sin_cache == nullptr))
    fail("inputs 'cos_cache' and 'sin_cache'", "both present or both absent",
         in.cos_cache ? "'sin_cache' absent" : "'cos_cache' absent");
  if (in.cos_cache) {
    for (const Tensor* t : {in.cos_cache, in.sin_cache}) {
      const std::string name = t == in.cos_cache ? "'cos_cache'" : "'sin_cache'";
      if (t->type != q.type)
        fail("input " + name + " type", std::string(elem_type_name(q.type)) + " (the type of 'query')",
             elem_type_name(t->type));
      if (t->shape.size() != 2 || t->shape[0] < 1 || t->shape[1] < 1 || 2 * t->shape[1] > d.head_dim)
        fail("input " + name + " shape",
             "[max_position >= 1, rotary_dim/2] with 1 <= rotary_dim/2 <= head_dim/2 = " + str(d.head_dim / 2),
             desc(*t));
    }
    if (in.sin_cache->shape != in.cos_cache->shape)
      fail("input 'sin_cache' shape", shape_str(in.cos_cache->shape) + " (the shape of 'cos_cache')",
           shape_str(in.sin_cache->shape));
  }
  return d;
}

namespace {
void cache_attention_impl(const CacheAttentionAttrs& a, const CacheAttentionInputs& in,
                          const std::shared_ptr<KVCache>& cache, void* y, const ParallelFor& parallel_for);

std::shared_ptr<KVCache> cache_of(const Tensor& cache_t, const char* op) {
  const int64_t handle = read_cache_handle(cache_t, op);
  try {
    return Registry::instance().cache(handle);
  } catch (...) {
    rethrow_with_prefix(std::string(op) + ": input 'cache': ");
  }
}
}  // namespace

void cache_attention(const CacheAttentionAttrs& a, const CacheAttentionInputs& in, void* y,
                     const ParallelFor& parallel_for) {
  if (in.cache == nullptr) fail("input 'cache'", "present", "absent");
  std::shared_ptr<KVCache> cache = cache_of(*in.cache, "CacheAttention");
  if (a.layer == 0 && a.node_id != 0 && !run_scope::current().bounded())
    Registry::instance().drop_stale_steps_of_node(std::this_thread::get_id(), a.node_id, cache.get());
  try {
    cache_attention_impl(a, in, cache, y, parallel_for);
  } catch (...) {
    cache->mark_step_failed();  // this run's unfinished step is a failure, not a short model
    throw;
  }
}

void cache_attention(const CacheAttentionAttrs& a, const Tensor& query, const Tensor& key, const Tensor& value,
                     const Tensor& cache_t, const Tensor* mask, const Tensor* seqlens_k, void* y,
                     const ParallelFor& parallel_for) {
  CacheAttentionInputs in;
  in.query = &query;
  in.key = &key;
  in.value = &value;
  in.cache = &cache_t;
  in.attn_mask = mask;
  in.seqlens_k = seqlens_k;
  cache_attention(a, in, y, parallel_for);
}

void note_failed_run(const Tensor& cache_t) noexcept {
  try {
    cache_of(cache_t, "CacheAttention")->mark_step_failed();
  } catch (...) {
  }
}

namespace {
void cache_attention_impl(const CacheAttentionAttrs& a, const CacheAttentionInputs& in,
                          const std::shared_ptr<KVCache>& cache, void* y, const ParallelFor& parallel_for) {
  validate(a);
  const AttentionDims d = cache_attention_dims(a, in);
  const Tensor& query = *in.query;
  const Tensor* mask = in.attn_mask;
  const Tensor* seqlens_k = in.seqlens_k;
  const CacheGeometry& g = cache->geometry();
  const DType dt = to_dtype(query.type, "CacheAttention: input 'query'");
  if (g.dtype != dt)
    fail(std::string("input 'cache' stores ") + dtype_name(g.dtype) + " but 'query' is " + elem_type_name(query.type));
  if (g.kv_num_heads != d.kv_heads)
    fail("input 'cache' has kv_num_heads=" + str(g.kv_num_heads) + " but " +
         (in.key ? "'key'" : "'query' (packed QKV)") + " has " + str(d.kv_heads));
  if (g.head_dim != d.head_dim)
    fail("input 'cache' has head_dim=" + str(g.head_dim) + " but " + (in.key ? "'key'" : "'query' (packed QKV)") +
         " has " + str(d.head_dim));
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

  // Where the new rows are: element strides (batch, head, sequence) into the inputs. Packed QKV
  // interleaves q, k and v heads in one [B, S, (Hq + 2*Hkv)*D] row per token.
  const size_t es = dtype_size(dt);
  const bool packed = in.key == nullptr;
  const bool rotary = in.cos_cache != nullptr;
  int64_t qs[3], ks[3], vs[3];
  const char* q_src = static_cast<const char*>(query.data);
  const char* k_src;
  const char* v_src;
  if (packed) {
    const int64_t W = (d.q_heads + 2 * d.kv_heads) * d.head_dim;
    qs[0] = ks[0] = vs[0] = d.seq * W;
    qs[1] = ks[1] = vs[1] = d.head_dim;
    qs[2] = ks[2] = vs[2] = W;
    k_src = q_src + static_cast<size_t>(d.q_heads * d.head_dim) * es;
    v_src = q_src + static_cast<size_t>((d.q_heads + d.kv_heads) * d.head_dim) * es;
  } else {
    layout_strides(d.rank, d.q_heads, d.seq, d.head_dim, qs);
    layout_strides(d.rank, d.kv_heads, d.seq, d.head_dim, ks);
    layout_strides(d.rank, d.kv_heads, d.seq, d.v_head_dim, vs);
    k_src = static_cast<const char*>(in.key->data);
    v_src = static_cast<const char*>(in.value->data);
  }

  // Rotary: positions P_b + s of the valid rows s < n_b (GroupQueryAttention derives the same
  // positions from seqlens_k). Every one must have a cos/sin row; checked before anything is written.
  int64_t rotary_dim = 0;
  if (rotary) {
    rotary_dim = 2 * in.cos_cache->shape[1];
    const int64_t max_position = in.cos_cache->shape[0];
    for (int64_t b = 0; b < d.batch; ++b) {
      const int64_t n = num_new[static_cast<size_t>(b)], p = past[static_cast<size_t>(b)];
      if (n > 0 && p + n - 1 >= max_position)
        fail("rotary position " + str(p + n - 1) + " of sequence " + str(b) + " (past length " + str(p) + " + " +
             str(n) + " new rows - 1)", "< max_position = " + str(max_position) + " (input 'cos_cache' dim 0)",
             str(p + n - 1) + "; nothing was appended");
    }
  }
  // Q (and K with rotary) in contiguous scratch of the query's layout: rotated rows, or copies.
  // Padding rows (s >= n_b) are copied unrotated: their outputs are zeros and never read.
  std::vector<char> q_buf, k_buf;
  const void* q_data = query.data;
  const char* k_rows = k_src;
  int64_t k_strides[3] = {ks[0], ks[1], ks[2]};
  if (packed || rotary) {
    int64_t qd[3], kd[3];
    layout_strides(d.rank, d.q_heads, d.seq, d.head_dim, qd);
    layout_strides(d.rank, d.kv_heads, d.seq, d.head_dim, kd);
    const size_t row = static_cast<size_t>(d.head_dim) * es;
    const size_t cache_row = static_cast<size_t>(rotary_dim / 2) * es;
    q_buf.resize(static_cast<size_t>(d.batch * d.seq * d.q_heads) * row);
    if (rotary) k_buf.resize(static_cast<size_t>(d.batch * d.seq * d.kv_heads) * row);
    const bool inter = a.rotary_interleaved != 0;
    auto one = [&](const char* src, char* dst, int64_t b, int64_t s) {
      if (!rotary || s >= num_new[static_cast<size_t>(b)]) {
        std::memcpy(dst, src, row);
        return;
      }
      const size_t pos = static_cast<size_t>(past[static_cast<size_t>(b)] + s);
      kernels::rotary_row(dt, src, static_cast<const char*>(in.cos_cache->data) + pos * cache_row,
                          static_cast<const char*>(in.sin_cache->data) + pos * cache_row, rotary_dim, d.head_dim,
                          inter, dst);
    };
    run_n(parallel_for, d.batch * d.seq, [&](int64_t bs) {
      const int64_t b = bs / d.seq, s = bs % d.seq;
      for (int64_t h = 0; h < d.q_heads; ++h)
        one(q_src + static_cast<size_t>(b * qs[0] + h * qs[1] + s * qs[2]) * es,
            q_buf.data() + static_cast<size_t>(b * qd[0] + h * qd[1] + s * qd[2]) * es, b, s);
      if (rotary)
        for (int64_t h = 0; h < d.kv_heads; ++h)
          one(k_src + static_cast<size_t>(b * ks[0] + h * ks[1] + s * ks[2]) * es,
              k_buf.data() + static_cast<size_t>(b * kd[0] + h * kd[1] + s * kd[2]) * es, b, s);
    });
    q_data = q_buf.data();
    if (rotary) {
      k_rows = k_buf.data();
      std::copy(kd, kd + 3, k_strides);
    }
  }

  // Nothing has been written yet; from here on the run's step changes (invisible until it commits).
  try {
    cache->begin_layer_append(a.layer, d.seq, num_new, a.commit_node != 0, a.node_id);
  } catch (...) {
    rethrow_with_prefix("CacheAttention: input 'cache': ");
  }
  NewRows rows;
  rows.key = k_rows;
  rows.value = v_src;
  std::copy(k_strides, k_strides + 3, rows.key_strides);
  std::copy(vs, vs + 3, rows.value_strides);
  rows.sequence_length = d.seq;
  rows.num_new = num_new.data();
  cache->append_rows(a.layer, rows);

  AttentionCall call;
  call.d = d;
  call.dtype = dt;
  call.q = q_data;
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
