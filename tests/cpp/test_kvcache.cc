// KVCache arena: steps commit only after the last layer, failures leave the
// cache intact, truncate/reorder/fork/import/export, memory accounting, the
// handle registry, and step ownership across threads.
#include <atomic>
#include <stdexcept>
#include <thread>
#include <vector>

#include "check.h"
#include "kvcache/kv_cache.h"

using namespace olep;

namespace {

CacheGeometry geom(int64_t layers = 2, int64_t batch = 2, int64_t heads = 2, int64_t d = 4, int64_t cap = 16) {
  CacheGeometry g;
  g.num_layers = layers;
  g.batch_size = batch;
  g.kv_num_heads = heads;
  g.head_dim = d;
  g.v_head_dim = d;
  g.max_sequence_length = cap;
  g.dtype = DType::kFloat32;
  return g;
}

// value of row s of new rows for (b, h, d): distinct per position via `base`
float tag(int64_t layer, int64_t b, int64_t h, int64_t pos, int64_t d, bool value) {
  return static_cast<float>(layer * 100000 + b * 10000 + h * 1000 + pos * 10 + d) * (value ? -1.0f : 1.0f);
}

// Appends S rows (positions starting at each sequence's length) to every layer; BNSH inputs.
void step(KVCache& c, int64_t S, std::vector<int64_t> num_new = {}) {
  const auto& g = c.geometry();
  if (num_new.empty()) num_new.assign(static_cast<size_t>(g.batch_size), S);
  const std::vector<int64_t> lens = c.seq_lens();
  std::vector<float> k(static_cast<size_t>(g.batch_size * g.kv_num_heads * S * g.head_dim));
  std::vector<float> v(k.size());
  for (int64_t l = 0; l < g.num_layers; ++l) {
    for (int64_t b = 0; b < g.batch_size; ++b)
      for (int64_t h = 0; h < g.kv_num_heads; ++h)
        for (int64_t s = 0; s < S; ++s)
          for (int64_t d = 0; d < g.head_dim; ++d) {
            const size_t i = static_cast<size_t>(((b * g.kv_num_heads + h) * S + s) * g.head_dim + d);
            k[i] = tag(l, b, h, lens[static_cast<size_t>(b)] + s, d, false);
            v[i] = tag(l, b, h, lens[static_cast<size_t>(b)] + s, d, true);
          }
    auto lk = c.lock();
    c.begin_layer_append(l, S, num_new);
    NewRows r;
    r.key = k.data();
    r.value = v.data();
    r.key_strides[0] = r.value_strides[0] = g.kv_num_heads * S * g.head_dim;
    r.key_strides[1] = r.value_strides[1] = S * g.head_dim;
    r.key_strides[2] = r.value_strides[2] = g.head_dim;
    r.sequence_length = S;
    r.num_new = num_new.data();
    c.append_rows(l, r);
    c.finish_layer_append(l);
  }
}

// Checks layer contents against the tag pattern for the given lengths.
void check_content(KVCache& c, const std::vector<int64_t>& lens, const std::vector<int64_t>& source_seq = {}) {
  const auto& g = c.geometry();
  for (int64_t l = 0; l < g.num_layers; ++l) {
    std::vector<float> k, v;
    int64_t L = 0;
    c.export_layer(l, false, [&](int64_t len) {
      L = len;
      k.assign(static_cast<size_t>(g.batch_size * g.kv_num_heads * len * g.head_dim), 0.0f);
      v.assign(k.size(), 0.0f);
      return std::make_pair<void*, void*>(k.data(), v.data());
    });
    for (int64_t b = 0; b < g.batch_size; ++b) {
      const int64_t src = source_seq.empty() ? b : source_seq[static_cast<size_t>(b)];
      for (int64_t h = 0; h < g.kv_num_heads; ++h)
        for (int64_t p = 0; p < L; ++p)
          for (int64_t d = 0; d < g.head_dim; ++d) {
            const size_t i = static_cast<size_t>(((b * g.kv_num_heads + h) * L + p) * g.head_dim + d);
            const bool valid = p < lens[static_cast<size_t>(b)];
            CHECK(k[i] == (valid ? tag(l, src, h, p, d, false) : 0.0f));
            CHECK(v[i] == (valid ? tag(l, src, h, p, d, true) : 0.0f));
          }
    }
  }
}

void test_geometry_validation() {
  CacheGeometry g = geom();
  g.head_dim = 0;
  EXPECT_THROW(KVCache c(g), std::invalid_argument, "head_dim must be >= 1, got 0");
  g = geom();
  g.max_sequence_length = -3;
  EXPECT_THROW(KVCache c(g), std::invalid_argument, "max_sequence_length");
  g = geom();
  g.memory_limit_bytes = -1;
  EXPECT_THROW(KVCache c(g), std::invalid_argument, "memory_limit_bytes");
  g = geom(4096, 65536, 4096, 4096, 1 << 20);
  EXPECT_THROW(KVCache c(g), std::invalid_argument, "address-space");
}

void test_steps_commit_after_last_layer() {
  KVCache c(geom());
  CHECK(c.stats().committed_bytes == 0);
  step(c, 3);
  CHECK((c.seq_lens() == std::vector<int64_t>{3, 3}));
  step(c, 1);
  step(c, 1);
  CHECK((c.seq_lens() == std::vector<int64_t>{5, 5}));
  const CacheStats s = c.stats();
  const int64_t row = 2 /*heads*/ * (4 + 4) * 4 /*bytes*/;
  CHECK(s.bytes_appended == 2 /*layers*/ * 2 /*batch*/ * 5 * row);
  CHECK(s.bytes_copied == 0);
  CHECK(s.live_bytes == 2 * 2 * 5 * row);
  CHECK(s.committed_bytes >= s.live_bytes);
  CHECK(s.num_appends == 3);
  check_content(c, {5, 5});
  CHECK(c.stats().bytes_copied == s.live_bytes);  // export counts as a copy

  // Layer 0 appended, layer 1 never ran (a failed run): nothing visible, content intact.
  {
    auto lk = c.lock();
    std::vector<int64_t> n = {2, 2};
    c.begin_layer_append(0, 2, n);
    std::vector<float> junk(2 * 2 * 2 * 4, 7.0f);
    NewRows r;
    r.key = r.value = junk.data();
    r.key_strides[0] = r.value_strides[0] = 16;
    r.key_strides[1] = r.value_strides[1] = 8;
    r.key_strides[2] = r.value_strides[2] = 4;
    r.sequence_length = 2;
    c.append_rows(0, r);
    c.finish_layer_append(0);
  }
  CHECK((c.seq_lens() == std::vector<int64_t>{5, 5}));
  // Layer 1 out of order on the same thread is rejected (layer 0 must restart the step)...
  {
    auto lk = c.lock();
    EXPECT_THROW(c.begin_layer_append(1, 3, {3, 3}), std::invalid_argument, "different number of tokens");
  }
  // ...and the next full step overwrites the discarded rows.
  step(c, 1);
  CHECK((c.seq_lens() == std::vector<int64_t>{6, 6}));
  check_content(c, {6, 6});
}

void test_ragged_and_limits() {
  KVCache c(geom(2, 2, 2, 4, 8));
  step(c, 4, {4, 2});  // right padding: sequence 1 keeps 2 of 4 rows
  CHECK((c.seq_lens() == std::vector<int64_t>{4, 2}));
  step(c, 1);
  CHECK((c.seq_lens() == std::vector<int64_t>{5, 3}));
  check_content(c, {5, 3});
  {
    auto lk = c.lock();
    EXPECT_THROW(c.begin_layer_append(0, 4, {4, 4}), std::runtime_error, "max_sequence_length is 8");
    EXPECT_THROW(c.begin_layer_append(0, 2, {3, 1}), std::invalid_argument, "must be in [0, 2]");
    EXPECT_THROW(c.begin_layer_append(2, 1, {1, 1}), std::invalid_argument, "attribute 'layer'");
    EXPECT_THROW(c.begin_layer_append(1, 1, {1, 1}), std::runtime_error, "expected layer 0, got layer 1");
  }
  CHECK((c.seq_lens() == std::vector<int64_t>{5, 3}));
  check_content(c, {5, 3});

  CacheGeometry g = geom(2, 1, 1, 256, 64);  // one row = 2 KiB (K+V): 2 rows per page each
  g.memory_limit_bytes = 2 * 2 * 4096;       // 2 layers * (K page + V page)
  KVCache m(g);
  step(m, 4);  // 4 rows of 1 KiB each side = 1 page each
  CHECK(m.stats().committed_bytes == 2 * 2 * 4096);
  {
    auto lk = m.lock();
    EXPECT_THROW(m.begin_layer_append(0, 1, {1}), std::runtime_error, "memory limit");
  }
  CHECK((m.seq_lens() == std::vector<int64_t>{4}));
  m.truncate({2});
  CHECK(m.stats().committed_bytes == 2 * 2 * 4096);  // rows 0..1 still use the first page
  m.truncate({0});
  CHECK(m.stats().committed_bytes == 0);
  step(m, 4);
  CHECK((m.seq_lens() == std::vector<int64_t>{4}));
}

void test_truncate_reorder_fork_import() {
  KVCache c(geom(2, 3, 2, 4, 16));
  step(c, 4);
  EXPECT_THROW(c.truncate({1, 2}), std::invalid_argument, "batch_size=3");
  EXPECT_THROW(c.truncate({1, 5, 0}), std::invalid_argument, "lengths[1] must be in [0, 4], got 5");
  EXPECT_THROW(c.truncate({-1, 0, 0}), std::invalid_argument, "lengths[0]");
  CHECK((c.seq_lens() == std::vector<int64_t>{4, 4, 4}));
  c.truncate({4, 2, 3});
  check_content(c, {4, 2, 3});
  step(c, 1);  // appends at each sequence's own length
  check_content(c, {5, 3, 4});

  EXPECT_THROW(c.reorder({0, 1}), std::invalid_argument, "batch_size=3");
  EXPECT_THROW(c.reorder({0, 3, 1}), std::invalid_argument, "indices[1] must be in [0, 3), got 3");
  const int64_t copied = c.stats().bytes_copied;
  c.reorder({2, 0, 0});
  CHECK((c.seq_lens() == std::vector<int64_t>{4, 5, 5}));
  check_content(c, {4, 5, 5}, {2, 0, 0});
  CHECK(c.stats().bytes_copied > copied);

  std::unique_ptr<KVCache> f = c.fork();
  CHECK(f->seq_lens() == c.seq_lens());
  check_content(*f, {4, 5, 5}, {2, 0, 0});
  f->truncate({0, 0, 0});
  check_content(c, {4, 5, 5}, {2, 0, 0});  // original untouched

  // import_past replaces content: BNSH arrays per layer.
  const auto& g = c.geometry();
  const int64_t L = 3;
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
            ks.back()[i] = tag(l, b, h, p, d, false);
            vs.back()[i] = tag(l, b, h, p, d, true);
          }
    kp.push_back(ks.back().data());
    vp.push_back(vs.back().data());
  }
  EXPECT_THROW(c.import_past({kp[0]}, {vp[0]}, L), std::invalid_argument, "num_layers=2");
  EXPECT_THROW(c.import_past(kp, vp, 17), std::invalid_argument, "max_sequence_length=16");
  c.import_past(kp, vp, L);
  check_content(c, {3, 3, 3});
  c.reset();
  CHECK((c.seq_lens() == std::vector<int64_t>{0, 0, 0}));
  CHECK(c.stats().committed_bytes == 0);
  check_content(c, {0, 0, 0});
}

// Blocks of >= 2 MiB: fully written 2 MiB regions become huge pages (MADV_COLLAPSE) as rows
// arrive; content, truncation into a collapsed region, re-append, reorder and fork stay exact.
void test_huge_page_blocks() {
  KVCache c(geom(1, 2, 1, 512, 2048));  // 2048 rows x 2 KiB = 4 MiB blocks, 1024 rows per 2 MiB
  step(c, 1000);
  step(c, 100);  // crosses the first 2 MiB boundary of every block
  check_content(c, {1100, 1100});
  const int64_t page_rows = 2;  // 4 KiB pages hold 2 rows of 2 KiB
  c.truncate({501, 1100});
  check_content(c, {501, 1100});
  CHECK(c.stats().committed_bytes == 2 * 4096 * ((501 + page_rows - 1) / page_rows + 1100 / page_rows));  // K+V
  step(c, 600, {600, 600});  // sequence 0 crosses the boundary again, sequence 1 to 1700
  check_content(c, {1101, 1700});
  c.reorder({1, 1});
  check_content(c, {1700, 1700}, {1, 1});
  std::unique_ptr<KVCache> f = c.fork();
  check_content(*f, {1700, 1700}, {1, 1});
  CHECK(c.stats().committed_bytes == 2 * 2 * 4096 * (1700 / page_rows));
}

void test_registry() {
  Registry& r = Registry::instance();
  const int64_t before = r.num_live();
  const int64_t h = r.add(std::make_unique<KVCache>(geom()));
  CHECK(r.is_live(h));
  CHECK(r.num_live() == before + 1);
  auto c = r.get(h, "test");
  r.release(h, "test");
  CHECK(!r.is_live(h));
  EXPECT_THROW(r.get(h, "CacheAttention: input 'cache'"), std::invalid_argument, "is unknown or released");
  EXPECT_THROW(r.release(h, "KVCache.close"), std::invalid_argument, "is unknown or released");
  const int64_t h2 = r.add(std::make_unique<KVCache>(geom()));
  CHECK(h2 != h);  // never reused
  step(*c, 2);     // a released cache held by a running op stays valid until it finishes
  r.release(h2, "test");
}

void test_thread_ownership() {
  KVCache c(geom());
  {
    auto lk = c.lock();
    c.begin_layer_append(0, 1, {1, 1});
    c.finish_layer_append(0);  // rows not written: fine for this check
  }
  std::atomic<bool> rejected{false};
  std::thread t([&] {
    auto lk = c.lock();
    try {
      c.begin_layer_append(1, 1, {1, 1});
    } catch (const std::runtime_error& e) {
      rejected = std::string(e.what()).find("another run") != std::string::npos;
    }
  });
  t.join();
  CHECK(rejected.load());
  CHECK((c.seq_lens() == std::vector<int64_t>{0, 0}));
  // Many threads running full steps on their own caches concurrently.
  std::vector<std::unique_ptr<KVCache>> caches;
  for (int i = 0; i < 4; ++i) caches.push_back(std::make_unique<KVCache>(geom(2, 2, 2, 4, 64)));
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
    check_content(*cc, {n, n});
  }
}


// A model with fewer attention layers than the cache never completes a step: after two
// runs that stop at the same layer, layer 0 says so instead of silently never committing.
// A run that failed in the op (mark_step_failed) is not counted.
void test_short_model_is_reported() {
  KVCache c(geom(3, 1, 1, 4, 16));
  auto layer0_and_1 = [&](bool fail_after) {
    for (int64_t l = 0; l < 2; ++l) {
      auto lk = c.lock();
      c.begin_layer_append(l, 1, {1});
      c.finish_layer_append(l);
    }
    if (fail_after) c.mark_step_failed();
  };
  layer0_and_1(true);   // failed runs are not evidence of a short model
  layer0_and_1(true);
  layer0_and_1(false);  // first abandonment at 2 layers
  layer0_and_1(false);  // layer 0 of this run found run 3's unfinished step: count 1 -> ok
  {
    auto lk = c.lock();
    EXPECT_THROW(c.begin_layer_append(0, 1, {1}), std::runtime_error, "fewer attention layers than the cache");
  }
  CHECK((c.seq_lens() == std::vector<int64_t>{0}));
  step(c, 1);  // reported once; a complete step then proceeds
  CHECK((c.seq_lens() == std::vector<int64_t>{1}));
}

// A mutating method during a run: the run's next layer names the real cause.
void test_method_during_run_message() {
  KVCache c(geom());
  step(c, 2);
  {
    auto lk = c.lock();
    c.begin_layer_append(0, 1, {1, 1});
    c.finish_layer_append(0);
  }
  std::thread t([&] { c.truncate({1, 1}); });
  t.join();
  auto lk = c.lock();
  EXPECT_THROW(c.begin_layer_append(1, 1, {1, 1}), std::runtime_error, "KVCache method");
}

// Adversarial review: reorder of sequences that are all empty snapshots 0 bytes into an empty
// std::vector, then memcpy(scratch.data() == nullptr, src, 0): undefined behaviour that the
// ASan+UBSan build (-fno-sanitize-recover=undefined) turns into an abort (kv_cache.cc, reorder).
void test_reorder_empty_sequences() {
  KVCache c(geom(1, 2, 1, 4, 16));
  c.reorder({1, 0});
  check_content(c, {0, 0});
}

}  // namespace

int main() {
  test_geometry_validation();
  test_steps_commit_after_last_layer();
  test_ragged_and_limits();
  test_truncate_reorder_fork_import();
  test_huge_page_blocks();
  test_registry();
  test_thread_ownership();
  test_short_model_is_reported();
  test_method_during_run_message();
  test_reorder_empty_sequences();  // last: under UBSan a failure aborts the process
  TEST_MAIN_END();
}
