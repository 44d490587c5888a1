#include "ops/attention_core.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

namespace olep {
namespace ops {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

// Work decomposition (fixed by the problem shape, never by the thread count, so
// 1 and N threads give bit-identical results):
//   item = (sequence b, kv head h, query block, KV split)
// Query blocks keep group_size * rows <= 64 state rows (bounded scratch in
// prefill). KV splits are used only when the other dimensions give fewer than
// kMinItems items; partial states are merged in split order. A split costs a kernel call's
// start (its first tiles' K/V from DRAM before the prefetch runs ahead, q laid out, a state to
// merge): about 7 us for MQA 32/1 at head_dim 128 (Zen 4, kernel alone, 512 keys from DRAM
// 0.094 ms against 4K keys 0.698 ms / 8), so splits are at least kMinSplitKeys keys and, past
// two, kSplitKeys each: MQA 32/1 B=1 at 4K keys takes 2 splits, not 8 (the EP's step at
// 1 thread, tools/bench_decode.py, in the commit that set it).
constexpr int64_t kMaxStateRows = 64;
constexpr int64_t kMinItems = 8;
constexpr int64_t kMinSplitKeys = 512;
constexpr int64_t kSplitKeys = 2048;

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
    p.num_splits = std::min((kMinItems + base - 1) / base, std::max<int64_t>(2, max_keys / kSplitKeys));
  return p;
}

// The kernel's scratch, 64-byte aligned: its tiles are read a vector at a time, and from a
// vector's (16-byte) alignment every 64-byte load of a row could straddle two cache lines, so a
// run's speed depended on where the allocator put it (a causal 64-row prefill, MHA 32/32 S=512
// on Zen 4: 30.5 or 37 ms per layer from one process to the next).
float* thread_scratch(size_t floats) {
  constexpr size_t kAlignFloats = 16;
  thread_local std::vector<float> buf;
  if (buf.size() < floats + kAlignFloats) buf.resize(floats + kAlignFloats);
  const uintptr_t p = reinterpret_cast<uintptr_t>(buf.data());
  return buf.data() + ((64 - p % 64) % 64) / sizeof(float);
}

}  // namespace

// Element strides (batch, head, sequence) of a rank-3 [B, S, H*D] or rank-4 [B, H, S, D] tensor.
void layout_strides(int64_t rank, int64_t H, int64_t S, int64_t D, int64_t out[3]) {
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

AttentionDims resolve_dims(const char* op, int64_t q_num_heads, int64_t kv_num_heads, const Tensor& q, const Tensor& k,
                           const Tensor& v, bool key_seq_may_differ, int64_t* key_seq) {
  auto fail = [op](const std::string& m) -> void { throw std::invalid_argument(std::string(op) + ": " + m); };
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
    if (q_num_heads <= 0 || kv_num_heads <= 0)
      fail("3-D inputs need attributes 'q_num_heads' and 'kv_num_heads' (ONNX Attention, 3-D inputs)");
    d.q_heads = q_num_heads;
    d.kv_heads = kv_num_heads;
    d.seq = q.shape[1];
    if (q.shape[2] % d.q_heads != 0)
      fail("input 'query' last dimension (" + str(q.shape[2]) + ") must be a multiple of q_num_heads=" + str(d.q_heads));
    d.head_dim = q.shape[2] / d.q_heads;
    const int64_t ks = k.shape[1];
    if (k.shape[0] != d.batch || (ks != d.seq && !key_seq_may_differ) || k.shape[2] != d.kv_heads * d.head_dim)
      fail("input 'key' must have shape " + shape_str({d.batch, d.seq, d.kv_heads * d.head_dim}) + "; got " + shape_str(k.shape));
    if (v.shape[0] != d.batch || v.shape[1] != ks || v.shape[2] % d.kv_heads != 0)
      fail("input 'value' must have shape [" + str(d.batch) + ", " + str(d.seq) + ", kv_num_heads*v_head_dim] with kv_num_heads=" +
           str(d.kv_heads) + "; got " + shape_str(v.shape));
    d.v_head_dim = v.shape[2] / d.kv_heads;
    if (key_seq) *key_seq = ks;
  } else {
    d.q_heads = q.shape[1];
    d.seq = q.shape[2];
    d.head_dim = q.shape[3];
    d.kv_heads = k.shape[1];
    if (q_num_heads > 0 && q_num_heads != d.q_heads)
      fail("attribute 'q_num_heads' (" + str(q_num_heads) + ") differs from input 'query' dim 1 (" + str(d.q_heads) + ")");
    if (kv_num_heads > 0 && kv_num_heads != d.kv_heads)
      fail("attribute 'kv_num_heads' (" + str(kv_num_heads) + ") differs from input 'key' dim 1 (" + str(d.kv_heads) + ")");
    const int64_t ks = k.shape[2];
    if (k.shape[0] != d.batch || (ks != d.seq && !key_seq_may_differ) || k.shape[3] != d.head_dim || d.kv_heads <= 0)
      fail("input 'key' must have shape [" + str(d.batch) + ", kv_num_heads, " + str(d.seq) + ", " + str(d.head_dim) +
           "]; got " + shape_str(k.shape));
    if (v.shape[0] != d.batch || v.shape[1] != d.kv_heads || v.shape[2] != ks)
      fail("input 'value' must have shape [" + str(d.batch) + ", " + str(d.kv_heads) + ", " + str(d.seq) +
           ", v_head_dim]; got " + shape_str(v.shape));
    d.v_head_dim = v.shape[3];
    if (key_seq) *key_seq = ks;
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

MaskSpec parse_mask(const char* op, const Tensor& mask_t, const AttentionDims& d, int64_t max_keys) {
  auto fail = [op](const std::string& m) -> void { throw std::invalid_argument(std::string(op) + ": " + m); };
  const Tensor* mask = &mask_t;
  MaskSpec spec;
  kernels::MaskView& mask_base = spec.view;
  int64_t& mask_batch_stride = spec.batch_stride;
  const size_t mr = mask->shape.size();
  if (mr < 2 || mr > 4) fail("input 'attn_mask' must have rank 2, 3 or 4; got shape " + shape_str(mask->shape));
  if (mask->type == ElemType::kBool) {
    mask_base.kind = kernels::MaskKind::kBool;
  } else if (is_float(mask->type)) {
    mask_base.kind = kernels::MaskKind::kAdditive;
    mask_base.dtype = to_dtype(mask->type, "input 'attn_mask'");
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
  spec.elem_size = mask->type == ElemType::kBool ? 1 : (mask->type == ElemType::kFloat32 ? 4 : 2);
  return spec;
}

BlockList dense_blocks(int64_t batch, int64_t kv_heads, const void* key, const void* value, int64_t capacity,
                       size_t k_row_bytes, size_t v_row_bytes, const std::vector<int64_t>& first,
                       const std::vector<int64_t>& rows) {
  BlockList out;
  out.offsets.reserve(static_cast<size_t>(batch * kv_heads + 1));
  out.offsets.push_back(0);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t n = rows[static_cast<size_t>(b)], f = first[static_cast<size_t>(b)];
      if (n > 0) {
        const size_t row = static_cast<size_t>((b * kv_heads + h) * capacity + f);
        KVBlock blk;
        blk.key = static_cast<const char*>(key) + row * k_row_bytes;
        blk.value = static_cast<const char*>(value) + row * v_row_bytes;
        blk.first_position = f;
        blk.num_rows = n;
        out.blocks.push_back(blk);
      }
      out.offsets.push_back(static_cast<int64_t>(out.blocks.size()));
    }
  return out;
}

void run_attention(const AttentionCall& c, const ParallelFor& parallel_for) {
  const AttentionDims& d = c.d;
  const int64_t G = d.q_heads / d.kv_heads;
  const float scale = c.scale > 0.0f ? c.scale : 1.0f / std::sqrt(static_cast<float>(d.head_dim));
  const DType dt = c.dtype;
  const size_t es = dtype_size(dt);
  int64_t qs[3], ys[3];
  layout_strides(d.rank, d.q_heads, d.seq, d.head_dim, qs);
  layout_strides(d.rank, d.q_heads, d.seq, d.v_head_dim, ys);
  int64_t max_keys = 0;
  for (int64_t b = 0; b < d.batch; ++b) max_keys = std::max(max_keys, c.num_keys[static_cast<size_t>(b)]);
  const Plan plan = make_plan(d, max_keys);
  const MaskSpec* mask = c.mask;
  if (static_cast<int64_t>(c.blocks.offsets.size()) != d.batch * d.kv_heads + 1)
    throw std::logic_error("run_attention: block list does not cover every (sequence, kv head)");

  // Describes work item (b, h, qb) without its key range.
  auto group = [&](int64_t b, int64_t h, int64_t qb) {
    const int64_t i0 = qb * plan.rows_per_block;
    const int64_t rows = std::min(plan.rows_per_block, d.seq - i0);
    const int64_t n_keys = c.num_keys[static_cast<size_t>(b)];
    kernels::AttentionGroup ag;
    ag.dtype = dt;
    ag.q = static_cast<const char*>(c.q) + static_cast<size_t>(b * qs[0] + h * G * qs[1] + i0 * qs[2]) * es;
    ag.q_head_stride = qs[1];
    ag.q_row_stride = qs[2];
    ag.out = static_cast<char*>(c.y) + static_cast<size_t>(b * ys[0] + h * G * ys[1] + i0 * ys[2]) * es;
    ag.out_head_stride = ys[1];
    ag.out_row_stride = ys[2];
    ag.group_size = G;
    ag.num_rows = rows;
    ag.num_valid_rows = std::max<int64_t>(0, std::min(c.num_valid_rows[static_cast<size_t>(b)] - i0, rows));
    ag.q_offset = c.q_offset[static_cast<size_t>(b)] + i0;
    ag.num_keys = n_keys;
    const size_t bh = static_cast<size_t>(b * d.kv_heads + h);
    ag.blocks = c.blocks.blocks.data() + c.blocks.offsets[bh];
    ag.num_blocks = c.blocks.offsets[bh + 1] - c.blocks.offsets[bh];
    ag.head_dim = d.head_dim;
    ag.v_head_dim = d.v_head_dim;
    ag.scale = scale;
    ag.softcap = c.softcap;
    ag.is_causal = c.is_causal;
    ag.local_window_size = c.local_window_size;
    if (mask) {
      ag.mask = mask->view;
      ag.mask.data = static_cast<const char*>(mask->view.data) +
                     static_cast<size_t>(b * mask->batch_stride + h * G * mask->view.head_stride +
                                         i0 * mask->view.row_stride) * mask->elem_size;
    }
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
  const kernels::AttentionGroup probe = group(0, 0, 0);
  const int64_t state_floats = kernels::state_floats(probe);
  std::vector<float> states(plan.num_splits > 1 ? static_cast<size_t>(items * state_floats) : 0);

  auto work = [&](int64_t item) {
    const int64_t sp = item % plan.num_splits;
    const int64_t g = item / plan.num_splits;
    const int64_t qb = g % plan.num_qblocks;
    const int64_t bh = g / plan.num_qblocks;
    const int64_t b = bh / d.kv_heads, h = bh % d.kv_heads;
    const kernels::AttentionGroup ag = group(b, h, qb);
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
    const kernels::AttentionGroup ag = group(bh / d.kv_heads, bh % d.kv_heads, qb);
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


}  // namespace ops
}  // namespace olep
