// StepTransaction: one run's append to a cache ("prepare, then apply").
//
// reserve()  at layer 0: every page the step needs for every layer (a private
//            copy of each shared tail page it writes into, and the new pages past
//            each sequence's last page) is allocated at once, after the cache's
//            quota and the pool's budget are checked; nothing visible changes.
// write()    per layer: copies the valid rows of shared tail pages into their
//            private copies (copy-on-write), then writes the new rows. Only pages
//            of the reservation and pages the table alone holds (refs 1) are
//            written; a shared page is never written in place.
// blocks()   the layer's blocks as the step sees them (its copies and new pages
//            over the committed table), for the attention of the same layer and
//            for CacheExport inside the run.
// commit()   installs the copies and new pages into the tables, releases the
//            shared pages the copies replace, advances the lengths.
// rollback() releases the reservation; the cache is exactly as before.
//
// Not thread-safe on its own: the owning KVCache calls it under its lock.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/kv_block.h"
#include "kvcache/geometry.h"
#include "kvcache/page_pool.h"
#include "kvcache/page_table.h"
#include "kvcache/quantize.h"
#include "kvcache/run_scope.h"

namespace olep {

/// New rows for one step of one layer, as strided views (element strides).
/// key(b, h, s, d) = key[b*key_strides[0] + h*key_strides[1] + s*key_strides[2] + d]
struct NewRows {
  const void* key = nullptr;
  const void* value = nullptr;
  int64_t key_strides[3] = {0, 0, 0};  // batch, head, sequence (innermost dim is contiguous)
  int64_t value_strides[3] = {0, 0, 0};
  int64_t sequence_length = 0;          // S
  const int64_t* num_new = nullptr;     // [batch] valid rows per sequence (<= S), or null = S each
};

/// The committed content of a cache: its page tables, lengths and the pages they hold.
struct CacheContent {
  std::vector<PageTable> tables;  // [layer * batch_size + b]
  std::vector<int64_t> lens;      // [batch_size] committed length of every sequence
  PageHolds holds;                // unique pages of `tables`
  PageTable& table(int64_t layer, int64_t b, int64_t batch) { return tables[static_cast<size_t>(layer * batch + b)]; }
  const PageTable& table(int64_t layer, int64_t b, int64_t batch) const {
    return tables[static_cast<size_t>(layer * batch + b)];
  }
};

/// Appends to *out the blocks of one kv head holding positions [key_begin, key_end) of a table
/// whose blocks start at `first_block`: one block per page, clipped to the range, with the page
/// of block blk given by page_of(blk).
template <class PageOf>
void append_blocks(const CacheGeometry& g, int64_t first_block, int64_t key_begin, int64_t key_end, PageOf page_of,
                   std::vector<KVBlock>* out) {
  const int64_t P = g.page_tokens;
  if (key_begin < first_block * P) key_begin = first_block * P;
  if (key_end <= key_begin) return;
  const size_t es = g.elem_bytes();
  const int64_t voff = g.value_offset();
  for (int64_t blk = key_begin / P; blk <= (key_end - 1) / P; ++blk) {
    const Page* pg = page_of(blk);
    const int64_t start = blk * P;
    const int64_t lo = key_begin > start ? key_begin : start;
    const int64_t hi = key_end < start + P ? key_end : start + P;
    if (pg->encoding != static_cast<uint8_t>(KVEncoding::kNative)) {
      out->push_back(quant::quant_block(g, pg->data, start, lo - start, hi - start));
      continue;
    }
    KVBlock kb;
    kb.key = pg->data + static_cast<size_t>((lo - start) * g.head_dim) * es;
    kb.value = pg->data + voff + static_cast<size_t>((lo - start) * g.v_head_dim) * es;
    kb.first_position = lo;
    kb.num_rows = hi - lo;
    out->push_back(kb);
  }
}

class StepTransaction {
 public:
  StepTransaction(const CacheGeometry& g, RunToken owner, int64_t sequence_length, std::vector<int64_t> num_new,
                  bool commit_node, uint64_t layer0_node = 0);

  /// Allocates every page of the step. `held_bytes` = what the cache holds now, checked with the
  /// new pages against g.memory_limit_bytes (MemoryLimitError), then the pool budget. Throws
  /// before any change.
  void reserve(const CacheContent& c, PagePool& pool);
  /// Copy-on-write of the layer's shared tail pages, then the new rows at positions
  /// lens[b] .. lens[b] + num_new[b] - 1. Marks the layer appended.
  void write(int64_t layer, const CacheContent& c, const NewRows& rows, PagePool& pool);
  /// Blocks of (layer, b, h) holding positions [key_begin, key_end) as this step sees them
  /// (committed pages, its private copies, its new pages), appended to *out.
  void blocks(int64_t layer, int64_t b, int64_t h, const CacheContent& c, int64_t key_begin, int64_t key_end,
              std::vector<KVBlock>* out) const;
  /// Installs the step into `c` (lengths advance); releases the pages the copies replace.
  void commit(CacheContent& c, PagePool& pool);
  /// Releases the reservation.
  void rollback(PagePool& pool) noexcept;

  /// A tail page the step writes into in place (it decided at layer 0 that the table alone holds it).
  struct InPlaceTail {
    int64_t layer, b, h;
    Page* page;
  };
  std::vector<InPlaceTail> in_place_tails(const CacheContent& c) const;

  const RunToken& owner() const { return owner_; }
  int64_t sequence_length() const { return seq_; }
  const std::vector<int64_t>& num_new() const { return num_new_; }
  int64_t next_layer() const { return next_layer_; }
  bool appended(int64_t layer) const { return layer < next_layer_; }
  bool all_layers() const { return next_layer_ == g_.num_layers; }
  bool commit_node() const { return commit_node_; }
  uint64_t layer0_node() const { return layer0_node_; }  // opaque id of the node that opened it
  bool complete = false;  // every layer appended and the run's commit point reached (deferred runs)
  int64_t reserved_bytes() const { return static_cast<int64_t>(reserved_.size()) * g_.page_bytes(); }
  int64_t copied_bytes() const { return copied_; }
  int64_t appended_bytes() const;

 private:
  struct Pending {                    // one (layer, sequence)
    int64_t tail_block = -1;          // block holding the old length's last position, -1 = none
    std::vector<Page*> tail_copy;     // [heads] private copies of a shared tail page, or empty
    int64_t first_new_block = 0;      // first block past the table
    std::vector<Page*> fresh;         // [(blk - first_new_block) * heads + h]
  };
  Page* page_for(const Pending& p, const PageTable& t, int64_t blk, int64_t h) const;

  const CacheGeometry& g_;
  RunToken owner_;
  int64_t seq_;
  std::vector<int64_t> num_new_;
  bool commit_node_;
  uint64_t layer0_node_;
  int64_t next_layer_ = 0;
  std::vector<Pending> pending_;  // [layer * batch + b]
  std::vector<Page*> reserved_;   // every page allocated by reserve()
  int64_t copied_ = 0;
};

}  // namespace olep
