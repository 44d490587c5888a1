// KVCache arena: steps (reserve at layer 0, commit at the last layer, the commit node or the end
// of a deferred run, rollback otherwise), ownership across threads and runs, limits, truncate /
// reorder / fork / import / export, the registry. Page sharing, checkpoints, eviction and
// persistence are in test_kvcache_pages.cc.
#include <atomic>
#include <stdexcept>
#include <thread>
#include <vector>

#include "check.h"
#include "kv_test_util.h"
#include "kvcache/errors.h"
#include "kvcache/registry.h"

using namespace olep;
using kvt::check_content;
using kvt::geom;
using kvt::step;
using kvt::streams_of;

namespace {

std::shared_ptr<KVCache> make(const CacheGeometry& g, std::shared_ptr<PagePool> pool = nullptr) {
  return std::make_shared<KVCache>(g, std::move(pool));
}

void test_geometry_validation() {
  CacheGeometry g = geom();
  g.head_dim = 0;
  EXPECT_THROW(KVCache(g, nullptr), std::invalid_argument, "head_dim must be in [1, 4096]; got 0");
  g = geom();
  g.max_sequence_length = -3;
  EXPECT_THROW(KVCache(g, nullptr), std::invalid_argument, "max_sequence_length");
  g = geom();
  g.memory_limit_bytes = -1;
  EXPECT_THROW(KVCache(g, nullptr), std::invalid_argument, "memory_limit_bytes");
  g = geom();
  g.page_tokens = 48;
  EXPECT_THROW(KVCache(g, nullptr), std::invalid_argument, "page_tokens must be a multiple of 32");
  g = geom();
  g.sliding_window = {4};
  EXPECT_THROW(KVCache(g, nullptr), std::invalid_argument, "sliding_window must have num_layers=2");
  g = geom();
  g.sliding_window = {0, -1};
  EXPECT_THROW(KVCache(g, nullptr), std::invalid_argument, "sliding_window[1]");
  g = geom();
  g.sliding_window = {0, 17};  // wider than max_sequence_length=16: allowed, never evicts
  KVCache wide(g, nullptr);
  g = geom();
  g.rollback_tokens = -1;
  EXPECT_THROW(KVCache(g, nullptr), std::invalid_argument, "rollback_tokens");
  // A huge max_sequence_length reserves nothing: pages come on demand.
  g = geom(32, 64, 8, 128, 1 << 24);
  KVCache big(g, nullptr);
  CHECK(big.stats().committed_bytes == 0);
}

void test_steps_commit_after_last_layer() {
  auto c = make(geom(2, 2, 2, 4, 64));
  CHECK(c->stats().committed_bytes == 0);
  step(*c, 3);
  CHECK((c->seq_lens() == std::vector<int64_t>{3, 3}));
  step(*c, 1);
  step(*c, 1);
  CHECK((c->seq_lens() == std::vector<int64_t>{5, 5}));
  const CacheStats s = c->stats();
  const int64_t row = 2 /*heads*/ * (4 + 4) * 4 /*bytes*/;
  CHECK(s.bytes_appended == 2 /*layers*/ * 2 /*batch*/ * 5 * row);
  CHECK(s.bytes_copied == 0);
  CHECK(s.live_bytes == 2 * 2 * 5 * row);
  CHECK(s.num_pages == 2 * 2 * 2);  // one 32-position page per (layer, sequence, head)
  CHECK(s.committed_bytes == s.num_pages * 32 * 8 * 4);
  CHECK(s.num_appends == 3);
  CHECK(s.reserved_bytes == 0);
  check_content(*c, streams_of({5, 5}));
  CHECK(c->stats().bytes_copied == s.live_bytes);  // export counts as a copy

  // Layer 0 appended, layer 1 never ran (a failed run without boundaries): nothing visible. Seen
  // from another thread the step's pages are reserved, not committed; layer 1 of a different
  // step length is refused.
  kvt::layer_step(*c, 0, 30);  // crosses into a second page
  {
    auto lk = c->lock();
    EXPECT_THROW(c->begin_layer_append(1, 3, {3, 3}, false), std::invalid_argument, "different number of tokens");
  }
  std::thread reader([&] {
    // layer 0 reserved the new pages of every layer (2 layers x 2 sequences x 2 heads)
    CHECK(c->stats().reserved_bytes == 2 * 2 * 2 * 32 * 8 * 4);
    CHECK((c->seq_lens() == std::vector<int64_t>{5, 5}));
  });
  reader.join();
  // The thread that ran the failed run calls a method: its stale step is rolled back.
  CHECK(c->stats().reserved_bytes == 0);
  check_content(*c, streams_of({5, 5}));
  step(*c, 1);
  CHECK((c->seq_lens() == std::vector<int64_t>{6, 6}));
  check_content(*c, streams_of({6, 6}));
  CHECK(c->stats().reserved_bytes == 0);
}

void test_ragged_and_limits() {
  auto c = make(geom(2, 2, 2, 4, 8));
  step(*c, 4, {4, 2});  // right padding: sequence 1 keeps 2 of 4 rows
  CHECK((c->seq_lens() == std::vector<int64_t>{4, 2}));
  step(*c, 1);
  CHECK((c->seq_lens() == std::vector<int64_t>{5, 3}));
  check_content(*c, streams_of({5, 3}));
  {
    auto lk = c->lock();
    EXPECT_THROW(c->begin_layer_append(0, 4, {4, 4}, false), std::invalid_argument, "max_sequence_length is 8");
    EXPECT_THROW(c->begin_layer_append(0, 2, {3, 1}, false), std::invalid_argument, "must be in [0, 2]");
    EXPECT_THROW(c->begin_layer_append(2, 1, {1, 1}, false), std::invalid_argument, "layer must be in [0, num_layers=2)");
    EXPECT_THROW(c->begin_layer_append(1, 1, {1, 1}, false), std::invalid_argument, "or layer 0 is missing");
    EXPECT_THROW(c->begin_layer_append(0, 1, {1, 1, 1}, false), std::invalid_argument, "batch_size is 2");
  }
  CHECK((c->seq_lens() == std::vector<int64_t>{5, 3}));
  check_content(*c, streams_of({5, 3}));

  // Quota: 2 layers x 1 head x 1 page of 32 positions = 2 pages.
  CacheGeometry g = geom(2, 1, 1, 8, 256);
  const int64_t page = 32 * 16 * 4;
  g.memory_limit_bytes = 2 * page;
  auto m = make(g);
  step(*m, 32);  // exactly one page per layer
  CHECK(m->stats().committed_bytes == 2 * page);
  {
    auto lk = m->lock();
    EXPECT_THROW(m->begin_layer_append(0, 1, {1}, false), MemoryLimitError, "cache memory_limit_bytes is 4096");
  }
  CHECK((m->seq_lens() == std::vector<int64_t>{32}));
  CHECK(m->stats().reserved_bytes == 0);
  m->truncate({2});
  CHECK(m->stats().committed_bytes == 2 * page);  // positions 0..1 still use the first page
  m->truncate({0});
  CHECK(m->stats().committed_bytes == 0);
  step(*m, 4);
  CHECK((m->seq_lens() == std::vector<int64_t>{4}));
}

void test_truncate_reorder_fork_import() {
  auto c = make(geom(2, 3, 2, 4, 80));
  step(*c, 40);
  EXPECT_THROW(c->truncate({1, 2}), std::invalid_argument, "batch_size=3");
  EXPECT_THROW(c->truncate({1, 41, 0}), std::invalid_argument, "lengths[1] must be in [0, 40] (seq_lens[1]); got 41");
  EXPECT_THROW(c->truncate({-1, 0, 0}), std::invalid_argument, "lengths[0]");
  CHECK((c->seq_lens() == std::vector<int64_t>{40, 40, 40}));
  c->truncate({40, 33, 3});
  check_content(*c, streams_of({40, 33, 3}));
  CHECK(c->stats().num_pages == 2 * 2 * (2 + 2 + 1));
  step(*c, 1);  // appends at each sequence's own length
  check_content(*c, streams_of({41, 34, 4}));

  EXPECT_THROW(c->reorder({0, 1}), std::invalid_argument, "batch_size=3");
  EXPECT_THROW(c->reorder({0, 3, 1}), std::invalid_argument, "indices[1] must be in [0, 3); got 3");
  const int64_t copied = c->stats().bytes_copied;
  c->reorder({2, 0, 0});
  CHECK((c->seq_lens() == std::vector<int64_t>{4, 41, 41}));
  kvt::Streams want = {std::vector<int64_t>(4, 2), std::vector<int64_t>(41, 0), std::vector<int64_t>(41, 0)};
  CHECK(c->stats().bytes_copied == copied);  // a permutation of page tables
  check_content(*c, want);

  std::unique_ptr<KVCache> f = c->fork({0, 1, 2});
  CHECK(f->seq_lens() == c->seq_lens());
  check_content(*f, want);
  f->truncate({0, 0, 0});
  check_content(*c, want);  // original untouched
  EXPECT_THROW(c->fork({}), std::invalid_argument, "at least one");
  EXPECT_THROW(c->fork({3}), std::invalid_argument, "indices[0]");

  // import_past replaces content: BNSH arrays per layer.
  const auto& g = c->geometry();
  const int64_t L = 35;
  std::vector<std::vector<float>> ks, vs;
  std::vector<const void*> kp, vp;
  for (int64_t l = 0; l < g.num_layers; ++l) {
    ks.emplace_back(static_cast<size_t>(g.batch_size * g.kv_num_heads * L * g.head_dim));
    vs.emplace_back(ks.back().size());
    for (int64_t b = 0; b < g.batch_size; ++b)
      for (int64_t h = 0; h < g.kv_num_heads; ++h)
        for (int64_t p = 0; p < L; ++p)
          for (int64_t d = 0; d < g.head_dim; ++d) {
            const size_t i = static_cast<size_t>(((b * g.kv_num_heads + h) * L + p) * g.head_dim + d);
            ks.back()[i] = kvt::tag(l, b, h, p, d, false);
            vs.back()[i] = kvt::tag(l, b, h, p, d, true);
          }
    kp.push_back(ks.back().data());
    vp.push_back(vs.back().data());
  }
  EXPECT_THROW(c->import_past({kp[0]}, {vp[0]}, L), std::invalid_argument, "num_layers=2");
  EXPECT_THROW(c->import_past(kp, vp, 81), std::invalid_argument, "max_sequence_length=80");
  c->import_past(kp, vp, L);
  check_content(*c, streams_of({L, L, L}));
  c->reset();
  CHECK((c->seq_lens() == std::vector<int64_t>{0, 0, 0}));
  CHECK(c->stats().committed_bytes == 0);
  check_content(*c, streams_of({0, 0, 0}));
}

void test_registry() {
  Registry& r = Registry::instance();
  const int64_t before = r.num_live_caches();
  const int64_t h = r.add_cache(make(geom()));
  CHECK(r.is_live(h));
  CHECK(r.num_live_caches() == before + 1);
  auto c = r.cache(h);
  r.release_cache(h);
  CHECK(!r.is_live(h));
  EXPECT_THROW(r.cache(h), std::invalid_argument, "KVCache handle");
  EXPECT_THROW(r.release_cache(h), std::invalid_argument, "is unknown or released");
  const int64_t h2 = r.add_cache(make(geom()));
  CHECK(h2 != h);  // never reused
  step(*c, 2);     // a released cache held by a running op stays valid until it finishes
  r.release_cache(h2);

  auto pool = std::make_shared<PagePool>();
  const int64_t ph = r.add_pool(pool);
  CHECK(r.pool(ph) == pool);
  auto in_pool = make(geom(), pool);
  EXPECT_THROW(r.release_pool(ph), std::invalid_argument, "in use by 1 cache(s)");
  in_pool.reset();
  EXPECT_THROW(r.release_pool(ph), std::invalid_argument, "in use");  // `pool` here still holds it
  pool.reset();
  r.release_pool(ph);
  EXPECT_THROW(r.pool(ph), std::invalid_argument, "KVPool handle");
  EXPECT_THROW(r.checkpoint(ph), std::invalid_argument, "KVCheckpoint handle");
}

// An unbounded step (plain CPU EP path) is taken over by another thread; its owner then fails
// with BusyError naming who took it. A bounded run's step refuses another thread (BusyError).
void test_thread_ownership() {
  auto c = make(geom());
  kvt::layer_step(*c, 0, 1);
  std::atomic<bool> rejected{false};
  std::thread t([&] {
    auto lk = c->lock();
    try {
      c->begin_layer_append(1, 1, {1, 1}, false);
    } catch (const BusyError& e) {
      rejected = std::string(e.what()).find("being appended by a run on thread") != std::string::npos;
    }
  });
  t.join();
  CHECK(rejected.load());
  std::thread taker([&] { step(*c, 2); });  // another thread takes the unbounded step over
  taker.join();
  {
    auto lk = c->lock();
    EXPECT_THROW(c->begin_layer_append(1, 1, {1, 1}, false), BusyError, "took the cache over while this run was at layer 1");
  }
  CHECK((c->seq_lens() == std::vector<int64_t>{2, 2}));

  // A bounded run owns its step until its end.
  run_scope::begin(false);
  kvt::layer_step(*c, 0, 1);
  std::atomic<int> busy{0};
  std::thread other([&] {
    try {
      step(*c, 1);
    } catch (const BusyError& e) {
      if (std::string(e.what()).find("being appended by run ") != std::string::npos) busy = 1;
    }
    try {
      c->truncate({1, 1});
    } catch (const BusyError& e) {
      if (std::string(e.what()).find("truncate while run ") != std::string::npos) busy += 1;
    }
  });
  other.join();
  CHECK(busy.load() == 2);
  CHECK(run_scope::end(false).empty());  // discards the incomplete step
  CHECK((c->seq_lens() == std::vector<int64_t>{2, 2}));
  CHECK(c->stats().reserved_bytes == 0);

  // Many threads running full steps on their own caches of one pool concurrently.
  auto pool = std::make_shared<PagePool>();
  std::vector<std::shared_ptr<KVCache>> caches;
  for (int i = 0; i < 4; ++i) caches.push_back(make(geom(2, 2, 2, 4, 128), pool));
  std::vector<std::thread> ts;
  for (int i = 0; i < 4; ++i)
    ts.emplace_back([&, i] {
      for (int s = 0; s < 20; ++s) step(*caches[static_cast<size_t>(i)], 1 + (s % 3));
    });
  for (auto& th : ts) th.join();
  for (auto& cc : caches) {
    int64_t n = 0;
    for (int s = 0; s < 20; ++s) n += 1 + (s % 3);
    CHECK((cc->seq_lens() == std::vector<int64_t>{n, n}));
    check_content(*cc, streams_of({n, n}));
  }
}

// Run boundaries: a deferred run commits at end(true) only; a bounded run discards an incomplete
// step at its end; a repeated layer in one bounded run is an error; the commit node.
void test_runs() {
  auto c = make(geom(3, 1, 1, 4, 64));
  // Deferred + success: nothing visible until end(true).
  run_scope::begin(true);
  step(*c, 2);
  CHECK((c->seq_lens() == std::vector<int64_t>{0}));
  CHECK(c->stats().reserved_bytes > 0);
  CHECK(run_scope::end(true).empty());
  CHECK((c->seq_lens() == std::vector<int64_t>{2}));
  // Deferred + failure after every layer appended: rolled back.
  const CacheStats before = c->stats();
  run_scope::begin(true);
  step(*c, 3);
  CHECK(run_scope::end(false).empty());
  CHECK((c->seq_lens() == std::vector<int64_t>{2}));
  const CacheStats after = c->stats();
  CHECK(after.committed_bytes == before.committed_bytes && after.bytes_appended == before.bytes_appended &&
        after.num_appends == before.num_appends && after.reserved_bytes == 0);
  check_content(*c, streams_of({2}));
  // Deferred success with layers missing: the certain "fewer attention layers" diagnosis.
  run_scope::begin(true);
  step(*c, 1, {}, {}, false, /*layers=*/2);
  std::vector<std::string> d = run_scope::end(true);
  CHECK(d.size() == 1 && d[0].find("fewer attention layers than the cache") != std::string::npos &&
        d[0].find("num_layers=2") != std::string::npos);
  CHECK((c->seq_lens() == std::vector<int64_t>{2}));
  // Repeated layer within a bounded run.
  run_scope::begin(false);
  kvt::layer_step(*c, 0, 1);
  EXPECT_THROW(kvt::layer_step(*c, 0, 1), std::invalid_argument, "layer 0 appended twice");
  kvt::layer_step(*c, 1, 1);
  EXPECT_THROW(kvt::layer_step(*c, 1, 1), std::invalid_argument, "layer 1 appended twice");
  EXPECT_THROW(kvt::layer_step(*c, 0, 1), std::invalid_argument, "layer 0 appended twice");
  run_scope::end(false);
  CHECK((c->seq_lens() == std::vector<int64_t>{2}));
  // The commit node: the last layer does not commit; complete_step() does, once all layers ran.
  run_scope::begin(false);
  step(*c, 1, {}, {}, /*commit_node=*/true);
  CHECK((c->seq_lens() == std::vector<int64_t>{2}));
  {
    auto lk = c->lock();
    CHECK((c->complete_step() == std::vector<int64_t>{3}));
  }
  run_scope::end(false);
  CHECK((c->seq_lens() == std::vector<int64_t>{3}));
  run_scope::begin(false);
  step(*c, 1, {}, {}, true, /*layers=*/1);
  {
    auto lk = c->lock();
    EXPECT_THROW(c->complete_step(), std::invalid_argument, "fewer attention layers than the cache");
  }
  run_scope::end(false);
  CHECK((c->seq_lens() == std::vector<int64_t>{3}));
  {
    auto lk = c->lock();
    EXPECT_THROW(c->complete_step(), std::invalid_argument, "no layer appended");
  }
  // The commit node in a run that failed before it (never reached): rolled back at the run's end.
  run_scope::begin(false);
  step(*c, 5, {}, {}, true);
  run_scope::end(false);
  CHECK((c->seq_lens() == std::vector<int64_t>{3}));
  check_content(*c, streams_of({3}));
  // Unbounded (no run scope) with a commit node that never ran: the next run on this thread
  // discards it at its layer 0.
  step(*c, 5, {}, {}, true);
  CHECK((c->seq_lens() == std::vector<int64_t>{3}));
  step(*c, 1);
  CHECK((c->seq_lens() == std::vector<int64_t>{4}));
  check_content(*c, streams_of({4}));
}

// A mutating method during an unbounded run: the run's next layer names the method.
void test_method_during_run_message() {
  auto c = make(geom());
  step(*c, 2);
  kvt::layer_step(*c, 0, 1);
  std::thread t([&] { c->truncate({1, 1}); });
  t.join();
  auto lk = c->lock();
  EXPECT_THROW(c->begin_layer_append(1, 1, {1, 1}, false), BusyError, "KVCache.truncate took the cache over");
}

void test_reorder_empty_sequences() {
  auto c = make(geom(1, 2, 1, 4, 16));
  c->reorder({1, 0});
  check_content(*c, streams_of({0, 0}));
  auto f = c->fork({1, 1, 1});
  check_content(*f, streams_of({0, 0, 0}));
}

}  // namespace

int main() {
  test_geometry_validation();
  test_steps_commit_after_last_layer();
  test_ragged_and_limits();
  test_truncate_reorder_fork_import();
  test_registry();
  test_thread_ownership();
  test_runs();
  test_method_during_run_message();
  test_reorder_empty_sequences();
  TEST_MAIN_END();
}
