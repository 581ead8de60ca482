// A minimal test harness: CHECK records a failure and carries on; main() reports and sets the
// exit code that ctest reads.
#pragma once

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace ts_test {

struct Case {
  const char* name;
  std::function<void()> fn;
};

inline std::vector<Case>& cases() {
  static std::vector<Case> all;
  return all;
}

inline int& failures() {
  static int n = 0;
  return n;
}

struct Register {
  Register(const char* name, std::function<void()> fn) { cases().push_back({name, std::move(fn)}); }
};

}  // namespace ts_test

#define TS_CONCAT2(a, b) a##b
#define TS_CONCAT(a, b) TS_CONCAT2(a, b)
#define TEST_CASE(name)                                                       \
  static void TS_CONCAT(ts_case_, __LINE__)();                                \
  static ::ts_test::Register TS_CONCAT(ts_reg_, __LINE__)(name, TS_CONCAT(ts_case_, __LINE__)); \
  static void TS_CONCAT(ts_case_, __LINE__)()

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) {                                                             \
      ++::ts_test::failures();                                                 \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
    }                                                                          \
  } while (0)

#define CHECK_THROWS_AS(expr, type)                                            \
  do {                                                                         \
    bool ts_caught = false;                                                    \
    try {                                                                      \
      (void)(expr);                                                            \
    } catch (const type&) {                                                    \
      ts_caught = true;                                                        \
    } catch (...) {                                                            \
    }                                                                          \
    if (!ts_caught) {                                                          \
      ++::ts_test::failures();                                                 \
      std::fprintf(stderr, "%s:%d: expected %s from %s\n", __FILE__, __LINE__, #type, #expr); \
    }                                                                          \
  } while (0)

#define TS_TEST_MAIN                                                           \
  int main() {                                                                 \
    int failed_cases = 0;                                                      \
    for (auto& c : ::ts_test::cases()) {                                       \
      const int before = ::ts_test::failures();                                \
      try {                                                                    \
        c.fn();                                                                \
      } catch (const std::exception& e) {                                      \
        ++::ts_test::failures();                                               \
        std::fprintf(stderr, "%s: unexpected exception: %s\n", c.name, e.what()); \
      }                                                                        \
      const bool ok = ::ts_test::failures() == before;                         \
      failed_cases += !ok;                                                     \
      std::printf("[%s] %s\n", ok ? "PASS" : "FAIL", c.name);                  \
    }                                                                          \
    std::printf("%zu cases, %d failed\n", ::ts_test::cases().size(), failed_cases); \
    return failed_cases ? 1 : 0;                                               \
  }
