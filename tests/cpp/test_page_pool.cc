// PagePool: all-or-nothing allocation under a budget, reference counts, slabs
// mapped on demand, empty slabs unmapped at once or kept for reuse within the
// retention rule (keep_free_bytes, the budget, a user), exact accounting
// (committed = live + free + overhead), and concurrent use.
#include <algorithm>
#include <cstring>
#include <set>
#include <thread>
#include <vector>

#include "check.h"
#include "kvcache/errors.h"
#include "kvcache/page_pool.h"

using namespace olep;

namespace {

void check_accounting(const PagePool& p) {
  const PoolStats s = p.stats();
  CHECK(s.committed_bytes == s.live_bytes + s.free_bytes + s.overhead_bytes);
  CHECK(s.overhead_bytes >= 0);
  CHECK(s.shared_bytes <= s.live_bytes);
  // The global invariant: free pages + held pages == mapped pages, and no held page is free.
  int64_t held = 0, free = 0;
  for (const auto& pr : p.page_refs()) (pr.second ? held : free) += 1;
  CHECK(held == s.num_pages);
  CHECK(free == s.num_free_pages);
  // Empty slabs: slabs none of whose pages is held (ids are slot << 16 | index).
  std::set<uint32_t> slots, used;
  for (const auto& pr : p.page_refs()) {
    slots.insert(pr.first >> 16);
    if (pr.second) used.insert(pr.first >> 16);
  }
  CHECK(static_cast<int64_t>(slots.size()) == s.num_slabs);
  CHECK((s.empty_slab_bytes == 0) == (slots.size() == used.size()));
  CHECK(s.empty_slab_bytes <= s.committed_bytes && s.empty_slab_bytes <= s.keep_free_bytes);
  if (s.num_caches + s.num_checkpoints == 0) CHECK(s.empty_slab_bytes == 0);
  if (s.memory_limit_bytes > 0) CHECK(s.live_bytes + s.empty_slab_bytes <= s.memory_limit_bytes);
}

constexpr int64_t kMiB2 = int64_t{2} << 20;

void test_allocate_release() {
  PagePool pool;
  const int64_t pb = 8192;
  std::vector<Page*> a;
  pool.allocate(pb, 10, &a);
  CHECK(a.size() == 10);
  std::set<uint32_t> ids;
  std::set<char*> addrs;
  for (Page* p : a) {
    ids.insert(p->id);
    addrs.insert(p->data);
    CHECK(p->refs == 1);
    CHECK(p->bytes == pb);
    CHECK(reinterpret_cast<uintptr_t>(p->data) % 64 == 0);
    std::memset(p->data, 0x5a, static_cast<size_t>(pb));  // writable, no overlap with ASan
  }
  CHECK(ids.size() == 10 && addrs.size() == 10);
  PoolStats s = pool.stats();
  CHECK(s.num_slabs == 1);
  CHECK(s.committed_bytes == 2 << 20);
  CHECK(s.live_bytes == 10 * pb);
  CHECK(s.num_pages == 10);
  CHECK(s.num_free_pages == (2 << 20) / pb - 10);
  check_accounting(pool);
  pool.retain(a.data(), 3);
  CHECK(pool.stats().shared_bytes == 3 * pb);
  CHECK(pool.refs(a[0]) == 2 && pool.refs(a[5]) == 1);
  pool.release(a.data(), 3);
  CHECK(pool.stats().shared_bytes == 0);
  pool.release(a);
  s = pool.stats();
  CHECK(s.live_bytes == 0 && s.num_pages == 0);
  CHECK(s.committed_bytes == 0 && s.num_slabs == 0);  // the empty slab is unmapped at once
  check_accounting(pool);
}

void test_lowest_first_and_reuse() {
  PagePool pool;
  std::vector<Page*> a, b;
  pool.allocate(4096, 4, &a);
  const uint32_t second = a[1]->id;
  pool.release(&a[1], 1);
  pool.allocate(4096, 1, &b);
  CHECK(b[0]->id == second);  // the lowest free id is taken first (deterministic)
  pool.release(&a[0], 1);
  pool.release(&a[2], 2);
  pool.release(b);
  CHECK(pool.stats().committed_bytes == 0);
}

void test_budget_all_or_nothing() {
  const int64_t pb = 4096;
  PagePool pool(10 * pb);
  std::vector<Page*> a;
  pool.allocate(pb, 7, &a);
  const PoolStats before = pool.stats();
  std::vector<Page*> b;
  EXPECT_THROW(pool.allocate(pb, 4, &b), MemoryLimitError, "memory_limit_bytes is 40960");
  EXPECT_THROW(pool.allocate(pb, 4, &b), MemoryLimitError, "in use");
  CHECK(b.empty());
  const PoolStats after = pool.stats();
  CHECK(after.live_bytes == before.live_bytes && after.committed_bytes == before.committed_bytes);
  pool.allocate(pb, 3, &b);  // exactly the budget
  CHECK(pool.stats().live_bytes == 10 * pb);
  pool.release(a);
  pool.release(b);
  EXPECT_THROW(PagePool(-1), std::invalid_argument, "memory_limit_bytes");
  EXPECT_THROW(pool.allocate(100, 1, &b), std::invalid_argument, "multiple of 64");
}

void test_size_classes_and_big_pages() {
  PagePool pool;
  std::vector<Page*> small, big, odd;
  pool.allocate(4096, 3, &small);
  pool.allocate(3 << 20, 2, &big);    // 3 MiB pages: slabs of 6 MiB hold two each
  pool.allocate(18432, 5, &odd);      // head_dim 72 float32, 32 tokens: not a divisor of 2 MiB
  for (Page* p : big) {
    CHECK(reinterpret_cast<uintptr_t>(p->data) % 64 == 0);
    p->data[0] = 1;
    p->data[p->bytes - 1] = 2;
  }
  CHECK(reinterpret_cast<uintptr_t>(big[0]->data) % (2 << 20) == 0);
  const PoolStats s = pool.stats();
  CHECK(s.live_bytes == 3 * 4096 + 2 * (3 << 20) + 5 * 18432);
  CHECK(s.num_slabs == 3);
  check_accounting(pool);
  pool.release(small);
  pool.release(big);
  pool.release(odd);
  CHECK(pool.stats().committed_bytes == 0);
}

void test_many_slabs() {
  PagePool pool;
  std::vector<Page*> a;
  const int64_t pb = 512 << 10;  // 4 per 2 MiB slab
  pool.allocate(pb, 17, &a);
  CHECK(pool.stats().num_slabs == 5);
  const int64_t before = PagePool::process_committed_bytes();
  std::vector<Page*> keep(a.begin(), a.begin() + 4), drop(a.begin() + 4, a.end());
  pool.release(drop);
  CHECK(pool.stats().num_slabs == 1);
  CHECK(PagePool::process_committed_bytes() == before - 4 * (2 << 20));
  check_accounting(pool);
  pool.release(keep);
}

void test_concurrent() {
  PagePool pool(64 * 4096);
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t)
    ts.emplace_back([&pool, t] {
      std::vector<Page*> held;
      for (int i = 0; i < 2000; ++i) {
        const int r = (i * 7 + t * 13) % 5;
        if (r < 3) {
          try {
            pool.allocate(4096, 1 + r, &held);
          } catch (const MemoryLimitError&) {
          }
        } else if (!held.empty()) {
          const size_t k = std::min<size_t>(held.size(), static_cast<size_t>(r));
          pool.retain(held.data(), k);
          pool.release(held.data(), k);
          pool.release(held.data() + held.size() - k, k);
          held.resize(held.size() - k);
        }
        if (held.size() > 8) {
          pool.release(held);
          held.clear();
        }
      }
      pool.release(held);
    });
  for (auto& th : ts) th.join();
  const PoolStats s = pool.stats();
  CHECK(s.live_bytes == 0 && s.committed_bytes == 0);
}

void test_empty_slabs_kept_for_reuse() {
  PagePool pool(0, 2 * kMiB2);
  pool.add_cache(1);  // retention needs a user
  const int64_t pb = 4096;  // 512 per slab
  std::vector<Page*> a;
  pool.allocate(pb, 600, &a);
  CHECK(pool.stats().num_slabs == 2 && pool.stats().empty_slab_bytes == 0);
  std::vector<char*> addrs;
  for (Page* p : a) addrs.push_back(p->data);
  pool.release(a);
  PoolStats s = pool.stats();
  CHECK(s.live_bytes == 0 && s.committed_bytes == 2 * kMiB2 && s.empty_slab_bytes == 2 * kMiB2);
  check_accounting(pool);
  // Appending again maps nothing: the same pages (lowest first), the same addresses.
  const int64_t process_before = PagePool::process_committed_bytes();
  std::vector<Page*> b;
  pool.allocate(pb, 600, &b);
  CHECK(PagePool::process_committed_bytes() == process_before);
  for (size_t i = 0; i < b.size(); ++i) CHECK(b[i]->data == addrs[i]);
  CHECK(pool.stats().empty_slab_bytes == 0);
  check_accounting(pool);
  pool.release(b);
  // More empty slabs than keep_free_bytes: the ones past it are unmapped as they empty.
  std::vector<Page*> c;
  pool.allocate(pb, 4 * 512, &c);
  CHECK(pool.stats().num_slabs == 4);
  pool.release(c);
  s = pool.stats();
  CHECK(s.num_slabs == 2 && s.empty_slab_bytes == 2 * kMiB2 && s.committed_bytes == 2 * kMiB2);
  check_accounting(pool);
  // trim() unmaps them and says how much.
  CHECK(pool.trim() == 2 * kMiB2);
  CHECK(pool.stats().committed_bytes == 0 && pool.trim() == 0);
  // The last user leaving unmaps the empty slabs.
  pool.allocate(pb, 10, &c);
  c.erase(c.begin(), c.end() - 10);
  pool.release(c);
  CHECK(pool.stats().empty_slab_bytes == kMiB2);
  pool.add_cache(-1);
  CHECK(pool.stats().committed_bytes == 0);
  check_accounting(pool);
  EXPECT_THROW(PagePool(0, -1), std::invalid_argument, "keep_free_bytes");
}

void test_keep_free_zero_and_no_user() {
  for (int64_t keep : {int64_t{0}, kDefaultKeepFreeBytes}) {
    PagePool pool(0, keep);
    if (keep == 0) pool.add_cache(1);  // keep 0: a user does not matter; default: no user
    std::vector<Page*> a;
    pool.allocate(4096, 513, &a);
    pool.release(a);
    const PoolStats s = pool.stats();
    CHECK(s.committed_bytes == 0 && s.num_slabs == 0 && s.empty_slab_bytes == 0);
    if (keep == 0) pool.add_cache(-1);
  }
}

void test_retention_within_budget() {
  // Under a budget, live_bytes + empty slab bytes never pass it.
  {
    PagePool pool(3 * kMiB2 / 4);  // 1.5 MiB: an empty 2 MiB slab alone passes it
    pool.add_cache(1);
    std::vector<Page*> a;
    pool.allocate(4096, 128, &a);  // 512 KiB of one slab
    pool.release(a);
    CHECK(pool.stats().committed_bytes == 0);
    pool.add_cache(-1);
  }
  PagePool pool(3 * kMiB2 / 2);  // 3 MiB
  pool.add_checkpoint(1);           // a checkpoint is a user too
  std::vector<Page*> a, b;
  pool.allocate(4096, 128, &a);
  pool.release(a);
  CHECK(pool.stats().empty_slab_bytes == kMiB2);  // 0 + 2 MiB <= 3 MiB: kept
  pool.allocate(8192, 128, &b);                    // another size class, 1 MiB: 1 + 2 <= 3, kept
  CHECK(pool.stats().empty_slab_bytes == kMiB2 && pool.stats().num_slabs == 2);
  check_accounting(pool);
  pool.allocate(8192, 32, &b);                     // 1.25 MiB live + 2 MiB empty > 3: it goes
  PoolStats s = pool.stats();
  CHECK(s.empty_slab_bytes == 0 && s.num_slabs == 1 && s.committed_bytes == kMiB2);
  check_accounting(pool);
  pool.release(b);
  CHECK(pool.stats().empty_slab_bytes == kMiB2);
  pool.add_checkpoint(-1);
  CHECK(pool.stats().committed_bytes == 0);

  // Not even in between: when new slabs must be mapped, the kept slabs of other sizes that the
  // budget cannot hold beside the new pages go first, so the new slab takes the freed slot.
  PagePool p2(3 * kMiB2 / 2);  // 3 MiB
  p2.add_cache(1);
  std::vector<Page*> x, y;
  p2.allocate(4096, 1, &x);  // slot 0
  const uint32_t slot0 = x[0]->id >> 16;
  p2.release(x);
  CHECK(p2.stats().empty_slab_bytes == kMiB2);
  const int64_t process_before = PagePool::process_committed_bytes();
  p2.allocate(8192, 256, &y);  // 2 MiB: a new slab; 2 + 2 kept > 3 MiB
  CHECK((y[0]->id >> 16) == slot0);  // mapped after slot 0 was unmapped
  CHECK(PagePool::process_committed_bytes() == process_before);
  check_accounting(p2);
  p2.release(y);
  p2.add_cache(-1);
}

}  // namespace

int main() {
  test_allocate_release();
  test_lowest_first_and_reuse();
  test_budget_all_or_nothing();
  test_size_classes_and_big_pages();
  test_many_slabs();
  test_concurrent();
  test_empty_slabs_kept_for_reuse();
  test_keep_free_zero_and_no_user();
  test_retention_within_budget();
  TEST_MAIN_END();
}
