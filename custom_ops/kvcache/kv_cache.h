// The persistent KV cache and its process-wide handle registry.
//
// One KVCache serves one request group (batch_size sequences) across all
// num_layers attention layers of one model. Storage is contiguous per
// (layer, sequence, kv head): a block of max_sequence_length rows for K
// (head_dim elements each) and one for V (v_head_dim elements each), in one
// address-space reservation made up front (mmap, MAP_NORESERVE) whose pages
// the kernel commits as rows are first written. Each row block starts on a
// page boundary, so `committed_bytes` (page-rounded high-water mark per block)
// is what the process really touched.
//
// Appending n rows writes exactly n rows per (layer, sequence, head): cost is
// O(n), never O(cached length). Attention reads rows where they lie through
// `block_list()` (one block per (layer, sequence, head) today; paged and
// quantized storage will yield more blocks through the same call).
//
// Steps. A model run appends one "step" of S rows (n_b <= S valid rows per
// sequence) to every layer, in layer order 0..num_layers-1. Rows become
// visible (seq_lens advances) only when the last layer has appended: a run
// that fails half-way leaves seq_lens and every committed row as they were.
// The partial step is discarded when layer 0 starts a new step or when a
// mutating method (reset/truncate/reorder/import_past) runs.
//
// Thread safety: every public method locks the cache's mutex. A step belongs
// to the thread that started it (ORT runs a session's kernels on the thread
// that called Run). Layer 0 of a new run always starts a new step (so a failed
// run can never block the cache); if another thread's step was open, that run
// is rejected at its next layer. Two concurrent runs are never interleaved.
//
// No ORT, no ONNX here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/dtype.h"
#include "kernels/kv_block.h"
#include <functional>

namespace olep {

/// Shape and limits of a cache. All counts are >= 1; memory_limit_bytes 0 = no limit.
struct CacheGeometry {
  int64_t num_layers = 0;
  int64_t batch_size = 0;
  int64_t kv_num_heads = 0;
  int64_t head_dim = 0;
  int64_t v_head_dim = 0;
  int64_t max_sequence_length = 0;
  DType dtype = DType::kFloat32;
  int64_t memory_limit_bytes = 0;
};

/// Memory and traffic counters (bytes unless named num_).
struct CacheStats {
  int64_t reserved_bytes = 0;   // address space reserved
  int64_t committed_bytes = 0;  // pages touched (page-rounded per row block)
  int64_t live_bytes = 0;       // bytes of valid (committed-step) rows
  int64_t bytes_appended = 0;   // cumulative bytes of new rows written by steps and imports
  int64_t bytes_copied = 0;     // cumulative bytes of cached rows moved by fork/reorder/export
  int64_t num_appends = 0;      // committed steps
};

/// New rows for one step of one layer, as strided views (element strides).
/// key(b, h, s, d) = key[b*key_strides[0] + h*key_strides[1] + s*key_strides[2] + d]
struct NewRows {
  const void* key = nullptr;
  const void* value = nullptr;
  int64_t key_strides[3] = {0, 0, 0};    // batch, head, sequence (innermost dim is contiguous)
  int64_t value_strides[3] = {0, 0, 0};
  int64_t sequence_length = 0;            // S
  const int64_t* num_new = nullptr;       // [batch] valid rows per sequence (<= S), or null = S each
};

class KVCache {
 public:
  /// Validates `g` (std::invalid_argument naming the field) and reserves address space
  /// (std::runtime_error if the reservation fails).
  explicit KVCache(const CacheGeometry& g);
  ~KVCache();
  KVCache(const KVCache&) = delete;
  KVCache& operator=(const KVCache&) = delete;

  const CacheGeometry& geometry() const { return g_; }

  // ---- Python-facing operations (each locks; mutating ones discard a partial step) ----
  std::vector<int64_t> seq_lens() const;
  CacheStats stats() const;
  void reset();
  /// lengths: [batch], 0 <= lengths[b] <= seq_lens[b]. Frees pages beyond the new length.
  void truncate(const std::vector<int64_t>& lengths);
  /// New sequence i = old sequence indices[i]; indices [batch], each in [0, batch).
  void reorder(const std::vector<int64_t>& indices);
  /// A new cache with the same geometry and a copy of the valid rows.
  std::unique_ptr<KVCache> fork();
  /// Replaces the content: layer l rows [0, L) of every sequence from BNSH [B, Hkv, L, D] arrays
  /// (C-contiguous, cache dtype). keys.size() == values.size() == num_layers.
  void import_past(const std::vector<const void*>& keys, const std::vector<const void*>& values, int64_t length);
  /// Output buffers for export_layer: given L, returns zero-filled BNSH [B, Hkv, L, D] and
  /// [B, Hkv, L, Dv] buffers of the cache dtype (key first).
  using ExportAllocator = std::function<std::pair<void*, void*>(int64_t length)>;
  /// Copies layer `layer` (valid rows, L = max length, shorter sequences left zero) into buffers
  /// from `alloc`. include_pending: also the rows the calling thread's open step appended to that
  /// layer (CacheExport inside a run). Returns the per-sequence lengths.
  std::vector<int64_t> export_layer(int64_t layer, bool include_pending, const ExportAllocator& alloc);
  /// Committed lengths; the caller holds lock().
  const std::vector<int64_t>& lengths_locked() const { return lens_; }

  // ---- Op-facing: one layer's part of a step ----
  // Usage (see ops/cache_attention.cc): lock(), begin_layer_append(...), append_rows(...),
  // read block_list() and attend, finish_layer_append(), unlock. All under the returned lock.
  std::unique_lock<std::mutex> lock() const { return std::unique_lock<std::mutex>(mu_); }
  /// Checks and opens layer `layer` of the current step for `num_new` rows per sequence
  /// (step length S). Throws (std::invalid_argument / std::runtime_error) before any write if
  /// the layer is out of order, another thread owns the step, the sequence would exceed
  /// max_sequence_length, or the step would exceed memory_limit_bytes.
  /// Returns the past length P_b of every sequence (rows visible before this step).
  std::vector<int64_t> begin_layer_append(int64_t layer, int64_t sequence_length, const std::vector<int64_t>& num_new);
  /// Writes the new rows of `layer` at positions P_b .. P_b + n_b - 1. Call after begin_layer_append.
  void append_rows(int64_t layer, const NewRows& rows);
  /// Marks `layer` done; commits the step when it is the last layer.
  void finish_layer_append(int64_t layer);
  /// The blocks holding positions [0, num_keys[b]) of every (b, h) of `layer`, including the
  /// calling thread's rows of the open step. Caller holds the lock; pointers stay valid while it does.
  void block_list(int64_t layer, const std::vector<int64_t>& num_keys, BlockList* out) const;

  /// Discards a partial step owned by the calling thread (used at the start of a run).
  void discard_step_of_current_thread();
  /// Marks the calling thread's open step as failed (an op error), so its abandonment is not
  /// mistaken for a model with fewer layers than the cache.
  void mark_step_failed();

 private:
  struct Step {
    bool open = false;
    std::thread::id owner;
    int64_t next_layer = 0;      // layers 0..next_layer-1 appended
    int64_t sequence_length = 0;
    std::vector<int64_t> num_new;  // [batch]
    bool failed = false;           // a CacheAttention of this step reported an error
  };

  size_t block_index(int64_t layer, int64_t b, int64_t h) const {
    return static_cast<size_t>((layer * g_.batch_size + b) * g_.kv_num_heads + h);
  }
  char* key_block(int64_t layer, int64_t b, int64_t h) const;
  char* value_block(int64_t layer, int64_t b, int64_t h) const;
  int64_t committed_for_rows(int64_t rows) const;  // one (layer, sequence) over all heads, K+V
  int64_t row_bytes() const;                        // K+V bytes of one position over all heads
  void release_rows_from(int64_t layer, int64_t b, int64_t first_row);  // madvise pages past first_row
  // Rows [0, new_rows) of (layer, b) are written, [0, old_rows) were: map every 2 MiB region
  // that became fully written with one huge page (MADV_COLLAPSE). Only whole written regions,
  // so committed memory stays exactly the pages the rows touch.
  void promote_written(int64_t layer, int64_t b, int64_t old_rows, int64_t new_rows);
  void discard_step_locked();
  void discard_for_method_locked();   // a mutating method: remember whose run it interrupted
  void note_abandoned_locked();       // this thread's step is left unfinished by a new run
  std::vector<int64_t> layer_lengths_locked(int64_t layer, bool include_pending) const;
  CacheStats stats_locked() const;

  CacheGeometry g_;
  size_t page_ = 4096;
  size_t key_block_bytes_ = 0;    // page-aligned (2 MiB-aligned when huge_)
  size_t value_block_bytes_ = 0;  // page-aligned (2 MiB-aligned when huge_)
  size_t reserved_ = 0;
  char* base_ = nullptr;          // 2 MiB-aligned when huge_
  char* map_ = nullptr;           // the mapping (base_ rounded down), map_bytes_ long
  size_t map_bytes_ = 0;
  bool huge_ = false;             // blocks of >= 2 MiB: written 2 MiB regions become huge pages

  mutable std::mutex mu_;
  std::vector<int64_t> lens_;         // [batch] committed lengths
  std::vector<int64_t> high_water_;   // [layer * batch + b] rows ever written since release
  Step step_;
  std::thread::id interrupted_;  // owner of the last step discarded by another run or a method
  int64_t abandoned_at_ = -1;     // layer count of the last unfinished (not failed) step of a run
  int abandoned_repeats_ = 0;     // consecutive runs that stopped at abandoned_at_
  int64_t bytes_appended_ = 0;
  int64_t bytes_copied_ = 0;
  int64_t num_appends_ = 0;
};

/// Process-wide registry: opaque int64 handles -> caches. Handles are never
/// reused (a counter with a random per-process base) and never pointers.
class Registry {
 public:
  static Registry& instance();
  int64_t add(std::unique_ptr<KVCache> cache);
  /// Throws std::invalid_argument("<what>: handle N is unknown or released") for a bad handle.
  std::shared_ptr<KVCache> get(int64_t handle, const char* what) const;
  /// Throws like get() for a bad handle.
  void release(int64_t handle, const char* what);
  bool is_live(int64_t handle) const;
  int64_t num_live() const;
  /// Calls KVCache::discard_step_of_current_thread on every live cache.
  void discard_steps_of_current_thread();

 private:
  Registry();
  mutable std::mutex mu_;
  int64_t next_;
  std::unordered_map<int64_t, std::shared_ptr<KVCache>> caches_;
};

}  // namespace olep
