#include "ops/attention_tensor.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

namespace olep {
namespace ops {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

[[noreturn]] void fail(const std::string& m) { throw std::invalid_argument("Attention: " + m); }

// Copies S rows of (b, h) from a rank-3/4 tensor (strides from layout_strides) to dst (contiguous rows of D).
void copy_rows(const char* src, const int64_t st[3], int64_t b, int64_t h, int64_t S, int64_t D, size_t es, char* dst) {
  const char* base = src + static_cast<size_t>(b * st[0] + h * st[1]) * es;
  if (st[2] == D) {
    std::memcpy(dst, base, static_cast<size_t>(S * D) * es);
    return;
  }
  for (int64_t s = 0; s < S; ++s)
    std::memcpy(dst + static_cast<size_t>(s * D) * es, base + static_cast<size_t>(s * st[2]) * es, static_cast<size_t>(D) * es);
}

}  // namespace

OnnxAttentionShapes onnx_attention_shapes(const OnnxAttentionAttrs& a, const OnnxAttentionInputs& in) {
  if (!in.q || !in.k || !in.v) fail("inputs Q, K and V are required");
  if (a.is_causal != 0 && a.is_causal != 1) fail("attribute 'is_causal' must be 0 or 1; got " + str(a.is_causal));
  if (a.qk_matmul_output_mode < 0 || a.qk_matmul_output_mode > 3)
    fail("attribute 'qk_matmul_output_mode' must be 0, 1, 2 or 3; got " + str(a.qk_matmul_output_mode));
  OnnxAttentionShapes s;
  int64_t key_seq = 0;
  s.d = resolve_dims("Attention", a.q_num_heads, a.kv_num_heads, *in.q, *in.k, *in.v, /*key_seq_may_differ=*/true,
                     &key_seq);
  const AttentionDims& d = s.d;
  if (d.seq <= 0 || key_seq < 0) fail("sequence lengths must be >= 1 for Q and >= 0 for K/V");
  if ((in.past_key == nullptr) != (in.past_value == nullptr)) fail("past_key and past_value must be given together");
  if (in.past_key) {
    for (const Tensor* t : {in.past_key, in.past_value}) {
      const int64_t dd = t == in.past_key ? d.head_dim : d.v_head_dim;
      const char* name = t == in.past_key ? "past_key" : "past_value";
      if (t->type != in.q->type || t->shape.size() != 4 || t->shape[0] != d.batch || t->shape[1] != d.kv_heads ||
          t->shape[3] != dd)
        fail(std::string("input '") + name + "' must be BNSH [" + str(d.batch) + ", " + str(d.kv_heads) + ", P, " +
             str(dd) + "] of the type of Q; got " + elem_type_name(t->type) + " " + shape_str(t->shape));
    }
    if (in.past_key->shape[2] != in.past_value->shape[2]) fail("past_key and past_value must have the same length");
    s.past = in.past_key->shape[2];
  }
  if (in.nonpad_kv_seqlen) {
    if (in.past_key) fail("nonpad_kv_seqlen cannot be used together with past_key/past_value (ONNX Attention-24)");
    const Tensor& n = *in.nonpad_kv_seqlen;
    if (n.type != ElemType::kInt64 || n.shape.size() != 1 || n.shape[0] != d.batch)
      fail("input 'nonpad_kv_seqlen' must be int64 [" + str(d.batch) + "]; got " + elem_type_name(n.type) + " " +
           shape_str(n.shape));
    for (int64_t b = 0; b < d.batch; ++b) {
      const int64_t v = static_cast<const int64_t*>(n.data)[b];
      if (v < 0 || v > key_seq)
        fail("nonpad_kv_seqlen[" + str(b) + "] = " + str(v) + " must be in [0, " + str(key_seq) + "]");
    }
  }
  s.total = s.past + key_seq;
  s.y = output_shape(d);
  s.present_key = {d.batch, d.kv_heads, s.total, d.head_dim};
  s.present_value = {d.batch, d.kv_heads, s.total, d.v_head_dim};
  s.qk = {d.batch, d.q_heads, d.seq, s.total};
  return s;
}

void onnx_attention(const OnnxAttentionAttrs& a, const OnnxAttentionInputs& in, const OnnxAttentionShapes& s, void* y,
                    void* present_key, void* present_value, void* qk_matmul_output, const ParallelFor& parallel_for) {
  const AttentionDims& d = s.d;
  const DType dt = to_dtype(in.q->type, "Attention: input 'Q'");
  const size_t es = dtype_size(dt);
  const int64_t key_seq = s.total - s.past;
  std::vector<char> scratch_k, scratch_v;
  if (!present_key) {
    scratch_k.resize(static_cast<size_t>(d.batch * d.kv_heads * s.total * d.head_dim) * es);
    present_key = scratch_k.data();
  }
  if (!present_value) {
    scratch_v.resize(static_cast<size_t>(d.batch * d.kv_heads * s.total * d.v_head_dim) * es);
    present_value = scratch_v.data();
  }
  // present = concat(past, new): the one copy the tensor contract requires.
  int64_t ks[3], vs[3];
  layout_strides(d.rank, d.kv_heads, key_seq, d.head_dim, ks);
  layout_strides(d.rank, d.kv_heads, key_seq, d.v_head_dim, vs);
  const size_t pk_row = static_cast<size_t>(d.head_dim) * es, pv_row = static_cast<size_t>(d.v_head_dim) * es;
  // One (sequence, kv head) per task on the intra-op pool: the copy is memory-bound and
  // as large as the cache, so it gets the threads too.
  auto copy_one = [&](int64_t item) {
    const int64_t b = item / d.kv_heads, h = item % d.kv_heads;
    {
      const size_t bh = static_cast<size_t>(b * d.kv_heads + h);
      char* kd = static_cast<char*>(present_key) + bh * static_cast<size_t>(s.total) * pk_row;
      char* vd = static_cast<char*>(present_value) + bh * static_cast<size_t>(s.total) * pv_row;
      if (s.past) {
        std::memcpy(kd, static_cast<const char*>(in.past_key->data) + bh * static_cast<size_t>(s.past) * pk_row,
                    static_cast<size_t>(s.past) * pk_row);
        std::memcpy(vd, static_cast<const char*>(in.past_value->data) + bh * static_cast<size_t>(s.past) * pv_row,
                    static_cast<size_t>(s.past) * pv_row);
      }
      if (key_seq) {
        copy_rows(static_cast<const char*>(in.k->data), ks, b, h, key_seq, d.head_dim, es,
                  kd + static_cast<size_t>(s.past) * pk_row);
        copy_rows(static_cast<const char*>(in.v->data), vs, b, h, key_seq, d.v_head_dim, es,
                  vd + static_cast<size_t>(s.past) * pv_row);
      }
    }
  };
  const int64_t items = d.batch * d.kv_heads;
  if (parallel_for && items > 1) {
    parallel_for(items, copy_one);
  } else {
    for (int64_t i = 0; i < items; ++i) copy_one(i);
  }

  AttentionCall call;
  call.d = d;
  call.dtype = dt;
  call.q = in.q->data;
  call.y = y;
  call.scale = a.scale;
  call.softcap = a.softcap;
  call.is_causal = a.is_causal != 0;
  call.q_offset.assign(static_cast<size_t>(d.batch), s.past);
  call.num_keys.assign(static_cast<size_t>(d.batch), s.total);
  call.num_valid_rows.assign(static_cast<size_t>(d.batch), d.seq);
  if (in.nonpad_kv_seqlen)
    for (int64_t b = 0; b < d.batch; ++b) {
      const int64_t n = static_cast<const int64_t*>(in.nonpad_kv_seqlen->data)[b];
      call.num_keys[static_cast<size_t>(b)] = n;
      call.q_offset[static_cast<size_t>(b)] = n - d.seq;
    }
  MaskSpec mask;
  if (in.attn_mask) {
    // A last dimension shorter than the keys: the keys past it are masked out (opset 24 pads
    // attn_mask to total_sequence_length with -inf; the reference does so for opset 23 too).
    const int64_t mask_keys = in.attn_mask->shape.empty() ? 1 : in.attn_mask->shape.back();
    if (mask_keys != 1)
      for (int64_t& n : call.num_keys) n = std::min(n, mask_keys);
    int64_t max_keys = 0;
    for (int64_t n : call.num_keys) max_keys = std::max(max_keys, n);
    mask = parse_mask("Attention", *in.attn_mask, d, max_keys);
    call.mask = &mask;
  }
  call.blocks = dense_blocks(d.batch, d.kv_heads, present_key, present_value, s.total, pk_row, pv_row,
                             std::vector<int64_t>(static_cast<size_t>(d.batch), 0), call.num_keys);
  run_attention(call, parallel_for);
  if (qk_matmul_output) {
    // Per (sequence, kv head): the group's score rows over every present key, the causal
    // offset, mask and key count of Y's call (run_attention's own items describe them).
    const float scale = a.scale > 0.0f ? a.scale : 1.0f / std::sqrt(static_cast<float>(d.head_dim));
    const int64_t G = d.q_heads / d.kv_heads;
    int64_t qs[3];
    layout_strides(d.rank, d.q_heads, d.seq, d.head_dim, qs);
    auto one = [&](int64_t item) {
      const int64_t b = item / d.kv_heads, h = item % d.kv_heads;
      kernels::AttentionGroup ag;
      ag.dtype = dt;
      ag.q = static_cast<const char*>(in.q->data) + static_cast<size_t>(b * qs[0] + h * G * qs[1]) * es;
      ag.q_head_stride = qs[1];
      ag.q_row_stride = qs[2];
      ag.group_size = G;
      ag.num_rows = d.seq;
      ag.num_valid_rows = d.seq;
      ag.q_offset = call.q_offset[static_cast<size_t>(b)];
      ag.num_keys = call.num_keys[static_cast<size_t>(b)];
      ag.head_dim = d.head_dim;
      ag.v_head_dim = d.v_head_dim;
      ag.scale = scale;
      ag.softcap = a.softcap;
      ag.is_causal = call.is_causal;
      if (call.mask) {
        ag.mask = mask.view;
        ag.mask.data = static_cast<const char*>(mask.view.data) +
                       static_cast<size_t>(b * mask.batch_stride + h * G * mask.view.head_stride) * mask.elem_size;
      }
      const size_t bh = static_cast<size_t>(b * d.kv_heads + h);
      const char* key = static_cast<const char*>(present_key) + bh * static_cast<size_t>(s.total) * pk_row;
      void* out = static_cast<char*>(qk_matmul_output) + static_cast<size_t>((b * d.q_heads + h * G) * d.seq * s.total) * es;
      std::vector<float> row(static_cast<size_t>(s.total));
      kernels::qk_scores(ag, static_cast<kernels::QkStage>(a.qk_matmul_output_mode), key, s.total, out, d.seq * s.total,
                         s.total, row.data());
    };
    if (parallel_for && items > 1) {
      parallel_for(items, one);
    } else {
      for (int64_t i = 0; i < items; ++i) one(i);
    }
  }
}

}  // namespace ops
}  // namespace olep
