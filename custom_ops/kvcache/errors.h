// Typed errors of the KV-cache arena. Three kinds cross every boundary with
// their kind intact (the provider writes the kind in front of the ORT status
// message, the bindings raise the Python class of the same name):
//   std::invalid_argument  a bad argument or index          -> ValueError
//   MemoryLimitError       a memory_limit_bytes would be     -> KVCacheMemoryError
//                          exceeded (cache quota or pool budget)
//   BusyError              another run owns the cache now    -> KVCacheBusyError
// Every arena operation that throws leaves the cache and the pool exactly as
// they were. Messages speak of the arena only (pages, sequences, layers,
// lengths); the op and method names are put in front by ops/ and the bindings.
#pragma once

#include <exception>
#include <stdexcept>
#include <string>

namespace olep {

/// A cache quota or pool budget would be exceeded. The message names the limit, what the
/// operation needs and what is in use.
class MemoryLimitError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// The cache is in use by another run (a concurrent run, or a method racing a run).
class BusyError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// "KVCacheMemoryError", "KVCacheBusyError", "ValueError" (std::invalid_argument) or "" (other).
inline const char* error_kind(const std::exception& e) {
  if (dynamic_cast<const MemoryLimitError*>(&e)) return "KVCacheMemoryError";
  if (dynamic_cast<const BusyError*>(&e)) return "KVCacheBusyError";
  if (dynamic_cast<const std::invalid_argument*>(&e)) return "ValueError";
  return "";
}

/// Rethrows the exception being handled with `prefix` in front of its message, keeping its kind.
/// Call inside a catch block only.
[[noreturn]] inline void rethrow_with_prefix(const std::string& prefix) {
  try {
    throw;
  } catch (const MemoryLimitError& e) {
    throw MemoryLimitError(prefix + e.what());
  } catch (const BusyError& e) {
    throw BusyError(prefix + e.what());
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(prefix + e.what());
  } catch (const std::logic_error& e) {
    throw std::logic_error(prefix + e.what());
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(prefix + e.what());
  }
}

}  // namespace olep
