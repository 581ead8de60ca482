// A persistent pool of worker threads. Threads are created once; each parallel_for wakes them,
// and the calling thread works alongside them, so a call costs a wake-up, not a thread start.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace trainstream {

// CPUs this process may run on (sched_getaffinity), at least 1.
std::size_t available_cpus();

// Names the calling thread (Linux: at most 15 characters, as top, perf and gdb show it; elsewhere
// nothing): the pool's threads are "ts-pool", the offload pipeline's engine threads "ts-engine".
void name_this_thread(const char* name);

// Makes the calling thread `by` nicer than it is (Linux: its own nice value, clamped to 19;
// elsewhere nothing). The offload pipeline's engine threads run this way so that the thread that
// launches the GPU's work, and runs the gradient hooks, gets a core whenever it wakes. Raising a
// nice value needs no privilege; a refusal leaves the thread as it was.
void lower_this_thread_priority(int by);

class ThreadPool {
 public:
  // `threads` counts the caller too: ThreadPool(1) runs everything on the calling thread.
  // 0 means available_cpus().
  explicit ThreadPool(std::size_t threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  std::size_t size() const { return workers_.size() + 1; }

  // Calls fn(i) once for every i in [0, tasks), spread over the pool, and returns when all calls
  // have finished. The first exception thrown by fn is rethrown here (the remaining tasks are
  // skipped). Calls from several threads are serialised.
  void parallel_for(std::size_t tasks, const std::function<void(std::size_t)>& fn);

 private:
  void stop() noexcept;
  void worker_loop();
  void run_tasks();

  std::vector<std::thread> workers_;
  std::mutex call_mutex_;  // one parallel_for at a time

  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::size_t generation_ = 0;
  bool stopping_ = false;

  // State of the call in flight.
  const std::function<void(std::size_t)>* fn_ = nullptr;
  std::size_t tasks_ = 0;
  std::atomic<std::size_t> next_task_{0};
  std::size_t busy_workers_ = 0;
  std::exception_ptr error_;
  std::atomic<bool> failed_{false};
};

}  // namespace trainstream
