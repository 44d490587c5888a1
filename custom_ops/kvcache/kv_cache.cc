#include "kvcache/kv_cache.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace olep {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // Linux >= 6.1
#endif
constexpr size_t kHugePage = size_t{2} << 20;

void check_positive(int64_t v, const char* name) {
  if (v <= 0) throw std::invalid_argument(std::string("KVCache: ") + name + " must be >= 1, got " + str(v));
}

}  // namespace

KVCache::KVCache(const CacheGeometry& g) : g_(g) {
  check_positive(g.num_layers, "num_layers");
  check_positive(g.batch_size, "batch_size");
  check_positive(g.kv_num_heads, "kv_num_heads");
  check_positive(g.head_dim, "head_dim");
  check_positive(g.v_head_dim, "v_head_dim");
  check_positive(g.max_sequence_length, "max_sequence_length");
  if (g.memory_limit_bytes < 0)
    throw std::invalid_argument("KVCache: memory_limit_bytes must be >= 0 (0 = no limit), got " +
                                str(g.memory_limit_bytes));
  const int64_t kMaxDim = int64_t{1} << 20;
  if (g.num_layers > 4096 || g.batch_size > 65536 || g.kv_num_heads > 4096 || g.head_dim > 4096 ||
      g.v_head_dim > 4096 || g.max_sequence_length > kMaxDim * 16)
    throw std::invalid_argument("KVCache: geometry too large (num_layers<=4096, batch_size<=65536, kv_num_heads<=4096, "
                                "head_dim<=4096, max_sequence_length<=16777216)");
  const long ps = sysconf(_SC_PAGESIZE);
  page_ = ps > 0 ? static_cast<size_t>(ps) : 4096;
  const size_t es = dtype_size(g.dtype);
  key_block_bytes_ = round_up(static_cast<size_t>(g.max_sequence_length * g.head_dim) * es, page_);
  value_block_bytes_ = round_up(static_cast<size_t>(g.max_sequence_length * g.v_head_dim) * es, page_);
  // Streaming K/V from 4 KiB pages runs at ~60% of the read bandwidth of 2 MiB pages on the
  // machines we measured (page walks, prefetchers stopping at 4 KiB boundaries). Blocks of at
  // least 2 MiB are laid out on 2 MiB boundaries so that each fully written 2 MiB region can be
  // mapped with one huge page (promote_written); smaller blocks keep 4 KiB pages.
  huge_ = key_block_bytes_ >= kHugePage && value_block_bytes_ >= kHugePage;
  if (huge_) {
    key_block_bytes_ = round_up(key_block_bytes_, kHugePage);
    value_block_bytes_ = round_up(value_block_bytes_, kHugePage);
  }
  const double blocks = static_cast<double>(g.num_layers) * g.batch_size * g.kv_num_heads;
  const double total = blocks * static_cast<double>(key_block_bytes_ + value_block_bytes_);
  if (total > static_cast<double>(int64_t{1} << 46))
    throw std::invalid_argument("KVCache: reservation of " + std::to_string(total) +
                                " bytes exceeds the 64 TiB address-space limit; lower max_sequence_length");
  reserved_ = static_cast<size_t>(blocks) * (key_block_bytes_ + value_block_bytes_);
  map_bytes_ = reserved_ + (huge_ ? kHugePage : 0);
  void* p = mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED)
    throw std::runtime_error("KVCache: could not reserve " + std::to_string(map_bytes_) + " bytes of address space");
  map_ = static_cast<char*>(p);
  base_ = huge_ ? reinterpret_cast<char*>(round_up(reinterpret_cast<uintptr_t>(map_), kHugePage)) : map_;
  // No huge page at fault time (THP "always" would commit 2 MiB on a block's first row): only
  // promote_written() turns fully written regions into huge pages. Best effort.
  madvise(map_, map_bytes_, MADV_NOHUGEPAGE);
  lens_.assign(static_cast<size_t>(g.batch_size), 0);
  high_water_.assign(static_cast<size_t>(g.num_layers * g.batch_size), 0);
}

KVCache::~KVCache() {
  if (map_) munmap(map_, map_bytes_);
}

char* KVCache::key_block(int64_t layer, int64_t b, int64_t h) const {
  return base_ + block_index(layer, b, h) * (key_block_bytes_ + value_block_bytes_);
}

char* KVCache::value_block(int64_t layer, int64_t b, int64_t h) const {
  return key_block(layer, b, h) + key_block_bytes_;
}

int64_t KVCache::row_bytes() const {
  return g_.kv_num_heads * (g_.head_dim + g_.v_head_dim) * static_cast<int64_t>(dtype_size(g_.dtype));
}

int64_t KVCache::committed_for_rows(int64_t rows) const {
  const size_t es = dtype_size(g_.dtype);
  const size_t k = round_up(static_cast<size_t>(rows * g_.head_dim) * es, page_);
  const size_t v = round_up(static_cast<size_t>(rows * g_.v_head_dim) * es, page_);
  return static_cast<int64_t>((k + v) * static_cast<size_t>(g_.kv_num_heads));
}

void KVCache::release_rows_from(int64_t layer, int64_t b, int64_t first_row) {
  int64_t& hw = high_water_[static_cast<size_t>(layer * g_.batch_size + b)];
  if (first_row >= hw) return;
  const size_t es = dtype_size(g_.dtype);
  const size_t k_keep = round_up(static_cast<size_t>(first_row * g_.head_dim) * es, page_);
  const size_t v_keep = round_up(static_cast<size_t>(first_row * g_.v_head_dim) * es, page_);
  for (int64_t h = 0; h < g_.kv_num_heads; ++h) {
    char* k = key_block(layer, b, h);
    char* v = value_block(layer, b, h);
    // Zero the tail of the kept page so no stale row survives, then drop whole pages.
    const size_t k_used = static_cast<size_t>(hw * g_.head_dim) * es;
    const size_t v_used = static_cast<size_t>(hw * g_.v_head_dim) * es;
    const size_t k_from = static_cast<size_t>(first_row * g_.head_dim) * es;
    const size_t v_from = static_cast<size_t>(first_row * g_.v_head_dim) * es;
    std::memset(k + k_from, 0, std::min(k_keep, k_used) - k_from);
    std::memset(v + v_from, 0, std::min(v_keep, v_used) - v_from);
    if (huge_) {  // regions no longer fully written go back to NOHUGEPAGE (no 2 MiB commit on refault)
      const size_t k_region = k_from / kHugePage * kHugePage, v_region = v_from / kHugePage * kHugePage;
      madvise(k + k_region, key_block_bytes_ - k_region, MADV_NOHUGEPAGE);
      madvise(v + v_region, value_block_bytes_ - v_region, MADV_NOHUGEPAGE);
    }
    if (key_block_bytes_ > k_keep) madvise(k + k_keep, key_block_bytes_ - k_keep, MADV_DONTNEED);
    if (value_block_bytes_ > v_keep) madvise(v + v_keep, value_block_bytes_ - v_keep, MADV_DONTNEED);
  }
  hw = first_row;
}

void KVCache::promote_written(int64_t layer, int64_t b, int64_t old_rows, int64_t new_rows) {
  if (!huge_ || new_rows <= old_rows) return;
  const size_t es = dtype_size(g_.dtype);
  auto collapse = [](char* block, size_t written_before, size_t written_now) {
    const uintptr_t blk = reinterpret_cast<uintptr_t>(block);
    const uintptr_t first = blk + written_before / kHugePage * kHugePage;  // blocks are 2 MiB-aligned
    const uintptr_t end = blk + written_now / kHugePage * kHugePage;
    // Best effort: an older kernel (EINVAL) or no free huge page (EAGAIN/ENOMEM) keeps 4 KiB
    // pages, which only costs read speed.
    for (uintptr_t a = first; a < end; a += kHugePage) {
      madvise(reinterpret_cast<void*>(a), kHugePage, MADV_HUGEPAGE);  // lift the arena's NOHUGEPAGE
      madvise(reinterpret_cast<void*>(a), kHugePage, MADV_COLLAPSE);
    }
  };
  for (int64_t h = 0; h < g_.kv_num_heads; ++h) {
    collapse(key_block(layer, b, h), static_cast<size_t>(old_rows * g_.head_dim) * es,
             static_cast<size_t>(new_rows * g_.head_dim) * es);
    collapse(value_block(layer, b, h), static_cast<size_t>(old_rows * g_.v_head_dim) * es,
             static_cast<size_t>(new_rows * g_.v_head_dim) * es);
  }
}

void KVCache::discard_step_locked() {
  if (!step_.open) return;
  // Rows a discarded step wrote sit beyond the committed lengths; zero/free them so the
  // storage past every length is always zero (export pads with zeros, truncate relies on it).
  for (int64_t l = 0; l < g_.num_layers; ++l)
    for (int64_t b = 0; b < g_.batch_size; ++b) release_rows_from(l, b, lens_[static_cast<size_t>(b)]);
  step_ = Step{};
}

void KVCache::discard_for_method_locked() {
  if (step_.open) interrupted_ = step_.owner;
  abandoned_at_ = -1;
  abandoned_repeats_ = 0;
  discard_step_locked();
}

void KVCache::note_abandoned_locked() {
  if (!step_.open || step_.owner != std::this_thread::get_id() || step_.failed) return;
  if (step_.next_layer == abandoned_at_) {
    ++abandoned_repeats_;
  } else {
    abandoned_at_ = step_.next_layer;
    abandoned_repeats_ = 1;
  }
}

void KVCache::discard_step_of_current_thread() {
  std::lock_guard<std::mutex> lk(mu_);
  if (step_.open && step_.owner == std::this_thread::get_id()) {
    note_abandoned_locked();
    discard_step_locked();
  }
}

void KVCache::mark_step_failed() {
  std::lock_guard<std::mutex> lk(mu_);
  if (step_.open && step_.owner == std::this_thread::get_id()) step_.failed = true;
}

std::vector<int64_t> KVCache::seq_lens() const {
  std::lock_guard<std::mutex> lk(mu_);
  return lens_;
}

CacheStats KVCache::stats_locked() const {
  CacheStats s;
  s.reserved_bytes = static_cast<int64_t>(reserved_);
  for (int64_t hw : high_water_) s.committed_bytes += committed_for_rows(hw);
  int64_t rows = 0;
  for (int64_t n : lens_) rows += n;
  s.live_bytes = rows * g_.num_layers * row_bytes();
  s.bytes_appended = bytes_appended_;
  s.bytes_copied = bytes_copied_;
  s.num_appends = num_appends_;
  return s;
}

CacheStats KVCache::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  return stats_locked();
}

void KVCache::reset() {
  std::lock_guard<std::mutex> lk(mu_);
  discard_for_method_locked();
  std::fill(lens_.begin(), lens_.end(), 0);
  for (int64_t l = 0; l < g_.num_layers; ++l)
    for (int64_t b = 0; b < g_.batch_size; ++b) release_rows_from(l, b, 0);
}

void KVCache::truncate(const std::vector<int64_t>& lengths) {
  std::lock_guard<std::mutex> lk(mu_);
  if (static_cast<int64_t>(lengths.size()) != g_.batch_size)
    throw std::invalid_argument("KVCache.truncate: lengths must have batch_size=" + str(g_.batch_size) +
                                " entries, got " + str(static_cast<int64_t>(lengths.size())));
  for (size_t b = 0; b < lengths.size(); ++b)
    if (lengths[b] < 0 || lengths[b] > lens_[b])
      throw std::invalid_argument("KVCache.truncate: lengths[" + str(static_cast<int64_t>(b)) + "] must be in [0, " +
                                  str(lens_[b]) + "], got " + str(lengths[b]));
  discard_for_method_locked();
  for (int64_t b = 0; b < g_.batch_size; ++b) {
    lens_[static_cast<size_t>(b)] = lengths[static_cast<size_t>(b)];
    for (int64_t l = 0; l < g_.num_layers; ++l) release_rows_from(l, b, lens_[static_cast<size_t>(b)]);
  }
}

void KVCache::reorder(const std::vector<int64_t>& indices) {
  std::lock_guard<std::mutex> lk(mu_);
  const int64_t B = g_.batch_size;
  if (static_cast<int64_t>(indices.size()) != B)
    throw std::invalid_argument("KVCache.reorder: indices must have batch_size=" + str(B) + " entries, got " +
                                str(static_cast<int64_t>(indices.size())));
  for (size_t i = 0; i < indices.size(); ++i)
    if (indices[i] < 0 || indices[i] >= B)
      throw std::invalid_argument("KVCache.reorder: indices[" + str(static_cast<int64_t>(i)) + "] must be in [0, " +
                                  str(B) + "), got " + str(indices[i]));
  const std::vector<int64_t> old_lens = lens_;
  const size_t es = dtype_size(g_.dtype);
  // Memory: exactly what will be committed afterwards (a moved sequence's pages are released first).
  if (g_.memory_limit_bytes > 0) {
    int64_t after = 0;
    for (int64_t l = 0; l < g_.num_layers; ++l)
      for (int64_t i = 0; i < B; ++i) {
        const int64_t s = indices[static_cast<size_t>(i)];
        after += committed_for_rows(s == i ? high_water_[static_cast<size_t>(l * B + i)] : old_lens[static_cast<size_t>(s)]);
      }
    if (after > g_.memory_limit_bytes)
      throw std::runtime_error("KVCache.reorder: memory limit reached: needs " + str(after) +
                               " committed bytes; memory_limit_bytes is " + str(g_.memory_limit_bytes));
  }
  discard_for_method_locked();
  // Snapshot each source sequence that is also overwritten, one layer at a time.
  std::vector<char> scratch;
  for (int64_t l = 0; l < g_.num_layers; ++l) {
    std::vector<int64_t> src_slot(static_cast<size_t>(B), -1);
    size_t need_bytes = 0;
    std::vector<size_t> offset(static_cast<size_t>(B), 0);
    for (int64_t i = 0; i < B; ++i) {
      const int64_t s = indices[static_cast<size_t>(i)];
      if (s == i || src_slot[static_cast<size_t>(s)] >= 0) continue;
      src_slot[static_cast<size_t>(s)] = 1;
      offset[static_cast<size_t>(s)] = need_bytes;
      need_bytes += static_cast<size_t>(old_lens[static_cast<size_t>(s)] * row_bytes());
    }
    scratch.resize(need_bytes);
    for (int64_t s = 0; s < B; ++s) {
      if (src_slot[static_cast<size_t>(s)] < 0) continue;
      const int64_t n = old_lens[static_cast<size_t>(s)];
      if (n == 0) continue;  // nothing to snapshot (scratch may be empty: no null memcpy)
      char* dst = scratch.data() + offset[static_cast<size_t>(s)];
      for (int64_t h = 0; h < g_.kv_num_heads; ++h) {
        const size_t kb = static_cast<size_t>(n * g_.head_dim) * es, vb = static_cast<size_t>(n * g_.v_head_dim) * es;
        std::memcpy(dst, key_block(l, s, h), kb);
        dst += kb;
        std::memcpy(dst, value_block(l, s, h), vb);
        dst += vb;
      }
    }
    for (int64_t i = 0; i < B; ++i) {
      const int64_t s = indices[static_cast<size_t>(i)];
      if (s == i) continue;
      const int64_t n = old_lens[static_cast<size_t>(s)];
      const char* src = scratch.data() + offset[static_cast<size_t>(s)];
      release_rows_from(l, i, 0);
      for (int64_t h = 0; n > 0 && h < g_.kv_num_heads; ++h) {
        const size_t kb = static_cast<size_t>(n * g_.head_dim) * es, vb = static_cast<size_t>(n * g_.v_head_dim) * es;
        std::memcpy(key_block(l, i, h), src, kb);
        src += kb;
        std::memcpy(value_block(l, i, h), src, vb);
        src += vb;
      }
      high_water_[static_cast<size_t>(l * B + i)] = n;
      promote_written(l, i, 0, n);
      bytes_copied_ += n * row_bytes();
    }
  }
  for (int64_t i = 0; i < B; ++i) lens_[static_cast<size_t>(i)] = old_lens[static_cast<size_t>(indices[static_cast<size_t>(i)])];
}

std::unique_ptr<KVCache> KVCache::fork() {
  std::lock_guard<std::mutex> lk(mu_);
  int64_t need = 0;
  for (int64_t l = 0; l < g_.num_layers; ++l)
    for (int64_t b = 0; b < g_.batch_size; ++b) need += committed_for_rows(lens_[static_cast<size_t>(b)]);
  if (g_.memory_limit_bytes > 0 && need > g_.memory_limit_bytes)
    throw std::runtime_error("KVCache.fork: memory limit reached: the fork needs " + str(need) +
                             " committed bytes; memory_limit_bytes is " + str(g_.memory_limit_bytes));
  auto out = std::make_unique<KVCache>(g_);
  const size_t es = dtype_size(g_.dtype);
  int64_t copied = 0;
  for (int64_t l = 0; l < g_.num_layers; ++l)
    for (int64_t b = 0; b < g_.batch_size; ++b) {
      const int64_t n = lens_[static_cast<size_t>(b)];
      for (int64_t h = 0; h < g_.kv_num_heads; ++h) {
        std::memcpy(out->key_block(l, b, h), key_block(l, b, h), static_cast<size_t>(n * g_.head_dim) * es);
        std::memcpy(out->value_block(l, b, h), value_block(l, b, h), static_cast<size_t>(n * g_.v_head_dim) * es);
      }
      out->high_water_[static_cast<size_t>(l * g_.batch_size + b)] = n;
      out->promote_written(l, b, 0, n);
      copied += n * row_bytes();
    }
  out->lens_ = lens_;
  out->bytes_copied_ = copied;
  bytes_copied_ += copied;
  return out;
}

void KVCache::import_past(const std::vector<const void*>& keys, const std::vector<const void*>& values,
                          int64_t length) {
  std::lock_guard<std::mutex> lk(mu_);
  if (static_cast<int64_t>(keys.size()) != g_.num_layers || static_cast<int64_t>(values.size()) != g_.num_layers)
    throw std::invalid_argument("KVCache.import_past: keys and values must hold num_layers=" + str(g_.num_layers) +
                                " arrays, got " + str(static_cast<int64_t>(keys.size())) + " and " +
                                str(static_cast<int64_t>(values.size())));
  if (length < 0 || length > g_.max_sequence_length)
    throw std::invalid_argument("KVCache.import_past: past length must be in [0, max_sequence_length=" +
                                str(g_.max_sequence_length) + "], got " + str(length));
  const int64_t need = g_.num_layers * g_.batch_size * committed_for_rows(length);
  if (g_.memory_limit_bytes > 0 && need > g_.memory_limit_bytes)
    throw std::runtime_error("KVCache.import_past: memory limit reached: needs " + str(need) +
                             " committed bytes; memory_limit_bytes is " + str(g_.memory_limit_bytes));
  discard_for_method_locked();
  const size_t es = dtype_size(g_.dtype);
  for (int64_t l = 0; l < g_.num_layers; ++l)
    for (int64_t b = 0; b < g_.batch_size; ++b) {
      release_rows_from(l, b, 0);
      for (int64_t h = 0; h < g_.kv_num_heads; ++h) {
        const size_t kb = static_cast<size_t>(length * g_.head_dim) * es;
        const size_t vb = static_cast<size_t>(length * g_.v_head_dim) * es;
        const size_t bh = static_cast<size_t>(b * g_.kv_num_heads + h);
        std::memcpy(key_block(l, b, h), static_cast<const char*>(keys[static_cast<size_t>(l)]) + bh * kb, kb);
        std::memcpy(value_block(l, b, h), static_cast<const char*>(values[static_cast<size_t>(l)]) + bh * vb, vb);
      }
      high_water_[static_cast<size_t>(l * g_.batch_size + b)] = length;
      promote_written(l, b, 0, length);
    }
  std::fill(lens_.begin(), lens_.end(), length);
  bytes_appended_ += g_.num_layers * g_.batch_size * length * row_bytes();
}

std::vector<int64_t> KVCache::layer_lengths_locked(int64_t layer, bool include_pending) const {
  std::vector<int64_t> out = lens_;
  if (include_pending && step_.open && step_.owner == std::this_thread::get_id() && layer < step_.next_layer)
    for (size_t b = 0; b < out.size(); ++b) out[b] += step_.num_new[b];
  return out;
}

std::vector<int64_t> KVCache::export_layer(int64_t layer, bool include_pending, const ExportAllocator& alloc) {
  std::lock_guard<std::mutex> lk(mu_);
  if (layer < 0 || layer >= g_.num_layers)
    throw std::invalid_argument("KVCache.export: layer must be in [0, " + str(g_.num_layers) + "), got " + str(layer));
  const std::vector<int64_t> lens = layer_lengths_locked(layer, include_pending);
  const int64_t out_length = lens.empty() ? 0 : *std::max_element(lens.begin(), lens.end());
  const std::pair<void*, void*> out = alloc(out_length);
  const size_t es = dtype_size(g_.dtype);
  for (int64_t b = 0; b < g_.batch_size; ++b)
    for (int64_t h = 0; h < g_.kv_num_heads; ++h) {
      const size_t bh = static_cast<size_t>(b * g_.kv_num_heads + h);
      const int64_t n = lens[static_cast<size_t>(b)];
      if (n == 0) continue;
      std::memcpy(static_cast<char*>(out.first) + bh * static_cast<size_t>(out_length * g_.head_dim) * es,
                  key_block(layer, b, h), static_cast<size_t>(n * g_.head_dim) * es);
      std::memcpy(static_cast<char*>(out.second) + bh * static_cast<size_t>(out_length * g_.v_head_dim) * es,
                  value_block(layer, b, h), static_cast<size_t>(n * g_.v_head_dim) * es);
      bytes_copied_ += n * (g_.head_dim + g_.v_head_dim) * static_cast<int64_t>(es);
    }
  return lens;
}

std::vector<int64_t> KVCache::begin_layer_append(int64_t layer, int64_t sequence_length,
                                                 const std::vector<int64_t>& num_new) {
  const auto me = std::this_thread::get_id();
  if (layer < 0 || layer >= g_.num_layers)
    throw std::invalid_argument("attribute 'layer' must be in [0, num_layers=" + str(g_.num_layers) +
                                ") of input 'cache', got " + str(layer));
  if (static_cast<int64_t>(num_new.size()) != g_.batch_size)
    throw std::invalid_argument("batch size of the new rows must equal the cache batch_size=" + str(g_.batch_size) +
                                ", got " + str(static_cast<int64_t>(num_new.size())));
  for (size_t b = 0; b < num_new.size(); ++b) {
    if (num_new[b] < 0 || num_new[b] > sequence_length)
      throw std::invalid_argument("new token count of sequence " + str(static_cast<int64_t>(b)) + " must be in [0, " +
                                  str(sequence_length) + "], got " + str(num_new[b]));
    if (lens_[b] + num_new[b] > g_.max_sequence_length)
      throw std::runtime_error("sequence " + str(static_cast<int64_t>(b)) + " of input 'cache' would hold " +
                               str(lens_[b] + num_new[b]) + " tokens; max_sequence_length is " +
                               str(g_.max_sequence_length) + " (cache unchanged)");
  }
  if (layer == 0) {
    // A new step. Any open step (a failed run, or a concurrent run on another thread) is discarded;
    // a concurrent owner then fails at its next layer instead of interleaving.
    if (g_.memory_limit_bytes > 0) {
      int64_t extra = 0;
      for (int64_t l = 0; l < g_.num_layers; ++l)
        for (int64_t b = 0; b < g_.batch_size; ++b) {
          const int64_t hw = high_water_[static_cast<size_t>(l * g_.batch_size + b)];
          const int64_t need = lens_[static_cast<size_t>(b)] + num_new[static_cast<size_t>(b)];
          if (need > hw) extra += committed_for_rows(need) - committed_for_rows(hw);
        }
      const int64_t committed = stats_locked().committed_bytes;
      if (committed + extra > g_.memory_limit_bytes)
        throw std::runtime_error("memory limit of input 'cache' reached: this step needs " + str(committed + extra) +
                                 " committed bytes; memory_limit_bytes is " + str(g_.memory_limit_bytes) +
                                 " (cache unchanged)");
    }
    if (step_.open && step_.owner != me) interrupted_ = step_.owner;
    note_abandoned_locked();
    if (abandoned_repeats_ >= 2) {
      const int64_t k = abandoned_at_;
      abandoned_at_ = -1;  // report once per two such runs; a later good run proceeds
      abandoned_repeats_ = 0;
      discard_step_locked();
      throw std::runtime_error(
          "the last runs on input 'cache' appended only layers 0.." + str(k - 1) + " of its num_layers=" +
          str(g_.num_layers) + ": the model has fewer attention layers than the cache (create it with "
          "KVCache.for_model, or num_layers=" + str(k) + "), or those runs failed after layer " + str(k - 1) +
          " (this step was not appended)");
    }
    discard_step_locked();
    step_.open = true;
    step_.owner = me;
    step_.next_layer = 0;
    step_.sequence_length = sequence_length;
    step_.num_new = num_new;
  } else {
    if ((step_.open && step_.owner != me) || (!step_.open && interrupted_ == me)) {
      interrupted_ = std::thread::id();
      throw std::runtime_error("input 'cache' was changed by another run or by a KVCache method (reset, truncate, "
                               "reorder, from_past) while this run was at layer " + str(layer) +
                               "; this run's partial step was discarded (one cache serves one run at a time; "
                               "concurrent runs on one cache are rejected, never interleaved)");
    }
    if (!step_.open || step_.next_layer != layer)
      throw std::runtime_error("layers must append to input 'cache' in order 0..num_layers-1 within a run; expected "
                               "layer " + str(step_.open ? step_.next_layer : 0) + ", got layer " + str(layer) +
                               " (in the graph, layer l must depend on layer l-1's output, as in a decoder)");
    if (step_.sequence_length != sequence_length || step_.num_new != num_new)
      throw std::invalid_argument("layer " + str(layer) + " appends a different number of tokens (" +
                                  str(sequence_length) + ") than layer 0 of the same step (" +
                                  str(step_.sequence_length) + ")");
  }
  return lens_;
}

void KVCache::append_rows(int64_t layer, const NewRows& rows) {
  const size_t es = dtype_size(g_.dtype);
  for (int64_t b = 0; b < g_.batch_size; ++b) {
    const int64_t n = rows.num_new ? rows.num_new[b] : rows.sequence_length;
    const int64_t p = lens_[static_cast<size_t>(b)];
    for (int64_t h = 0; h < g_.kv_num_heads; ++h) {
      char* kdst = key_block(layer, b, h) + static_cast<size_t>(p * g_.head_dim) * es;
      char* vdst = value_block(layer, b, h) + static_cast<size_t>(p * g_.v_head_dim) * es;
      const char* ksrc = static_cast<const char*>(rows.key) +
                         static_cast<size_t>(b * rows.key_strides[0] + h * rows.key_strides[1]) * es;
      const char* vsrc = static_cast<const char*>(rows.value) +
                         static_cast<size_t>(b * rows.value_strides[0] + h * rows.value_strides[1]) * es;
      for (int64_t s = 0; s < n; ++s) {
        std::memcpy(kdst + static_cast<size_t>(s * g_.head_dim) * es,
                    ksrc + static_cast<size_t>(s * rows.key_strides[2]) * es, static_cast<size_t>(g_.head_dim) * es);
        std::memcpy(vdst + static_cast<size_t>(s * g_.v_head_dim) * es,
                    vsrc + static_cast<size_t>(s * rows.value_strides[2]) * es,
                    static_cast<size_t>(g_.v_head_dim) * es);
      }
    }
    int64_t& hw = high_water_[static_cast<size_t>(layer * g_.batch_size + b)];
    if (p + n > hw) {
      promote_written(layer, b, hw, p + n);
      hw = p + n;
    }
  }
}

void KVCache::finish_layer_append(int64_t layer) {
  step_.next_layer = layer + 1;
  if (step_.next_layer < g_.num_layers) return;
  int64_t rows = 0;
  for (int64_t b = 0; b < g_.batch_size; ++b) {
    lens_[static_cast<size_t>(b)] += step_.num_new[static_cast<size_t>(b)];
    rows += step_.num_new[static_cast<size_t>(b)];
  }
  bytes_appended_ += rows * g_.num_layers * row_bytes();
  ++num_appends_;
  step_ = Step{};
  abandoned_at_ = -1;
  abandoned_repeats_ = 0;
}

void KVCache::block_list(int64_t layer, const std::vector<int64_t>& num_keys, BlockList* out) const {
  out->blocks.clear();
  out->offsets.assign(1, 0);
  for (int64_t b = 0; b < g_.batch_size; ++b)
    for (int64_t h = 0; h < g_.kv_num_heads; ++h) {
      const int64_t n = num_keys[static_cast<size_t>(b)];
      if (n > 0) {
        KVBlock blk;
        blk.key = key_block(layer, b, h);
        blk.value = value_block(layer, b, h);
        blk.first_position = 0;
        blk.num_rows = n;
        out->blocks.push_back(blk);
      }
      out->offsets.push_back(static_cast<int64_t>(out->blocks.size()));
    }
}

// ---------------------------------------------------------------------------

Registry& Registry::instance() {
  static Registry* r = new Registry();  // never destroyed: caches may outlive static destruction order
  return *r;
}

Registry::Registry() {
  // Random per-process base so a handle from another process or a stale id is unlikely to alias.
  const auto t = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  next_ = static_cast<int64_t>(((t ^ (t >> 17) ^ reinterpret_cast<uintptr_t>(this)) & 0xffffffULL) << 20) + 1;
}

int64_t Registry::add(std::unique_ptr<KVCache> cache) {
  std::lock_guard<std::mutex> lk(mu_);
  const int64_t h = next_++;
  caches_.emplace(h, std::shared_ptr<KVCache>(std::move(cache)));
  return h;
}

std::shared_ptr<KVCache> Registry::get(int64_t handle, const char* what) const {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = caches_.find(handle);
  if (it == caches_.end())
    throw std::invalid_argument(std::string(what) + ": KVCache handle " + str(handle) + " is unknown or released");
  return it->second;
}

void Registry::release(int64_t handle, const char* what) {
  std::shared_ptr<KVCache> keep;  // destroyed outside the registry lock
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = caches_.find(handle);
    if (it == caches_.end())
      throw std::invalid_argument(std::string(what) + ": KVCache handle " + str(handle) + " is unknown or released");
    keep = std::move(it->second);
    caches_.erase(it);
  }
}

bool Registry::is_live(int64_t handle) const {
  std::lock_guard<std::mutex> lk(mu_);
  return caches_.count(handle) != 0;
}

int64_t Registry::num_live() const {
  std::lock_guard<std::mutex> lk(mu_);
  return static_cast<int64_t>(caches_.size());
}

void Registry::discard_steps_of_current_thread() {
  std::vector<std::shared_ptr<KVCache>> all;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& kv : caches_) all.push_back(kv.second);
  }
  for (auto& c : all) c->discard_step_of_current_thread();
}

}  // namespace olep
