// Streaming attention of a group of query heads that share one KV head, over
// cached K/V blocks (ONNX Attention opset 23 semantics; GQA mapping per ORT
// GroupQueryAttention: query head h reads kv head h / (q_num_heads / kv_num_heads)).
//
// For every query row: online softmax over the keys, block by block (running
// max, running sum, weighted V accumulation); scores exist only for one tile
// of keys at a time, never for the whole sequence; all arithmetic in float32
// whatever the storage type. Each K/V row is loaded (and converted) once per
// group and tile, not once per query head.
//
// A key range can be processed in pieces (split-KV): each piece yields an
// AttentionState, and merge_states() combines them exactly (in a fixed order,
// so results do not depend on the thread count).
//
// Kernels know nothing of ORT, ONNX or the cache arena: they get plain views.
#pragma once

#include <cstdint>
#include <string>

#include "common/dtype.h"
#include "kernels/kv_block.h"

namespace olep {
namespace kernels {

enum class MaskKind { kNone, kBool, kAdditive };

/// attn_mask for one sequence, already offset to (batch b, first query head of
/// the group, query row 0). Element strides; 0 on a broadcast dimension.
/// kBool: uint8/bool, nonzero = attend. kAdditive: `dtype` values added to the
/// scaled (and soft-capped) score; a value <= the lowest finite value of its
/// dtype (-inf, or finfo.min as exporters write it) masks the key out entirely.
struct MaskView {
  MaskKind kind = MaskKind::kNone;
  DType dtype = DType::kFloat32;
  const void* data = nullptr;
  int64_t head_stride = 0;
  int64_t row_stride = 0;
  int64_t key_stride = 0;
};

/// One (sequence, kv head, block of query rows) work item. Element strides;
/// q/out in `dtype`.
struct AttentionGroup {
  DType dtype = DType::kFloat32;
  const void* q = nullptr;  // (first head of the group, first row of the block)
  int64_t q_head_stride = 0;
  int64_t q_row_stride = 0;
  void* out = nullptr;  // same addressing as q, v_head_dim wide
  int64_t out_head_stride = 0;
  int64_t out_row_stride = 0;
  int64_t group_size = 1;      // query heads sharing the kv head
  int64_t num_rows = 0;        // query rows in this item
  int64_t num_valid_rows = 0;  // rows >= this (right padding) get zeros
  int64_t q_offset = 0;        // absolute position of this item's query row 0
  int64_t num_keys = 0;        // keys that exist: positions [0, num_keys)
  const KVBlock* blocks = nullptr;
  int64_t num_blocks = 0;
  int64_t head_dim = 0;
  int64_t v_head_dim = 0;
  float scale = 1.0f;
  float softcap = 0.0f;            // > 0: softcap * tanh(score / softcap), before the mask
  bool is_causal = false;          // key j visible to row i iff j <= q_offset + i
  int64_t local_window_size = -1;  // > 0: also j > q_offset + i - local_window_size
  MaskView mask;                   // offset to this item's row 0
};

/// Online-softmax state of R = group_size * num_rows rows (row r = h * num_rows + i):
/// running max m[r], running sum l[r] (relative to m), unnormalized output acc[r * v_head_dim + d].
struct AttentionState {
  float* m = nullptr;
  float* l = nullptr;
  float* acc = nullptr;
};

/// Floats of one AttentionState for `a` (m, l and acc together).
int64_t state_floats(const AttentionGroup& a);
/// Points s into `buffer` (state_floats(a) floats) and resets it (m = -inf, l = 0, acc = 0).
void init_state(const AttentionGroup& a, float* buffer, AttentionState* s);
/// Folds `src` into `dst` exactly: max of maxima, sums and accumulators rescaled.
void merge_states(const AttentionGroup& a, AttentionState* dst, const AttentionState& src);
/// Writes out = acc / l (zeros where nothing was visible or the row is padding) in `dtype`, with
/// the active ISA level (16-bit outputs converted W at a time; the same bits at every level).
void finalize(const AttentionGroup& a, const AttentionState& s);
/// Per-level implementations of finalize (16-bit outputs, v_head_dim a multiple of W).
void finalize_scalar(const AttentionGroup& a, const AttentionState& s);
void finalize_avx2(const AttentionGroup& a, const AttentionState& s);
void finalize_avx512(const AttentionGroup& a, const AttentionState& s);

/// Instruction-set levels, best last. The scalar level is always built and is the test oracle.
/// kAvx512Bf16 ("avx512_bf16", needs AVX512_BF16 and AVX512_VNNI) is kAvx512 plus VDPBF16PS for
/// q . k of bfloat16 caches (exact bf16 products, float32 sums; see attention_avx512_bf16.cc) and
/// VPDPWSSD for the exact int16 pair sums of int8 pages (kAvx512 and kAvx2 compute the same
/// sums with VPMADDWD + VPADDD); other dtypes run as kAvx512.
enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };
const char* isa_name(Isa isa);
/// Best level this CPU supports.
Isa detected_isa();
/// Level in use: detected_isa(), or ONNX_LIGHT_ISA=scalar|avx2|avx512|avx512_bf16 from the environment
/// at first use, or set_isa(). A level the CPU lacks is refused.
Isa active_isa();
/// The level ONNX_LIGHT_ISA=`value` selects when the CPU's best is `best` (null or empty: best).
/// An unknown name or a level above best gives best and sets *warning naming the levels (printed
/// to stderr once by active_isa); otherwise *warning is cleared.
Isa choose_isa(const char* value, Isa best, std::string* warning);
/// Forces a level (tests, benchmarks). Throws std::invalid_argument if the CPU lacks it.
void set_isa(Isa isa);

/// float32 scratch a call of attend_range needs for `a` (beyond the state).
int64_t scratch_floats(const AttentionGroup& a);
/// Processes keys [key_begin, key_end) into `state` with the active ISA level.
/// `scratch` holds scratch_floats(a) floats.
void attend_range(const AttentionGroup& a, int64_t key_begin, int64_t key_end, AttentionState* state, float* scratch);

/// Per-level implementations (attend_range dispatches). Same contract.
void attend_range_scalar(const AttentionGroup& a, int64_t key_begin, int64_t key_end, AttentionState* state,
                         float* scratch);
void attend_range_avx2(const AttentionGroup& a, int64_t key_begin, int64_t key_end, AttentionState* state,
                       float* scratch);
void attend_range_avx512(const AttentionGroup& a, int64_t key_begin, int64_t key_end, AttentionState* state,
                         float* scratch);
void attend_range_avx512_bf16(const AttentionGroup& a, int64_t key_begin, int64_t key_end, AttentionState* state,
                              float* scratch);

/// What qk_scores writes: the stages of ONNX Attention's optional 4th output, by
/// qk_matmul_output_mode (opset 23/24 text).
enum class QkStage : int {
  kMatMul = 0,   // scale * q . k, for every key (masks play no part)
  kSoftcap = 1,  // softcap * tanh(s / softcap) when softcap > 0, else as kMatMul
  kBiased = 2,   // kSoftcap plus the bias: the attn_mask value as given (bool: 0 / -inf), -inf for keys
                 // outside the causal frontier or local window and for keys >= num_keys
  kSoftmax = 3,  // the softmax weights Y uses, in float32 before rounding to `dtype`: the mask as
                 // attend_range reads it (a value <= the lowest finite one is -inf), keys with -inf bias
                 // get 0, a row with no visible key is all 0, a NaN or +inf score makes the row NaN
};

/// ONNX Attention's qk_matmul_output for work item `a` over dense keys: for each query head
/// h < group_size, row i < num_rows and key j < total_keys (total_keys >= a.num_keys; keys
/// from num_keys on are padding: -inf bias), writes stage `stage` of score (h, i, j) as `a.dtype` to
/// out[h * out_head_stride + i * out_row_stride + j]; rows >= num_valid_rows get zeros.
/// key: total_keys rows of head_dim elements of `a.dtype`, row j at key + j * head_dim elements
/// (a.blocks are not read). Scalar float32 on every ISA level (a debug output, not a hot path).
/// `scratch`: total_keys floats.
void qk_scores(const AttentionGroup& a, QkStage stage, const void* key, int64_t total_keys, void* out,
               int64_t out_head_stride, int64_t out_row_stride, float* scratch);

/// Convenience: the whole key range, then finalize (tests, small calls).
void attend_group(const AttentionGroup& a, float* scratch_and_state);
int64_t attend_group_floats(const AttentionGroup& a);

}  // namespace kernels
}  // namespace olep
