// Paged storage: copy-on-write after fork and reorder, the pool invariant (refs == holders),
// truncate arithmetic at the edges, checkpoints, sliding-window eviction with rollback, save /
// load, and concurrent forks, reorders, runs and closes in one pool. Built with ASan + UBSan in
// CI; in that (Debug) build every page write also asserts that the page has one holder.
#include <atomic>
#include <cstdio>
#include <fstream>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "kv_test_util.h"
#include "kvcache/errors.h"

using namespace olep;
using kvt::check_content;
using kvt::check_pool;
using kvt::geom;
using kvt::step;
using kvt::Streams;
using kvt::streams_of;

namespace {

std::shared_ptr<KVCache> make(const CacheGeometry& g, std::shared_ptr<PagePool> pool) {
  return std::make_shared<KVCache>(g, std::move(pool));
}

// CASES C16 (fork variant): P=16, N=8 pages; A prefills 40 (pages a0, a1, a2 with 8 of 16 rows);
// B = fork(A); interleaved appends with different rows. The first write into a2 copies it (one
// extra page in all), a0 and a1 stay shared with refcount 2, rows 32..39 are bit-identical copies.
void test_cow_fork_partly_filled_tail() {
  // The case's P=16 is below the kernels' 32-row tile: P=32 with the same shape (80 positions: two
  // full pages and a tail with 16 of 32 rows), N = 8 pages.
  CacheGeometry g = geom(1, 1, 1, 8, 128, 32);
  auto pool = std::make_shared<PagePool>(8 * g.page_bytes());
  auto a = make(g, pool);
  step(*a, 80 - 32, {}, {0});
  step(*a, 32 - 16, {}, {0});  // length 64
  step(*a, 16, {}, {0});       // length 80: a0, a1 full, a2 half
  CHECK(a->stats().num_pages == 3);
  std::shared_ptr<KVCache> b(a->fork({0}));
  check_pool(*pool, {a.get(), b.get()});
  const std::vector<uint32_t> shared = a->page_ids(0, 0, 0);
  CHECK(b->page_ids(0, 0, 0) == shared);
  const PoolStats before = pool->stats();
  CHECK(before.num_pages == 3 && before.shared_bytes == 3 * g.page_bytes());
  step(*a, 1, {}, {0});  // A.append(80): a2 is shared, A writes into its own copy
  step(*b, 1, {}, {1});  // B.append(80): B now holds a2 alone and writes in place
  step(*a, 1, {}, {0});
  step(*b, 1, {}, {1});
  step(*b, 1, {}, {1});
  check_pool(*pool, {a.get(), b.get()});
  const std::vector<uint32_t> ia = a->page_ids(0, 0, 0), ib = b->page_ids(0, 0, 0);
  CHECK(ia[0] == shared[0] && ia[1] == shared[1] && ib[0] == shared[0] && ib[1] == shared[1]);
  CHECK(ia[2] != shared[2] && ib[2] == shared[2]);
  CHECK(pool->stats().num_pages == 4);  // a0, a1 shared + A's copy + a2 (B's): one extra page
  CHECK(pool->stats().num_free_pages >= 0);
  Streams wa = {std::vector<int64_t>(82, 0)}, wb = {std::vector<int64_t>(83, 0)};
  for (int p = 80; p < 83; ++p) wb[0][static_cast<size_t>(p)] = 1;
  check_content(*a, wa);
  check_content(*b, wb);
  const int64_t row = 2 * 8 * 4;
  CHECK(a->stats().bytes_copied >= 16 * row);  // A copied a2's 16 valid rows (export adds more)
  // Refcounts: a0, a1 have 2 holders; tails 1.
  std::vector<std::pair<uint32_t, uint32_t>> refs = pool->page_refs();
  for (const auto& pr : refs) {
    if (pr.first == shared[0] || pr.first == shared[1]) CHECK(pr.second == 2);
    if (pr.first == ia[2] || pr.first == ib[2]) CHECK(pr.second == 1);
  }
  b.reset();
  check_pool(*pool, {a.get()});
  CHECK(pool->stats().num_pages == 3 && pool->stats().shared_bytes == 0);
}

// CASES C14: beams=3, reorders [2,0,0], [1,1,2], [0,0,0] after position-tagged appends: each beam's
// history is the composition of the reorders; appends after a reorder stay with the new row.
void test_reorder_histories() {
  auto pool = std::make_shared<PagePool>();
  auto c = make(geom(2, 3, 1, 4, 256), pool);
  Streams want(3);
  auto append = [&](int64_t S, int tagbase) {
    std::vector<int64_t> streams = {tagbase, tagbase + 1, tagbase + 2};
    step(*c, S, {}, streams);
    for (int b = 0; b < 3; ++b)
      for (int64_t s = 0; s < S; ++s) want[static_cast<size_t>(b)].push_back(tagbase + b);
  };
  auto reorder = [&](std::vector<int64_t> idx) {
    c->reorder(idx);
    Streams w2;
    for (int64_t i : idx) w2.push_back(want[static_cast<size_t>(i)]);
    want = w2;
  };
  append(40, 0);  // prefill (distinct per beam here, to see every move)
  check_content(*c, want);
  append(1, 3);
  reorder({2, 0, 0});
  check_content(*c, want);
  append(1, 6);
  reorder({1, 1, 2});
  check_content(*c, want);
  append(1, 9);
  reorder({0, 0, 0});
  append(30, 12);  // crosses a page boundary on every beam after sharing
  check_content(*c, want);
  check_pool(*pool, {c.get()});
}

// CASES C21: truncate/rollback arithmetic at the edges, with and without a fork sharing pages.
void test_truncate_edges() {
  for (bool forked : {false, true}) {
    auto pool = std::make_shared<PagePool>();
    auto c = make(geom(1, 1, 1, 4, 400), pool);
    step(*c, 9 * 32);  // 9 pages... use 3 pages of 32 below, like the case's 3 pages of 4
    c->truncate({3 * 32});
    std::shared_ptr<KVCache> f;
    if (forked) f.reset(c->fork({0}).release());
    const PoolStats full = pool->stats();
    CHECK(full.num_pages == 3);
    EXPECT_THROW(c->truncate({3 * 32 + 1}), std::invalid_argument, "must be in [0, 96]");
    c->truncate({3 * 32});  // no-op
    CHECK(pool->stats().num_pages == 3);
    c->truncate({4 * 8 + 0});  // 32: page 0 kept, pages 1-2 released (unless the fork holds them)
    CHECK(c->stats().num_pages == 1);
    CHECK(pool->stats().num_pages == (forked ? 3 : 1));
    check_content(*c, streams_of({32}));
    step(*c, 1, {}, {5});  // the next append goes to position 32 (a new page)
    Streams w = streams_of({33});
    w[0][32] = 5;
    check_content(*c, w);
    c->truncate({33 - 0});
    c->truncate({1 + 32 + 0 - 1});  // back to 32
    c->truncate({0});
    CHECK(c->stats().num_pages == 0 && c->stats().committed_bytes == 0);
    step(*c, 1);
    check_content(*c, streams_of({1}));
    if (forked) check_content(*f, streams_of({96}));
    // truncate into a shared page keeps it shared; the next write copies it, the other holder is unchanged.
    if (forked) {
      c->reset();
      std::shared_ptr<KVCache> g2(f->fork({0}));
      g2->truncate({33});  // page 1 kept with 1 valid row, shared with f
      step(*g2, 2, {}, {7});
      check_content(*f, streams_of({96}));
      Streams w2 = streams_of({35});
      w2[0][33] = w2[0][34] = 7;
      check_content(*g2, w2);
      check_pool(*pool, {c.get(), f.get(), g2.get()});
    }
  }
}

void test_checkpoint_restore() {
  auto pool = std::make_shared<PagePool>();
  auto c = make(geom(2, 2, 2, 4, 256), pool);
  step(*c, 40);
  std::shared_ptr<Checkpoint> cp = c->checkpoint();
  CHECK(c->stats().bytes_copied == 0);
  CHECK(c->stats().shared_bytes == c->stats().committed_bytes);
  check_pool(*pool, {c.get()}, {cp.get()});
  step(*c, 30, {}, {5, 6});  // writes into the shared tail pages: copies them
  c->truncate({10, 70});
  CHECK(c->stats().checkpoint_bytes > 0);
  c->restore(*cp);
  CHECK((c->seq_lens() == std::vector<int64_t>{40, 40}));
  check_content(*c, streams_of({40, 40}));
  check_pool(*pool, {c.get()}, {cp.get()});
  // Same geometry required; another pool refused.
  auto other = make(geom(2, 3, 2, 4, 256), pool);
  EXPECT_THROW(other->restore(*cp), std::invalid_argument, "batch_size is 2 but the cache's is 3");
  auto foreign = make(geom(2, 2, 2, 4, 256), std::make_shared<PagePool>());
  EXPECT_THROW(foreign->restore(*cp), std::invalid_argument, "another pool");
  // Restore into another cache of the same geometry and pool.
  auto twin = make(geom(2, 2, 2, 4, 256), pool);
  twin->restore(*cp);
  check_content(*twin, streams_of({40, 40}));
  // Quota: a restore whose pages exceed the quota is refused before any change.
  CacheGeometry gq = geom(2, 2, 2, 4, 256);
  gq.memory_limit_bytes = gq.page_bytes();
  auto small = make(gq, pool);
  EXPECT_THROW(small->restore(*cp), MemoryLimitError, "cache memory_limit_bytes");
  CHECK(small->stats().num_pages == 0);
  cp.reset();  // the checkpoint's pins go away
  check_pool(*pool, {c.get(), other.get(), twin.get(), small.get()});
}

// Sliding-window eviction: W + R + pages bound, absolute positions, truncate back by at most R.
void test_eviction() {
  auto pool = std::make_shared<PagePool>();
  CacheGeometry g = geom(2, 1, 1, 4, 4096, 32);
  g.sliding_window = {0, 64};  // layer 1 evicts
  g.rollback_tokens = 16;
  auto c = make(g, pool);
  int64_t len = 0;
  for (int i = 0; i < 60; ++i) {
    step(*c, 7);
    len += 7;
    const std::vector<int64_t> first = c->first_positions();
    CHECK(first[0] == 0);
    CHECK(first[1] == std::max<int64_t>(0, len - 64 - 16) / 32 * 32);
    CHECK(static_cast<int64_t>(c->page_ids(1, 0, 0).size()) <= (64 + 16) / 32 + 2);
  }
  check_pool(*pool, {c.get()});
  // Contents: layer 0 whole, layer 1 from its first position (export zeros before it).
  check_content(*c, streams_of({len}));
  // Truncate: back by R works; further is refused naming the earliest length.
  const int64_t first1 = c->first_positions()[1];
  const int64_t earliest = first1 + 64 - 1;
  CHECK(len - 16 >= earliest);
  c->truncate({len - 16});
  EXPECT_THROW(c->truncate({earliest - 1}), std::invalid_argument,
               ("in [" + std::to_string(earliest) + ", ").c_str());
  c->truncate({earliest});
  check_content(*c, streams_of({earliest}));
  c->truncate({0});  // always possible: the sequence restarts
  CHECK(c->first_positions()[1] == 0 && c->stats().num_pages == 0);
  step(*c, 5);
  check_content(*c, streams_of({5}));
}

void test_save_load() {
  auto pool = std::make_shared<PagePool>();
  CacheGeometry g = geom(2, 2, 2, 4, 4096, 32);
  g.sliding_window = {0, 40};
  g.rollback_tokens = 4;
  auto c = make(g, pool);
  step(*c, 100, {100, 77});
  step(*c, 3);
  const std::string path = "kvcache_test_save.bin";
  c->save(path);
  std::shared_ptr<KVCache> d(KVCache::load(path, pool));
  CHECK(d->seq_lens() == c->seq_lens());
  CHECK(d->first_positions() == c->first_positions());
  CHECK(d->geometry().sliding_window == g.sliding_window && d->geometry().rollback_tokens == 4);
  check_content(*d, streams_of({103, 80}));
  step(*d, 2);
  step(*c, 2);
  check_content(*d, streams_of({105, 82}));
  check_pool(*pool, {c.get(), d.get()});
  // Save again: byte-identical to saving the original now.
  const std::string p2 = "kvcache_test_save2.bin", p3 = "kvcache_test_save3.bin";
  c->save(p2);
  d->save(p3);
  auto slurp = [](const std::string& p) {
    std::ifstream f(p, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  };
  CHECK(slurp(p2) == slurp(p3));
  // Corruptions: wrong magic, version, size (truncated), checksum. Nothing is created.
  const std::string good = slurp(path);
  const PoolStats before = pool->stats();
  auto write = [](const std::string& p, const std::string& bytes) {
    std::ofstream f(p, std::ios::binary | std::ios::trunc);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  };
  std::string bad = good;
  bad[0] = 'X';
  write(p2, bad);
  EXPECT_THROW(KVCache::load(p2, pool), std::invalid_argument, "wrong magic");
  bad = good;
  bad[8] = 9;
  write(p2, bad);
  EXPECT_THROW(KVCache::load(p2, pool), std::invalid_argument, "format version 9");
  write(p2, good.substr(0, good.size() - 100));
  EXPECT_THROW(KVCache::load(p2, pool), std::invalid_argument, "truncated");
  bad = good;
  bad[good.size() / 2] ^= 0x40;
  write(p2, bad);
  EXPECT_THROW(KVCache::load(p2, pool), std::invalid_argument, "checksum mismatch");
  bad = good;
  bad[16] = 0;  // num_layers = 0 (low byte of 2)
  write(p2, bad);
  EXPECT_THROW(KVCache::load(p2, pool), std::invalid_argument, "bad geometry");
  EXPECT_THROW(KVCache::load("no/such/file", pool), std::invalid_argument, "cannot open");
  const PoolStats after = pool->stats();
  CHECK(after.live_bytes == before.live_bytes && after.num_caches == before.num_caches);
  std::remove(path.c_str());
  std::remove(p2.c_str());
  std::remove(p3.c_str());
}

// Threads forking, reordering, running and closing caches of one pool; the pool invariant holds
// at the end and every page is back once all caches are gone.
void test_concurrent_pool() {
  auto pool = std::make_shared<PagePool>(0);
  std::vector<std::thread> ts;
  std::atomic<int> errors{0};
  for (int t = 0; t < 4; ++t)
    ts.emplace_back([&, t] {
      std::mt19937 rng(static_cast<unsigned>(t));
      auto base = make(geom(2, 2, 2, 4, 1024), pool);
      std::vector<std::shared_ptr<KVCache>> mine = {base};
      try {
        for (int i = 0; i < 150; ++i) {
          auto& c = mine[rng() % mine.size()];
          const int op = static_cast<int>(rng() % 6);
          const auto lens = c->seq_lens();
          if (op <= 1 && lens[0] < 900 && lens[1] < 900) {
            step(*c, 1 + rng() % 40);
          } else if (op == 2 && mine.size() < 5) {
            mine.emplace_back(c->fork({static_cast<int64_t>(rng() % 2), static_cast<int64_t>(rng() % 2)}));
          } else if (op == 3) {
            c->reorder({static_cast<int64_t>(rng() % 2), static_cast<int64_t>(rng() % 2)});
          } else if (op == 4) {
            c->truncate({static_cast<int64_t>(rng() % (lens[0] + 1)), static_cast<int64_t>(rng() % (lens[1] + 1))});
          } else if (op == 5 && mine.size() > 1) {
            mine.erase(mine.begin() + static_cast<std::ptrdiff_t>(rng() % mine.size()));
          }
        }
      } catch (const std::exception& e) {
        std::fprintf(stderr, "thread %d: %s\n", t, e.what());
        ++errors;
      }
    });
  for (auto& th : ts) th.join();
  CHECK(errors.load() == 0);
  CHECK(pool->stats().num_pages == 0 && pool->stats().committed_bytes == 0);
}

// Review finding: a checkpoint or fork taken by another thread between two layers of a run must
// not share the tail pages the run writes in place (the run decided at layer 0 that it alone
// holds them): the snapshot gets private copies of their committed rows. In the Debug/ASan build
// a missed case fails the write-path check ("copy-on-write missed").
void test_snapshot_between_layers() {
  auto pool = std::make_shared<PagePool>();
  auto c = std::make_shared<KVCache>(geom(2, 2, 1, 4, 128, 32), pool);
  step(*c, 5);
  std::shared_ptr<Checkpoint> cp;
  std::unique_ptr<KVCache> f;
  run_scope::begin(false);  // a bounded run, as the EP's OnRunStart begins one
  kvt::layer_step(*c, 0, 1, {}, {7, 8});
  std::thread([&] {
    cp = c->checkpoint();
    f = c->fork({1, 1});
  }).join();
  kvt::layer_step(*c, 1, 1, {}, {7, 8});  // writes in place: the snapshots hold copies
  run_scope::end(false);
  Streams want = streams_of({6, 6});
  want[0][5] = 7;
  want[1][5] = 8;
  check_content(*c, want);
  check_content(*f, Streams{std::vector<int64_t>(5, 1), std::vector<int64_t>(5, 1)});
  CHECK((f->seq_lens() == std::vector<int64_t>{5, 5}));
  std::shared_ptr<KVCache> f2(std::move(f));
  check_pool(*pool, {c.get(), f2.get()}, {cp.get()});
  c->restore(*cp);
  check_content(*c, streams_of({5, 5}));
}

// Review finding: a crafted file whose header sizes would overflow load()'s size arithmetic is a
// clear error, never undefined behaviour (UBSan) or a huge allocation.
void test_load_crafted_header() {
  const int64_t L = 128, B = 64;
  std::vector<int64_t> f = {L, B, 4096, 4096, 4096, int64_t{1} << 24, 0, 65536, 0, 0, 0, 0};
  for (int64_t l = 0; l < L; ++l) f.push_back(0);
  for (int64_t b = 0; b < B; ++b) f.push_back(int64_t{1} << 24);
  for (int64_t i = 0; i < 2 * L * B; ++i) f.push_back(0);  // first positions, quantization marks
  const char magic[8] = {'O', 'L', 'K', 'V', 'C', 'A', 'C', 'H'};
  const uint32_t version = 3, header = static_cast<uint32_t>(16 + 8 * f.size());
  const std::string path = "kvcache_test_crafted.bin";
  std::FILE* fp = std::fopen(path.c_str(), "wb");
  std::fwrite(magic, 1, 8, fp);
  std::fwrite(&version, 4, 1, fp);
  std::fwrite(&header, 4, 1, fp);
  std::fwrite(f.data(), 8, f.size(), fp);
  const uint64_t sum = 0;
  std::fwrite(&sum, 8, 1, fp);
  std::fclose(fp);
  auto pool = std::make_shared<PagePool>();
  EXPECT_THROW(KVCache::load(path, pool), std::invalid_argument, "more blocks than the file");
  CHECK(pool->stats().committed_bytes == 0);
  std::remove(path.c_str());
  std::vector<Page*> none;
  EXPECT_THROW(pool->allocate(int64_t{1} << 31, int64_t{1} << 33, &none), MemoryLimitError, "exceed any memory");
}

// Review finding: sliding_window=1 truncated to its earliest length holds no page; save/load
// round-trips it.
void test_save_load_window1_empty_table() {
  CacheGeometry g = geom(1, 1, 1, 4, 256, 32);
  g.sliding_window = {1};
  auto c = std::make_shared<KVCache>(g, nullptr);
  step(*c, 100);
  c->truncate({96});
  CHECK(c->stats().num_pages == 0);
  const std::string path = "kvcache_test_w1.bin";
  c->save(path);
  std::shared_ptr<KVCache> d(KVCache::load(path, nullptr));
  CHECK(d->seq_lens() == c->seq_lens() && d->first_positions() == c->first_positions());
  step(*d, 3);
  check_content(*d, streams_of({99}));
  std::remove(path.c_str());
}


// A prefill's pages of one (layer, sequence, kv head) are consecutive pages of the pool (ids
// one apart: the same slab, one after another in memory), so the kernel reads a head's context
// as one stream: after a step, after import_past, and the quantized pages of a prefill.
void test_head_runs_consecutive() {
  // `split`: a block index where the run may restart (the first page of another size class)
  auto runs = [](const KVCache& c, int64_t blocks, int64_t split = -1) {
    const auto& g = c.geometry();
    for (int64_t l = 0; l < g.num_layers; ++l)
      for (int64_t b = 0; b < g.batch_size; ++b)
        for (int64_t h = 0; h < g.kv_num_heads; ++h) {
          const std::vector<uint32_t> ids = c.page_ids(l, b, h);
          CHECK(static_cast<int64_t>(ids.size()) == blocks);
          for (size_t i = 1; i < ids.size(); ++i)
            if (static_cast<int64_t>(i) != split) CHECK(ids[i] == ids[i - 1] + 1);
        }
  };
  const int64_t P = 32, blocks = 6;
  {  // one step of 6 pages (the last one partly filled), then a step that opens a 7th block
    CacheGeometry g = geom(2, 2, 3, 4, 8 * P, P);
    auto pool = std::make_shared<PagePool>();
    auto c = make(g, pool);
    step(*c, blocks * P - 5);
    runs(*c, blocks);
    step(*c, 5);  // fills the tail pages: no new page
    runs(*c, blocks);
    check_pool(*pool, {c.get()});
  }
  {  // import_past
    CacheGeometry g = geom(2, 2, 3, 4, 8 * P, P);
    auto pool = std::make_shared<PagePool>();
    auto c = make(g, pool);
    const int64_t L = blocks * P;
    std::vector<float> k(static_cast<size_t>(g.batch_size * g.kv_num_heads * L * g.head_dim), 1.0f), v(k);
    std::vector<const void*> ks(static_cast<size_t>(g.num_layers), k.data()), vs(ks.size(), v.data());
    c->import_past(ks, vs, L);
    runs(*c, blocks);
    check_pool(*pool, {c.get()});
  }
  for (KVQuant mode : {KVQuant::kInt8, KVQuant::kInt4}) {  // every page of the prefill quantized
    CacheGeometry g = geom(2, 2, 3, 32, 8 * P, P);
    g.kv_quant = mode;
    auto pool = std::make_shared<PagePool>();
    auto c = make(g, pool);
    step(*c, blocks * P);
    CHECK(c->stats().quantized_bytes == g.num_layers * g.batch_size * g.kv_num_heads * blocks * g.quant_scale_offset());
    runs(*c, blocks);
    check_pool(*pool, {c.get()});
  }
  {  // load: the file's pages, native and quantized, head by head into a new pool
    CacheGeometry g = geom(2, 2, 3, 32, 8 * P, P);
    g.kv_quant = KVQuant::kInt8;
    g.recent_tokens = 2 * P;
    auto c = make(g, std::make_shared<PagePool>());
    step(*c, blocks * P);
    const std::string path = "kvcache_test_runs.bin";
    c->save(path);
    auto pool = std::make_shared<PagePool>();
    std::shared_ptr<KVCache> d(KVCache::load(path, pool));
    std::remove(path.c_str());
    runs(*d, blocks, blocks - 2);  // 4 int8 pages, then 2 native
    check_pool(*pool, {d.get()});
  }
}
}  // namespace

// A cache without a pool gets a private one that keeps one page per (layer, sequence, kv head)
// of empty slabs (whole slabs, plus one), at most the shared pools' 64 MiB.
void test_private_pool_keep_free() {
  const int64_t slab = int64_t{2} << 20;
  // 2 layers x 2 sequences x 2 heads x 32 tokens x (4 + 4) floats = 8 KiB of pages: 1 slab + 1
  CHECK(make(geom(), nullptr)->pool()->keep_free_bytes() == 2 * slab);
  // 30 layers x 1 x 3 heads x 256 tokens x (64 + 64) floats: 90 pages of 128 KiB = 11.25 MiB -> 12 + 2
  CHECK(make(geom(30, 1, 3, 64, 4096, 256), nullptr)->pool()->keep_free_bytes() == 7 * slab);
  // 32 x 4 x 8 x 256 x 256 floats: 256 MiB of pages: the cap
  CHECK(make(geom(32, 4, 8, 128, 4096, 256), nullptr)->pool()->keep_free_bytes() == kDefaultKeepFreeBytes);
  CHECK(std::make_shared<PagePool>()->keep_free_bytes() == kDefaultKeepFreeBytes);  // a shared pool's default
}

int main() {
  test_private_pool_keep_free();
  test_head_runs_consecutive();
  test_snapshot_between_layers();
  test_load_crafted_header();
  test_save_load_window1_empty_table();
  test_cow_fork_partly_filled_tail();
  test_reorder_histories();
  test_truncate_edges();
  test_checkpoint_restore();
  test_eviction();
  test_save_load();
  test_concurrent_pool();
  TEST_MAIN_END();
}
