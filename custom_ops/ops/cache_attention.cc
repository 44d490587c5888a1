#include "ops/cache_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/attention.h"
#include "kvcache/kv_cache.h"

namespace olep {
namespace ops {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument("CacheAttention: " + msg); }

bool is_float(ElemType t) { return t == ElemType::kFloat32 || t == ElemType::kFloat16 || t == ElemType::kBFloat16; }

DType to_dtype(ElemType t) {
  switch (t) {
    case ElemType::kFloat16: return DType::kFloat16;
    case ElemType::kBFloat16: return DType::kBFloat16;
    default: return DType::kFloat32;
  }
}

// Element strides (batch, head, sequence) of a rank-3 [B, S, H*D] or rank-4 [B, H, S, D] tensor.
void strides(int64_t rank, int64_t H, int64_t S, int64_t D, int64_t out[3]) {
  if (rank == 4) {
    out[0] = H * S * D;
    out[1] = S * D;
    out[2] = D;
  } else {
    out[0] = S * H * D;
    out[1] = D;
    out[2] = H * D;
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
}

AttentionDims resolve_dims(const CacheAttentionAttrs& a, const Tensor& q, const Tensor& k, const Tensor& v) {
  AttentionDims d;
  const size_t r = q.shape.size();
  if (r != 3 && r != 4) fail("input 'query' must be rank 3 [B, S, q_num_heads*head_dim] or rank 4 [B, q_num_heads, S, "
                             "head_dim]; got shape " + shape_str(q.shape));
  if (k.shape.size() != r) fail("input 'key' must have the rank of 'query' (" + str(r) + "); got shape " + shape_str(k.shape));
  if (v.shape.size() != r) fail("input 'value' must have the rank of 'query' (" + str(r) + "); got shape " + shape_str(v.shape));
  if (!is_float(q.type)) fail(std::string("input 'query' must be float, float16 or bfloat16; got ") + elem_type_name(q.type));
  if (k.type != q.type) fail(std::string("input 'key' must have the type of 'query' (") + elem_type_name(q.type) + "); got " + elem_type_name(k.type));
  if (v.type != q.type) fail(std::string("input 'value' must have the type of 'query' (") + elem_type_name(q.type) + "); got " + elem_type_name(v.type));
  for (const Tensor* t : {&q, &k, &v})
    for (int64_t x : t->shape)
      if (x < 0) fail("negative dimension in " + shape_str(t->shape));
  d.rank = static_cast<int64_t>(r);
  d.batch = q.shape[0];
  if (r == 3) {
    if (a.q_num_heads <= 0 || a.kv_num_heads <= 0)
      fail("3-D inputs need attributes 'q_num_heads' and 'kv_num_heads' (ONNX Attention, 3-D inputs)");
    d.q_heads = a.q_num_heads;
    d.kv_heads = a.kv_num_heads;
    d.seq = q.shape[1];
    if (q.shape[2] % d.q_heads != 0)
      fail("input 'query' last dimension (" + str(q.shape[2]) + ") must be a multiple of q_num_heads=" + str(d.q_heads));
    d.head_dim = q.shape[2] / d.q_heads;
    if (k.shape[0] != d.batch || k.shape[1] != d.seq || k.shape[2] != d.kv_heads * d.head_dim)
      fail("input 'key' must have shape " + shape_str({d.batch, d.seq, d.kv_heads * d.head_dim}) + "; got " + shape_str(k.shape));
    if (v.shape[0] != d.batch || v.shape[1] != d.seq || v.shape[2] % d.kv_heads != 0)
      fail("input 'value' must have shape [" + str(d.batch) + ", " + str(d.seq) + ", kv_num_heads*v_head_dim] with kv_num_heads=" +
           str(d.kv_heads) + "; got " + shape_str(v.shape));
    d.v_head_dim = v.shape[2] / d.kv_heads;
  } else {
    d.q_heads = q.shape[1];
    d.seq = q.shape[2];
    d.head_dim = q.shape[3];
    d.kv_heads = k.shape[1];
    if (a.q_num_heads > 0 && a.q_num_heads != d.q_heads)
      fail("attribute 'q_num_heads' (" + str(a.q_num_heads) + ") differs from input 'query' dim 1 (" + str(d.q_heads) + ")");
    if (a.kv_num_heads > 0 && a.kv_num_heads != d.kv_heads)
      fail("attribute 'kv_num_heads' (" + str(a.kv_num_heads) + ") differs from input 'key' dim 1 (" + str(d.kv_heads) + ")");
    if (k.shape[0] != d.batch || k.shape[2] != d.seq || k.shape[3] != d.head_dim || d.kv_heads <= 0)
      fail("input 'key' must have shape [" + str(d.batch) + ", kv_num_heads, " + str(d.seq) + ", " + str(d.head_dim) +
           "]; got " + shape_str(k.shape));
    if (v.shape[0] != d.batch || v.shape[1] != d.kv_heads || v.shape[2] != d.seq)
      fail("input 'value' must have shape [" + str(d.batch) + ", " + str(d.kv_heads) + ", " + str(d.seq) +
           ", v_head_dim]; got " + shape_str(v.shape));
    d.v_head_dim = v.shape[3];
  }
  if (d.q_heads <= 0 || d.kv_heads <= 0 || d.q_heads % d.kv_heads != 0)
    fail("q_num_heads (" + str(d.q_heads) + ") must be a positive multiple of kv_num_heads (" + str(d.kv_heads) + ")");
  if (d.batch <= 0) fail("batch size must be >= 1; got " + str(d.batch));
  if (d.seq <= 0) fail("sequence length of 'query' must be >= 1; got " + str(d.seq));
  if (d.head_dim <= 0 || d.v_head_dim <= 0) fail("head_dim and v_head_dim must be >= 1");
  return d;
}

std::vector<int64_t> output_shape(const AttentionDims& d) {
  if (d.rank == 3) return {d.batch, d.seq, d.q_heads * d.v_head_dim};
  return {d.batch, d.q_heads, d.seq, d.v_head_dim};
}

namespace {

// Work decomposition (fixed by the problem shape, never by the thread count, so
// 1 and N threads give bit-identical results):
//   item = (sequence b, kv head h, query block, KV split)
// Query blocks keep group_size * rows <= 64 state rows (bounded scratch in
// prefill). KV splits are used only when the other dimensions give fewer than
// kMinItems items; partial states are merged in split order.
constexpr int64_t kMaxStateRows = 64;
constexpr int64_t kMinItems = 8;
constexpr int64_t kMinSplitKeys = 512;

struct Plan {
  int64_t rows_per_block, num_qblocks, num_splits;
};

Plan make_plan(const AttentionDims& d, int64_t max_keys) {
  Plan p;
  const int64_t G = d.q_heads / d.kv_heads;
  p.rows_per_block = std::max<int64_t>(1, std::min<int64_t>(d.seq, kMaxStateRows / G));
  p.num_qblocks = (d.seq + p.rows_per_block - 1) / p.rows_per_block;
  const int64_t base = d.batch * d.kv_heads * p.num_qblocks;
  p.num_splits = 1;
  if (base < kMinItems && max_keys >= 2 * kMinSplitKeys)
    p.num_splits = std::min((kMinItems + base - 1) / base, max_keys / kMinSplitKeys);
  return p;
}

float* thread_scratch(size_t floats) {
  thread_local std::vector<float> buf;
  if (buf.size() < floats) buf.resize(floats);
  return buf.data();
}

void run_attention(const CacheAttentionAttrs& a, const AttentionDims& d, DType dt, const KVCache& cache,
                   const Tensor& query, const std::vector<int64_t>& past, const std::vector<int64_t>& num_new,
                   const Tensor* mask, const kernels::MaskView& mask_base, int64_t mask_batch_stride, void* y,
                   const ParallelFor& parallel_for) {
  const int64_t G = d.q_heads / d.kv_heads;
  const float scale = a.scale > 0.0f ? a.scale : 1.0f / std::sqrt(static_cast<float>(d.head_dim));
  const size_t es = dtype_size(dt);
  int64_t qs[3], ys[3];
  strides(d.rank, d.q_heads, d.seq, d.head_dim, qs);
  strides(d.rank, d.q_heads, d.seq, d.v_head_dim, ys);
  int64_t max_keys = 0;
  for (int64_t b = 0; b < d.batch; ++b)
    max_keys = std::max(max_keys, past[static_cast<size_t>(b)] + num_new[static_cast<size_t>(b)]);
  const Plan plan = make_plan(d, max_keys);
  const size_t mes = mask ? (mask->type == ElemType::kBool ? 1 : (mask->type == ElemType::kFloat32 ? 4 : 2)) : 0;

  // Describes work item (b, h, qb) without its key range.
  auto group = [&](int64_t b, int64_t h, int64_t qb, KVBlock* blocks) {
    const int64_t i0 = qb * plan.rows_per_block;
    const int64_t rows = std::min(plan.rows_per_block, d.seq - i0);
    const int64_t n_keys = past[static_cast<size_t>(b)] + num_new[static_cast<size_t>(b)];
    kernels::AttentionGroup ag;
    ag.dtype = dt;
    ag.q = static_cast<const char*>(query.data) + static_cast<size_t>(b * qs[0] + h * G * qs[1] + i0 * qs[2]) * es;
    ag.q_head_stride = qs[1];
    ag.q_row_stride = qs[2];
    ag.out = static_cast<char*>(y) + static_cast<size_t>(b * ys[0] + h * G * ys[1] + i0 * ys[2]) * es;
    ag.out_head_stride = ys[1];
    ag.out_row_stride = ys[2];
    ag.group_size = G;
    ag.num_rows = rows;
    ag.num_valid_rows = std::max<int64_t>(0, std::min(num_new[static_cast<size_t>(b)] - i0, rows));
    ag.q_offset = past[static_cast<size_t>(b)] + i0;
    ag.num_keys = n_keys;
    ag.num_blocks = cache.blocks(a.layer, b, h, n_keys, blocks, 1);
    ag.blocks = blocks;
    ag.head_dim = d.head_dim;
    ag.v_head_dim = d.v_head_dim;
    ag.scale = scale;
    ag.softcap = a.softcap;
    ag.is_causal = a.is_causal != 0;
    ag.local_window_size = a.local_window_size;
    ag.mask = mask_base;
    if (mask)
      ag.mask.data = static_cast<const char*>(mask->data) +
                     static_cast<size_t>(b * mask_batch_stride + h * G * mask_base.head_stride +
                                         i0 * mask_base.row_stride) * mes;
    return ag;
  };
  auto split_range = [&](int64_t n_keys, int64_t sp, int64_t* k0, int64_t* k1) {
    const int64_t chunk = ((n_keys + plan.num_splits - 1) / plan.num_splits + 15) / 16 * 16;
    *k0 = std::min(n_keys, sp * chunk);
    *k1 = std::min(n_keys, (sp + 1) * chunk);
  };

  const int64_t groups = d.batch * d.kv_heads * plan.num_qblocks;
  const int64_t items = groups * plan.num_splits;
  // One state per item when splitting; otherwise states live in thread scratch.
  kernels::AttentionGroup probe;
  {
    KVBlock tmp[1];
    probe = group(0, 0, 0, tmp);
  }
  const int64_t state_floats = kernels::state_floats(probe);
  std::vector<float> states(plan.num_splits > 1 ? static_cast<size_t>(items * state_floats) : 0);

  auto work = [&](int64_t item) {
    const int64_t sp = item % plan.num_splits;
    const int64_t g = item / plan.num_splits;
    const int64_t qb = g % plan.num_qblocks;
    const int64_t bh = g / plan.num_qblocks;
    const int64_t b = bh / d.kv_heads, h = bh % d.kv_heads;
    KVBlock blocks[1];
    const kernels::AttentionGroup ag = group(b, h, qb, blocks);
    const size_t scratch = static_cast<size_t>(kernels::scratch_floats(ag));
    float* buf = thread_scratch(scratch + static_cast<size_t>(kernels::state_floats(ag)));
    float* st_buf = plan.num_splits > 1 ? states.data() + item * state_floats : buf + scratch;
    kernels::AttentionState st;
    kernels::init_state(ag, st_buf, &st);
    int64_t k0, k1;
    split_range(ag.num_keys, sp, &k0, &k1);
    if (k0 < k1) kernels::attend_range(ag, k0, k1, &st, buf);
    if (plan.num_splits == 1) kernels::finalize(ag, st);
  };
  auto merge = [&](int64_t g) {
    const int64_t qb = g % plan.num_qblocks;
    const int64_t bh = g / plan.num_qblocks;
    KVBlock blocks[1];
    const kernels::AttentionGroup ag = group(bh / d.kv_heads, bh % d.kv_heads, qb, blocks);
    kernels::AttentionState dst;
    dst.m = states.data() + g * plan.num_splits * state_floats;
    const int64_t R = ag.group_size * ag.num_rows;
    dst.l = dst.m + R;
    dst.acc = dst.m + 2 * R;
    for (int64_t sp = 1; sp < plan.num_splits; ++sp) {
      kernels::AttentionState src;
      src.m = dst.m + sp * state_floats;
      src.l = src.m + R;
      src.acc = src.m + 2 * R;
      kernels::merge_states(ag, &dst, src);
    }
    kernels::finalize(ag, dst);
  };
  auto run = [&](int64_t n, const std::function<void(int64_t)>& fn) {
    if (parallel_for && n > 1) {
      parallel_for(n, fn);
    } else {
      for (int64_t i = 0; i < n; ++i) fn(i);
    }
  };
  run(items, work);
  if (plan.num_splits > 1) run(groups, merge);
}

}  // namespace

void cache_attention(const CacheAttentionAttrs& a, const Tensor& query, const Tensor& key, const Tensor& value,
                     const Tensor& cache_t, const Tensor* mask, const Tensor* seqlens_k, void* y,
                     const ParallelFor& parallel_for) {
  validate(a);
  const AttentionDims d = resolve_dims(a, query, key, value);
  const int64_t handle = read_cache_handle(cache_t, "CacheAttention");
  std::shared_ptr<KVCache> cache = Registry::instance().get(handle, "CacheAttention: input 'cache'");
  const CacheGeometry& g = cache->geometry();
  const DType dt = to_dtype(query.type);
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

  auto lock = cache->lock();
  const std::vector<int64_t> past = cache->lengths_locked();

  // Valid new rows per sequence.
  std::vector<int64_t> num_new(static_cast<size_t>(d.batch), d.seq);
  if (seqlens_k) {
    const bool shape_ok = (seqlens_k->shape.size() == 1 && seqlens_k->shape[0] == d.batch) ||
                          (seqlens_k->shape.size() == 2 && seqlens_k->shape[0] == d.batch && seqlens_k->shape[1] == 1);
    if (!shape_ok || (seqlens_k->type != ElemType::kInt32 && seqlens_k->type != ElemType::kInt64))
      fail("input 'seqlens_k' must be int32 [" + str(d.batch) + "] or [" + str(d.batch) + ", 1]; got " +
           elem_type_name(seqlens_k->type) + " " + shape_str(seqlens_k->shape));
    for (int64_t b = 0; b < d.batch; ++b) {
      const int64_t sk = seqlens_k->type == ElemType::kInt32 ? static_cast<const int32_t*>(seqlens_k->data)[b]
                                                             : static_cast<const int64_t*>(seqlens_k->data)[b];
      const int64_t n = sk + 1 - past[static_cast<size_t>(b)];
      if (n < 0 || n > d.seq)
        fail("input 'seqlens_k'[" + str(b) + "] = " + str(sk) + " must be in [" + str(past[static_cast<size_t>(b)] - 1) +
             ", " + str(past[static_cast<size_t>(b)] + d.seq - 1) + "] (total valid length - 1; the cache holds " +
             str(past[static_cast<size_t>(b)]) + " tokens and S=" + str(d.seq) + ")");
      num_new[static_cast<size_t>(b)] = n;
    }
  }
  int64_t max_keys = 0;
  for (int64_t b = 0; b < d.batch; ++b)
    max_keys = std::max(max_keys, past[static_cast<size_t>(b)] + num_new[static_cast<size_t>(b)]);

  // attn_mask: numpy broadcasting of its shape (right-aligned) to [B, Hq, S, T].
  kernels::MaskView mask_base;
  int64_t mask_batch_stride = 0;
  if (mask) {
    const size_t mr = mask->shape.size();
    if (mr < 2 || mr > 4) fail("input 'attn_mask' must have rank 2, 3 or 4; got shape " + shape_str(mask->shape));
    if (mask->type == ElemType::kBool) {
      mask_base.kind = kernels::MaskKind::kBool;
    } else if (is_float(mask->type)) {
      mask_base.kind = kernels::MaskKind::kAdditive;
      mask_base.dtype = to_dtype(mask->type);
    } else {
      fail(std::string("input 'attn_mask' must be bool or a float type; got ") + elem_type_name(mask->type));
    }
    int64_t m[4] = {1, 1, 1, 1};
    for (size_t i = 0; i < mr; ++i) m[4 - mr + i] = mask->shape[i];
    const int64_t target[3] = {d.batch, d.q_heads, d.seq};
    for (int i = 0; i < 3; ++i)
      if (m[i] != 1 && m[i] != target[i])
        fail("input 'attn_mask' with shape " + shape_str(mask->shape) + " does not broadcast to [B=" + str(d.batch) +
             ", q_num_heads=" + str(d.q_heads) + ", S=" + str(d.seq) + ", total_sequence_length]");
    if (m[3] != 1 && m[3] < max_keys)
      fail("input 'attn_mask' last dimension must cover past + new tokens (>= " + str(max_keys) + "); got shape " +
           shape_str(mask->shape));
    mask_base.data = mask->data;
    mask_base.key_stride = m[3] == 1 ? 0 : 1;
    mask_base.row_stride = m[2] == 1 ? 0 : m[3];
    mask_base.head_stride = m[1] == 1 ? 0 : m[2] * m[3];
    mask_batch_stride = m[0] == 1 ? 0 : m[1] * m[2] * m[3];
  }

  // Nothing has been written yet; from here on the cache changes.
  cache->begin_layer_append(a.layer, d.seq, num_new);
  int64_t ks[3], vs[3];
  strides(d.rank, d.kv_heads, d.seq, d.head_dim, ks);
  strides(d.rank, d.kv_heads, d.seq, d.v_head_dim, vs);
  NewRows rows;
  rows.key = key.data;
  rows.value = value.data;
  std::copy(ks, ks + 3, rows.key_strides);
  std::copy(vs, vs + 3, rows.value_strides);
  rows.sequence_length = d.seq;
  rows.num_new = num_new.data();
  cache->append_rows(a.layer, rows);

  run_attention(a, d, dt, *cache, query, past, num_new, mask, mask_base, mask_batch_stride, y, parallel_for);
  cache->finish_layer_append(a.layer);
}

void cache_export(int64_t layer, const Tensor& cache_t, const ExportOutputs& alloc) {
  if (layer < 0) throw std::invalid_argument("CacheExport: attribute 'layer' is required and must be >= 0");
  const int64_t handle = read_cache_handle(cache_t, "CacheExport");
  std::shared_ptr<KVCache> cache = Registry::instance().get(handle, "CacheExport: input 'cache'");
  const CacheGeometry& g = cache->geometry();
  if (layer >= g.num_layers)
    throw std::invalid_argument("CacheExport: attribute 'layer' (" + str(layer) + ") must be < num_layers of input "
                                "'cache' (" + str(g.num_layers) + ")");
  const size_t es = dtype_size(g.dtype);
  cache->export_layer(layer, /*include_pending=*/true, [&](int64_t L) {
    const std::vector<int64_t> ks = {g.batch_size, g.kv_num_heads, L, g.head_dim};
    const std::vector<int64_t> vs = {g.batch_size, g.kv_num_heads, L, g.v_head_dim};
    std::pair<void*, void*> out = alloc(ks, vs);
    const size_t kn = static_cast<size_t>(g.batch_size * g.kv_num_heads * L);
    if (kn) {
      std::memset(out.first, 0, kn * static_cast<size_t>(g.head_dim) * es);
      std::memset(out.second, 0, kn * static_cast<size_t>(g.v_head_dim) * es);
    }
    return out;
  });
}

}  // namespace ops
}  // namespace olep
