#include "kvcache/registry.h"

#include <chrono>
#include <stdexcept>
#include <string>

namespace olep {
namespace {

[[noreturn]] void unknown(const char* kind, int64_t h) {
  throw std::invalid_argument(std::string(kind) + " handle " + std::to_string(h) + " is unknown or released");
}

}  // namespace

Registry& Registry::instance() {
  static Registry* r = new Registry();  // never destroyed: caches may outlive static destruction order
  return *r;
}

Registry::Registry() {
  // Random per-process base so a handle from another process or a stale id is unlikely to alias.
  const auto t = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  next_ = static_cast<int64_t>(((t ^ (t >> 17) ^ reinterpret_cast<uintptr_t>(this)) & 0xffffffULL) << 20) + 1;
}

template <class T>
int64_t Registry::add(std::unordered_map<int64_t, std::shared_ptr<T>>& m, std::shared_ptr<T> v) {
  std::lock_guard<std::mutex> lk(mu_);
  const int64_t h = next_++;
  m.emplace(h, std::move(v));
  return h;
}

template <class T>
void Registry::take(std::unordered_map<int64_t, std::shared_ptr<T>>& m, int64_t h, const char* kind) {
  std::shared_ptr<T> keep;  // declared first: destroyed after the lock is released
  std::lock_guard<std::mutex> lk(mu_);
  auto it = m.find(h);
  if (it == m.end()) unknown(kind, h);
  keep = std::move(it->second);
  m.erase(it);
}

template <class T>
std::shared_ptr<T> Registry::get(const std::unordered_map<int64_t, std::shared_ptr<T>>& m, int64_t h,
                                 const char* kind) const {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = m.find(h);
  if (it == m.end()) unknown(kind, h);
  return it->second;
}

int64_t Registry::add_cache(std::shared_ptr<KVCache> c) { return add(caches_, std::move(c)); }

std::shared_ptr<KVCache> Registry::cache(int64_t h) const { return get(caches_, h, "KVCache"); }

void Registry::release_cache(int64_t h) { take(caches_, h, "KVCache"); }

int64_t Registry::add_pool(std::shared_ptr<PagePool> p) { return add(pools_, std::move(p)); }

std::shared_ptr<PagePool> Registry::pool(int64_t h) const { return get(pools_, h, "KVPool"); }

void Registry::release_pool(int64_t h) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = pools_.find(h);
  if (it == pools_.end()) unknown("KVPool", h);
  const PoolStats s = it->second->stats();
  // Caches and checkpoints hold the pool; so does a cache being created in it right now (it took
  // the pointer from this registry, under this lock, before registering itself with the pool).
  if (s.num_caches > 0 || s.num_checkpoints > 0 || it->second.use_count() > 1)
    throw std::invalid_argument("the pool is in use by " + std::to_string(s.num_caches) + " cache(s) and " +
                                std::to_string(s.num_checkpoints) + " checkpoint(s)" +
                                (s.num_caches + s.num_checkpoints == 0 ? " (one is being created)" : "") +
                                "; close them first");
  pools_.erase(it);
}

int64_t Registry::add_checkpoint(std::shared_ptr<Checkpoint> cp) { return add(checkpoints_, std::move(cp)); }

std::shared_ptr<Checkpoint> Registry::checkpoint(int64_t h) const { return get(checkpoints_, h, "KVCheckpoint"); }

void Registry::release_checkpoint(int64_t h) { take(checkpoints_, h, "KVCheckpoint"); }

void Registry::drop_stale_steps_of_node(std::thread::id thread, uint64_t node, const KVCache* except) const {
  std::vector<std::shared_ptr<KVCache>> all;
  {
    std::lock_guard<std::mutex> lk(mu_);
    all.reserve(caches_.size());
    for (const auto& kv : caches_)
      if (kv.second.get() != except) all.push_back(kv.second);
  }
  for (const auto& c : all) c->drop_stale_step_of_node(thread, node);
}

bool Registry::is_live(int64_t h) const {
  std::lock_guard<std::mutex> lk(mu_);
  return caches_.count(h) || pools_.count(h) || checkpoints_.count(h);
}

int64_t Registry::num_live_caches() const {
  std::lock_guard<std::mutex> lk(mu_);
  return static_cast<int64_t>(caches_.size());
}

}  // namespace olep
