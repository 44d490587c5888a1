// Attention over blocked K/V shared by every attention op: input layout
// resolution (3-D BSNH / 4-D BNSH), attn_mask broadcasting, and the parallel
// work decomposition over the streaming kernels. ORT-free.
// Semantics: ONNX Attention opset 23/24 (onnx.ai Operators/Attention); GQA head
// mapping as ORT com.microsoft.GroupQueryAttention (query head h reads kv head
// h / (q_num_heads / kv_num_heads)).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kernels/attention.h"
#include "ops/tensor.h"

namespace olep {
namespace ops {

/// Resolved dimensions of one attention call.
struct AttentionDims {
  int64_t rank = 4;  // 3 (BSNH packed [B, S, H*D]) or 4 (BNSH)
  int64_t batch = 0, seq = 0, q_heads = 0, kv_heads = 0, head_dim = 0, v_head_dim = 0;
};

/// Validates query/key/value (ranks, shapes, float types) against q_num_heads /
/// kv_num_heads attributes (0 = absent; required for rank 3) and returns the
/// dims; for rank 4, key/value may have a different sequence length than the
/// query when `key_seq_may_differ` (ONNX Attention without a cache), which is
/// returned in *key_seq. Throws std::invalid_argument "<op>: ..." naming the input.
AttentionDims resolve_dims(const char* op, int64_t q_num_heads, int64_t kv_num_heads, const Tensor& q, const Tensor& k,
                           const Tensor& v, bool key_seq_may_differ = false, int64_t* key_seq = nullptr);

/// Y's shape: [B, S, Hq*Dv] (rank 3) or [B, Hq, S, Dv] (rank 4).
std::vector<int64_t> output_shape(const AttentionDims& d);

/// Element strides (batch, head, sequence) of a rank-3 [B, S, H*D] or rank-4 [B, H, S, D] tensor.
void layout_strides(int64_t rank, int64_t H, int64_t S, int64_t D, int64_t out[3]);

/// attn_mask broadcast (numpy rules, right-aligned, rank 2-4) to [B, Hq, S, T]:
/// the view for batch 0 plus the batch stride. The last dim must be 1 or >= min_keys.
struct MaskSpec {
  kernels::MaskView view;
  int64_t batch_stride = 0;
  size_t elem_size = 0;
};
MaskSpec parse_mask(const char* op, const Tensor& mask, const AttentionDims& d, int64_t min_keys);

/// One block per (b, h) of dense BNSH buffers key [batch, kv_heads, capacity, *] and value
/// [batch, kv_heads, capacity, *] (row sizes in bytes): positions [first[b], first[b] + rows[b]).
BlockList dense_blocks(int64_t batch, int64_t kv_heads, const void* key, const void* value, int64_t capacity,
                       size_t k_row_bytes, size_t v_row_bytes, const std::vector<int64_t>& first,
                       const std::vector<int64_t>& rows);

/// One attention over K/V that lives in blocks (a cache, or past/present tensors).
struct AttentionCall {
  AttentionDims d;
  DType dtype = DType::kFloat32;
  const void* q = nullptr;  // layout of d.rank
  void* y = nullptr;        // layout of d.rank
  float scale = 0.0f;       // 0 = 1/sqrt(head_dim)
  float softcap = 0.0f;
  bool is_causal = false;
  int64_t local_window_size = -1;
  std::vector<int64_t> q_offset;        // [B] absolute position of query row 0
  std::vector<int64_t> num_keys;        // [B] keys [0, num_keys) exist
  std::vector<int64_t> num_valid_rows;  // [B] query rows >= this are padding (zeros)
  const MaskSpec* mask = nullptr;
  BlockList blocks;  // covers positions [0, num_keys[b]) of every (b, h), or the part that exists
};

/// Runs `c` over work items (sequence, kv head, query block, KV split) through
/// `parallel_for`. The split is fixed by the shape, never by the thread count,
/// so results are bit-identical for any number of threads.
void run_attention(const AttentionCall& c, const ParallelFor& parallel_for);

}  // namespace ops
}  // namespace olep
