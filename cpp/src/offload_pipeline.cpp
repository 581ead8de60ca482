// The pipeline's face: its engine threads start and stop here, and parameters get their host buffers.
#include "trainstream/offload_pipeline.hpp"

#include "pipeline/task.hpp"
#include "trainstream/errors.hpp"
#include "trainstream/grad_ops.hpp"

namespace trainstream {

OffloadPipeline::OffloadPipeline(std::unique_ptr<Transfer> transfer, std::size_t threads,
                                 std::optional<Isa> isa, std::size_t max_download_bytes,
                                 bool device_accumulate, int niceness)
    : transfer_(std::move(transfer)),
      spare_(transfer_ ? transfer_->slab_source() : std::make_unique<PageableSlabs>()),
      engine_(threads, isa),
      max_download_bytes_(max_download_bytes),
      device_accumulate_(device_accumulate),
      niceness_(niceness) {
  TS_EXPECTS(transfer_ != nullptr, "OffloadPipeline: no transfer backend");
  try {
    for (std::size_t i = 0; i < engine_.threads(); ++i) workers_.emplace_back([this] { worker_loop(); });
  } catch (...) {  // out of threads: stop the ones already running before giving up
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    work_ready_.notify_all();
    for (auto& t : workers_) t.join();
    throw;
  }
}

OffloadPipeline::~OffloadPipeline() {
  {
    // Downloads still in flight call back into this object when they land: wait for them.
    std::unique_lock<std::mutex> lock(mutex_);
    landed_.wait(lock, [&] { return downloading_bytes_ == 0; });
    stopping_ = true;
  }
  work_ready_.notify_all();
  for (auto& t : workers_) t.join();
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
  p->landing_dtype_ = weight_dtype;
  if (weight_dtype == DType::float32) {
    p->inexact_ = static_cast<std::uint32_t*>(arena.allocate(sizeof(std::uint32_t)));
    p->packs_ = true;
  }
  zero_fill(engine_.pool(), p->exp_avg, 4 * numel);
  zero_fill(engine_.pool(), p->exp_avg_sq, 4 * numel);
  p->slot_ = transfer_->make_slot();
  return p;
}

}  // namespace trainstream
