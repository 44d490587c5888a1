// KVCache: the op side of a step (who owns it, append, block lists, commit).
#include <algorithm>
#include <stdexcept>
#include <string>

#include "kvcache/errors.h"
#include "kvcache/kv_cache.h"

namespace olep {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

}  // namespace

std::vector<int64_t> KVCache::begin_layer_append(int64_t layer, int64_t sequence_length,
                                                 const std::vector<int64_t>& num_new, bool commit_node,
                                                 uint64_t node) {
  const RunToken me = run_scope::current();
  const int64_t B = g_.batch_size;
  if (layer < 0 || layer >= g_.num_layers)
    throw std::invalid_argument("layer must be in [0, num_layers=" + str(g_.num_layers) + "); got " + str(layer));
  if (static_cast<int64_t>(num_new.size()) != B)
    throw std::invalid_argument("the new rows have batch " + str(static_cast<int64_t>(num_new.size())) +
                                "; the cache's batch_size is " + str(B));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = num_new[static_cast<size_t>(b)], len = content_.lens[static_cast<size_t>(b)];
    if (n < 0 || n > sequence_length)
      throw std::invalid_argument("new token count of sequence " + str(b) + " must be in [0, " +
                                  str(sequence_length) + "]; got " + str(n));
    if (n > g_.max_sequence_length - len)  // no overflow: both sides are in [0, 2^24]
      throw std::invalid_argument("sequence " + str(b) + " would hold " + str(len + n) +
                                  " tokens; max_sequence_length is " + str(g_.max_sequence_length) +
                                  " (cache unchanged)");
  }
  if (layer == 0) {
    if (step_) {
      const RunToken& owner = step_->owner();
      if (owner.thread == me.thread) {
        if (me.bounded() && owner == me)
          throw std::invalid_argument("layer 0 appended twice in one run: two nodes have layer=0 (every layer "
                                      "index must appear once)");
        discard_step_locked();  // a stale step of an earlier run on this thread
      } else if (owner.bounded()) {
        throw BusyError("the cache is being appended by " + describe_owner_locked() +
                        "; one cache serves one run at a time (this run appended nothing)");
      } else {
        interrupted_ = owner;  // its run had no known end: take over; the owner fails at its next layer
        interrupted_by_ = me.describe();
        discard_step_locked();
      }
    }
    if (interrupted_.thread == me.thread) interrupted_ = RunToken{};
    last_committed_by_ = std::thread::id();
    StepTransaction st(g_, me, sequence_length, num_new, commit_node, node);
    st.reserve(content_, *pool_);  // throws before any change
    step_.emplace(std::move(st));
    if (auto self = weak_from_this().lock()) run_scope::note(self);
  } else {
    if (!step_ || step_->owner() != me) {
      if (interrupted_ == me && me.thread == interrupted_.thread) {
        const std::string by = interrupted_by_;
        interrupted_ = RunToken{};
        throw BusyError(by + " took the cache over while this run was at layer " + str(layer) +
                        "; this run's step was discarded (one cache serves one run at a time)");
      }
      if (step_)
        throw BusyError("the cache is being appended by " + describe_owner_locked() +
                        "; one cache serves one run at a time");
      if (last_committed_by_ == me.thread)
        throw std::invalid_argument("layer " + str(layer) + " appends after this run's step already committed at "
                                    "its last layer: two nodes have layer=" + str(layer) + ", or layer 0 is "
                                    "missing (every layer index must appear once, in order 0..num_layers-1)");
      throw std::invalid_argument("layer " + str(layer) + " appends before layer 0 did in this run: layers must "
                                  "append in order 0..num_layers-1 (in the graph, layer l must depend on layer "
                                  "l-1's output)");
    }
    if (layer < step_->next_layer())
      throw std::invalid_argument("layer " + str(layer) + " appended twice in one run: two nodes have layer=" +
                                  str(layer) + " (every layer index must appear once)");
    if (layer > step_->next_layer())
      throw std::invalid_argument("layers must append in order 0..num_layers-1 within a run; expected layer " +
                                  str(step_->next_layer()) + ", got layer " + str(layer) +
                                  " (is the node with layer=" + str(step_->next_layer()) + " missing?)");
    if (step_->sequence_length() != sequence_length || step_->num_new() != num_new)
      throw std::invalid_argument("layer " + str(layer) + " appends a different number of tokens (" +
                                  str(sequence_length) + ") than layer 0 of the same run (" +
                                  str(step_->sequence_length()) + ")");
  }
  return content_.lens;
}

void KVCache::append_rows(int64_t layer, const NewRows& rows) {
  if (!step_) throw std::logic_error("append_rows without begin_layer_append");
  step_->write(layer, content_, rows, *pool_);
}

void KVCache::block_list(int64_t layer, const std::vector<int64_t>& first_key, const std::vector<int64_t>& num_keys,
                         BlockList* out) const {
  const int64_t B = g_.batch_size, H = g_.kv_num_heads;
  out->blocks.clear();
  out->offsets.assign(1, 0);
  const bool mine = step_ && step_->owner() == run_scope::current();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t kb = first_key.empty() ? 0 : std::max<int64_t>(0, first_key[static_cast<size_t>(b)]);
    const int64_t ke = num_keys[static_cast<size_t>(b)];
    const int64_t held = content_.lens[static_cast<size_t>(b)] +
                         (mine && step_->appended(layer) ? step_->num_new()[static_cast<size_t>(b)] : 0);
    if (ke > held)
      throw std::logic_error("block_list: keys up to " + str(ke) + " requested, " + str(held) + " held");
    const PageTable& t = content_.table(layer, b, B);
    for (int64_t h = 0; h < H; ++h) {
      if (mine) step_->blocks(layer, b, h, content_, kb, ke, &out->blocks);
      else append_blocks(g_, t.first_block, kb, ke, [&](int64_t blk) { return t.at(blk, h, H); }, &out->blocks);
      out->offsets.push_back(static_cast<int64_t>(out->blocks.size()));
    }
  }
}

void KVCache::finish_layer_append(int64_t layer) {
  if (!step_ || layer != g_.num_layers - 1 || step_->commit_node()) return;
  if (run_scope::deferred()) step_->complete = true;
  else commit_step_locked();
}

void KVCache::check_step_complete() {
  const RunToken me = run_scope::current();
  if (!step_ || step_->owner() != me) {
    if (interrupted_ == me && me.thread == interrupted_.thread) {
      const std::string by = interrupted_by_;
      interrupted_ = RunToken{};
      throw BusyError(by + " took the cache over during this run; this run's step was discarded");
    }
    if (step_) throw BusyError("the cache is being appended by " + describe_owner_locked());
    throw std::invalid_argument("no layer appended to the cache in this run, so there is no step to commit");
  }
  if (!step_->all_layers()) {
    const int64_t k = step_->next_layer();
    discard_step_locked();  // the run fails here: nothing it appended can ever commit
    throw std::invalid_argument("the run appended layers 0.." + str(k - 1) + " of the cache's num_layers=" +
                                str(g_.num_layers) + " before its commit: the model has fewer attention layers "
                                "than the cache (create it with KVCache.for_model, or num_layers=" + str(k) +
                                "); nothing was appended");
  }
}

std::vector<int64_t> KVCache::complete_step() {
  check_step_complete();
  std::vector<int64_t> lens = content_.lens;
  for (size_t b = 0; b < lens.size(); ++b) lens[b] += step_->num_new()[b];
  if (run_scope::deferred()) step_->complete = true;
  else commit_step_locked();
  return lens;
}

void KVCache::commit_step_locked() {
  last_committed_by_ = step_->owner().thread;
  step_->commit(content_, *pool_);
  bytes_appended_ += step_->appended_bytes();
  bytes_copied_ += step_->copied_bytes();
  ++num_appends_;
  step_.reset();
  evict_locked();
  quantize_cold_locked();
}

void KVCache::drop_stale_step_of_node(std::thread::id thread, uint64_t node) noexcept {
  std::lock_guard<std::mutex> lk(mu_);
  if (step_ && !step_->owner().bounded() && step_->owner().thread == thread && node != 0 &&
      step_->layer0_node() == node)
    discard_step_locked();
}

void KVCache::mark_step_failed() {
  std::lock_guard<std::mutex> lk(mu_);
  // An op of this run failed, so ORT fails the run: roll the step back now rather than at the
  // run's end (the plain CPU EP path has no end signal), releasing its reserved pages at once.
  if (step_ && step_->owner() == run_scope::current()) discard_step_locked();
}

std::string KVCache::end_run(const RunToken& run, bool ok, bool deferred) noexcept {
  std::lock_guard<std::mutex> lk(mu_);
  if (!step_ || step_->owner() != run) return "";
  if (deferred && ok && step_->all_layers()) {
    commit_step_locked();
    return "";
  }
  std::string why;
  if (deferred && ok) {
    const int64_t k = step_->next_layer();
    why = "the run finished after appending layers 0.." + str(k - 1) + " of the cache's num_layers=" +
          str(g_.num_layers) + ": the model has fewer attention layers than the cache (create it with "
          "KVCache.for_model, or num_layers=" + str(k) + "); nothing was appended";
  }
  discard_step_locked();
  return why;
}

}  // namespace olep
