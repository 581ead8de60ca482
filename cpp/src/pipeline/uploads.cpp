// Upload scheduling: what goes up after a job, how much is on its way, and when the device may read it.
#include "task.hpp"
#include "trainstream/errors.hpp"
#include "trainstream/grad_ops.hpp"

namespace trainstream {

void OffloadPipeline::load_weights(HostParam& p, std::uintptr_t device_weight, std::uintptr_t stream) {
  {
    std::unique_lock<std::mutex> lock(mutex_);
    wait_idle(p, lock);
  }
  TS_EXPECTS(p.holds_state(), kReleased);
  const bool bf16 = p.weight_dtype == DType::bfloat16;
  // (stochastically rounded bf16 weights are their own master: straight into it)
  void* staging = p.master_bf16 ? static_cast<void*>(p.master_bf16) : bf16 ? p.grad : static_cast<void*>(p.master);
  transfer_->download(*p.slot_, staging, reinterpret_cast<const void*>(device_weight), p.weight_bytes(), stream, {});
  transfer_->wait_download(*p.slot_);
  if (bf16 && p.master) to_float32(engine_.pool(), p.master, p.grad, DType::bfloat16, p.numel);
}

std::size_t OffloadPipeline::keep_weights_on_host(HostParam& p) {
  std::unique_lock<std::mutex> lock(mutex_);
  wait_idle(p, lock);  // no job may be writing the rounding where it used to go
  TS_EXPECTS(p.holds_state(), kReleased);
  if (p.keeps_weights_) return 0;
  std::size_t bytes = 0;
  // (stochastically rounded bf16 weights are their own state: they stream from it)
  if (p.weight_dtype == DType::bfloat16 && p.host_bf16 == nullptr && p.moments != Moments::blockwise8_sr) {
    lock.unlock();  // (the arena has a lock of its own)
    auto* buffer = static_cast<std::uint16_t*>(transfer_->arena().allocate(2 * p.numel));
    lock.lock();
    p.host_bf16 = buffer;
    bytes = 2 * p.numel;
  }
  p.keeps_weights_ = true;
  return bytes;
}

// An fp32 term waits for the commit in host memory, unless it went up to device memory when it was
// speculated, as bf16 weights did (upload_weights()).
bool OffloadPipeline::commit_uploads(const HostParam& p) {
  return p.weight_dtype != DType::bfloat16 && p.held_term_ == 0;
}

// Weights go up as soon as they are known, whatever a clip verdict later says, except fp32 update
// terms. A speculated bf16 rounding goes up at once, as an update without clipping does: the
// weights in VRAM are nobody's state (the master is, on the host), and if the verdict clips, the
// redo uploads the right rounding behind it on the same stream before the next forward reads
// them. An fp32 term cannot be taken back once applied: it waits for the commit in host memory, or
// in device memory the caller lent (GradJob::device_term), where the commit applies it.
std::size_t OffloadPipeline::upload_weights(const Task& task) {
  HostParam& p = *task.param;
  if (task.job.device_weight == 0) return 0;
  void* device = reinterpret_cast<void*>(task.job.device_weight);
  if (task.buffers.term_only) {
    const std::size_t bytes = sizeof(float) * p.numel;
    if (task.job.speculate) {
      if (task.job.device_term == 0) return 0;  // (the commit uploads it)
      transfer_->upload(*p.slot_, reinterpret_cast<void*>(task.job.device_term), p.master, bytes);
      p.held_term_ = task.job.device_term;
      return bytes;
    }
    if (task.held_term && !task.job.update) {  // a commit of a term already in device memory
      transfer_->apply_update(*p.slot_, static_cast<float*>(device), reinterpret_cast<const float*>(task.held_term),
                              p.numel, task.coeffs.decay);
      return 0;
    }
    transfer_->upload_update(*p.slot_, static_cast<float*>(device), p.master, p.numel, task.coeffs.decay);
    return bytes;
  }
  if (!task.job.update && !commit_uploads(p)) return 0;  // (bf16 weights go up from an update's rounding)
  if (task.job.speculate && p.weight_dtype == DType::float32) return 0;  // (8-bit moments: the commit uploads the master)
  if (p.weight_dtype == DType::bfloat16) {
    transfer_->upload(*p.slot_, device, task.buffers.param_bf16, p.weight_bytes());
  } else {
    transfer_->upload(*p.slot_, device, p.master, p.weight_bytes());
  }
  return p.weight_bytes();
}

void OffloadPipeline::track_upload_locked(const std::shared_ptr<HostParam>& p, std::size_t bytes) {
  uploads_.push_back({p, bytes});
  uploading_bytes_ += bytes;
  upload_room_locked();  // (drops those seen complete, so the list stays short)
}

bool OffloadPipeline::upload_room_locked() {
  try {
    // One stream carries them in order: the first not complete holds up the rest.
    while (!uploads_.empty() && transfer_->upload_complete(*uploads_.front().param->slot_)) {
      uploading_bytes_ -= uploads_.front().bytes;
      uploads_.pop_front();
    }
  } catch (...) {  // a failed query: the next synchronize() says so; until then, count nothing
    if (!error_) error_ = std::current_exception();
    uploads_.clear();
    uploading_bytes_ = 0;
  }
  return uploading_bytes_ < upload_window_;
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

}  // namespace trainstream
