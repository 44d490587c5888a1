// Run boundaries: which run of which thread a cache step belongs to, and what
// happens to a run's steps when it ends.
//
// Three paths call into this (see docs/API.md, "When a step commits"):
//   - onnx_light_ep.InferenceSession.run (Python) begins a *deferred* run around
//     ORT's Run and ends it with ok = whether Run returned normally: the run's
//     steps commit exactly when the whole run succeeded.
//   - OnnxLightExecutionProvider's OnRunStart/OnRunEnd begin and end a bounded,
//     not deferred run: steps commit when the run completes them (CacheCommit,
//     or the last layer), and a step still incomplete at OnRunEnd is discarded.
//   - the plain CPU EP path has no run boundary: serial 0 ("unbounded").
// Nested begin() calls (the Python wrapper around a run of the EP) count
// depth; the outermost one's kind applies. State is thread-local: a run is
// the thread that called Run (ORT's sequential execution).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace olep {

class KVCache;

/// Identity of a run. serial 0 = a run with no known boundaries.
struct RunToken {
  std::thread::id thread;
  uint64_t serial = 0;
  bool bounded() const { return serial != 0; }
  bool operator==(const RunToken& o) const { return thread == o.thread && serial == o.serial; }
  bool operator!=(const RunToken& o) const { return !(*this == o); }
  std::string describe() const;  // "run 12 on thread 0x..." / "a run on thread 0x..."
};

namespace run_scope {

/// Begins a run on the calling thread. deferred: steps completed in the run commit at end(true).
void begin(bool deferred);
/// Ends the run begun by the matching begin(). At depth 0 every cache the run appended to ends
/// its step (KVCache::end_run). Returns the diagnoses of a deferred run that succeeded but left
/// a step incomplete (a model with fewer attention layers than the cache); never throws.
std::vector<std::string> end(bool ok) noexcept;
/// The calling thread's current run (serial 0 outside begin/end).
RunToken current();
/// True when the calling thread's current run defers commits to end(true).
bool deferred();
/// Records that the current run appended to `cache` (no-op outside a bounded run).
void note(const std::shared_ptr<KVCache>& cache);

}  // namespace run_scope
}  // namespace olep
