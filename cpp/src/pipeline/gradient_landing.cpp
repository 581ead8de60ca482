// Gradient landing: each gradient's download to host memory, by the route it takes, under the budget.
#include <chrono>
#include <utility>

#include "trainstream/offload_pipeline.hpp"

namespace trainstream {

void OffloadPipeline::land_gradient(const std::shared_ptr<HostParam>& p, std::uintptr_t device_grad,
                                    std::uintptr_t producer_stream, const GradJob& requested) {
  check_job(*p, requested, true);  // before anything is written to it
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
  if (route != Route::landing) {
    job.accumulate = false;
    check_job(*p, job, false);  // what is left of it must not read a landing buffer this leaves out
  }
  // Without device accumulation every gradient queues its job (even an empty one); with it, only
  // a job with work is queued, since an empty one would make the next micro-batch's hook wait for
  // this one to land. Later jobs still wait for this landing: enqueue() orders every job after
  // the latest download.
  const bool queue_job =
      !device_add || route == Route::landing || job.norm || job.update || job.device_weight != 0;
  // Only the landing route consumes the gradient in a job of its own, which reads the verdict.
  const bool packed = route == Route::landing && p->packs_ && pack_gradients_;
  if (!packed) p->sent_bf16_ = false;
  const std::size_t bytes = p->weight_bytes();
  {
    std::unique_lock<std::mutex> lock(mutex_);
    const auto waiting_since = std::chrono::steady_clock::now();
    // Queued jobs may still read the landing buffer or read/write the accumulator (the previous
    // window's norm and update), both of which this download is about to overwrite or add to.
    // Within a device-accumulated window no job is queued, so this returns at once.
    wait_idle(*p, lock);
    // An fp32 parameter with an accumulator takes its landing buffer the first time a gradient is
    // sent there (a window summed in VRAM, micro-batches added on the host): no job reads it now.
    if (route == Route::landing && p->grad == nullptr) p->grad = transfer_->arena().allocate(p->weight_bytes());
    landed_.wait(lock, [&] {
      return downloading_bytes_ == 0 || downloading_bytes_ + bytes <= max_download_bytes_ || error_;
    });
    rethrow_locked();
    stats_.landing_wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - waiting_since).count();
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
  const DeviceNorm norm{reinterpret_cast<double*>(job.device_norm), reinterpret_cast<double*>(job.device_norm_scratch)};
  std::uintptr_t after = producer_stream;  // what the download follows
  try {
    // A packed download measures in its own pass over the gradient.
    if (norm.out && !packed) after = transfer_->measure(*p->slot_, grad, p->weight_dtype, p->numel, norm, after);
    if (route == Route::add) {
      transfer_->accumulate_download(*p->slot_, p->accumulator, grad, p->weight_dtype, p->numel,
                                     requested.overwrite, after, std::move(landed));
    } else if (packed) {
      transfer_->download_bf16_exact(*p->slot_, p->grad, static_cast<const float*>(grad), p->numel,
                                     p->inexact_, after, norm, std::move(landed));
    } else {
      void* target = route == Route::in_place ? static_cast<void*>(p->accumulator) : p->grad;
      transfer_->download(*p->slot_, target, grad, bytes, after, std::move(landed));
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
  if (queue_job) enqueue(p, job, route == Route::landing, packed);
}

std::size_t OffloadPipeline::downloading_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return downloading_bytes_;
}

}  // namespace trainstream
