#include "trainstream/offload_pipeline.hpp"

#include <cstring>

#include "trainstream/errors.hpp"
#include "trainstream/grad_ops.hpp"

namespace trainstream {

OffloadPipeline::OffloadPipeline(std::unique_ptr<Transfer> transfer, std::size_t threads,
                                 std::optional<Isa> isa, std::size_t max_download_bytes,
                                 bool device_accumulate)
    : transfer_(std::move(transfer)),
      engine_(threads, isa),
      max_download_bytes_(max_download_bytes),
      device_accumulate_(device_accumulate) {
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
  if (weight_dtype == DType::float32) {
    p->inexact_ = static_cast<std::uint32_t*>(arena.allocate(sizeof(std::uint32_t)));
    p->packs_ = true;
  }
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
  check_accumulator(*p, requested);  // before anything is written to it
  GradJob job = requested;
  const bool device_add = device_accumulate_;
  // Where the gradient goes: the first fp32 micro-batch is copied straight into the accumulator;
  // other micro-batches are added into it by the transfer (device_add) or copied to the landing
  // buffer for the worker to add; without accumulation it is copied to the landing buffer.
  enum class Route { landing, in_place, add } route = Route::landing;
  if (job.accumulate && job.overwrite && p->weight_dtype == DType::float32) {
    route = Route::in_place;
  } else if (job.accumulate && device_add) {
    route = Route::add;
  }
  if (route != Route::landing) job.accumulate = false;
  // The old path always queues the job (even an empty one); the device path only one with work,
  // since an empty job would make the next micro-batch's hook wait for this one to land. Later
  // jobs still wait for this landing: enqueue() orders every job after the latest download.
  const bool queue_job =
      !device_add || route == Route::landing || job.norm || job.update || job.device_weight != 0;
  // Only the landing route consumes the gradient in a job of its own, which reads the verdict.
  const bool packed = route == Route::landing && p->packs_ && pack_gradients_;
  if (!packed) p->sent_bf16_ = false;
  const std::size_t bytes = p->weight_bytes();
  {
    std::unique_lock<std::mutex> lock(mutex_);
    // Queued jobs may still read the landing buffer or read/write the accumulator (the previous
    // window's norm and update), both of which this download is about to overwrite or add to.
    // Within a device-accumulated window no job is queued, so this returns at once.
    wait_idle(*p, lock);
    landed_.wait(lock, [&] {
      return downloading_bytes_ == 0 || downloading_bytes_ + bytes <= max_download_bytes_ || error_;
    });
    rethrow_locked();
    downloading_bytes_ += bytes;
    ++p->downloads_;
  }
  HostParam* raw = p.get();
  auto landed = [this, raw, bytes] {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      downloading_bytes_ -= bytes;
      ++raw->landed_;
    }
    landed_.notify_all();
    work_ready_.notify_one();
  };
  const void* grad = reinterpret_cast<const void*>(device_grad);
  try {
    if (route == Route::add) {
      transfer_->accumulate_download(*p->slot_, p->accumulator, grad, p->weight_dtype, p->numel,
                                     requested.overwrite, producer_stream, std::move(landed));
    } else if (packed) {
      transfer_->download_bf16_exact(*p->slot_, p->grad, static_cast<const float*>(grad), p->numel,
                                     p->inexact_, producer_stream, std::move(landed));
    } else {
      void* target = route == Route::in_place ? static_cast<void*>(p->accumulator) : p->grad;
      transfer_->download(*p->slot_, target, grad, bytes, producer_stream, std::move(landed));
    }
  } catch (...) {
    // Nothing was queued, so `landed` will never run: undo its bookkeeping, or later jobs and the
    // destructor would wait for it forever.
    {
      std::lock_guard<std::mutex> lock(mutex_);
      downloading_bytes_ -= bytes;
      --p->downloads_;
    }
    landed_.notify_all();
    throw;
  }
  if (queue_job) enqueue(p, job, packed);
}

void OffloadPipeline::submit(const std::shared_ptr<HostParam>& p, const GradJob& job) { enqueue(p, job); }

void OffloadPipeline::check_accumulator(const HostParam& p, const GradJob& job) {
  TS_EXPECTS(!(job.accumulate || job.from_accumulator) || p.accumulator,
             "OffloadPipeline: accumulation requested for a parameter without an accumulator");
}

void OffloadPipeline::enqueue(const std::shared_ptr<HostParam>& p, const GradJob& job, bool packed) {
  check_accumulator(*p, job);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    rethrow_locked();
    // The job runs after every download of this parameter issued so far has landed: its own
    // gradient, and device accumulations that queued no job of their own.
    queue_.push_back({p, job, ++p->queued_, p->downloads_, ++order_, packed});
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
  DType landed = p.weight_dtype;  // what the landing buffer holds
  if (task.packed) {
    if (*p.inexact_ == 0) {
      landed = DType::bfloat16;
    } else {
      p.packs_ = false;  // e.g. a tied or fp32-computed weight: stop testing its gradients
    }
    p.sent_bf16_ = landed == DType::bfloat16;
  }
  if (job.accumulate) accumulate_grad(pool, p.accumulator, p.grad, landed, p.numel, job.overwrite);
  const void* grad = job.from_accumulator ? static_cast<const void*>(p.accumulator) : p.grad;
  const DType grad_dtype = job.from_accumulator ? DType::float32 : landed;
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

bool OffloadPipeline::settled(const std::vector<HostParam*>& params) {
  std::lock_guard<std::mutex> lock(mutex_);
  rethrow_locked();
  for (HostParam* p : params) {
    // A job is counted done after it has issued its upload, so a finished job's upload is seen.
    if (p->done_ != p->queued_ || !transfer_->upload_complete(*p->slot_)) return false;
  }
  return true;
}

void OffloadPipeline::synchronize() {
  std::unique_lock<std::mutex> lock(mutex_);
  // Downloads first: a device accumulation need not have a job that waits for it.
  landed_.wait(lock, [&] { return downloading_bytes_ == 0 || error_; });
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
