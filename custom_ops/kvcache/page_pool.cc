#include "kvcache/page_pool.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <atomic>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>

#include "kvcache/errors.h"

namespace olep {
namespace {

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // Linux >= 6.1
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux >= 5.14
#endif

constexpr int64_t kHugePage = kSlabUnitBytes;
constexpr uint32_t kMaxPagesPerSlab = 1u << 16;
constexpr uint32_t kMaxSlabs = 1u << 16;

std::atomic<int64_t> g_process_committed{0};
std::atomic<bool> g_huge_pages{true};

std::string str(int64_t v) { return std::to_string(v); }

int64_t round_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

// Slab size for pages of `page_bytes`: a multiple of 2 MiB (1..8 of them) wasting the
// smallest fraction on a tail no page fits in, the smaller slab on a tie.
void slab_shape(int64_t page_bytes, int64_t* slab_bytes, int64_t* pages_per_slab) {
  const int64_t min_huge = (page_bytes + kHugePage - 1) / kHugePage;
  int64_t best_bytes = 0, best_pages = 0;
  double best_waste = 2.0;
  for (int64_t m = min_huge; m <= std::max<int64_t>(min_huge, 8); ++m) {
    const int64_t bytes = m * kHugePage;
    const int64_t pages = std::min<int64_t>(bytes / page_bytes, kMaxPagesPerSlab);
    const double waste = static_cast<double>(bytes - pages * page_bytes) / static_cast<double>(bytes);
    if (waste < best_waste - 1e-9) {
      best_waste = waste;
      best_bytes = bytes;
      best_pages = pages;
    }
  }
  *slab_bytes = best_bytes;
  *pages_per_slab = best_pages;
}

}  // namespace

struct PagePool::Slab {
  char* map = nullptr;  // mmap result (map_bytes long); base is the 2 MiB-aligned part
  size_t map_bytes = 0;
  int64_t bytes = 0;
  int64_t page_bytes = 0;
  int64_t used = 0;  // pages with refs > 0
  std::unique_ptr<Page[]> pages;
  int64_t num_pages = 0;
};

PagePool::PagePool(int64_t memory_limit_bytes, int64_t keep_free_bytes)
    : limit_(memory_limit_bytes), keep_free_(keep_free_bytes) {
  if (memory_limit_bytes < 0)
    throw std::invalid_argument("memory_limit_bytes must be >= 0 (0 = no limit); got " + str(memory_limit_bytes));
  if (keep_free_bytes < 0)
    throw std::invalid_argument("keep_free_bytes must be >= 0 (0 = unmap empty slabs at once); got " +
                                str(keep_free_bytes));
}

PagePool::~PagePool() {
  std::lock_guard<std::mutex> lk(mu_);
  for (uint32_t s = 0; s < slabs_.size(); ++s)
    if (slabs_[s]) unmap_slab_locked(s);
}

PagePool::SizeClass& PagePool::size_class_locked(int64_t page_bytes) {
  auto it = classes_.find(page_bytes);
  if (it != classes_.end()) return it->second;
  SizeClass c;
  c.page_bytes = page_bytes;
  slab_shape(page_bytes, &c.slab_bytes, &c.pages_per_slab);
  return classes_.emplace(page_bytes, std::move(c)).first->second;
}

Page* PagePool::page_locked(uint32_t id) const { return &slabs_[id >> 16]->pages[id & 0xffffu]; }

uint32_t PagePool::map_slab_locked(SizeClass& c) {
  uint32_t slot;
  if (!free_slots_.empty()) {
    slot = free_slots_.back();
  } else {
    if (slabs_.size() >= kMaxSlabs)
      throw MemoryLimitError("the pool already maps " + str(kMaxSlabs) + " slabs, its maximum");
    slot = static_cast<uint32_t>(slabs_.size());
  }
  // Everything that allocates on the heap comes before the mapping or is undone with it, so a
  // refusal anywhere leaves the pool as it was (std::bad_alloc becomes MemoryLimitError, which
  // allocate() answers by trimming and retrying once). Capacity for the slot in slabs_ and in
  // free_slots_ is reserved here, so the push_backs below and unmap's never allocate.
  std::unique_ptr<Slab> slab;
  try {
    slab = std::make_unique<Slab>();
    slab->pages.reset(new Page[static_cast<size_t>(c.pages_per_slab)]);
    if (slot == slabs_.size()) {
      slabs_.reserve(slabs_.size() + 1);
      free_slots_.reserve(slabs_.size() + 1);
    }
  } catch (const std::bad_alloc&) {
    throw MemoryLimitError("the system refused memory for a slab's page records (" + str(c.pages_per_slab) +
                           " pages)");
  }
  // Map 2 MiB more than needed and keep the 2 MiB-aligned part, so each 2 MiB of the slab can
  // be one huge page.
  const size_t map_bytes = static_cast<size_t>(c.slab_bytes + kHugePage);
  void* p = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED)
    throw MemoryLimitError("the system refused to map a slab of " + str(c.slab_bytes) + " bytes");
  char* map = static_cast<char*>(p);
  char* base = reinterpret_cast<char*>(round_up(reinterpret_cast<intptr_t>(map), kHugePage));
  const size_t head = static_cast<size_t>(base - map);
  if (head) munmap(map, head);
  const size_t tail = map_bytes - head - static_cast<size_t>(c.slab_bytes);
  if (tail) munmap(base + c.slab_bytes, tail);
  const size_t bytes = static_cast<size_t>(c.slab_bytes);
  // Huge pages at fault time where THP allows it (enabled = madvise or always), then fault the
  // whole slab in now (no page faults later, on the decode path), then collapse any 2 MiB range
  // that still has small pages (MADV_COLLAPSE works whatever the THP "enabled" setting). All
  // best effort: a kernel without them keeps 4 KiB pages, which only costs read speed.
  const bool huge = g_huge_pages.load(std::memory_order_relaxed);
  madvise(base, bytes, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
  if (madvise(base, bytes, MADV_POPULATE_WRITE) != 0) {
    if (errno == ENOMEM || errno == EFAULT) {
      munmap(base, bytes);
      throw MemoryLimitError("the system refused to commit a slab of " + str(c.slab_bytes) + " bytes");
    }
    const long ps = sysconf(_SC_PAGESIZE);
    for (size_t off = 0; off < bytes; off += static_cast<size_t>(ps > 0 ? ps : 4096)) base[off] = 0;
  }
  if (huge) madvise(base, bytes, MADV_COLLAPSE);

  slab->map = base;
  slab->map_bytes = bytes;
  slab->bytes = c.slab_bytes;
  slab->page_bytes = c.page_bytes;
  slab->num_pages = c.pages_per_slab;
  int64_t inserted = 0;
  try {
    for (; inserted < c.pages_per_slab; ++inserted) {
      Page& pg = slab->pages[static_cast<size_t>(inserted)];
      pg.data = base + inserted * c.page_bytes;
      pg.bytes = c.page_bytes;
      pg.id = (slot << 16) | static_cast<uint32_t>(inserted);
      pg.refs = 0;
      pg.slab = slot;
      c.free.insert(pg.id);  // a set node: may throw std::bad_alloc
    }
  } catch (const std::bad_alloc&) {
    for (int64_t i = 0; i < inserted; ++i) c.free.erase(slab->pages[static_cast<size_t>(i)].id);
    munmap(base, bytes);
    throw MemoryLimitError("the system refused memory for a slab's free list (" + str(c.pages_per_slab) +
                           " pages)");
  }
  if (slot == slabs_.size()) slabs_.push_back(nullptr);  // capacity reserved above
  else free_slots_.pop_back();
  slabs_[slot] = std::move(slab);
  committed_ += c.slab_bytes;
  empty_bytes_ += c.slab_bytes;
  free_bytes_ += c.pages_per_slab * c.page_bytes;
  num_free_ += c.pages_per_slab;
  ++num_slabs_;
  g_process_committed.fetch_add(c.slab_bytes, std::memory_order_relaxed);
  return slot;
}

void PagePool::unmap_slab_locked(uint32_t slot) noexcept {
  Slab& s = *slabs_[slot];
  auto it = classes_.find(s.page_bytes);
  for (int64_t i = 0; i < s.num_pages; ++i) {
    const Page& pg = s.pages[static_cast<size_t>(i)];
    if (pg.refs == 0) {
      if (it != classes_.end()) it->second.free.erase(pg.id);
      free_bytes_ -= s.page_bytes;
      --num_free_;
    }
  }
  munmap(s.map, s.map_bytes);
  committed_ -= s.bytes;
  if (s.used == 0) empty_bytes_ -= s.bytes;
  --num_slabs_;
  g_process_committed.fetch_sub(s.bytes, std::memory_order_relaxed);
  slabs_[slot].reset();
  free_slots_.push_back(slot);
}

bool PagePool::retention_ok_locked() const noexcept {
  if (empty_bytes_ == 0) return true;
  if (num_caches_ + num_checkpoints_ <= 0 || empty_bytes_ > keep_free_) return false;
  return limit_ == 0 || live_ + empty_bytes_ <= limit_;
}

int64_t PagePool::trim_locked(bool all) noexcept {
  int64_t unmapped = 0;
  // Highest slots first: allocation takes the lowest page ids, so the low slabs are the ones reused.
  for (size_t s = slabs_.size(); s-- > 0 && empty_bytes_ > 0;) {
    if (!all && retention_ok_locked()) break;
    if (slabs_[s] && slabs_[s]->used == 0) {
      unmapped += slabs_[s]->bytes;
      unmap_slab_locked(static_cast<uint32_t>(s));
    }
  }
  return unmapped;
}

int64_t PagePool::trim() noexcept {
  std::lock_guard<std::mutex> lk(mu_);
  return trim_locked(true);
}

void PagePool::allocate(int64_t page_bytes, int64_t n, std::vector<Page*>* out) {
  if (page_bytes <= 0 || page_bytes % 64 != 0)
    throw std::invalid_argument("page size must be a positive multiple of 64 bytes; got " + str(page_bytes));
  if (n < 0) throw std::invalid_argument("page count must be >= 0; got " + str(n));
  if (n == 0) return;
  int64_t need = 0;
  if (__builtin_mul_overflow(n, page_bytes, &need) || need > (int64_t{1} << 50))
    throw MemoryLimitError(str(n) + " pages of " + str(page_bytes) + " bytes exceed any memory (1 PiB)");
  std::lock_guard<std::mutex> lk(mu_);
  if (limit_ > 0 && live_ + need > limit_)
    throw MemoryLimitError("pool memory_limit_bytes is " + str(limit_) + ": " + str(n) + " new pages need " +
                           str(need) + " bytes and " + str(live_) + " bytes are in use");
  SizeClass& c = size_class_locked(page_bytes);
  out->reserve(out->size() + static_cast<size_t>(n));
  // Under a budget, the empty slabs kept of other sizes go before new slabs are mapped when the
  // pool would otherwise hold more than the budget in between (live + new pages + kept slabs):
  // the free pages of this size are all taken first, so only other sizes' kept slabs remain.
  if (limit_ > 0 && static_cast<int64_t>(c.free.size()) < n && empty_bytes_ > 0) {
    int64_t empty_here = 0;
    for (const auto& sl : slabs_)
      if (sl && sl->used == 0 && sl->page_bytes == page_bytes) empty_here += sl->bytes;
    for (size_t i = slabs_.size(); i-- > 0 && live_ + need + (empty_bytes_ - empty_here) > limit_;)
      if (slabs_[i] && slabs_[i]->used == 0 && slabs_[i]->page_bytes != page_bytes)
        unmap_slab_locked(static_cast<uint32_t>(i));
  }
  // Map the slabs the free list lacks; on failure unmap the ones mapped here (all or nothing).
  const auto map_missing = [&] {
    const int64_t missing = n - static_cast<int64_t>(c.free.size());
    if (missing <= 0) return;
    std::vector<uint32_t> mapped;
    try {
      mapped.reserve(static_cast<size_t>((missing + c.pages_per_slab - 1) / c.pages_per_slab));
    } catch (const std::bad_alloc&) {
      throw MemoryLimitError("the system refused memory for mapping " + str(missing) + " pages");
    }
    try {
      while (static_cast<int64_t>(c.free.size()) < n) mapped.push_back(map_slab_locked(c));  // reserved
    } catch (...) {
      for (uint32_t slot : mapped) unmap_slab_locked(slot);
      throw;
    }
  };
  try {
    map_missing();
  } catch (const MemoryLimitError&) {
    if (trim_locked(true) == 0) throw;  // the empty slabs kept for reuse go first, then one retry
    map_missing();
  }
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t id = *c.free.begin();
    c.free.erase(c.free.begin());
    Page* pg = page_locked(id);
    pg->refs = 1;
    pg->encoding = 0;
    Slab& slab = *slabs_[pg->slab];
    if (slab.used++ == 0) empty_bytes_ -= slab.bytes;
    out->push_back(pg);
  }
  live_ += need;
  free_bytes_ -= need;
  num_live_ += n;
  num_free_ -= n;
  if (!retention_ok_locked()) trim_locked(false);  // slabs of other sizes kept past the budget
}

void PagePool::retain(const Page* const* pages, size_t n) {
  std::lock_guard<std::mutex> lk(mu_);
  for (size_t i = 0; i < n; ++i) {
    Page* p = const_cast<Page*>(pages[i]);
    if (p->refs == 0) throw std::logic_error("PagePool::retain: page " + str(p->id) + " is free");
  }
  for (size_t i = 0; i < n; ++i) {
    Page* p = const_cast<Page*>(pages[i]);
    if (++p->refs == 2) shared_ += p->bytes;
  }
}

void PagePool::release(const Page* const* pages, size_t n) noexcept {
  std::lock_guard<std::mutex> lk(mu_);
  for (size_t i = 0; i < n; ++i) {
    Page* p = const_cast<Page*>(pages[i]);
    if (p->refs == 0) continue;  // never happens for a caller that holds the page
    if (--p->refs == 1) shared_ -= p->bytes;
    if (p->refs > 0) continue;
    live_ -= p->bytes;
    --num_live_;
    free_bytes_ += p->bytes;
    ++num_free_;
    auto c = classes_.find(p->bytes);  // exists: the page was allocated from it
    if (c != classes_.end()) c->second.free.insert(p->id);
    Slab& slab = *slabs_[p->slab];
    if (--slab.used == 0) {
      empty_bytes_ += slab.bytes;
      if (!retention_ok_locked()) unmap_slab_locked(p->slab);
    }
  }
}

void PagePool::refs(const Page* const* pages, size_t n, uint32_t* out) const {
  std::lock_guard<std::mutex> lk(mu_);
  for (size_t i = 0; i < n; ++i) out[i] = pages[i]->refs;
}

uint32_t PagePool::refs(const Page* p) const {
  std::lock_guard<std::mutex> lk(mu_);
  return p->refs;
}

PoolStats PagePool::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  PoolStats s;
  s.memory_limit_bytes = limit_;
  s.committed_bytes = committed_;
  s.live_bytes = live_;
  s.shared_bytes = shared_;
  s.free_bytes = free_bytes_;
  s.overhead_bytes = committed_ - live_ - free_bytes_;
  s.num_pages = num_live_;
  s.num_free_pages = num_free_;
  s.num_slabs = num_slabs_;
  s.num_caches = num_caches_;
  s.num_checkpoints = num_checkpoints_;
  s.keep_free_bytes = keep_free_;
  s.empty_slab_bytes = empty_bytes_;
  return s;
}

std::vector<std::pair<uint32_t, uint32_t>> PagePool::page_refs() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<std::pair<uint32_t, uint32_t>> out;
  for (const auto& s : slabs_)
    if (s)
      for (int64_t i = 0; i < s->num_pages; ++i) out.emplace_back(s->pages[static_cast<size_t>(i)].id, s->pages[static_cast<size_t>(i)].refs);
  std::sort(out.begin(), out.end());
  return out;
}

void PagePool::add_cache(int delta) {
  std::lock_guard<std::mutex> lk(mu_);
  num_caches_ += delta;
  if (num_caches_ + num_checkpoints_ <= 0) trim_locked(true);
}

void PagePool::add_checkpoint(int delta) {
  std::lock_guard<std::mutex> lk(mu_);
  num_checkpoints_ += delta;
  if (num_caches_ + num_checkpoints_ <= 0) trim_locked(true);
}

int64_t PagePool::process_committed_bytes() { return g_process_committed.load(std::memory_order_relaxed); }

void PagePool::set_huge_pages(bool on) { g_huge_pages.store(on, std::memory_order_relaxed); }

bool PagePool::huge_pages() { return g_huge_pages.load(std::memory_order_relaxed); }

}  // namespace olep
