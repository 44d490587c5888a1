// KVCache: construction, accounting and the methods (reset, truncate, reorder,
// fork, import, export, checkpoint/restore). The op side of a step is in
// kv_cache_step.cc, save/load in persist.cc.
#include "kvcache/kv_cache.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "kvcache/errors.h"
#include "kvcache/policies.h"
#include "kvcache/quantize.h"

namespace olep {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

// Every page of `c`'s tables, one entry per table reference (for retain/release).
std::vector<Page*> all_table_pages(const CacheContent& c) {
  std::vector<Page*> out;
  for (const PageTable& t : c.tables) out.insert(out.end(), t.pages.begin(), t.pages.end());
  return out;
}

void rebuild_holds(CacheContent* c) {
  c->holds.clear();
  for (const PageTable& t : c->tables) c->holds.add_table(t);
}

// Empty slab bytes a cache's private pool keeps: one native page per (layer, sequence, kv head),
// what a step that starts a page takes, so a truncate back across a page start (a rejected
// draft, a beam reorder) and the next step map nothing; rounded up to whole 2 MiB slabs plus one
// (the pages straddle slab ends), at most the shared pools' default. Bounded by the cache's own
// geometry because every cache without a pool has one: a server with many of them keeps little.
int64_t private_keep_free_bytes(const CacheGeometry& g) {
  constexpr int64_t kSlab = kSlabUnitBytes;
  const double step = static_cast<double>(g.num_layers) * static_cast<double>(g.batch_size) *
                      static_cast<double>(g.kv_num_heads) * static_cast<double>(g.page_bytes());
  if (step >= static_cast<double>(kDefaultKeepFreeBytes)) return kDefaultKeepFreeBytes;
  const int64_t bytes = (static_cast<int64_t>(step) + kSlab - 1) / kSlab * kSlab + kSlab;
  return std::min(bytes, kDefaultKeepFreeBytes);
}

}  // namespace

KVCache::KVCache(const CacheGeometry& g, std::shared_ptr<PagePool> pool) : g_(g), pool_(std::move(pool)) {
  g_.validate();
  if (!pool_) pool_ = std::make_shared<PagePool>(0, private_keep_free_bytes(g_));
  content_.tables.resize(static_cast<size_t>(g_.num_layers * g_.batch_size));
  content_.lens.assign(static_cast<size_t>(g_.batch_size), 0);
  pool_->add_cache(1);
}

KVCache::~KVCache() {
  discard_step_locked();
  pool_->release(all_table_pages(content_));
  pool_->add_cache(-1);
}

std::vector<int64_t> KVCache::seq_lens() const {
  std::lock_guard<std::mutex> lk(mu_);
  drop_stale_step_locked();
  return content_.lens;
}

std::vector<int64_t> KVCache::first_positions() const {
  std::lock_guard<std::mutex> lk(mu_);
  drop_stale_step_locked();
  std::vector<int64_t> out;
  for (const PageTable& t : content_.tables) out.push_back(t.first_block * g_.page_tokens);
  return out;
}

CacheStats KVCache::stats_locked() const {
  const int64_t B = g_.batch_size, H = g_.kv_num_heads, P = g_.page_tokens;
  CacheStats s;
  s.reserved_bytes = step_ ? step_->reserved_bytes() : 0;
  s.num_pages = content_.holds.size();
  s.committed_bytes = content_.holds.bytes();
  // Valid rows of each unique page: the most any table holding it uses.
  std::unordered_map<const Page*, int64_t> rows;
  for (int64_t l = 0; l < g_.num_layers; ++l)
    for (int64_t b = 0; b < B; ++b) {
      const PageTable& t = content_.table(l, b, B);
      const int64_t len = content_.lens[static_cast<size_t>(b)];
      for (int64_t blk = t.first_block; blk < t.end_block(H); ++blk) {
        const int64_t n = std::min(P, len - blk * P);
        for (int64_t h = 0; h < H; ++h) {
          int64_t& r = rows[t.at(blk, h, H)];
          r = std::max(r, n);
        }
      }
    }
  for (const auto& kv : rows) {
    if (kv.first->encoding != static_cast<uint8_t>(KVEncoding::kNative)) {
      // codes of the valid rows and the page's metadata (a quantized page is always full)
      // (metadata: c bytes per channel and per row, c = 4 for int8, 8 for int4)
      const int64_t c = g_.quant_meta_bytes() / (g_.head_dim + P);
      s.live_bytes += kv.second * (g_.quant_scale_offset() / P + c) + c * g_.head_dim;
      s.quantized_bytes += g_.quant_scale_offset();
      s.scale_bytes += g_.quant_meta_bytes();
    } else {
      s.live_bytes += kv.second * (g_.head_dim + g_.v_head_dim) * static_cast<int64_t>(g_.elem_bytes());
      s.native_bytes += kv.first->bytes;
    }
  }
  std::vector<const Page*> pages;
  content_.holds.for_each([&](const Page* p, uint32_t) { pages.push_back(p); });
  std::vector<uint32_t> refs(pages.size());
  if (!pages.empty()) pool_->refs(pages.data(), pages.size(), refs.data());
  for (size_t i = 0; i < pages.size(); ++i)
    if (refs[i] > 1) s.shared_bytes += pages[i]->bytes;
  // Pages only this cache's checkpoints hold: not in its tables, and every reference the pool
  // counts for them comes from those checkpoints (no other cache or checkpoint holds them).
  std::unordered_map<const Page*, uint32_t> cp_refs;
  for (const auto& w : checkpoints_)
    if (auto cp = w.lock())
      cp->content().holds.for_each([&](const Page* p, uint32_t n) {
        if (!content_.holds.count(p)) cp_refs[p] += n;
      });
  std::vector<const Page*> cp_pages;
  for (const auto& kv : cp_refs) cp_pages.push_back(kv.first);
  std::vector<uint32_t> cp_pool_refs(cp_pages.size());
  if (!cp_pages.empty()) pool_->refs(cp_pages.data(), cp_pages.size(), cp_pool_refs.data());
  for (size_t i = 0; i < cp_pages.size(); ++i)
    if (cp_pool_refs[i] == cp_refs[cp_pages[i]]) s.checkpoint_bytes += cp_pages[i]->bytes;
  s.page_table_bytes = static_cast<int64_t>(content_.tables.size() * sizeof(PageTable));
  for (const PageTable& t : content_.tables) s.page_table_bytes += static_cast<int64_t>(t.pages.size() * sizeof(Page*));
  s.fragmentation_bytes = s.committed_bytes - s.live_bytes;
  s.bytes_appended = bytes_appended_;
  s.bytes_copied = bytes_copied_;
  s.num_appends = num_appends_;
  return s;
}

CacheStats KVCache::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  drop_stale_step_locked();
  return stats_locked();
}

std::string KVCache::describe_owner_locked() const {
  if (!step_) return "no run";
  return step_->owner().describe() + " (at layer " + str(step_->next_layer()) + " of " + str(g_.num_layers) + ")";
}

void KVCache::refuse_if_busy_locked(const char* method) const {
  if (step_ && step_->owner().bounded() && step_->owner().thread != std::this_thread::get_id())
    throw BusyError(std::string(method) + " while " + describe_owner_locked() +
                    " is appending to the cache; a cache serves one run at a time (cache unchanged)");
}

void KVCache::take_over_locked(const char* method) {
  if (!step_) return;
  interrupted_ = step_->owner();
  interrupted_by_ = std::string("KVCache.") + method;
  discard_step_locked();
}

void KVCache::drop_stale_step_locked() const noexcept {
  if (!step_ || step_->owner().thread != std::this_thread::get_id()) return;
  const RunToken me = run_scope::current();
  if (step_->owner().bounded() && step_->owner() == me) return;  // the calling thread's active run
  discard_step_locked();
}

void KVCache::discard_step_locked() const noexcept {
  if (!step_) return;
  step_->rollback(*pool_);
  step_.reset();
}

int64_t KVCache::earliest_length_locked(int64_t b) const {
  int64_t e = 0;
  for (int64_t l = 0; l < g_.num_layers; ++l)
    e = std::max(e, policies::earliest_length(content_.table(l, b, g_.batch_size).first_block, g_.window(l),
                                              g_.page_tokens));
  return e;
}

void KVCache::reset() {
  std::lock_guard<std::mutex> lk(mu_);
  drop_stale_step_locked();
  refuse_if_busy_locked("reset");
  take_over_locked("reset");
  pool_->release(all_table_pages(content_));
  for (PageTable& t : content_.tables) t = PageTable{};
  content_.holds.clear();
  std::fill(content_.lens.begin(), content_.lens.end(), 0);
}

void KVCache::truncate(const std::vector<int64_t>& lengths) {
  std::lock_guard<std::mutex> lk(mu_);
  drop_stale_step_locked();
  truncate_locked(lengths);
}

void KVCache::rollback(const std::vector<int64_t>& num_tokens) {
  std::lock_guard<std::mutex> lk(mu_);
  drop_stale_step_locked();
  const int64_t B = g_.batch_size;
  if (static_cast<int64_t>(num_tokens.size()) != B)
    throw std::invalid_argument("num_tokens must have batch_size=" + str(B) + " entries; got " +
                                str(static_cast<int64_t>(num_tokens.size())));
  std::vector<int64_t> lengths(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = num_tokens[static_cast<size_t>(b)], len = content_.lens[static_cast<size_t>(b)];
    if (n < 0 || n > len)
      throw std::invalid_argument("num_tokens[" + str(b) + "] must be in [0, " + str(len) + "] (seq_lens[" +
                                  str(b) + "]); got " + str(n));
    lengths[static_cast<size_t>(b)] = len - n;
  }
  truncate_locked(lengths);
}

void KVCache::truncate_locked(const std::vector<int64_t>& lengths) {
  const int64_t B = g_.batch_size, H = g_.kv_num_heads, P = g_.page_tokens;
  if (static_cast<int64_t>(lengths.size()) != B)
    throw std::invalid_argument("lengths must have batch_size=" + str(B) + " entries; got " +
                                str(static_cast<int64_t>(lengths.size())));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = lengths[static_cast<size_t>(b)], len = content_.lens[static_cast<size_t>(b)];
    if (n < 0 || n > len)
      throw std::invalid_argument("lengths[" + str(b) + "] must be in [0, " + str(len) + "] (seq_lens[" + str(b) +
                                  "]); got " + str(n));
    const int64_t earliest = earliest_length_locked(b);
    if (n != len && n != 0 && n < earliest)
      throw std::invalid_argument("lengths[" + str(b) + "] must be 0 or in [" + str(earliest) + ", " + str(len) +
                                  "]: sliding-window layers have released older positions, and " + str(earliest) +
                                  " is the earliest length whose window they still hold (rollback_tokens=" +
                                  str(g_.rollback_tokens) + " sets how far a truncate can go); got " + str(n));
  }
  refuse_if_busy_locked("truncate");
  // A cut inside a quantized page: its kept rows move to a native page (dequantized, rounded to
  // the cache dtype), so later appends write native rows. Allocated before any change.
  auto quantized_tail = [&](const PageTable& t, int64_t n, int64_t h) -> Page* {
    if (n % P == 0 || n / P < t.first_block || n / P >= t.end_block(H)) return nullptr;
    Page* pg = t.at(n / P, h, H);
    return pg->encoding != static_cast<uint8_t>(KVEncoding::kNative) ? pg : nullptr;
  };
  int64_t need = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = lengths[static_cast<size_t>(b)];
    if (n == content_.lens[static_cast<size_t>(b)]) continue;
    for (int64_t l = 0; l < g_.num_layers; ++l)
      for (int64_t h = 0; h < H; ++h) need += quantized_tail(content_.table(l, b, B), n, h) ? 1 : 0;
  }
  // The cache quota on what it would hold afterwards: its pages minus those the truncation
  // releases (cut-off blocks, the int8 pages the native copies replace), plus the copies.
  if (need > 0 && g_.memory_limit_bytes > 0) {
    PageHolds after = content_.holds;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t n = lengths[static_cast<size_t>(b)];
      if (n == content_.lens[static_cast<size_t>(b)]) continue;
      for (int64_t l = 0; l < g_.num_layers; ++l) {
        const PageTable& t = content_.table(l, b, B);
        for (int64_t h = 0; h < H; ++h)
          if (Page* q = quantized_tail(t, n, h)) after.remove(q);
        const int64_t keep_end = n == 0 ? t.first_block : (n + P - 1) / P;
        for (size_t i = static_cast<size_t>(std::max<int64_t>(0, keep_end - t.first_block) * H); i < t.pages.size(); ++i)
          after.remove(t.pages[i]);
      }
    }
    if (after.bytes() + need * g_.page_bytes() > g_.memory_limit_bytes)
      throw MemoryLimitError("cache memory_limit_bytes is " + str(g_.memory_limit_bytes) + ": truncating into " +
                             str(need) + " int8 page(s) needs as many native pages (" + str(need * g_.page_bytes()) +
                             " bytes) and the cache would still hold " + str(after.bytes()) + " bytes");
  }
  std::vector<Page*> natives;
  pool_->allocate(g_.page_bytes(), need, &natives);  // MemoryLimitError: nothing changed
  take_over_locked("truncate");
  std::vector<Page*> drop;
  size_t next_native = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = lengths[static_cast<size_t>(b)];
    if (n == content_.lens[static_cast<size_t>(b)]) continue;
    for (int64_t l = 0; l < g_.num_layers; ++l) {
      PageTable& t = content_.table(l, b, B);
      for (int64_t h = 0; h < H; ++h) {
        Page* q = quantized_tail(t, n, h);
        if (!q) continue;
        Page* nat = natives[next_native++];
        const KVBlock kb = quant::quant_block(g_, q->data, (n / P) * P, 0, n % P);
        quant::dequantize_block(g_, kb, nat->data, nat->data + g_.value_offset());
        content_.holds.remove(q);
        drop.push_back(q);
        t.at(n / P, h, H) = nat;
        content_.holds.add(nat);
      }
      const int64_t keep_end = n == 0 ? t.first_block : (n + P - 1) / P;
      const size_t keep = static_cast<size_t>(std::max<int64_t>(0, keep_end - t.first_block) * H);
      for (size_t i = keep; i < t.pages.size(); ++i) {
        content_.holds.remove(t.pages[i]);
        drop.push_back(t.pages[i]);
      }
      t.pages.resize(keep);
      if (n == 0) t.first_block = 0;
      t.quant_next = std::min(t.quant_next, n / P);
    }
    content_.lens[static_cast<size_t>(b)] = n;
  }
  pool_->release(drop);
}

void KVCache::reorder(const std::vector<int64_t>& indices) {
  std::lock_guard<std::mutex> lk(mu_);
  drop_stale_step_locked();
  const int64_t B = g_.batch_size;
  if (static_cast<int64_t>(indices.size()) != B)
    throw std::invalid_argument("indices must have batch_size=" + str(B) + " entries; got " +
                                str(static_cast<int64_t>(indices.size())));
  for (size_t i = 0; i < indices.size(); ++i)
    if (indices[i] < 0 || indices[i] >= B)
      throw std::invalid_argument("indices[" + str(static_cast<int64_t>(i)) + "] must be in [0, " + str(B) +
                                  "); got " + str(indices[i]));
  refuse_if_busy_locked("reorder");
  take_over_locked("reorder");
  CacheContent next;
  next.tables.resize(content_.tables.size());
  next.lens.resize(static_cast<size_t>(B));
  for (int64_t i = 0; i < B; ++i) {
    const int64_t src = indices[static_cast<size_t>(i)];
    next.lens[static_cast<size_t>(i)] = content_.lens[static_cast<size_t>(src)];
    for (int64_t l = 0; l < g_.num_layers; ++l) next.table(l, i, B) = content_.table(l, src, B);
  }
  rebuild_holds(&next);
  // Retain the new tables' references before releasing the old ones: a page moving between
  // sequences never drops to zero on the way. Unique pages can only shrink: no quota check.
  pool_->retain(all_table_pages(next));
  pool_->release(all_table_pages(content_));
  content_ = std::move(next);
}

std::unique_ptr<KVCache> KVCache::fork(const std::vector<int64_t>& indices) {
  std::lock_guard<std::mutex> lk(mu_);
  drop_stale_step_locked();
  const int64_t B = g_.batch_size;
  if (indices.empty()) throw std::invalid_argument("indices must name at least one sequence");
  for (size_t i = 0; i < indices.size(); ++i)
    if (indices[i] < 0 || indices[i] >= B)
      throw std::invalid_argument("indices[" + str(static_cast<int64_t>(i)) + "] must be in [0, " + str(B) +
                                  "); got " + str(indices[i]));
  CacheGeometry g2 = g_;
  g2.batch_size = static_cast<int64_t>(indices.size());
  g2.validate();
  CacheContent next;
  next.tables.resize(static_cast<size_t>(g2.num_layers * g2.batch_size));
  next.lens.resize(indices.size());
  for (int64_t i = 0; i < g2.batch_size; ++i) {
    const int64_t src = indices[static_cast<size_t>(i)];
    next.lens[static_cast<size_t>(i)] = content_.lens[static_cast<size_t>(src)];
    for (int64_t l = 0; l < g_.num_layers; ++l) next.table(l, i, g2.batch_size) = content_.table(l, src, B);
  }
  rebuild_holds(&next);
  if (g2.memory_limit_bytes > 0 && next.holds.bytes() > g2.memory_limit_bytes)
    throw MemoryLimitError("cache memory_limit_bytes is " + str(g2.memory_limit_bytes) + ": the fork holds " +
                           str(next.holds.bytes()) + " bytes of shared pages");
  auto out = std::make_unique<KVCache>(g2, pool_);
  const std::vector<Page*> copies = privatize_in_place_tails_locked(&next, indices);
  rebuild_holds(&next);
  pool_->retain(all_table_pages(next));
  pool_->release(copies);
  out->content_ = std::move(next);
  return out;
}

void KVCache::import_past(const std::vector<const void*>& keys, const std::vector<const void*>& values,
                          int64_t length) {
  std::lock_guard<std::mutex> lk(mu_);
  drop_stale_step_locked();
  const int64_t B = g_.batch_size, H = g_.kv_num_heads, P = g_.page_tokens;
  if (static_cast<int64_t>(keys.size()) != g_.num_layers || static_cast<int64_t>(values.size()) != g_.num_layers)
    throw std::invalid_argument("keys and values must hold num_layers=" + str(g_.num_layers) + " arrays; got " +
                                str(static_cast<int64_t>(keys.size())) + " and " +
                                str(static_cast<int64_t>(values.size())));
  if (length < 0 || length > g_.max_sequence_length)
    throw std::invalid_argument("past length must be in [0, max_sequence_length=" + str(g_.max_sequence_length) +
                                "]; got " + str(length));
  refuse_if_busy_locked("from_past");
  const int64_t blocks = (length + P - 1) / P;
  const int64_t need = g_.num_layers * B * blocks * H;
  if (g_.memory_limit_bytes > 0 && need * g_.page_bytes() > g_.memory_limit_bytes)
    throw MemoryLimitError("cache memory_limit_bytes is " + str(g_.memory_limit_bytes) + ": " + str(length) +
                           " positions need " + str(need * g_.page_bytes()) + " bytes of pages");
  std::vector<Page*> pages;
  pool_->allocate(g_.page_bytes(), need, &pages);  // all or nothing
  take_over_locked("from_past");
  const size_t es = g_.elem_bytes();
  const size_t krow = static_cast<size_t>(g_.head_dim) * es, vrow = static_cast<size_t>(g_.v_head_dim) * es;
  CacheContent next;
  next.tables.resize(content_.tables.size());
  next.lens.assign(static_cast<size_t>(B), length);
  size_t k = 0;  // first page of this (layer, sequence); its head h takes [k + h * blocks, + blocks)
  for (int64_t l = 0; l < g_.num_layers; ++l)
    for (int64_t b = 0; b < B; ++b, k += static_cast<size_t>(blocks * H)) {
      PageTable& t = next.table(l, b, B);
      for (int64_t blk = 0; blk < blocks; ++blk)
        for (int64_t h = 0; h < H; ++h) {
          Page* pg = pages[k + static_cast<size_t>(h * blocks + blk)];  // one head's pages in a row (step.cc)
          t.pages.push_back(pg);
          const int64_t n = std::min(P, length - blk * P);
          const size_t src = static_cast<size_t>((b * H + h) * length + blk * P);
          std::memcpy(pg->data, static_cast<const char*>(keys[static_cast<size_t>(l)]) + src * krow,
                      static_cast<size_t>(n) * krow);
          std::memcpy(pg->data + g_.value_offset(), static_cast<const char*>(values[static_cast<size_t>(l)]) + src * vrow,
                      static_cast<size_t>(n) * vrow);
        }
    }
  rebuild_holds(&next);
  pool_->release(all_table_pages(content_));
  content_ = std::move(next);
  bytes_appended_ += g_.num_layers * B * length * g_.row_bytes();
  evict_locked();
  quantize_cold_locked();
}

std::vector<int64_t> KVCache::export_layer(int64_t layer, bool include_pending, const ExportAllocator& alloc) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!include_pending) drop_stale_step_locked();  // a CacheExport of the current run keeps its step
  const int64_t B = g_.batch_size, H = g_.kv_num_heads;
  if (layer < 0 || layer >= g_.num_layers)
    throw std::invalid_argument("layer must be in [0, " + str(g_.num_layers) + "); got " + str(layer));
  std::vector<int64_t> lens = content_.lens;
  const bool pending = include_pending && step_ && step_->owner() == run_scope::current() && step_->appended(layer);
  if (pending)
    for (int64_t b = 0; b < B; ++b) lens[static_cast<size_t>(b)] += step_->num_new()[static_cast<size_t>(b)];
  const int64_t L = lens.empty() ? 0 : *std::max_element(lens.begin(), lens.end());
  const std::pair<void*, void*> out = alloc(L);
  const size_t es = g_.elem_bytes();
  const size_t krow = static_cast<size_t>(g_.head_dim) * es, vrow = static_cast<size_t>(g_.v_head_dim) * es;
  std::vector<KVBlock> blocks;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      blocks.clear();
      if (pending) {
        step_->blocks(layer, b, h, content_, 0, lens[static_cast<size_t>(b)], &blocks);
      } else {
        const PageTable& t = content_.table(layer, b, B);
        append_blocks(g_, t.first_block, 0, lens[static_cast<size_t>(b)], [&](int64_t blk) { return t.at(blk, h, H); },
                      &blocks);
      }
      const size_t base = static_cast<size_t>((b * H + h) * L);
      for (const KVBlock& kb : blocks) {
        const size_t row = base + static_cast<size_t>(kb.first_position);
        char* kd = static_cast<char*>(out.first) + row * krow;
        char* vd = static_cast<char*>(out.second) + row * vrow;
        if (kb.encoding != KVEncoding::kNative) {
          quant::dequantize_block(g_, kb, kd, vd);  // export returns dequantized values
        } else {
          std::memcpy(kd, kb.key, static_cast<size_t>(kb.num_rows) * krow);
          std::memcpy(vd, kb.value, static_cast<size_t>(kb.num_rows) * vrow);
        }
        bytes_copied_ += kb.num_rows * static_cast<int64_t>(krow + vrow);
      }
    }
  return lens;
}

std::shared_ptr<Checkpoint> KVCache::checkpoint() {
  std::lock_guard<std::mutex> lk(mu_);
  drop_stale_step_locked();
  CacheContent copy;
  copy.tables = content_.tables;
  copy.lens = content_.lens;
  std::vector<int64_t> identity(static_cast<size_t>(g_.batch_size));
  for (int64_t b = 0; b < g_.batch_size; ++b) identity[static_cast<size_t>(b)] = b;
  const std::vector<Page*> copies = privatize_in_place_tails_locked(&copy, identity);
  rebuild_holds(&copy);
  pool_->retain(all_table_pages(copy));
  pool_->release(copies);
  auto cp = std::make_shared<Checkpoint>(g_, pool_, std::move(copy));
  checkpoints_.erase(std::remove_if(checkpoints_.begin(), checkpoints_.end(),
                                    [](const std::weak_ptr<Checkpoint>& w) { return w.expired(); }),
                     checkpoints_.end());
  checkpoints_.push_back(cp);
  return cp;
}

void KVCache::restore(const Checkpoint& cp) {
  std::lock_guard<std::mutex> lk(mu_);
  drop_stale_step_locked();
  const CacheGeometry& o = cp.geometry();
  if (cp.pool() != pool_)
    throw std::invalid_argument("the checkpoint holds pages of another pool; restore it into a cache of its pool");
  auto differs = [](const char* what, int64_t want, int64_t got) {
    throw std::invalid_argument(std::string("the checkpoint's ") + what + " is " + str(got) + " but the cache's is " +
                                str(want) + " (a checkpoint restores into a cache of the same geometry)");
  };
  if (o.batch_size != g_.batch_size) differs("batch_size", g_.batch_size, o.batch_size);
  if (o.num_layers != g_.num_layers) differs("num_layers", g_.num_layers, o.num_layers);
  if (o.kv_num_heads != g_.kv_num_heads) differs("kv_num_heads", g_.kv_num_heads, o.kv_num_heads);
  if (o.head_dim != g_.head_dim) differs("head_dim", g_.head_dim, o.head_dim);
  if (o.v_head_dim != g_.v_head_dim) differs("v_head_dim", g_.v_head_dim, o.v_head_dim);
  if (o.page_tokens != g_.page_tokens) differs("page_tokens", g_.page_tokens, o.page_tokens);
  if (o.dtype != g_.dtype)
    throw std::invalid_argument(std::string("the checkpoint's dtype is ") + dtype_name(o.dtype) +
                                " but the cache's is " + dtype_name(g_.dtype));
  if (o.max_sequence_length != g_.max_sequence_length)
    differs("max_sequence_length", g_.max_sequence_length, o.max_sequence_length);
  if (o.rollback_tokens != g_.rollback_tokens) differs("rollback_tokens", g_.rollback_tokens, o.rollback_tokens);
  for (int64_t l = 0; l < g_.num_layers; ++l)
    if (o.window(l) != g_.window(l))
      differs(("sliding_window[" + str(l) + "]").c_str(), g_.window(l), o.window(l));
  refuse_if_busy_locked("restore");
  const CacheContent& src = cp.content();
  if (g_.memory_limit_bytes > 0 && src.holds.bytes() > g_.memory_limit_bytes)
    throw MemoryLimitError("cache memory_limit_bytes is " + str(g_.memory_limit_bytes) + ": the checkpoint holds " +
                           str(src.holds.bytes()) + " bytes of pages");
  take_over_locked("restore");
  CacheContent next;
  next.tables = src.tables;
  next.lens = src.lens;
  next.holds = src.holds;
  pool_->retain(all_table_pages(next));
  pool_->release(all_table_pages(content_));
  content_ = std::move(next);
}

std::vector<uint32_t> KVCache::page_ids(int64_t layer, int64_t b, int64_t h) const {
  std::lock_guard<std::mutex> lk(mu_);
  drop_stale_step_locked();
  if (layer < 0 || layer >= g_.num_layers || b < 0 || b >= g_.batch_size || h < 0 || h >= g_.kv_num_heads)
    throw std::invalid_argument("(layer, sequence, head) out of range");
  const PageTable& t = content_.table(layer, b, g_.batch_size);
  std::vector<uint32_t> out;
  for (int64_t blk = t.first_block; blk < t.end_block(g_.kv_num_heads); ++blk)
    out.push_back(t.at(blk, h, g_.kv_num_heads)->id);
  return out;
}

std::vector<Page*> KVCache::privatize_in_place_tails_locked(CacheContent* snap, const std::vector<int64_t>& src) {
  std::vector<Page*> copies;
  if (!step_) return copies;
  const std::vector<StepTransaction::InPlaceTail> tails = step_->in_place_tails(content_);
  if (tails.empty()) return copies;
  pool_->allocate(g_.page_bytes(), static_cast<int64_t>(tails.size()), &copies);
  const int64_t H = g_.kv_num_heads, P = g_.page_tokens, B2 = static_cast<int64_t>(src.size());
  const size_t es = g_.elem_bytes();
  const size_t krow = static_cast<size_t>(g_.head_dim) * es, vrow = static_cast<size_t>(g_.v_head_dim) * es;
  for (size_t k = 0; k < tails.size(); ++k) {
    const auto& t = tails[k];
    const int64_t len = content_.lens[static_cast<size_t>(t.b)];
    const int64_t blk = len / P, valid = len - blk * P;
    Page* copy = copies[k];
    std::memcpy(copy->data, t.page->data, static_cast<size_t>(valid) * krow);
    std::memcpy(copy->data + g_.value_offset(), t.page->data + g_.value_offset(), static_cast<size_t>(valid) * vrow);
    bytes_copied_ += valid * static_cast<int64_t>(krow + vrow);
    for (int64_t i = 0; i < B2; ++i)
      if (src[static_cast<size_t>(i)] == t.b) snap->table(t.layer, i, B2).at(blk, t.h, H) = copy;
  }
  return copies;
}

void KVCache::evict_locked() {
  if (!g_.evicts()) return;
  const int64_t B = g_.batch_size, H = g_.kv_num_heads;
  std::vector<Page*> drop;
  for (int64_t l = 0; l < g_.num_layers; ++l) {
    const int64_t w = g_.window(l);
    if (w <= 0) continue;
    for (int64_t b = 0; b < B; ++b) {
      PageTable& t = content_.table(l, b, B);
      const int64_t keep = policies::keep_from_block(content_.lens[static_cast<size_t>(b)], w, g_.rollback_tokens,
                                                     g_.page_tokens);
      if (keep <= t.first_block) continue;
      const size_t n = static_cast<size_t>((keep - t.first_block) * H);
      for (size_t i = 0; i < n; ++i) {
        content_.holds.remove(t.pages[i]);
        drop.push_back(t.pages[i]);
      }
      t.pages.erase(t.pages.begin(), t.pages.begin() + static_cast<std::ptrdiff_t>(n));
      t.first_block = keep;
    }
  }
  pool_->release(drop);
}

// ---------------------------------------------------------------------------

Checkpoint::Checkpoint(const CacheGeometry& g, std::shared_ptr<PagePool> pool, CacheContent content)
    : g_(g), pool_(std::move(pool)), content_(std::move(content)) {
  pool_->add_checkpoint(1);
}

Checkpoint::~Checkpoint() {
  pool_->release(all_table_pages(content_));
  pool_->add_checkpoint(-1);
}

}  // namespace olep
