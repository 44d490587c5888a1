// Helpers for the arena tests: geometries, position-tagged rows, a full step
// through the op-side API, content checks and the page-pool invariant.
#pragma once

#include <map>
#include <memory>
#include <vector>

#include "check.h"
#include "kvcache/kv_cache.h"
#include "kvcache/run_scope.h"

namespace kvt {

using namespace olep;

inline CacheGeometry geom(int64_t layers = 2, int64_t batch = 2, int64_t heads = 2, int64_t d = 4, int64_t cap = 16,
                          int64_t page_tokens = 32) {
  CacheGeometry g;
  g.num_layers = layers;
  g.batch_size = batch;
  g.kv_num_heads = heads;
  g.head_dim = d;
  g.v_head_dim = d;
  g.max_sequence_length = cap;
  g.dtype = DType::kFloat32;
  g.page_tokens = page_tokens;
  return g;
}

// Value of (layer, stream, head, position, d): `stream` tells apart rows written by different
// writers at the same position (forks).
inline float tag(int64_t layer, int64_t stream, int64_t h, int64_t pos, int64_t d, bool value) {
  return static_cast<float>(layer * 1000000 + stream * 100000 + h * 10000 + pos * 10 + d) * (value ? -1.0f : 1.0f);
}

// Appends S rows to layer l (positions starting at each sequence's length), rows tagged with
// streams[b] (default b): begin_layer_append, append_rows, finish_layer_append under the lock.
inline void layer_step(KVCache& c, int64_t l, int64_t S, std::vector<int64_t> num_new = {},
                       std::vector<int64_t> streams = {}, bool commit_node = false) {
  const auto& g = c.geometry();
  if (num_new.empty()) num_new.assign(static_cast<size_t>(g.batch_size), S);
  if (streams.empty())
    for (int64_t b = 0; b < g.batch_size; ++b) streams.push_back(b);
  std::vector<float> k(static_cast<size_t>(g.batch_size * g.kv_num_heads * S * g.head_dim));
  std::vector<float> v(k.size());
  auto lk = c.lock();
  const std::vector<int64_t> lens = c.lengths_locked();
  for (int64_t b = 0; b < g.batch_size; ++b)
    for (int64_t h = 0; h < g.kv_num_heads; ++h)
      for (int64_t s = 0; s < S; ++s)
        for (int64_t d = 0; d < g.head_dim; ++d) {
          const size_t i = static_cast<size_t>(((b * g.kv_num_heads + h) * S + s) * g.head_dim + d);
          k[i] = tag(l, streams[static_cast<size_t>(b)], h, lens[static_cast<size_t>(b)] + s, d, false);
          v[i] = tag(l, streams[static_cast<size_t>(b)], h, lens[static_cast<size_t>(b)] + s, d, true);
        }
  c.begin_layer_append(l, S, num_new, commit_node);
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

// layer_step for layers 0..layers-1 (default all): one step of a run.
inline void step(KVCache& c, int64_t S, std::vector<int64_t> num_new = {}, std::vector<int64_t> streams = {},
                 bool commit_node = false, int64_t layers = -1) {
  if (layers < 0) layers = c.geometry().num_layers;
  for (int64_t l = 0; l < layers; ++l) layer_step(c, l, S, num_new, streams, commit_node);
}

// The expected stream of every position of every sequence: stream[b][pos].
using Streams = std::vector<std::vector<int64_t>>;

inline Streams streams_of(const std::vector<int64_t>& lens) {
  Streams s;
  for (size_t b = 0; b < lens.size(); ++b) s.emplace_back(static_cast<size_t>(lens[b]), static_cast<int64_t>(b));
  return s;
}

// Every layer's content against the tags: position p of sequence b holds stream want[b][p]; p below
// first[l][b] (evicted) and p >= length read back as zeros from export.
inline void check_content(KVCache& c, const Streams& want) {
  const auto& g = c.geometry();
  const std::vector<int64_t> first = c.first_positions();
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
      const auto& w = want[static_cast<size_t>(b)];
      const int64_t f = first[static_cast<size_t>(l * g.batch_size + b)];
      for (int64_t h = 0; h < g.kv_num_heads; ++h)
        for (int64_t p = 0; p < L; ++p)
          for (int64_t d = 0; d < g.head_dim; ++d) {
            const size_t i = static_cast<size_t>(((b * g.kv_num_heads + h) * L + p) * g.head_dim + d);
            const bool valid = p < static_cast<int64_t>(w.size()) && p >= f;
            const float wk = valid ? tag(l, w[static_cast<size_t>(p)], h, p, d, false) : 0.0f;
            const float wv = valid ? tag(l, w[static_cast<size_t>(p)], h, p, d, true) : 0.0f;
            if (k[i] != wk || v[i] != wv) {
              std::fprintf(stderr, "content mismatch at layer %lld seq %lld head %lld pos %lld\n",
                           static_cast<long long>(l), static_cast<long long>(b), static_cast<long long>(h),
                           static_cast<long long>(p));
              CHECK(false);
              return;
            }
          }
    }
  }
}

// The pool invariant over a set of caches and checkpoints that are all of the pool's holders:
// refs(page) == number of (layer, sequence) tables and checkpoint tables holding it; a page with
// refs 0 is held by nobody; free + held == mapped.
inline void check_pool(const PagePool& pool, const std::vector<const KVCache*>& caches,
                       const std::vector<const Checkpoint*>& cps = {}) {
  std::map<uint32_t, uint32_t> expect;
  for (const KVCache* c : caches) {
    const auto& g = c->geometry();
    for (int64_t l = 0; l < g.num_layers; ++l)
      for (int64_t b = 0; b < g.batch_size; ++b)
        for (int64_t h = 0; h < g.kv_num_heads; ++h)
          for (uint32_t id : c->page_ids(l, b, h)) ++expect[id];
  }
  for (const Checkpoint* cp : cps)
    for (const PageTable& t : cp->content().tables)
      for (const Page* p : t.pages) ++expect[p->id];
  int64_t held = 0;
  for (const auto& pr : pool.page_refs()) {
    const auto it = expect.find(pr.first);
    const uint32_t want = it == expect.end() ? 0 : it->second;
    if (pr.second != want) {
      std::fprintf(stderr, "page %u: refs %u, holders %u\n", pr.first, pr.second, want);
      CHECK(false);
    }
    held += pr.second > 0;
  }
  const PoolStats s = pool.stats();
  CHECK(held == s.num_pages);
  CHECK(s.committed_bytes == s.live_bytes + s.free_bytes + s.overhead_bytes);
}

}  // namespace kvt
