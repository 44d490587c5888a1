#include "kvcache/step.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#include "kernels/row_copy.h"
#include "kvcache/errors.h"

namespace olep {
namespace {

std::string str(int64_t v) { return std::to_string(v); }
constexpr int64_t kNoBlock = std::numeric_limits<int64_t>::max();

}  // namespace

StepTransaction::StepTransaction(const CacheGeometry& g, RunToken owner, int64_t sequence_length,
                                 std::vector<int64_t> num_new, bool commit_node, uint64_t layer0_node)
    : g_(g), owner_(owner), seq_(sequence_length), num_new_(std::move(num_new)), commit_node_(commit_node),
      layer0_node_(layer0_node) {}

int64_t StepTransaction::appended_bytes() const {
  int64_t rows = 0;
  for (int64_t n : num_new_) rows += n;
  return rows * g_.row_bytes() * g_.num_layers;
}

void StepTransaction::reserve(const CacheContent& c, PagePool& pool) {
  const int64_t B = g_.batch_size, H = g_.kv_num_heads, P = g_.page_tokens;
  pending_.assign(static_cast<size_t>(g_.num_layers * B), Pending{});
  std::vector<const Page*> tails;  // tail pages the step writes into, to test for sharing
  std::vector<std::pair<size_t, int64_t>> tail_at;  // (pending index, head) of each
  int64_t fresh = 0;
  for (int64_t l = 0; l < g_.num_layers; ++l)
    for (int64_t b = 0; b < B; ++b) {
      Pending& p = pending_[static_cast<size_t>(l * B + b)];
      p.first_new_block = kNoBlock;
      const int64_t n = num_new_[static_cast<size_t>(b)];
      if (n == 0) continue;
      const int64_t len = c.lens[static_cast<size_t>(b)];
      const PageTable& t = c.table(l, b, B);
      p.first_new_block = (len + P - 1) / P;
      if (t.end_block(H) != p.first_new_block && len > 0)
        throw std::logic_error("page table of layer " + str(l) + ", sequence " + str(b) + " ends at block " +
                               str(t.end_block(H)) + " but its length " + str(len) + " needs " +
                               str(p.first_new_block));
      if (len % P != 0) {
        p.tail_block = len / P;
        for (int64_t h = 0; h < H; ++h) {
          tails.push_back(t.at(p.tail_block, h, H));
          tail_at.emplace_back(static_cast<size_t>(l * B + b), h);
        }
      }
      const int64_t last = (len + n - 1) / P;
      if (last >= p.first_new_block) fresh += (last - p.first_new_block + 1) * H;
    }
  std::vector<uint32_t> refs(tails.size());
  if (!tails.empty()) pool.refs(tails.data(), tails.size(), refs.data());
  int64_t copies = 0;
  for (uint32_t r : refs) copies += r > 1 ? 1 : 0;
  const int64_t need = copies + fresh;
  if (need == 0) return;
  const int64_t pb = g_.page_bytes();
  if (g_.memory_limit_bytes > 0 && c.holds.bytes() + need * pb > g_.memory_limit_bytes)
    throw MemoryLimitError("cache memory_limit_bytes is " + str(g_.memory_limit_bytes) + ": this step needs " +
                           str(need) + " new pages (" + str(need * pb) + " bytes) and the cache holds " +
                           str(c.holds.bytes()) + " bytes");
  pool.allocate(pb, need, &reserved_);  // throws before any change
  size_t next = 0;
  for (size_t i = 0; i < tails.size(); ++i) {
    if (refs[i] <= 1) continue;
    Pending& p = pending_[tail_at[i].first];
    if (p.tail_copy.empty()) p.tail_copy.assign(static_cast<size_t>(H), nullptr);
    p.tail_copy[static_cast<size_t>(tail_at[i].second)] = reserved_[next++];
  }
  for (int64_t l = 0; l < g_.num_layers; ++l)
    for (int64_t b = 0; b < B; ++b) {
      Pending& p = pending_[static_cast<size_t>(l * B + b)];
      const int64_t n = num_new_[static_cast<size_t>(b)];
      if (n == 0) continue;
      // Head by head: one head's new blocks take consecutive pages of the reservation, which
      // a pool hands out in address order from its slabs, so a prefill's pages of one (layer,
      // sequence, kv head) lie one after another and the kernel reads them as one stream.
      // (blocks is 0 when the new rows fit in the tail page.)
      const int64_t blocks = (c.lens[static_cast<size_t>(b)] + n - 1) / P - p.first_new_block + 1;
      p.fresh.assign(static_cast<size_t>(blocks * H), nullptr);
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < blocks; ++i) p.fresh[static_cast<size_t>(i * H + h)] = reserved_[next++];
    }
}

Page* StepTransaction::page_for(const Pending& p, const PageTable& t, int64_t blk, int64_t h) const {
  if (blk >= p.first_new_block)
    return p.fresh[static_cast<size_t>((blk - p.first_new_block) * g_.kv_num_heads + h)];
  if (blk == p.tail_block && !p.tail_copy.empty() && p.tail_copy[static_cast<size_t>(h)])
    return p.tail_copy[static_cast<size_t>(h)];
  return t.at(blk, h, g_.kv_num_heads);
}

void StepTransaction::write(int64_t layer, const CacheContent& c, const NewRows& rows, PagePool& pool) {
  const int64_t B = g_.batch_size, H = g_.kv_num_heads, P = g_.page_tokens, D = g_.head_dim, Dv = g_.v_head_dim;
  const size_t es = g_.elem_bytes();
  const size_t krow = static_cast<size_t>(D) * es, vrow = static_cast<size_t>(Dv) * es;
  const int64_t voff = g_.value_offset();
  bool streamed = false;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = num_new_[static_cast<size_t>(b)];
    if (n == 0) continue;
    const Pending& p = pending_[static_cast<size_t>(layer * B + b)];
    const PageTable& t = c.table(layer, b, B);
    const int64_t len = c.lens[static_cast<size_t>(b)];
    // Copy-on-write: the valid rows of a shared tail page go to the step's private copy.
    if (p.tail_block >= 0 && !p.tail_copy.empty()) {
      const int64_t valid = len - p.tail_block * P;
      for (int64_t h = 0; h < H; ++h) {
        Page* dst = p.tail_copy[static_cast<size_t>(h)];
        if (!dst) continue;
        const Page* src = t.at(p.tail_block, h, H);
        std::memcpy(dst->data, src->data, static_cast<size_t>(valid) * krow);
        std::memcpy(dst->data + voff, src->data + voff, static_cast<size_t>(valid) * vrow);
        copied_ += valid * static_cast<int64_t>(krow + vrow);
      }
    }
    // A long append (a prefill chunk) streams its rows past the caches (kernels::copy_rows);
    // a decode step's few rows stay cached for the attention that reads them next.
    const bool streaming = n >= kernels::kStreamCopyRows;
    streamed = streamed || streaming;
    for (int64_t h = 0; h < H; ++h) {
      const char* ks = static_cast<const char*>(rows.key) +
                       static_cast<size_t>(b * rows.key_strides[0] + h * rows.key_strides[1]) * es;
      const char* vs = static_cast<const char*>(rows.value) +
                       static_cast<size_t>(b * rows.value_strides[0] + h * rows.value_strides[1]) * es;
      const size_t ks_row = static_cast<size_t>(rows.key_strides[2]) * es;
      const size_t vs_row = static_cast<size_t>(rows.value_strides[2]) * es;
      for (int64_t s = 0; s < n;) {
        const int64_t pos = len + s, blk = pos / P, row = pos % P;
        const int64_t cnt = std::min(n - s, P - row);
        Page* pg = page_for(p, t, blk, h);
#ifndef NDEBUG
        // The write-path invariant: only a page this step alone holds is written.
        if (pool.refs(pg) != 1)
          throw std::logic_error("write into page " + std::to_string(pg->id) + " with " +
                                 std::to_string(pool.refs(pg)) + " holders (copy-on-write missed)");
#else
        (void)pool;
#endif
        char* kd = pg->data + static_cast<size_t>(row) * krow;
        char* vd = pg->data + voff + static_cast<size_t>(row) * vrow;
        const char* kr = ks + static_cast<size_t>(s) * ks_row;
        const char* vr = vs + static_cast<size_t>(s) * vs_row;
        kernels::copy_rows(kd, kr, cnt, krow, ks_row, streaming);
        kernels::copy_rows(vd, vr, cnt, vrow, vs_row, streaming);
        s += cnt;
      }
    }
  }
  if (streamed) kernels::stream_fence();  // the streamed rows before anything reads the pages
  next_layer_ = layer + 1;
}

void StepTransaction::blocks(int64_t layer, int64_t b, int64_t h, const CacheContent& c, int64_t key_begin,
                             int64_t key_end, std::vector<KVBlock>* out) const {
  const int64_t B = g_.batch_size, H = g_.kv_num_heads;
  const PageTable& t = c.table(layer, b, B);
  if (appended(layer) && !pending_.empty()) {
    const Pending& p = pending_[static_cast<size_t>(layer * B + b)];
    append_blocks(g_, t.first_block, key_begin, key_end, [&](int64_t blk) { return page_for(p, t, blk, h); }, out);
  } else {
    append_blocks(g_, t.first_block, key_begin, key_end, [&](int64_t blk) { return t.at(blk, h, H); }, out);
  }
}

std::vector<StepTransaction::InPlaceTail> StepTransaction::in_place_tails(const CacheContent& c) const {
  std::vector<InPlaceTail> out;
  const int64_t B = g_.batch_size, H = g_.kv_num_heads;
  for (int64_t l = 0; l < g_.num_layers && !pending_.empty(); ++l)
    for (int64_t b = 0; b < B; ++b) {
      const Pending& p = pending_[static_cast<size_t>(l * B + b)];
      if (p.tail_block < 0) continue;
      for (int64_t h = 0; h < H; ++h)
        if (p.tail_copy.empty() || !p.tail_copy[static_cast<size_t>(h)])
          out.push_back({l, b, h, c.table(l, b, B).at(p.tail_block, h, H)});
    }
  return out;
}

void StepTransaction::commit(CacheContent& c, PagePool& pool) {
  const int64_t B = g_.batch_size, H = g_.kv_num_heads;
  std::vector<Page*> replaced;
  for (int64_t l = 0; l < g_.num_layers && !pending_.empty(); ++l)
    for (int64_t b = 0; b < B; ++b) {
      Pending& p = pending_[static_cast<size_t>(l * B + b)];
      PageTable& t = c.table(l, b, B);
      if (p.tail_block >= 0 && !p.tail_copy.empty())
        for (int64_t h = 0; h < H; ++h) {
          Page* copy = p.tail_copy[static_cast<size_t>(h)];
          if (!copy) continue;
          Page*& slot = t.at(p.tail_block, h, H);
          c.holds.remove(slot);
          replaced.push_back(slot);
          slot = copy;
          c.holds.add(copy);
        }
      for (Page* pg : p.fresh) {
        t.pages.push_back(pg);
        c.holds.add(pg);
      }
    }
  for (int64_t b = 0; b < B; ++b) c.lens[static_cast<size_t>(b)] += num_new_[static_cast<size_t>(b)];
  reserved_.clear();  // the reservation's references now belong to the tables
  pending_.clear();
  pool.release(replaced);
}

void StepTransaction::rollback(PagePool& pool) noexcept {
  pool.release(reserved_);
  reserved_.clear();
  pending_.clear();
}

}  // namespace olep
