// PagePool when the heap refuses memory: each heap allocation PagePool::allocate makes (its
// size class, the page records and free list of a new slab, slot bookkeeping, the output
// vector) fails in turn, through a replacement of the global operator new that throws
// std::bad_alloc once at the k-th allocation. Whatever fails, the call leaves the pool exactly
// as it was (no stale free-list ids, no leaked slab, exact accounting) and usable, or succeeds
// through the retry after trimming the kept empty slabs.
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#include "check.h"
#include "kvcache/errors.h"
#include "kvcache/page_pool.h"

namespace {
std::atomic<long> g_fail_at{-1};  // heap allocations left before the one that fails; -1 = none

void* counted_alloc(std::size_t n) {
  if (g_fail_at.load(std::memory_order_relaxed) >= 0 && g_fail_at.fetch_sub(1) == 0) throw std::bad_alloc();
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
}  // namespace

void* operator new(std::size_t n) { return counted_alloc(n); }
void* operator new[](std::size_t n) { return counted_alloc(n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }

using namespace olep;

namespace {

constexpr int64_t kMiB2 = int64_t{2} << 20;
constexpr int64_t kPage = 64 << 10;  // 32 pages per slab

void check_consistent(const PagePool& p) {
  const PoolStats s = p.stats();
  CHECK(s.committed_bytes == s.live_bytes + s.free_bytes + s.overhead_bytes);
  int64_t held = 0, free = 0;
  for (const auto& pr : p.page_refs()) (pr.second ? held : free) += 1;
  CHECK(held == s.num_pages && free == s.num_free_pages);
  CHECK(s.committed_bytes == s.num_slabs * kMiB2);
}

// One refusal at each heap allocation of one allocate() call in turn. With `kept`, the pool
// holds an empty slab of another size, which a refusal trims before its one retry.
void refuse_each_allocation(bool kept) {
  const int64_t process_before = PagePool::process_committed_bytes();
  int failed_calls = 0, retried_ok = 0;
  long k = 0;
  for (;; ++k) {
    PagePool pool;
    pool.add_cache(1);
    std::vector<Page*> other, a, b, c;
    if (kept) {
      pool.allocate(4096, 1, &other);  // a slab of another size, emptied and kept
      pool.release(other);
    }
    pool.allocate(kPage, 20, &a);  // part of one slab
    const PoolStats before = pool.stats();
    CHECK(before.empty_slab_bytes == (kept ? kMiB2 : 0));
    b.reserve(64);
    g_fail_at.store(k);
    bool failed = false;
    try {
      pool.allocate(kPage, 40, &b);  // 12 free pages + one new slab
    } catch (const MemoryLimitError&) {
      failed = true;
    } catch (const std::bad_alloc&) {
      failed = true;
    }
    const bool fired = g_fail_at.exchange(-1) < 0;
    check_consistent(pool);
    if (failed) {
      ++failed_calls;
      const PoolStats after = pool.stats();
      CHECK(b.empty());
      CHECK(after.live_bytes == before.live_bytes && after.num_pages == before.num_pages);
      CHECK(after.committed_bytes <= before.committed_bytes);  // nothing leaked; kept slabs may be gone
    } else {
      CHECK(b.size() == 40);
      if (fired) ++retried_ok;  // a refusal answered by trimming the kept slab and mapping again
    }
    // Usable: every free page of the size and a new slab, each written end to end.
    pool.allocate(kPage, 60, &c);
    for (Page* p : c) std::memset(p->data, 0x5a, static_cast<size_t>(p->bytes));
    check_consistent(pool);
    pool.release(a);
    pool.release(b);
    pool.release(c);
    pool.add_cache(-1);
    CHECK(pool.stats().committed_bytes == 0);
    if (!fired) break;  // the call made fewer than k + 1 heap allocations: every one has failed once
  }
  CHECK(k >= 3);  // the call does allocate: the loop above tested something
  if (kept) CHECK(retried_ok >= 1);  // refusals after the mapping went through trim-and-retry
  else CHECK(failed_calls == k && retried_ok == 0);  // nothing to trim: each refusal fails the call
  CHECK(PagePool::process_committed_bytes() == process_before);
  std::printf("kept=%d: %ld heap allocations in the call, %d refusals failed it, %d retried ok\n", kept ? 1 : 0, k,
              failed_calls, retried_ok);
}

}  // namespace

int main() {
  refuse_each_allocation(false);
  refuse_each_allocation(true);
  TEST_MAIN_END();
}
