// Streaming attention of a group of query heads that share one KV head, over
// cached K/V blocks (ONNX Attention opset 23 semantics; GQA mapping per ORT
// GroupQueryAttention: query head h reads kv head h / (q_num_heads / kv_num_heads)).
//
// For every query row: online softmax over the keys, block by block (running
// max, running sum, weighted V accumulation), scores never materialized, all
// arithmetic in float32 whatever the storage type. Each K/V row is loaded and
// converted once per group, not once per query head.
//
// Kernels know nothing of ORT, ONNX or the cache arena: they get plain views.
#pragma once

#include <cstdint>

#include "common/dtype.h"
#include "kernels/kv_block.h"

namespace olep {
namespace kernels {

enum class MaskKind { kNone, kBool, kAdditive };

/// attn_mask for one sequence, already offset to (batch b, first query head of
/// the group). Element strides; 0 on a broadcast dimension.
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

/// One (sequence, kv head) work item. Element strides; all pointers in `dtype`.
struct AttentionGroup {
  DType dtype = DType::kFloat32;
  const void* q = nullptr;  // (first head of the group, row 0)
  int64_t q_head_stride = 0;
  int64_t q_row_stride = 0;
  void* out = nullptr;  // same addressing as q, v_head_dim wide
  int64_t out_head_stride = 0;
  int64_t out_row_stride = 0;
  int64_t group_size = 1;      // query heads sharing the kv head
  int64_t num_rows = 0;        // query rows S
  int64_t num_valid_rows = 0;  // rows >= this (right padding) get zeros
  int64_t q_offset = 0;        // absolute position of query row 0 (past length)
  int64_t num_keys = 0;        // keys that exist: positions [0, num_keys)
  const KVBlock* blocks = nullptr;
  int64_t num_blocks = 0;
  int64_t head_dim = 0;
  int64_t v_head_dim = 0;
  float scale = 1.0f;
  float softcap = 0.0f;        // > 0: softcap * tanh(score / softcap), before the mask
  bool is_causal = false;      // key j visible to row i iff j <= q_offset + i
  int64_t local_window_size = -1;  // > 0: also j > q_offset + i - local_window_size
  MaskView mask;
};

/// float32 scratch elements attend_group needs for `a`.
int64_t attend_scratch_floats(const AttentionGroup& a);

/// Scalar reference kernel (the test oracle for every ISA variant).
/// A row that sees no key gets zeros. `scratch` holds attend_scratch_floats(a) floats.
void attend_group_scalar(const AttentionGroup& a, float* scratch);

}  // namespace kernels
}  // namespace olep
