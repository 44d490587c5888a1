// ORT com.microsoft GroupQueryAttention (GQA) over tensors: the EP's tensor
// compatibility mode for onnxruntime-genai models that were NOT converted.
// Semantics: ORT contrib ops doc (docs/ContribOperators.md, GroupQueryAttention)
// and ORT's CPU kernel (contrib_ops/cpu/bert/group_query_attention.cc,
// group_query_attention_helper.h, gqa_attention_base.h), reproduced so that
// output, present_key and present_value equal plain ORT CPU's. ORT-free.
//
// Layouts: query [B, S, Hq*D] (BSNH), or packed QKV [B, S, (Hq + 2*Hkv)*D] when
// key/value are absent; key/value [B, S, Hkv*D]; past/present BNSH
// [B, Hkv, L, D]; output [B, S, Hq*D]. T = float32 or float16 for every one of
// them (cos/sin caches included); seqlens_k int32 [B] (or [B, 1]) = total valid
// length - 1 per sequence; total_sequence_length int32, one element.
//
// Step kinds (ORT's detection):
//   first prompt       S == total_sequence_length: every sequence starts at 0
//                      (P_b = 0) and holds seqlens_k[b] + 1 valid tokens; when
//                      that is < S the rest of its S rows is right padding;
//   token generation   S == 1 otherwise: past length P_b = seqlens_k[b];
//   subsequent prompt  S > 1, S != total_sequence_length, batch 1 only:
//                      P_0 = seqlens_k[0] + 1 - S.
// Present cache: when present_key/present_value are the very buffers of
// past_key/past_value (an IOBinding of one OrtValue to both; capacity = dim 2)
// only the S new rows of each sequence are written, at rows [P_b, P_b + S), and
// nothing else is touched. Otherwise present has L = max(total_sequence_length,
// past length) rows: [0, P_b) copied from past, [P_b, P_b + S) the new rows,
// the rest zero. Padding rows of a first prompt are stored like the others.
// Rotary (do_rotary=1, kernels/rotary.h): rotary_dim = 2 * cos_cache dim 1; position of
// new row s is s in a first prompt (for every sequence, padding or not) and
// P_b + s otherwise; applied to Q and to K before K is stored.
// Attention: query row s of sequence b sees keys j < seqlens_k[b] + 1 with
// j <= P_b + s (causal) and j > P_b + s - local_window_size when
// local_window_size > 0; scale default 1/sqrt(D); softcap * tanh(x / softcap)
// on the scaled scores when softcap > 0. A padding row of a first prompt
// (s > seqlens_k[b]) follows ORT's CPU kernel: for float32 without softcap
// (ORT's fused flash kernel) the rule above, zeros when it sees no key; for
// float16 or softcap > 0 (ORT's unfused kernel, also selected by the
// environment variable ORT_GQA_DISABLE_FLASH_ATTENTION=1) the row sees the
// local window that ends at the last valid key.
//
// Not supported (the EP refuses such nodes in GetCapability): position_ids,
// attention_bias, head_sink, k/v_scale, q/k_norm_weight, query_seqlens inputs;
// smooth_softmax, qk_output, quantized caches, sliding_window_cache, causal=0.
// Rejected at run time with a message (ORT computes something for them):
// key/value whose sequence length is not S (ORT's "shared KV"), a step after
// the first prompt without past_key/past_value, bfloat16.
#pragma once

#include <cstdint>
#include <vector>

#include "ops/attention_core.h"
#include "ops/tensor.h"

namespace olep {
namespace ops {

struct GqaAttrs {
  int64_t num_heads = 0;     // Hq (required)
  int64_t kv_num_heads = 0;  // Hkv (required); Hq % Hkv == 0
  float scale = 0.0f;        // 0 = 1/sqrt(D)
  float softcap = 0.0f;      // <= 0 = off
  int64_t local_window_size = -1;  // -1 = off, else > 0
  bool do_rotary = false;
  bool rotary_interleaved = false;
};

/// Inputs in ORT's order; absent optional inputs are null.
struct GqaInputs {
  const Tensor* query = nullptr;
  const Tensor* key = nullptr;
  const Tensor* value = nullptr;
  const Tensor* past_key = nullptr;
  const Tensor* past_value = nullptr;
  const Tensor* seqlens_k = nullptr;
  const Tensor* total_sequence_length = nullptr;
  const Tensor* cos_cache = nullptr;
  const Tensor* sin_cache = nullptr;
};

/// Everything gqa_shapes derives from the inputs.
struct GqaShapes {
  int64_t batch = 0, seq = 0, head_dim = 0;
  bool packed_qkv = false;
  bool first_prompt = false;
  int64_t past_capacity = 0;  // dim 2 of past_key (0 without a past)
  int64_t present_length = 0; // max(total_sequence_length, past_capacity)
  int64_t rotary_dim = 0;     // 0 without cos/sin caches
  std::vector<int64_t> total;  // [B] seqlens_k + 1
  std::vector<int64_t> past;   // [B] P_b
  std::vector<int64_t> output, present;  // output [B, S, Hq*D]; present [B, Hkv, L, D]
};

/// Validates the inputs as ORT's CPU kernel does (shapes, types, seqlens_k range,
/// rotary cache size); throws std::invalid_argument "GroupQueryAttention: <what>;
/// expected <X>, got <Y>".
GqaShapes gqa_shapes(const GqaAttrs& a, const GqaInputs& in);

/// Writes output (s.output, type T) and present_key/present_value (s.present).
/// When present_key == past_key->data and present_value == past_value->data the
/// present is the past buffer and only the new rows are written (see above); a
/// present that aliases only one of them is an error. Null presents go to internal
/// scratch. Work runs through `parallel_for`; results do not depend on the
/// thread count. Throws std::invalid_argument on aliasing errors.
void gqa_attention(const GqaAttrs& a, const GqaInputs& in, const GqaShapes& s, void* output, void* present_key,
                   void* present_value, const ParallelFor& parallel_for);

}  // namespace ops
}  // namespace olep
