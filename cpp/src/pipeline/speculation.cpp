// Speculation: next-state buffers, clip verdicts landing from the device, commits, dropped work.
#include <utility>

#include "task.hpp"
#include "trainstream/errors.hpp"
#include "trainstream/grad_ops.hpp"

namespace trainstream {

std::size_t OffloadPipeline::speculation_bytes(std::size_t numel, DType weight_dtype) {
  std::size_t bytes = 2 * HostArena::rounded(4 * numel);
  if (weight_dtype == DType::bfloat16) bytes += HostArena::rounded(4 * numel) + HostArena::rounded(2 * numel);
  return bytes;
}

std::size_t OffloadPipeline::enable_speculation(HostParam& p) {
  {
    std::unique_lock<std::mutex> lock(mutex_);
    wait_idle(p, lock);  // no job may be reading the pointers set below
    TS_EXPECTS(!p.keeps_weights_, "OffloadPipeline: weights kept on the host do not speculate");
    TS_EXPECTS(p.moments == Moments::fp32, "OffloadPipeline: blockwise 8-bit moments do not speculate (yet)");
    TS_EXPECTS(p.holds_state(), kReleased);
    if (p.next_exp_avg) return 0;
  }
  const auto touched = [&](std::size_t bytes) {
    void* block = spare_.allocate(bytes);
    zero_fill(engine_.pool(), block, bytes);
    return static_cast<float*>(block);
  };
  float* m = touched(4 * p.numel);
  float* v = touched(4 * p.numel);
  float* master = nullptr;
  std::uint16_t* bf16 = nullptr;
  if (p.weight_dtype == DType::bfloat16) {
    master = touched(4 * p.numel);
    bf16 = static_cast<std::uint16_t*>(transfer_->arena().allocate(2 * p.numel));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  p.next_exp_avg = m;
  p.next_exp_avg_sq = v;
  p.next_master = master;
  p.next_bf16 = bf16;
  return speculation_bytes(p.numel, p.weight_dtype);
}

void OffloadPipeline::commit(const std::vector<std::shared_ptr<HostParam>>& params,
                            const std::vector<std::uintptr_t>& device_weights,
                            const std::shared_ptr<const ClipScale>& verdict) {
  TS_EXPECTS(params.size() == device_weights.size(), "OffloadPipeline: one device weight per parameter");
  if (params.empty()) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    rethrow_locked();
    std::vector<GradJob> jobs(params.size());
    for (std::size_t k = 0; k < params.size(); ++k) {
      TS_EXPECTS(params[k] != nullptr, "OffloadPipeline: no parameter");
      TS_EXPECTS(params[k]->speculated_.has_value(),
                 "OffloadPipeline: a commit needs a speculative update queued since the parameter's last update");
      GradJob& job = jobs[k];
      job.commit = true;
      job.update = verdict != nullptr;
      job.scale = verdict;
      job.hyper = *params[k]->speculated_;
      job.device_weight = device_weights[k];
      check_job(*params[k], job, false);  // all before any is queued
    }
    for (std::size_t k = 0; k < params.size(); ++k) enqueue_locked(params[k], jobs[k], false, false);
  }
  work_ready_.notify_all();
}

std::shared_ptr<ClipScale> OffloadPipeline::land_scale(std::uintptr_t device_verdict, std::uintptr_t producer_stream) {
  constexpr std::size_t bytes = 2 * sizeof(double);
  if (verdict_host_ == nullptr) {  // (verdicts are queued from one thread, the caller's)
    verdict_slot_ = transfer_->make_slot();
    verdict_arena_ = std::make_unique<HostArena>(transfer_->slab_source(), 4096);
    verdict_host_ = static_cast<double*>(verdict_arena_->allocate(bytes));
  }
  auto scale = std::make_shared<ClipScale>();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    rethrow_locked();
    for (auto* tasks : {&queue_, &running_}) {
      for (auto& t : *tasks) {
        if (t->job.speculate && !t->verdict) t->verdict = scale;
      }
    }
    downloading_bytes_ += bytes;  // (the destructor waits for the callback below)
  }
  auto landed = [this, scale] {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      downloading_bytes_ -= bytes;
      scale->value_ = static_cast<float>(verdict_host_[0]);
      scale->norm_ = verdict_host_[1];
      scale->landed_.store(true, std::memory_order_release);
      if (!scale->commits()) drop_speculation_locked(scale.get());  // they will be redone: stop them now
    }
    landed_.notify_all();
    work_ready_.notify_all();
  };
  try {
    transfer_->download(*verdict_slot_, verdict_host_, reinterpret_cast<const void*>(device_verdict), bytes,
                        producer_stream, std::move(landed));
  } catch (...) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      downloading_bytes_ -= bytes;
    }
    landed_.notify_all();
    throw;
  }
  return scale;
}

void OffloadPipeline::wait(const ClipScale& scale) {
  std::unique_lock<std::mutex> lock(mutex_);
  landed_.wait(lock, [&] { return scale.landed() || error_; });
  rethrow_locked();
}

std::size_t OffloadPipeline::abandon_speculation() {
  std::lock_guard<std::mutex> lock(mutex_);
  return drop_speculation_locked(nullptr);
}

std::size_t OffloadPipeline::drop_speculation_locked(const ClipScale* verdict) {
  std::size_t cut = 0;
  for (auto* tasks : {&queue_, &running_}) {
    for (auto& t : *tasks) {
      if (t->job.speculate && !t->skip && (verdict == nullptr || t->verdict.get() == verdict)) {
        t->skip = true;
        ++cut;
      }
    }
  }
  return cut;
}

}  // namespace trainstream
