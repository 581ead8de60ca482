// Speculation: next-state buffers, clip verdicts landing from the device, commits, dropped work.
#include <utility>

#include "task.hpp"
#include "trainstream/errors.hpp"
#include "trainstream/grad_ops.hpp"

namespace trainstream {

std::size_t OffloadPipeline::speculation_bytes(std::size_t numel, DType weight_dtype, Moments moments) {
  const bool bf16 = weight_dtype == DType::bfloat16;
  std::size_t bytes = bf16 ? HostArena::rounded(2 * numel) : 0;
  if (quantized(moments)) {  // codes and scales, and the master, which is state either way
    const std::size_t codes = 2 * (HostArena::rounded(numel) + HostArena::rounded(4 * (numel / kQuantBlock)));
    if (moments == Moments::blockwise8_sr) return codes + HostArena::rounded(2 * numel);  // (they go up from it)
    return bytes + codes + HostArena::rounded(4 * numel);
  }
  return bytes + 2 * HostArena::rounded(4 * numel) + (bf16 ? HostArena::rounded(4 * numel) : 0);
}

std::size_t OffloadPipeline::enable_speculation(HostParam& p) {
  {
    std::unique_lock<std::mutex> lock(mutex_);
    wait_idle(p, lock);  // no job may be reading the pointers set below
    TS_EXPECTS(!p.keeps_weights_, "OffloadPipeline: weights kept on the host do not speculate");
    TS_EXPECTS(p.holds_state(), kReleased);
    if (p.has_next_state()) return 0;
  }
  const auto touched = [&](std::size_t bytes) {
    void* block = spare_.allocate(bytes);
    zero_fill(engine_.pool(), block, bytes);
    return block;
  };
  const bool compact = quantized(p.moments), bf16 = p.weight_dtype == DType::bfloat16;
  const bool stochastic = p.moments == Moments::blockwise8_sr;
  const std::size_t n = p.numel;
  float* m = compact ? nullptr : static_cast<float*>(touched(4 * n));
  float* v = compact ? nullptr : static_cast<float*>(touched(4 * n));
  Quantized m8, v8;
  if (compact) {
    for (Quantized* q : {&m8, &v8}) {
      q->codes = static_cast<std::uint8_t*>(touched(n));
      q->scale = static_cast<float*>(touched(4 * (n / kQuantBlock)));
    }
  }
  float* master = (bf16 || compact) && !stochastic ? static_cast<float*>(touched(4 * n)) : nullptr;
  std::uint16_t* master_bf16 = stochastic ? static_cast<std::uint16_t*>(touched(2 * n)) : nullptr;
  std::uint16_t* rounded =
      bf16 && !stochastic ? static_cast<std::uint16_t*>(transfer_->arena().allocate(2 * n)) : nullptr;
  std::lock_guard<std::mutex> lock(mutex_);
  p.next_exp_avg = m;
  p.next_exp_avg_sq = v;
  p.next_exp_avg8 = m8;
  p.next_exp_avg_sq8 = v8;
  p.next_master = master;
  p.next_master_bf16 = master_bf16;
  p.next_bf16 = rounded;
  return speculation_bytes(n, p.weight_dtype, p.moments);
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
