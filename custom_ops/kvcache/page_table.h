// PageTable: the pages of one (layer, sequence) of a cache, and PageHolds:
// the set of pages a group of tables holds, counted once per unique page.
//
// Block `blk` of a table covers positions [blk * page_tokens, (blk + 1) *
// page_tokens); the table holds blocks [first_block, end_block), one page per
// kv head each. Blocks before first_block were evicted (sliding window) and
// are absent keys. A table holds exactly the blocks its sequence's length
// reaches: end_block = ceil(seq_len / page_tokens) (0 pages for length 0 past
// the evicted prefix). Every page a table holds counts once in that page's
// reference count, whatever else holds it.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "kvcache/page_pool.h"

namespace olep {

struct PageTable {
  int64_t first_block = 0;
  // Cold-page quantization has considered every block before this one (quantized it, or left
  // it native: a sink block, non-finite values). Blocks from here on are native, except after
  // a pass the pool refused part-way: it walks head by head (kv_cache_quant.cc) and leaves
  // this mark where it started, so some of those blocks' pages may already be quantized (each
  // page says so in its encoding; the next pass skips them).
  int64_t quant_next = 0;
  std::vector<Page*> pages;  // [(blk - first_block) * kv_num_heads + h]

  int64_t num_blocks(int64_t heads) const { return static_cast<int64_t>(pages.size()) / heads; }
  int64_t end_block(int64_t heads) const { return first_block + num_blocks(heads); }
  Page* at(int64_t blk, int64_t h, int64_t heads) const {
    return pages[static_cast<size_t>((blk - first_block) * heads + h)];
  }
  Page*& at(int64_t blk, int64_t h, int64_t heads) { return pages[static_cast<size_t>((blk - first_block) * heads + h)]; }
};

/// The pages held by a set of tables, each once (a cache's committed pages).
class PageHolds {
 public:
  void add(const Page* p) {
    if (++n_[p] == 1) bytes_ += p->bytes;
  }
  /// Returns true when the last reference of this set to p went away.
  bool remove(const Page* p) {
    auto it = n_.find(p);
    if (it == n_.end()) return false;
    if (--it->second > 0) return false;
    n_.erase(it);
    bytes_ -= p->bytes;
    return true;
  }
  void add_table(const PageTable& t) {
    for (const Page* p : t.pages) add(p);
  }
  void remove_table(const PageTable& t) {
    for (const Page* p : t.pages) remove(p);
  }
  uint32_t count(const Page* p) const {
    auto it = n_.find(p);
    return it == n_.end() ? 0 : it->second;
  }
  int64_t size() const { return static_cast<int64_t>(n_.size()); }
  /// Bytes of the unique pages (pages of several sizes: native and quantized).
  int64_t bytes() const { return bytes_; }
  void clear() {
    n_.clear();
    bytes_ = 0;
  }
  template <class F>
  void for_each(F&& f) const {
    for (const auto& kv : n_) f(kv.first, kv.second);
  }

 private:
  std::unordered_map<const Page*, uint32_t> n_;
  int64_t bytes_ = 0;
};

}  // namespace olep
