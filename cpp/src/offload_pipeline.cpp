// The pipeline's face: its engine threads start and stop here, and parameters get their host buffers.
#include "trainstream/offload_pipeline.hpp"

#include "pipeline/task.hpp"
#include "trainstream/errors.hpp"
#include "trainstream/grad_ops.hpp"

#include <string>

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
                                                      bool accumulate, std::int64_t priority,
                                                      bool with_state, Moments moments) {
  TS_EXPECTS(numel > 0, "OffloadPipeline: zero-size parameter");
  if (quantized(moments)) {
    TS_EXPECTS(moments != Moments::blockwise8_sr || weight_dtype == DType::bfloat16,
               "OffloadPipeline: stochastically rounded weights without a master are bf16");
    TS_EXPECTS(numel % kQuantBlock == 0, "OffloadPipeline: blockwise 8-bit moments need a multiple of " +
                                             std::to_string(kQuantBlock) + " elements, got " + std::to_string(numel));
    TS_EXPECTS(!quantization_maps_.empty(), "OffloadPipeline: set_quantization_maps() before 8-bit moments");
  }
  auto p = std::make_shared<HostParam>();
  p->moments = moments;
  p->numel = numel;
  p->weight_dtype = weight_dtype;
  p->priority = priority;
  p->accumulates_ = accumulate;
  if (with_state) take_state(*p);
  p->slot_ = transfer_->make_slot();
  return p;
}

void OffloadPipeline::set_quantization_maps(const float* signed_map, const float* unsigned_map) {
  TS_EXPECTS(signed_map && unsigned_map, "OffloadPipeline: null quantization map");
  std::vector<float> maps(signed_map, signed_map + 256);
  maps.insert(maps.end(), unsigned_map, unsigned_map + 256);
  std::lock_guard<std::mutex> lock(mutex_);
  TS_EXPECTS(quantization_maps_.empty() || quantization_maps_ == maps,
             "OffloadPipeline: the quantization maps are set once");
  quantization_maps_ = std::move(maps);
}

std::size_t OffloadPipeline::take_state(HostParam& p) {
  if (p.holds_state()) return 0;
  HostArena& arena = transfer_->arena();
  const std::size_t numel = p.numel;
  if (p.moments == Moments::blockwise8_sr) {
    p.master_bf16 = static_cast<std::uint16_t*>(arena.allocate(2 * numel));
  } else {
    p.master = static_cast<float*>(arena.allocate(4 * numel));
  }
  if (quantized(p.moments)) {
    for (Quantized* q : {&p.exp_avg8, &p.exp_avg_sq8}) {  // torchao's zeros: codes 0, scales 0
      q->codes = static_cast<std::uint8_t*>(arena.allocate(numel));
      q->scale = static_cast<float*>(arena.allocate(4 * (numel / kQuantBlock)));
      zero_fill(engine_.pool(), q->codes, numel);
      zero_fill(engine_.pool(), q->scale, 4 * (numel / kQuantBlock));
    }
  } else {
    p.exp_avg = static_cast<float*>(arena.allocate(4 * numel));
    p.exp_avg_sq = static_cast<float*>(arena.allocate(4 * numel));
    zero_fill(engine_.pool(), p.exp_avg, 4 * numel);
    zero_fill(engine_.pool(), p.exp_avg_sq, 4 * numel);
  }
  if (!lands_in_accumulator(p.weight_dtype, p.accumulates_)) p.grad = arena.allocate(p.weight_bytes());
  if (p.accumulates_) p.accumulator = static_cast<float*>(arena.allocate(4 * numel));
  p.landing_dtype_ = p.weight_dtype;
  if (p.weight_dtype == DType::float32) {
    p.inexact_ = static_cast<std::uint32_t*>(arena.allocate(sizeof(std::uint32_t)));
    p.packs_ = true;
  }
  return state_bytes(p);
}

std::size_t OffloadPipeline::release_state(HostParam& p) {
  {
    std::unique_lock<std::mutex> lock(mutex_);
    wait_idle(p, lock);  // no job may still read or write its buffers
    TS_EXPECTS(!p.keeps_weights_, "OffloadPipeline: a streamed parameter's weights live in its host state");
    if (!p.holds_state()) return 0;
    p.speculated_.reset();
  }
  const std::size_t bytes = state_bytes(p);
  HostArena& arena = transfer_->arena();
  const std::size_t numel = p.numel;
  // A commit swaps the moments (and a bf16 master) with speculation's second set: each buffer goes
  // back to the arena that holds it now.
  for (float* block : {p.master, p.exp_avg, p.exp_avg_sq, p.next_exp_avg, p.next_exp_avg_sq, p.next_master}) {
    if (block != nullptr) (spare_.owns(block) ? spare_ : arena).release(block, 4 * numel);
  }
  arena.release(p.grad, p.weight_bytes());
  arena.release(p.accumulator, 4 * numel);
  arena.release(p.inexact_, sizeof(std::uint32_t));
  arena.release(p.next_bf16, 2 * numel);
  const auto give_back = [&](void* block, std::size_t bytes) {
    if (block != nullptr) (spare_.owns(block) ? spare_ : arena).release(block, bytes);
  };
  give_back(p.master_bf16, 2 * numel);
  give_back(p.next_master_bf16, 2 * numel);
  p.master_bf16 = p.next_master_bf16 = nullptr;
  for (Quantized* q : {&p.exp_avg8, &p.exp_avg_sq8, &p.next_exp_avg8, &p.next_exp_avg_sq8}) {
    give_back(q->codes, numel);
    give_back(q->scale, 4 * (numel / kQuantBlock));
    *q = Quantized{};
  }
  p.master = p.exp_avg = p.exp_avg_sq = p.accumulator = nullptr;
  p.next_exp_avg = p.next_exp_avg_sq = p.next_master = nullptr;
  p.grad = nullptr;
  p.inexact_ = nullptr;
  p.next_bf16 = nullptr;
  return bytes;
}

std::size_t OffloadPipeline::state_bytes(std::size_t numel, DType weight_dtype, bool accumulate, Moments moments) {
  const std::size_t master = moments == Moments::blockwise8_sr ? 2 : 4;
  const std::size_t rest = (master + (accumulate ? 4 : 0) +
                            (lands_in_accumulator(weight_dtype, accumulate) ? 0 : dtype_size(weight_dtype))) *
                           numel;
  if (quantized(moments)) {
    return rest + 2 * (HostArena::rounded(numel) + HostArena::rounded(4 * (numel / kQuantBlock)));
  }
  return rest + 8 * numel;
}

}  // namespace trainstream
