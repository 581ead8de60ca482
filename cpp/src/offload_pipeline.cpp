#include "trainstream/offload_pipeline.hpp"

#include <cstring>

#include "trainstream/errors.hpp"
#include "trainstream/grad_ops.hpp"

namespace trainstream {

OffloadPipeline::OffloadPipeline(std::unique_ptr<Transfer> transfer, std::size_t threads,
                                 std::optional<Isa> isa, std::size_t max_download_bytes)
    : transfer_(std::move(transfer)), engine_(threads, isa), max_download_bytes_(max_download_bytes) {
  TS_EXPECTS(transfer_ != nullptr, "OffloadPipeline: no transfer backend");
  worker_ = std::thread([this] { worker_loop(); });
}

OffloadPipeline::~OffloadPipeline() {
  {
    // Downloads still in flight call back into this object when they land: wait for them.
    std::unique_lock<std::mutex> lock(mutex_);
    landed_.wait(lock, [&] { return downloading_bytes_ == 0; });
    stopping_ = true;
  }
  work_ready_.notify_all();
  worker_.join();
}

std::shared_ptr<HostParam> OffloadPipeline::add_param(std::size_t numel, DType weight_dtype,
                                                      bool accumulate, std::int64_t priority) {
  TS_EXPECTS(numel > 0, "OffloadPipeline: zero-size parameter");
  HostArena& arena = transfer_->arena();
  auto p = std::make_shared<HostParam>();
  p->numel = numel;
  p->weight_dtype = weight_dtype;
  p->priority = priority;
  p->master = static_cast<float*>(arena.allocate(4 * numel));
  p->exp_avg = static_cast<float*>(arena.allocate(4 * numel));
  p->exp_avg_sq = static_cast<float*>(arena.allocate(4 * numel));
  p->grad = arena.allocate(p->weight_bytes());
  if (accumulate) p->accumulator = static_cast<float*>(arena.allocate(4 * numel));
  std::memset(p->exp_avg, 0, 4 * numel);
  std::memset(p->exp_avg_sq, 0, 4 * numel);
  p->slot_ = transfer_->make_slot();
  return p;
}

void OffloadPipeline::wait_idle(HostParam& p, std::unique_lock<std::mutex>& lock) {
  job_done_.wait(lock, [&] { return p.done_ == p.queued_ || error_; });
  rethrow_locked();
}

void OffloadPipeline::rethrow_locked() {
  if (error_) std::rethrow_exception(error_);
}

void OffloadPipeline::load_weights(HostParam& p, std::uintptr_t device_weight, std::uintptr_t stream) {
  {
    std::unique_lock<std::mutex> lock(mutex_);
    wait_idle(p, lock);
  }
  const bool bf16 = p.weight_dtype == DType::bfloat16;
  void* staging = bf16 ? p.grad : static_cast<void*>(p.master);
  transfer_->download(*p.slot_, staging, reinterpret_cast<const void*>(device_weight), p.weight_bytes(), stream, {});
  transfer_->wait_download(*p.slot_);
  if (bf16) to_float32(engine_.pool(), p.master, p.grad, DType::bfloat16, p.numel);
}

void OffloadPipeline::land_gradient(const std::shared_ptr<HostParam>& p, std::uintptr_t device_grad,
                                    std::uintptr_t producer_stream, const GradJob& requested) {
  GradJob job = requested;
  void* target = p->grad;
  if (job.accumulate && job.overwrite && p->weight_dtype == DType::float32) {
    target = p->accumulator;  // first fp32 micro-batch: land in place, nothing to add
    job.accumulate = false;
  }
  const std::size_t bytes = p->weight_bytes();
  std::uint64_t download;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    wait_idle(*p, lock);  // the landing buffer is about to be overwritten
    landed_.wait(lock, [&] {
      return downloading_bytes_ == 0 || downloading_bytes_ + bytes <= max_download_bytes_ || error_;
    });
    rethrow_locked();
    downloading_bytes_ += bytes;
    download = ++p->downloads_;
  }
  HostParam* raw = p.get();
  transfer_->download(*p->slot_, target, reinterpret_cast<const void*>(device_grad), bytes, producer_stream,
                      [this, raw, bytes] {
                        {
                          std::lock_guard<std::mutex> lock(mutex_);
                          downloading_bytes_ -= bytes;
                          ++raw->landed_;
                        }
                        landed_.notify_all();
                        work_ready_.notify_one();
                      });
  enqueue(p, job, download);
}

void OffloadPipeline::submit(const std::shared_ptr<HostParam>& p, const GradJob& job) {
  enqueue(p, job, /*download=*/0);
}

void OffloadPipeline::enqueue(const std::shared_ptr<HostParam>& p, const GradJob& job, std::uint64_t download) {
  TS_EXPECTS(!(job.accumulate || job.from_accumulator) || p->accumulator,
             "OffloadPipeline: accumulation requested for a parameter without an accumulator");
  {
    std::lock_guard<std::mutex> lock(mutex_);
    rethrow_locked();
    queue_.push_back({p, job, ++p->queued_, download, ++order_});
    ++in_flight_;
  }
  work_ready_.notify_one();
}

// Chooses the next task to run: among tasks that are next in line for their parameter and whose
// gradient has landed, plain accumulation first (in arrival order: the next backward needs those
// landing buffers back in that order), then updates in forward order.
bool OffloadPipeline::pick_locked(Task& out) {
  auto best = queue_.end();
  for (auto it = queue_.begin(); it != queue_.end(); ++it) {
    const HostParam& p = *it->param;
    if (it->seq != p.done_ + 1 || p.landed_ < it->download) continue;
    if (best == queue_.end()) {
      best = it;
      continue;
    }
    const bool upd = it->job.update, best_upd = best->job.update;
    if (upd != best_upd) {
      if (!upd) best = it;
    } else if (upd && p.priority < best->param->priority) {
      best = it;
    }  // else: equal class, keep the earlier (arrival order)
  }
  if (best == queue_.end()) return false;
  out = std::move(*best);
  queue_.erase(best);
  return true;
}

void OffloadPipeline::run(Task& task) {
  HostParam& p = *task.param;
  const GradJob& job = task.job;
  ThreadPool& pool = engine_.pool();
  if (job.accumulate) accumulate_grad(pool, p.accumulator, p.grad, p.weight_dtype, p.numel, job.overwrite);
  const void* grad = job.from_accumulator ? static_cast<const void*>(p.accumulator) : p.grad;
  const DType grad_dtype = job.from_accumulator ? DType::float32 : p.weight_dtype;
  if (job.norm) p.squared_norm = squared_norm(pool, grad, grad_dtype, p.numel);
  if (job.update) {
    AdamWBuffers b;
    b.param = p.master;
    b.grad = grad;
    b.grad_dtype = grad_dtype;
    b.exp_avg = p.exp_avg;
    b.exp_avg_sq = p.exp_avg_sq;
    // bf16 weights go back up from the landing buffer, written by the kernel as it updates.
    b.param_bf16 = p.weight_dtype == DType::bfloat16 ? static_cast<std::uint16_t*>(p.grad) : nullptr;
    b.numel = p.numel;
    engine_.step(b, job.hyper);
  }
  if (job.device_weight) {
    const void* src = p.weight_dtype == DType::bfloat16 ? p.grad : static_cast<const void*>(p.master);
    transfer_->upload(*p.slot_, reinterpret_cast<void*>(job.device_weight), src, p.weight_bytes());
  }
}

void OffloadPipeline::worker_loop() {
  bool bound = false;
  for (;;) {
    Task task;
    bool failed;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_ready_.wait(lock, [&] { return (stopping_ && queue_.empty()) || pick_locked(task); });
      if (!task.param) return;  // stopping, nothing left
      failed = error_ != nullptr;
    }
    try {
      if (!bound) {
        transfer_->bind_thread();
        bound = true;
      }
      if (!failed) run(task);  // after a failure, jobs are drained unrun
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_) error_ = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++task.param->done_;
      --in_flight_;
    }
    job_done_.notify_all();
  }
}

void OffloadPipeline::gate(const std::vector<HostParam*>& params, std::uintptr_t stream) {
  std::unique_lock<std::mutex> lock(mutex_);
  for (HostParam* p : params) {
    wait_idle(*p, lock);
    transfer_->order_after_upload(*p->slot_, stream);
  }
}

void OffloadPipeline::synchronize() {
  std::unique_lock<std::mutex> lock(mutex_);
  job_done_.wait(lock, [&] { return in_flight_ == 0; });
  rethrow_locked();
}

std::size_t OffloadPipeline::pending() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return in_flight_;
}

std::size_t OffloadPipeline::downloading_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return downloading_bytes_;
}

}  // namespace trainstream
