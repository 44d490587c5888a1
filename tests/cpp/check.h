// Minimal test harness: CHECK records a failure and continues; main() returns
// non-zero if any check failed. EXPECT_THROW checks the exception type and
// that its message contains a substring.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

inline int& failures() {
  static int n = 0;
  return n;
}

#define CHECK(cond)                                                           \
  do {                                                                        \
    if (!(cond)) {                                                            \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++failures();                                                           \
    }                                                                         \
  } while (0)

#define CHECK_NEAR(a, b, tol)                                                                        \
  do {                                                                                               \
    const double _a = (a), _b = (b);                                                                 \
    if (!(std::fabs(_a - _b) <= (tol))) {                                                            \
      std::fprintf(stderr, "%s:%d: CHECK_NEAR failed: %s=%g vs %s=%g (tol %g)\n", __FILE__, __LINE__, #a, _a, #b, \
                   _b, static_cast<double>(tol));                                                    \
      ++failures();                                                                                  \
    }                                                                                                \
  } while (0)

#define EXPECT_THROW(stmt, Type, substr)                                                              \
  do {                                                                                                \
    bool _thrown = false;                                                                             \
    try {                                                                                             \
      stmt;                                                                                           \
    } catch (const Type& e) {                                                                         \
      _thrown = true;                                                                                 \
      if (std::string(e.what()).find(substr) == std::string::npos) {                                  \
        std::fprintf(stderr, "%s:%d: message '%s' lacks '%s'\n", __FILE__, __LINE__, e.what(), substr); \
        ++failures();                                                                                 \
      }                                                                                               \
    }                                                                                                 \
    if (!_thrown) {                                                                                   \
      std::fprintf(stderr, "%s:%d: expected %s from %s\n", __FILE__, __LINE__, #Type, #stmt);         \
      ++failures();                                                                                   \
    }                                                                                                 \
  } while (0)

#define TEST_MAIN_END()                                           \
  do {                                                            \
    if (failures()) std::fprintf(stderr, "%d check(s) failed\n", failures()); \
    else std::printf("all checks passed\n");                      \
    return failures() ? 1 : 0;                                    \
  } while (0)

// n standard-normal floats from a fixed seed (test inputs).
inline std::vector<float> randn(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}
