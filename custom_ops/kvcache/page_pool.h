// PagePool: the page supply and memory budget behind KVCache storage.
//
// A page holds `page_tokens` consecutive positions of one (layer, sequence,
// kv head) of one cache: K rows [page_tokens, head_dim] then V rows
// [page_tokens, v_head_dim], in the cache's element type. Pages of one size
// (a size class) are carved from slabs: 2 MiB-aligned mappings whose length is
// a multiple of 2 MiB, faulted in at creation and backed by transparent huge
// pages where the kernel allows (MADV_HUGEPAGE before the first touch, then
// MADV_COLLAPSE; best effort), so streaming K/V from pages runs at huge-page
// bandwidth.
//
// Empty slabs (every page free) are kept mapped for reuse, so a cache that
// truncates across a page start and appends again (a speculative step, a beam
// reorder, a chat turn re-run from a common prefix) does not unmap and fault
// in the same memory step after step. The retention is bounded: an empty slab
// stays mapped only while the pool has a user (a cache or a checkpoint), the
// empty slabs' bytes stay within `keep_free_bytes`, and, under a budget,
// live_bytes plus those bytes stay within `memory_limit_bytes`; any other
// empty slab is unmapped at once. The last user leaving, trim(), and a failed
// mapping (before its retry) unmap every empty slab.
//
// Every page has a reference count: the number of holders (page tables,
// checkpoints, a step's reservation). A page with refs > 1 is shared and is
// never written in place (KVCache copies it first). A page with refs 0 is on
// its size class's free list, never referenced by anyone.
//
// Accounting (bytes): committed_bytes (slab bytes mapped, what the process
// holds) = live_bytes (pages with refs > 0) + free_bytes (free pages of mapped
// slabs) + overhead_bytes (slab tails too small for a page): every committed
// byte is in exactly one of the three. The budget `memory_limit_bytes` bounds
// live_bytes: allocate() refuses, before any change, a request that would
// take live_bytes past it (MemoryLimitError).
//
// Thread safety: every method locks the pool's mutex. Lock order: a cache's
// lock, then its pool's (the pool never calls into a cache). A Page's `data`,
// `bytes` and `id` never change while the page is held; `refs` is read and
// written under the pool mutex only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

namespace olep {

/// One page of a slab. Held pages keep their address until released.
struct Page {
  char* data = nullptr;  // `bytes` bytes, 64-byte aligned
  int64_t bytes = 0;     // size class
  uint32_t id = 0;       // unique among mapped pages (slab slot << 16 | index); for tests and debugging
  uint32_t refs = 0;     // holders; guarded by the pool mutex
  uint32_t slab = 0;     // slot of its slab
  uint8_t encoding = 0;  // how the holder laid out `data` (KVEncoding), written before the page is shared; 0 on allocation
};

/// Pool figures (bytes unless num_). committed = live + free + overhead.
struct PoolStats {
  int64_t memory_limit_bytes = 0;  // 0 = no limit
  int64_t committed_bytes = 0;     // slab bytes mapped
  int64_t live_bytes = 0;          // bytes of pages with refs > 0
  int64_t shared_bytes = 0;        // bytes of pages with refs > 1 (part of live_bytes)
  int64_t free_bytes = 0;          // bytes of free pages in mapped slabs
  int64_t overhead_bytes = 0;      // slab bytes that hold no page
  int64_t num_pages = 0;           // pages with refs > 0
  int64_t num_free_pages = 0;
  int64_t num_slabs = 0;
  int64_t num_caches = 0;          // caches using the pool
  int64_t num_checkpoints = 0;     // checkpoints holding its pages
  int64_t keep_free_bytes = 0;     // bound on empty_slab_bytes (0 = unmap empty slabs at once)
  int64_t empty_slab_bytes = 0;    // slab bytes of mapped slabs with no page in use (part of committed)
};

/// Slabs are whole multiples of this (one huge page).
constexpr int64_t kSlabUnitBytes = int64_t{2} << 20;

/// Default bound on the empty slab bytes a pool keeps mapped: 64 MiB, twice the pages a decode
/// step across a page start takes for batch 1 of a 32-layer, 8-kv-head, head_dim-128 fp16 model
/// with 256-token pages (32 MiB).
constexpr int64_t kDefaultKeepFreeBytes = int64_t{64} << 20;

class PagePool {
 public:
  /// memory_limit_bytes: budget of live page bytes, 0 = none; keep_free_bytes: bound on the
  /// bytes of empty slabs kept mapped for reuse, 0 = unmap them at once (std::invalid_argument
  /// if either is < 0).
  explicit PagePool(int64_t memory_limit_bytes = 0, int64_t keep_free_bytes = kDefaultKeepFreeBytes);
  /// Unmaps every slab. Callers (caches and checkpoints hold shared_ptrs) release their pages first.
  ~PagePool();
  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  int64_t memory_limit_bytes() const { return limit_; }
  int64_t keep_free_bytes() const { return keep_free_; }

  /// Appends `n` pages of `page_bytes` bytes (a multiple of 64, > 0) to *out, each with refs 1.
  /// All or nothing: MemoryLimitError (the budget, or the system refusing address space, commit or
  /// heap memory for a slab) leaves *out and every page unchanged (kept empty slabs may have been
  /// unmapped: a refusal trims them and retries once). Under a budget, kept slabs of other sizes
  /// that would take live + new + kept past it are unmapped before new slabs are mapped.
  /// Cost: O(n log F) plus mapping new slabs when the free list is short.
  void allocate(int64_t page_bytes, int64_t n, std::vector<Page*>* out);
  /// refs += 1 for each entry (repeats count repeatedly). Pages must be held (refs > 0).
  void retain(const Page* const* pages, size_t n);
  void retain(const std::vector<Page*>& pages) { retain(pages.data(), pages.size()); }
  /// refs -= 1 for each entry; a page reaching 0 goes to the free list, a slab whose pages are
  /// all free is kept mapped or unmapped (the retention rule above). Pages must be held. Never throws.
  void release(const Page* const* pages, size_t n) noexcept;
  void release(const std::vector<Page*>& pages) noexcept { release(pages.data(), pages.size()); }
  /// Reference count of each page, read under one lock.
  void refs(const Page* const* pages, size_t n, uint32_t* out) const;
  uint32_t refs(const Page* p) const;

  /// Unmaps every empty slab now; returns the bytes unmapped. Never throws.
  int64_t trim() noexcept;

  PoolStats stats() const;
  /// Every mapped page as (id, refs), by id; free pages have refs 0 (tests, debugging).
  std::vector<std::pair<uint32_t, uint32_t>> page_refs() const;

  /// Users, for stats and for refusing to close a pool in use; the last one leaving trims the pool.
  void add_cache(int delta);
  void add_checkpoint(int delta);

  /// Bytes committed by every pool of the process (slab bytes mapped).
  static int64_t process_committed_bytes();
  /// Whether slabs mapped from now on are backed by huge pages (default true; benchmarks turn it
  /// off to measure what huge pages buy: such slabs are MADV_NOHUGEPAGE, 4 KiB pages).
  static void set_huge_pages(bool on);
  static bool huge_pages();

 private:
  struct Slab;
  struct SizeClass {
    int64_t page_bytes = 0;
    int64_t pages_per_slab = 0;
    int64_t slab_bytes = 0;
    std::set<uint32_t> free;  // ids of free pages, lowest first (allocation takes the lowest)
  };
  SizeClass& size_class_locked(int64_t page_bytes);
  Page* page_locked(uint32_t id) const;
  uint32_t map_slab_locked(SizeClass& c);  // returns the slot; throws MemoryLimitError
  void unmap_slab_locked(uint32_t slot) noexcept;
  // Whether the empty slabs mapped now satisfy the retention rule.
  bool retention_ok_locked() const noexcept;
  // Unmaps empty slabs until the retained ones satisfy the rule (all of them if `all`).
  int64_t trim_locked(bool all) noexcept;

  const int64_t limit_;
  const int64_t keep_free_;
  mutable std::mutex mu_;
  std::map<int64_t, SizeClass> classes_;
  std::vector<std::unique_ptr<Slab>> slabs_;  // by slot; null = free slot
  std::vector<uint32_t> free_slots_;
  int64_t committed_ = 0, live_ = 0, shared_ = 0, free_bytes_ = 0, num_live_ = 0, num_free_ = 0, num_slabs_ = 0;
  int64_t num_caches_ = 0, num_checkpoints_ = 0;
  int64_t empty_bytes_ = 0;  // slab bytes of mapped slabs with used == 0
};

}  // namespace olep
