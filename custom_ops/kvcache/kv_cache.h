// KVCache: the persistent K/V cache of one request group (batch_size
// sequences) across all num_layers attention layers of one model, stored in
// pages of a PagePool (see page_pool.h, page_table.h, step.h).
//
// Storage. Each (layer, sequence) has a PageTable: block i holds positions
// [i * page_tokens, (i + 1) * page_tokens), one page per kv head. Pages are
// reference counted and may be shared: by the sequences of a fork or a beam
// reorder, by another cache of the same pool, by a checkpoint. A shared page
// is never written in place: the first write into it copies that one page
// (copy-on-write; its valid rows count in bytes_copied).
//
// Appending n rows writes exactly n rows per (layer, sequence, head), plus at
// most one page copy per (layer, sequence, head) when the tail page is
// shared: O(n), never O(cached length). Attention reads rows where they lie
// through block_list().
//
// Steps. A model run appends one step of S rows (n_b <= S valid rows per
// sequence) to every layer, in layer order 0..num_layers-1 (StepTransaction).
// Layer 0 reserves every page of the step; nothing is visible (seq_lens,
// stats, export, other runs) until the step commits, and a step that never
// commits is rolled back: the cache is exactly as before. When a step
// commits depends on the run (run_scope.h): at the run's CacheCommit node or
// its last layer, or, for deferred runs, when the run returned successfully.
// At commit, sliding-window layers release the pages that lie wholly before
// seq_len - sliding_window - rollback_tokens.
//
// Ownership. A step belongs to one run (RunToken). While a bounded run owns
// an open step, other runs and mutating methods get BusyError naming it. A
// step of a run with unknown boundaries (the plain CPU EP path) is taken over
// by the next run on another thread or by a method; its owner then fails at
// its next layer with BusyError. A new run on the same thread, or any method
// the thread calls, discards the thread's stale step.
//
// Thread safety: every public method locks the cache's mutex (lock order:
// cache, then pool). Block pointers stay valid while the lock is held.
// Errors (errors.h): std::invalid_argument, MemoryLimitError, BusyError; every
// method that throws leaves the cache as it was. No ORT, no ONNX here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "kernels/kv_block.h"
#include "kvcache/geometry.h"
#include "kvcache/page_pool.h"
#include "kvcache/run_scope.h"
#include "kvcache/step.h"

namespace olep {

class Checkpoint;

/// Memory and traffic counters (bytes unless named num_). See docs/API.md.
struct CacheStats {
  int64_t reserved_bytes = 0;       // pages reserved by an open step, not yet committed
  int64_t committed_bytes = 0;      // bytes of the unique pages its tables hold
  int64_t live_bytes = 0;           // bytes of valid rows in those pages
  int64_t shared_bytes = 0;         // bytes of its pages with more than one holder
  int64_t checkpoint_bytes = 0;     // bytes of pages only its checkpoints hold
  int64_t num_pages = 0;            // unique pages its tables hold
  int64_t page_table_bytes = 0;     // page-table metadata
  int64_t fragmentation_bytes = 0;  // committed - live
  int64_t bytes_appended = 0;       // cumulative bytes of new rows committed by steps and imports
  int64_t bytes_copied = 0;         // cumulative bytes of cached rows copied (copy-on-write, export)
  int64_t num_appends = 0;          // committed steps
  int64_t quantized_bytes = 0;      // int8 K/V bytes of its quantized pages (scales not included)
  int64_t native_bytes = 0;         // bytes of its pages in the cache dtype
  int64_t scale_bytes = 0;          // bytes of the scales of its quantized pages
};

class KVCache : public std::enable_shared_from_this<KVCache> {
 public:
  /// Validates `g` (std::invalid_argument naming the field). `pool` supplies pages (when null, a
  /// private pool that keeps at most one page per (layer, sequence, kv head) of empty slabs, in
  /// whole slabs plus one, at most kDefaultKeepFreeBytes).
  KVCache(const CacheGeometry& g, std::shared_ptr<PagePool> pool);
  ~KVCache();
  KVCache(const KVCache&) = delete;
  KVCache& operator=(const KVCache&) = delete;

  const CacheGeometry& geometry() const { return g_; }
  const std::shared_ptr<PagePool>& pool() const { return pool_; }

  // ---- methods (each locks; a mutating one takes over or refuses an open step, see above) ----
  std::vector<int64_t> seq_lens() const;
  /// First position each (layer, sequence) still holds ([layer * batch + b]; > 0 after eviction).
  std::vector<int64_t> first_positions() const;
  CacheStats stats() const;
  void reset();
  /// lengths [batch]: 0 <= lengths[b] <= seq_lens[b], and on sliding-window layers either 0 or
  /// >= the earliest length its evicted positions allow (the message names it).
  void truncate(const std::vector<int64_t>& lengths);
  /// truncate(seq_lens - num_tokens) under one lock: num_tokens [batch], each in [0, seq_lens[b]]
  /// (std::invalid_argument otherwise: never clamped, never wraps).
  void rollback(const std::vector<int64_t>& num_tokens);
  /// New sequence i = old sequence indices[i] (repeats allowed): a permutation of page tables,
  /// no rows copied.
  void reorder(const std::vector<int64_t>& indices);
  /// A new cache in the same pool whose sequence i shares the pages of sequence indices[i]
  /// (batch_size = indices.size()); O(pages), no rows copied.
  std::unique_ptr<KVCache> fork(const std::vector<int64_t>& indices);
  /// Replaces the content: layer l rows [0, length) of every sequence from BNSH [B, Hkv, L, D]
  /// arrays (C-contiguous, cache dtype). keys.size() == values.size() == num_layers.
  void import_past(const std::vector<const void*>& keys, const std::vector<const void*>& values, int64_t length);
  /// Given L, returns zero-filled BNSH [B, Hkv, L, D] and [B, Hkv, L, Dv] buffers (key first).
  using ExportAllocator = std::function<std::pair<void*, void*>(int64_t length)>;
  /// Copies layer `layer` (L = max length; shorter sequences and evicted positions left zero)
  /// into buffers from `alloc`. include_pending: also the rows the current run's open step
  /// appended to that layer (CacheExport inside a run). Returns the per-sequence lengths.
  std::vector<int64_t> export_layer(int64_t layer, bool include_pending, const ExportAllocator& alloc);
  /// A snapshot of every page table and length (pages retained, nothing copied).
  std::shared_ptr<Checkpoint> checkpoint();
  /// Makes the content and seq_lens exactly those of `cp` (same geometry and pool, else
  /// std::invalid_argument); swaps page tables, copies no rows.
  void restore(const Checkpoint& cp);
  /// Writes the valid rows and the geometry to `path` (persist.cc). Throws std::runtime_error
  /// on an I/O error.
  void save(const std::string& path) const;
  /// A cache read from a file written by save(); std::invalid_argument naming what is wrong
  /// with the file (nothing is created then).
  static std::unique_ptr<KVCache> load(const std::string& path, std::shared_ptr<PagePool> pool);

  // ---- the op side of a step; all under lock() ----
  std::unique_lock<std::mutex> lock() const { return std::unique_lock<std::mutex>(mu_); }
  /// Committed lengths; the caller holds lock().
  const std::vector<int64_t>& lengths_locked() const { return content_.lens; }
  /// Opens (layer 0) or continues the current run's step for `layer` with num_new rows per
  /// sequence (step length S). Throws before any write: std::invalid_argument (layer out of
  /// order or repeated, counts), BusyError (another run owns the cache), MemoryLimitError.
  /// commit_node: the graph commits with a CacheCommit node, not at its last layer.
  /// Returns the past length of every sequence.
  /// node: an opaque id of the node appending (0 = unknown), see drop_stale_step_of_node.
  std::vector<int64_t> begin_layer_append(int64_t layer, int64_t sequence_length,
                                          const std::vector<int64_t>& num_new, bool commit_node, uint64_t node = 0);
  /// Plain CPU EP path (no run boundaries): the node `node` starts a run on this thread, so a step
  /// it opened on this cache in an earlier run on this thread is stale: rolled back (its pages go
  /// back to the pool at once). Locks; never throws.
  void drop_stale_step_of_node(std::thread::id thread, uint64_t node) noexcept;
  /// Writes the new rows of `layer` (after begin_layer_append).
  void append_rows(int64_t layer, const NewRows& rows);
  /// Blocks of every (b, h) of `layer` holding positions [first_key[b], num_keys[b]) (first_key
  /// empty = from the first held position), including the current run's open step.
  void block_list(int64_t layer, const std::vector<int64_t>& first_key, const std::vector<int64_t>& num_keys,
                  BlockList* out) const;
  /// Marks `layer` done; at the last layer of a graph without a CacheCommit node the step is
  /// complete (and committed unless the run defers).
  void finish_layer_append(int64_t layer);
  /// CacheCommit: throws (std::invalid_argument "the model has fewer attention layers ...",
  /// BusyError) unless the current run's step is open with every layer appended; on a refusal
  /// the step is rolled back.
  void check_step_complete();
  /// CacheCommit, after check_step_complete() on every cache of the node: completes the step
  /// (commits it unless the run defers). Returns the lengths the step gives every sequence.
  std::vector<int64_t> complete_step();
  /// An op of the current run failed (so the run fails): rolls its open step back at once.
  void mark_step_failed();
  /// Called by run_scope::end for each cache the run appended to: commits a complete step of a
  /// deferred run that succeeded, discards any other step of that run still open. Returns a
  /// diagnosis when a successful deferred run left the step incomplete ("" otherwise).
  std::string end_run(const RunToken& run, bool ok, bool deferred) noexcept;

  /// Page ids of (layer, b, h), block by block (tests, debugging).
  std::vector<uint32_t> page_ids(int64_t layer, int64_t b, int64_t h) const;

 private:
  friend class Checkpoint;
  // A method will change the content: BusyError while a live run of another thread owns a step.
  void refuse_if_busy_locked(const char* method) const;
  // Just before the change: roll back any open step (remembering whose it was, for its owner).
  void take_over_locked(const char* method);
  void discard_step_locked() const noexcept;
  // Every method first rolls back a step the calling thread left open in an earlier run that
  // has ended (the thread is here, so its run is over): on the plain CPU EP path a failed run
  // gives no end signal, and this makes its cache exact again for the thread that ran it.
  void drop_stale_step_locked() const noexcept;
  void commit_step_locked();
  void evict_locked();
  // Cold-page quantization after a commit or an import (kv_cache_quant.cc): every block that
  // left the recent window is replaced by its int8 page. Best effort, never throws: a page the
  // pool cannot supply now stays native and is retried at the next commit.
  void quantize_cold_locked() noexcept;
  void truncate_locked(const std::vector<int64_t>& lengths);
  // A snapshot (fork, checkpoint) of the committed content taken while another run's step is
  // open must not share the tail pages that step writes in place: `snap` (whose sequence i is
  // the cache's sequence src[i]) gets private copies of their committed rows. Allocates (throws
  // MemoryLimitError before any change); returns the copies, each holding one reference the
  // caller drops once the snapshot's tables retain their pages.
  std::vector<Page*> privatize_in_place_tails_locked(CacheContent* snap, const std::vector<int64_t>& src);
  CacheStats stats_locked() const;
  std::string describe_owner_locked() const;
  int64_t earliest_length_locked(int64_t b) const;

  CacheGeometry g_;
  std::shared_ptr<PagePool> pool_;
  mutable std::mutex mu_;
  CacheContent content_;
  mutable std::optional<StepTransaction> step_;  // mutable: readers drop the caller's stale step
  RunToken interrupted_;             // owner of the last step taken over by another run or a method
  std::string interrupted_by_;       // who took it over
  std::thread::id last_committed_by_;  // thread whose step committed last (until a new step opens)
  std::vector<std::weak_ptr<Checkpoint>> checkpoints_;  // taken from this cache (checkpoint_bytes)
  int64_t bytes_appended_ = 0;
  int64_t bytes_copied_ = 0;
  int64_t num_appends_ = 0;
};

/// A retained snapshot of a cache's page tables and lengths. Pins its pages (they count in the
/// pool's live bytes) until destroyed. Thread-safe to read; restore() locks the target cache.
class Checkpoint {
 public:
  Checkpoint(const CacheGeometry& g, std::shared_ptr<PagePool> pool, CacheContent content);
  ~Checkpoint();
  Checkpoint(const Checkpoint&) = delete;
  Checkpoint& operator=(const Checkpoint&) = delete;
  const CacheGeometry& geometry() const { return g_; }
  const std::shared_ptr<PagePool>& pool() const { return pool_; }
  const CacheContent& content() const { return content_; }
  int64_t num_pages() const { return content_.holds.size(); }

 private:
  CacheGeometry g_;
  std::shared_ptr<PagePool> pool_;
  CacheContent content_;
};

}  // namespace olep
