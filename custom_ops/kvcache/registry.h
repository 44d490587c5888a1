// Registry: the process-wide table of opaque int64 handles for caches, pools
// and checkpoints. Handles are never reused (a counter with a random
// per-process base) and are never pointers; an unknown or released handle is
// std::invalid_argument naming the kind ("KVCache handle 123 is unknown or
// released"). The one piece of process-wide mutable state of the arena: it
// lives in libonnx_light.so, which ORT and the Python module share.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "kvcache/kv_cache.h"
#include "kvcache/page_pool.h"

namespace olep {

class Registry {
 public:
  static Registry& instance();

  int64_t add_cache(std::shared_ptr<KVCache> cache);
  std::shared_ptr<KVCache> cache(int64_t handle) const;
  void release_cache(int64_t handle);

  int64_t add_pool(std::shared_ptr<PagePool> pool);
  std::shared_ptr<PagePool> pool(int64_t handle) const;
  /// Refuses (std::invalid_argument, nothing changes) while caches or checkpoints use the pool.
  void release_pool(int64_t handle);

  int64_t add_checkpoint(std::shared_ptr<Checkpoint> cp);
  std::shared_ptr<Checkpoint> checkpoint(int64_t handle) const;
  void release_checkpoint(int64_t handle);

  bool is_live(int64_t handle) const;
  /// KVCache::drop_stale_step_of_node on every live cache but `except` (the plain CPU EP path,
  /// at layer 0 of a run). Takes each cache's lock in turn; call holding none.
  void drop_stale_steps_of_node(std::thread::id thread, uint64_t node, const KVCache* except) const;
  int64_t num_live_caches() const;

 private:
  Registry();
  template <class T>
  int64_t add(std::unordered_map<int64_t, std::shared_ptr<T>>& m, std::shared_ptr<T> v);
  template <class T>
  void take(std::unordered_map<int64_t, std::shared_ptr<T>>& m, int64_t h, const char* kind);
  template <class T>
  std::shared_ptr<T> get(const std::unordered_map<int64_t, std::shared_ptr<T>>& m, int64_t h, const char* kind) const;
  mutable std::mutex mu_;
  int64_t next_;
  std::unordered_map<int64_t, std::shared_ptr<KVCache>> caches_;
  std::unordered_map<int64_t, std::shared_ptr<PagePool>> pools_;
  std::unordered_map<int64_t, std::shared_ptr<Checkpoint>> checkpoints_;
};

}  // namespace olep
