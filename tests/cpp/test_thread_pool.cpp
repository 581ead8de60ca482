#include <atomic>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include "check.hpp"
#include "trainstream/grad_ops.hpp"
#include "trainstream/thread_pool.hpp"

using trainstream::ThreadPool;

TEST_CASE("every task runs exactly once") {
  ThreadPool pool(4);
  for (std::size_t tasks : {1u, 3u, 4u, 5u, 1000u}) {
    std::vector<std::atomic<int>> hits(tasks);
    pool.parallel_for(tasks, [&](std::size_t i) { hits[i].fetch_add(1); });
    for (auto& h : hits) CHECK(h.load() == 1);
  }
}

TEST_CASE("work spreads over several threads") {
  ThreadPool pool(4);
  std::mutex mu;
  std::set<std::thread::id> ids;
  pool.parallel_for(64, [&](std::size_t) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    std::lock_guard<std::mutex> lock(mu);
    ids.insert(std::this_thread::get_id());
  });
  CHECK(ids.size() > 1);
}

TEST_CASE("an exception reaches the caller and the pool stays usable") {
  ThreadPool pool(3);
  CHECK_THROWS_AS(pool.parallel_for(100, [](std::size_t i) {
    if (i == 42) throw std::runtime_error("boom");
  }), std::runtime_error);
  std::atomic<int> n{0};
  pool.parallel_for(10, [&](std::size_t) { n++; });
  CHECK(n.load() == 10);
}

TEST_CASE("many back-to-back calls do not lose or repeat work") {
  ThreadPool pool(4);
  std::atomic<long> sum{0};
  for (int call = 0; call < 2000; ++call) {
    pool.parallel_for(7, [&](std::size_t i) { sum += static_cast<long>(i); });
  }
  CHECK(sum.load() == 2000L * 21);
}

TEST_CASE("calls from several threads are serialised safely") {
  ThreadPool pool(4);
  std::atomic<long> sum{0};
  std::vector<std::thread> callers;
  for (int t = 0; t < 4; ++t) {
    callers.emplace_back([&] {
      for (int call = 0; call < 200; ++call) pool.parallel_for(16, [&](std::size_t) { sum++; });
    });
  }
  for (auto& t : callers) t.join();
  CHECK(sum.load() == 4L * 200 * 16);
}

TEST_CASE("a pool of one runs on the caller") {
  ThreadPool pool(1);
  CHECK(pool.size() == 1);
  const auto me = std::this_thread::get_id();
  bool same = true;
  pool.parallel_for(5, [&](std::size_t) { same = same && std::this_thread::get_id() == me; });
  CHECK(same);
}

TEST_CASE("default size is the CPUs available") {
  ThreadPool pool;
  CHECK(pool.size() == trainstream::available_cpus());
}

TEST_CASE("zero_fill clears exactly its bytes, whole and in pieces") {
  ThreadPool pool(4);
  for (std::size_t bytes : {1u, 4095u, 16384u, 16385u, 1000003u}) {
    std::vector<unsigned char> buffer(bytes + 2, 0xAB);
    trainstream::zero_fill(pool, buffer.data() + 1, bytes);
    CHECK(buffer.front() == 0xAB && buffer.back() == 0xAB);
    bool zero = true;
    for (std::size_t i = 1; i <= bytes; ++i) zero = zero && buffer[i] == 0;
    CHECK(zero);
  }
}

TS_TEST_MAIN
