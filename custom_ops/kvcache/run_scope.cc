#include "kvcache/run_scope.h"

#include <atomic>
#include <sstream>

#include "kvcache/kv_cache.h"

namespace olep {
namespace {

std::atomic<uint64_t> g_next_serial{1};

struct Scope {
  int depth = 0;
  uint64_t serial = 0;
  bool deferred = false;
  std::vector<std::weak_ptr<KVCache>> caches;
};

Scope& scope() {
  thread_local Scope s;
  return s;
}

}  // namespace

std::string RunToken::describe() const {
  std::ostringstream o;
  if (bounded()) o << "run " << serial << " on thread " << thread;
  else o << "a run on thread " << thread;
  return o.str();
}

namespace run_scope {

void begin(bool deferred) {
  Scope& s = scope();
  if (s.depth++ > 0) return;  // nested: the outermost run's kind applies
  s.serial = g_next_serial.fetch_add(1, std::memory_order_relaxed);
  s.deferred = deferred;
  s.caches.clear();
}

std::vector<std::string> end(bool ok) noexcept {
  std::vector<std::string> diagnoses;
  Scope& s = scope();
  if (s.depth == 0) return diagnoses;
  if (--s.depth > 0) return diagnoses;
  const RunToken token{std::this_thread::get_id(), s.serial};
  std::vector<std::weak_ptr<KVCache>> caches;
  caches.swap(s.caches);
  for (auto& w : caches)
    if (auto c = w.lock()) {
      std::string d = c->end_run(token, ok, s.deferred);
      if (!d.empty()) diagnoses.push_back(std::move(d));
    }
  s.serial = 0;
  s.deferred = false;
  return diagnoses;
}

RunToken current() { return RunToken{std::this_thread::get_id(), scope().depth > 0 ? scope().serial : 0}; }

bool deferred() { return scope().depth > 0 && scope().deferred; }

void note(const std::shared_ptr<KVCache>& cache) {
  Scope& s = scope();
  if (s.depth == 0 || !cache) return;
  for (const auto& w : s.caches)
    if (w.lock() == cache) return;
  s.caches.push_back(cache);
}

}  // namespace run_scope
}  // namespace olep
