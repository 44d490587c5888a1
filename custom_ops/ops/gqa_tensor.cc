#include "ops/gqa_tensor.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels/rotary.h"

namespace olep {
namespace ops {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

[[noreturn]] void fail(const std::string& what, const std::string& expected, const std::string& got) {
  throw std::invalid_argument("GroupQueryAttention: " + what + "; expected " + expected + ", got " + got);
}

std::string desc(const Tensor& t) { return std::string(elem_type_name(t.type)) + " " + shape_str(t.shape); }

void check_type(const Tensor& t, const char* name, ElemType want) {
  if (t.type != want) fail(std::string("input '") + name + "' type", elem_type_name(want), elem_type_name(t.type));
}

// ORT's CPU kernel picks its fused flash kernel for float32 without softcap unless
// ORT_GQA_DISABLE_FLASH_ATTENTION is set; padding rows of a first prompt differ
// between the two kernels (gqa_tensor.h).
bool ort_unfused_kernel(DType dt, float softcap) {
  static const bool disabled = [] {
    const char* v = std::getenv("ORT_GQA_DISABLE_FLASH_ATTENTION");
    if (v == nullptr) return false;
    const std::string s(v);
    return s == "1" || s == "true" || s == "True" || s == "TRUE";
  }();
  return dt != DType::kFloat32 || softcap > 0.0f || disabled;
}

void run_n(const ParallelFor& pf, int64_t n, const std::function<void(int64_t)>& fn) {
  if (pf && n > 1) {
    pf(n, fn);
  } else {
    for (int64_t i = 0; i < n; ++i) fn(i);
  }
}

}  // namespace

GqaShapes gqa_shapes(const GqaAttrs& a, const GqaInputs& in) {
  const int64_t Hq = a.num_heads, Hkv = a.kv_num_heads;
  if (Hq <= 0 || Hkv <= 0 || Hq % Hkv != 0)
    fail("attributes num_heads/kv_num_heads", "positive with num_heads % kv_num_heads == 0",
         str(Hq) + "/" + str(Hkv));
  if (a.local_window_size != -1 && a.local_window_size <= 0)
    fail("attribute 'local_window_size'", "-1 or > 0", str(a.local_window_size));
  if (!in.query || !in.seqlens_k || !in.total_sequence_length)
    fail("required inputs", "query, seqlens_k and total_sequence_length", "one of them absent");
  const Tensor& q = *in.query;
  if (q.type != ElemType::kFloat32 && q.type != ElemType::kFloat16)
    fail("input 'query' type", "float or float16", elem_type_name(q.type));
  if (q.shape.size() != 3) fail("input 'query' rank", "3 [B, S, hidden]", desc(q));
  GqaShapes s;
  s.batch = q.shape[0];
  s.seq = q.shape[1];
  const int64_t B = s.batch, S = s.seq, X = q.shape[2];
  if (B < 1 || S < 1) fail("input 'query' batch and sequence length", ">= 1", desc(q));
  if ((in.key == nullptr) != (in.value == nullptr))
    fail("inputs 'key' and 'value'", "both present or both absent (packed QKV)", in.key ? "value absent" : "key absent");
  s.packed_qkv = in.key == nullptr;
  const int64_t heads = s.packed_qkv ? Hq + 2 * Hkv : Hq;
  if (X <= 0 || X % heads != 0)
    fail("input 'query' last dimension", std::string("a positive multiple of ") +
         (s.packed_qkv ? "num_heads + 2*kv_num_heads = " : "num_heads = ") + str(heads), desc(q));
  const int64_t D = X / heads;
  s.head_dim = D;
  if (D % 8 != 0) fail("head size (as ORT requires)", "a multiple of 8", str(D));
  const std::vector<int64_t> kv_shape = {B, S, Hkv * D};
  if (!s.packed_qkv)
    for (const Tensor* t : {in.key, in.value}) {
      const char* name = t == in.key ? "key" : "value";
      check_type(*t, name, q.type);
      if (t->shape != kv_shape) fail(std::string("input '") + name + "' shape", shape_str(kv_shape), desc(*t));
    }
  if ((in.past_key == nullptr) != (in.past_value == nullptr))
    fail("inputs 'past_key' and 'past_value'", "both present or both absent", in.past_key ? "past_value absent" : "past_key absent");
  if (in.past_key) {
    s.past_capacity = in.past_key->shape.size() == 4 ? in.past_key->shape[2] : -1;
    const std::vector<int64_t> want = {B, Hkv, s.past_capacity, D};
    for (const Tensor* t : {in.past_key, in.past_value}) {
      const char* name = t == in.past_key ? "past_key" : "past_value";
      check_type(*t, name, q.type);
      if (t->shape != want) fail(std::string("input '") + name + "' shape", "BNSH " + shape_str(want), desc(*t));
    }
  }
  const Tensor& sk = *in.seqlens_k;
  check_type(sk, "seqlens_k", ElemType::kInt32);
  if (!(sk.shape == std::vector<int64_t>{B} || sk.shape == std::vector<int64_t>{B, 1}))
    fail("input 'seqlens_k' shape", "[" + str(B) + "]", desc(sk));
  const Tensor& ts = *in.total_sequence_length;
  check_type(ts, "total_sequence_length", ElemType::kInt32);
  if (ts.numel() != 1) fail("input 'total_sequence_length'", "one element", desc(ts));
  const int64_t total = *static_cast<const int32_t*>(ts.data);
  s.present_length = std::max(total, s.past_capacity);

  if ((in.cos_cache == nullptr) != (in.sin_cache == nullptr))
    fail("inputs 'cos_cache' and 'sin_cache'", "both present or both absent", in.cos_cache ? "sin_cache absent" : "cos_cache absent");
  int64_t cache_rows = 0;
  if (in.cos_cache) {
    for (const Tensor* t : {in.cos_cache, in.sin_cache}) {
      const char* name = t == in.cos_cache ? "cos_cache" : "sin_cache";
      check_type(*t, name, q.type);
      if (t->shape.size() != 2) fail(std::string("input '") + name + "' rank", "2 [max_sequence_length, rotary_dim/2]", desc(*t));
      if (t->shape[0] < total)
        fail(std::string("input '") + name + "' dim 0", ">= total_sequence_length = " + str(total), desc(*t));
    }
    if (D % 16 != 0) fail("head size with cos_cache/sin_cache (as ORT requires)", "a multiple of 16", str(D));
    const int64_t r2 = in.cos_cache->shape[1];
    if (r2 <= 0 || r2 > (D / 16) * 8 || r2 % 8 != 0 || in.sin_cache->shape[1] != r2)
      fail("cos_cache/sin_cache dim 1", "equal, a positive multiple of 8 and <= head_size/2 = " + str(D / 2),
           desc(*in.cos_cache) + " / " + desc(*in.sin_cache));
    s.rotary_dim = 2 * r2;
    cache_rows = std::min(in.cos_cache->shape[0], in.sin_cache->shape[0]);
  } else if (a.do_rotary) {
    fail("inputs 'cos_cache' and 'sin_cache' with do_rotary=1", "present", "absent");
  }

  // Step kind, as ORT detects it.
  if (S > 1 && S != total) {
    if (B != 1)
      fail("batch size when sequence_length (" + str(S) + ") > 1 differs from total_sequence_length (" + str(total) + ")",
           "1", str(B));
    s.first_prompt = false;
  } else {
    s.first_prompt = S == total;
  }
  s.total.resize(static_cast<size_t>(B));
  s.past.resize(static_cast<size_t>(B));
  const int32_t* skd = static_cast<const int32_t*>(sk.data);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t v = skd[b];
    const std::string name = "seqlens_k[" + str(b) + "]";
    if (v < 0 || v >= s.present_length) fail(name, "in [0, " + str(s.present_length) + ")", str(v));
    s.total[static_cast<size_t>(b)] = v + 1;
    if (s.first_prompt) continue;
    if (v + 1 < S) fail(name + " after the first prompt", ">= sequence_length - 1 = " + str(S - 1), str(v));
    if (!in.past_key) fail("inputs 'past_key'/'past_value' after the first prompt", "present", "absent");
    const int64_t p = v + 1 - S;
    if (p > s.past_capacity)
      fail(name + " + 1 - sequence_length (past rows read)", "<= past_key dim 2 = " + str(s.past_capacity), str(p));
    s.past[static_cast<size_t>(b)] = p;
  }
  if (a.do_rotary) {
    int64_t max_pos = 0;
    for (int64_t p : s.past) max_pos = std::max(max_pos, p + S - 1);
    if (max_pos >= cache_rows)
      fail("rotary position " + str(max_pos), "< cos_cache/sin_cache rows = " + str(cache_rows), str(max_pos));
  }
  s.output = {B, S, Hq * D};
  s.present = {B, Hkv, s.present_length, D};
  return s;
}

void gqa_attention(const GqaAttrs& a, const GqaInputs& in, const GqaShapes& s, void* output, void* present_key,
                   void* present_value, const ParallelFor& parallel_for) {
  const DType dt = to_dtype(in.query->type, "GroupQueryAttention: input 'query'");
  const size_t es = dtype_size(dt);
  const int64_t B = s.batch, S = s.seq, D = s.head_dim, Hq = a.num_heads, Hkv = a.kv_num_heads, L = s.present_length;
  const size_t row = static_cast<size_t>(D) * es;
  const bool share_k = in.past_key && present_key == in.past_key->data;
  const bool share_v = in.past_value && present_value == in.past_value->data;
  if (share_k != share_v)
    fail("present/past buffer sharing", "present_key and present_value both bound to their past buffers or neither",
         share_k ? "only present_key shared" : "only present_value shared");
  const bool share = share_k && share_v;
  if (share && L != s.past_capacity)
    fail("shared past/present buffer length", "present length " + str(L), str(s.past_capacity));
  std::vector<char> scratch_k, scratch_v;
  if (!present_key) {
    scratch_k.resize(static_cast<size_t>(B * Hkv * L) * row);
    present_key = scratch_k.data();
  }
  if (!present_value) {
    scratch_v.resize(static_cast<size_t>(B * Hkv * L) * row);
    present_value = scratch_v.data();
  }

  // Rows of the new tokens in the inputs: token (b, s), head h.
  const char* qbase = static_cast<const char*>(in.query->data);
  const int64_t qrow_heads = s.packed_qkv ? Hq + 2 * Hkv : Hq;
  auto q_row = [&](int64_t b, int64_t t, int64_t h) { return qbase + static_cast<size_t>((b * S + t) * qrow_heads + h) * row; };
  auto k_row = [&](int64_t b, int64_t t, int64_t h) -> const char* {
    if (s.packed_qkv) return q_row(b, t, Hq + h);
    return static_cast<const char*>(in.key->data) + static_cast<size_t>((b * S + t) * Hkv + h) * row;
  };
  auto v_row = [&](int64_t b, int64_t t, int64_t h) -> const char* {
    if (s.packed_qkv) return q_row(b, t, Hq + Hkv + h);
    return static_cast<const char*>(in.value->data) + static_cast<size_t>((b * S + t) * Hkv + h) * row;
  };
  const bool rotary = a.do_rotary;
  const size_t cache_row = static_cast<size_t>(s.rotary_dim / 2) * es;
  auto rotate = [&](int64_t b, int64_t t, const char* src, char* dst) {
    const size_t pos = static_cast<size_t>(s.past[static_cast<size_t>(b)] + t);
    kernels::rotary_row(dt, src, static_cast<const char*>(in.cos_cache->data) + pos * cache_row,
               static_cast<const char*>(in.sin_cache->data) + pos * cache_row, s.rotary_dim, D, a.rotary_interleaved, dst);
  };

  // Q as [B, S, Hq, D]: the input itself, or a copy (rotated, or unpacked).
  std::vector<char> qbuf;
  const char* q = qbase;
  if (rotary || s.packed_qkv) {
    qbuf.resize(static_cast<size_t>(B * S * Hq) * row);
    run_n(parallel_for, B * S, [&](int64_t bt) {
      const int64_t b = bt / S, t = bt % S;
      for (int64_t h = 0; h < Hq; ++h) {
        char* dst = qbuf.data() + static_cast<size_t>(bt * Hq + h) * row;
        if (rotary) {
          rotate(b, t, q_row(b, t, h), dst);
        } else {
          std::memcpy(dst, q_row(b, t, h), row);
        }
      }
    });
    q = qbuf.data();
  }

  // Present: [0, P_b) from past (unless shared), new rows at [P_b, P_b + S), zeros after (unless shared).
  char* pk = static_cast<char*>(present_key);
  char* pv = static_cast<char*>(present_value);
  run_n(parallel_for, B * Hkv, [&](int64_t bh) {
    const int64_t b = bh / Hkv, h = bh % Hkv;
    const int64_t p = s.past[static_cast<size_t>(b)];
    char* kd = pk + static_cast<size_t>(bh * L) * row;
    char* vd = pv + static_cast<size_t>(bh * L) * row;
    if (!share) {
      if (p > 0) {
        const size_t src = static_cast<size_t>(bh * s.past_capacity) * row;
        std::memcpy(kd, static_cast<const char*>(in.past_key->data) + src, static_cast<size_t>(p) * row);
        std::memcpy(vd, static_cast<const char*>(in.past_value->data) + src, static_cast<size_t>(p) * row);
      }
      const size_t tail = static_cast<size_t>(L - p - S) * row;
      std::memset(kd + static_cast<size_t>(p + S) * row, 0, tail);
      std::memset(vd + static_cast<size_t>(p + S) * row, 0, tail);
    }
    for (int64_t t = 0; t < S; ++t) {
      char* kt = kd + static_cast<size_t>(p + t) * row;
      if (rotary) {
        rotate(b, t, k_row(b, t, h), kt);
      } else {
        std::memcpy(kt, k_row(b, t, h), row);
      }
      std::memcpy(vd + static_cast<size_t>(p + t) * row, v_row(b, t, h), row);
    }
  });

  // Attention over present rows [0, seqlens_k + 1).
  const bool fix_padding = s.first_prompt && a.local_window_size > 0 && ort_unfused_kernel(dt, a.softcap);
  AttentionCall call;
  call.d.rank = 3;
  call.d.batch = B;
  call.d.seq = S;
  call.d.q_heads = Hq;
  call.d.kv_heads = Hkv;
  call.d.head_dim = D;
  call.d.v_head_dim = D;
  call.dtype = dt;
  call.q = q;
  call.y = output;
  call.scale = a.scale;
  call.softcap = a.softcap;
  call.is_causal = true;
  call.local_window_size = a.local_window_size > 0 ? a.local_window_size : -1;
  call.q_offset = s.past;
  call.num_keys = s.total;
  call.num_valid_rows.assign(static_cast<size_t>(B), S);
  if (fix_padding)
    for (int64_t b = 0; b < B; ++b)
      call.num_valid_rows[static_cast<size_t>(b)] = std::min(S, s.total[static_cast<size_t>(b)]);
  call.blocks = dense_blocks(B, Hkv, pk, pv, L, row, row, std::vector<int64_t>(static_cast<size_t>(B), 0), s.total);
  run_attention(call, parallel_for);
  if (!fix_padding) return;

  // ORT's unfused kernel: a padding row s >= T_b of a first prompt sees the window that
  // ends at the last valid key, [max(0, T_b - W), T_b), without causal masking.
  for (int64_t b = 0; b < B; ++b) {
    const int64_t T = s.total[static_cast<size_t>(b)];
    if (T >= S) continue;
    const int64_t lo = std::max<int64_t>(0, T - a.local_window_size);
    AttentionCall pad = call;
    pad.d.batch = 1;
    pad.d.seq = S - T;
    pad.q = q + static_cast<size_t>((b * S + T) * Hq) * row;
    pad.y = static_cast<char*>(output) + static_cast<size_t>((b * S + T) * Hq) * row;
    pad.is_causal = false;
    pad.local_window_size = -1;
    pad.q_offset = {0};
    pad.num_keys = {T};
    pad.num_valid_rows = {S - T};
    const size_t seq_off = static_cast<size_t>(b * Hkv * L) * row;
    pad.blocks = dense_blocks(1, Hkv, pk + seq_off, pv + seq_off, L, row, row, {lo}, {T - lo});
    run_attention(pad, parallel_for);
  }
}

}  // namespace ops
}  // namespace olep
