// The engine threads: they start jobs, run them chunk by chunk and finish them (norm, swap, upload).
#include <algorithm>
#include <chrono>
#include <utility>

#include "task.hpp"
#include "trainstream/errors.hpp"
#include "trainstream/grad_ops.hpp"
#include "trainstream/thread_pool.hpp"

namespace trainstream {

static_assert(kChunkAlignment % kNormBlock == 0, "a job's chunks must hold whole norm blocks");
static_assert(kChunkAlignment % kQuantBlock == 0, "a job's chunks must hold whole 8-bit blocks");

void OffloadPipeline::worker_loop() {
  lower_this_thread_priority(niceness_);
  name_this_thread("ts-engine");  // (after: a thread found by its name has its priority)
  try {
    transfer_->bind_thread();  // before any other call: picking a job may query an upload's event
  } catch (...) {
    record_error();  // (every job is then drained unrun, and synchronize() rethrows this)
  }
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    Task* task = nullptr;
    std::size_t chunk = 0;
    work_ready_.wait(lock, [&] {
      task = next_chunk_locked(chunk);
      return task || (stopping_ && queue_.empty() && running_.empty());
    });
    if (!task) return;  // stopping, nothing left
    // (the rate the planner reads is the updates': a job that only adds or measures is not timed)
    const bool timed = task->job.update, adding = task->job.accumulate && !task->job.update;
    if (timed && running_update_chunks_++ == 0) busy_since_ = std::chrono::steady_clock::now();
    if (adding && running_add_chunks_++ == 0) adding_since_ = std::chrono::steady_clock::now();
    lock.unlock();
    bool ok = true;
    try {
      run_chunk(*task, chunk);
    } catch (...) {
      record_error();
      ok = false;
    }
    lock.lock();
    if (timed && --running_update_chunks_ == 0) {
      stats_.busy_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - busy_since_).count();
    }
    if (adding && --running_add_chunks_ == 0) {
      stats_.adding_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - adding_since_).count();
    }
    if (!ok) task->skip = true;
    if (++task->chunks_done < task->chunks) continue;
    // This thread ran the job's last chunk: it finishes the job.
    auto it = std::find_if(running_.begin(), running_.end(), [&](const auto& t) { return t.get() == task; });
    std::unique_ptr<Task> done = std::move(*it);
    running_.erase(it);
    lock.unlock();
    std::size_t bytes = 0;
    try {
      bytes = finish(*done);
    } catch (...) {
      record_error();
    }
    lock.lock();
    if (done->job.update && !done->skip) stats_.updated_elements += done->param->numel;
    if (done->job.accumulate && !done->job.update && !done->skip) stats_.added_elements += done->param->numel;
    if (bytes) track_upload_locked(done->param, bytes);
    ++done->param->done_;
    --in_flight_;
    job_done_.notify_all();
    // The parameter's next job may be ready now; when stopping, the others may exit.
    if (stopping_) {
      work_ready_.notify_all();
    } else {
      work_ready_.notify_one();
    }
  }
}

// Under the mutex: a chunk of the earliest started job that has one left, else the first chunk of
// a newly started job; null when there is no work.
OffloadPipeline::Task* OffloadPipeline::next_chunk_locked(std::size_t& chunk) {
  for (auto& t : running_) {
    if (t->next_chunk < t->chunks) {
      chunk = t->next_chunk++;
      return t.get();
    }
  }
  std::unique_ptr<Task> fresh = pick_locked();
  if (!fresh) return nullptr;
  start(*fresh);
  chunk = fresh->next_chunk++;
  Task* raw = fresh.get();
  running_.push_back(std::move(fresh));
  if (raw->chunks > 1) work_ready_.notify_all();  // more chunks than this thread: wake the others
  return raw;
}

// Under the mutex: what the job's chunks read and how they are cut.
void OffloadPipeline::start(Task& task) {
  HostParam& p = *task.param;
  GradJob& job = task.job;
  if (error_) task.skip = true;  // after a failure, jobs are drained unrun (as are abandoned ones)
  if (job.scale) {
    job.hyper.grad_scale = job.scale->value();
    if (job.commit && job.scale->commits()) job.update = false;  // the speculated step stands
  }
  const bool redo = job.commit && job.update;  // the clipped step, into the next-state buffers
  if (task.landing) {  // this job's own download: what it wrote, for this job and the later ones
    p.landing_dtype_ = p.weight_dtype;
    if (task.packed) {
      if (*p.inexact_ == 0) {
        p.landing_dtype_ = DType::bfloat16;
      } else {
        p.packs_ = false;  // e.g. a tied or fp32-computed weight: stop testing its gradients
      }
      p.sent_bf16_ = p.landing_dtype_ == DType::bfloat16;
    }
  }
  if (job.update || job.commit) {  // (jobs of a parameter start in order: its last one has finished)
    task.held_term = p.held_term_;
    p.held_term_ = 0;
  }
  task.landed = p.landing_dtype_;
  task.grad = job.from_accumulator ? static_cast<const void*>(p.accumulator) : p.grad;
  task.grad_dtype = job.from_accumulator ? DType::float32 : task.landed;
  task.chunk = chunk_elements(p.numel, workers_.size());  // whole norm blocks
  const bool elementwise = job.accumulate || job.norm || job.update;
  // (8-bit moments: the master is state, and goes up whole)
  const bool fp32_term =
      upload_terms_ && p.weight_dtype == DType::float32 && p.moments == Moments::fp32 && job.device_weight != 0;
  if (job.commit && !job.update && !task.skip) {  // (finish() swaps and uploads)
    task.buffers.term_only = fp32_term;
    task.coeffs = adamw_coeffs(job.hyper);  // validated when the job was made
  }
  task.chunks = elementwise ? (p.numel + task.chunk - 1) / task.chunk : 1;
  if (job.norm) task.partial.assign((p.numel + kNormBlock - 1) / kNormBlock, 0.0);
  if (job.update && !task.skip && quantized(p.moments)) {
    start_8bit(task);
  } else if (job.update && !task.skip) {
    AdamWBuffers& b = task.buffers;
    b.param = p.master;
    b.grad = task.grad;
    b.grad_dtype = task.grad_dtype;
    b.exp_avg = p.exp_avg;
    b.exp_avg_sq = p.exp_avg_sq;
    const bool bf16 = p.weight_dtype == DType::bfloat16;
    // bf16 weights go back up from the landing buffer, written by the kernel as it updates (or
    // stay in their host buffer, when kept there).
    b.param_bf16 = bf16 ? (p.keeps_weights_ ? p.host_bf16 : static_cast<std::uint16_t*>(p.grad)) : nullptr;
    b.numel = p.numel;
    // fp32 weights: the master buffer receives the update term, and the device applies it.
    b.term_only = fp32_term;
    if (job.speculate || redo) {
      // The term is no state (the device holds the weights), so it may be written over; the
      // moments and a bf16 master may not, nor the landing buffer while a speculation may be
      // redone from its gradient. A redo reads each gradient element before it writes that
      // element's rounding, as an update in place does.
      b.exp_avg_out = p.next_exp_avg;
      b.exp_avg_sq_out = p.next_exp_avg_sq;
      if (bf16) {
        b.param_out = p.next_master;
        if (job.speculate) b.param_bf16 = p.next_bf16;
      }
    }
    try {
      TS_EXPECTS(!(job.speculate || redo) || b.term_only || bf16,
                 "OffloadPipeline: fp32 weights speculate only with upload_terms (their master is state)");
      validate_buffers(b);
      task.coeffs = adamw_coeffs(job.hyper);
    } catch (...) {
      if (!error_) error_ = std::current_exception();
      task.skip = true;
    }
  }
}

// Under the mutex: an update of blockwise 8-bit moments (torchao's AdamW8bit over the fp32 master).
void OffloadPipeline::start_8bit(Task& task) {
  HostParam& p = *task.param;
  const AdamWHyper& h = task.job.hyper;
  const bool stochastic = p.moments == Moments::blockwise8_sr;
  const bool second_set = task.job.speculate || task.job.commit;  // (a redo too), as an exact update
  AdamW8bitBuffers b;
  b.param = p.master;
  b.param16 = p.master_bf16;
  b.grad = task.grad;
  b.grad_dtype = task.grad_dtype;
  b.exp_avg = p.exp_avg8;
  b.exp_avg_sq = p.exp_avg_sq8;
  b.signed_qmap = quantization_maps_.data();
  b.unsigned_qmap = quantization_maps_.data() + 256;
  if (stochastic) {  // the weights are the state, and go up (or stream) from it
    b.param_bf16 = nullptr;
  } else if (p.weight_dtype == DType::bfloat16) {  // (up from the landing buffer, as an exact update's)
    b.param_bf16 = p.keeps_weights_ ? p.host_bf16 : static_cast<std::uint16_t*>(p.grad);
  }
  if (second_set) {
    b.param_out = p.next_master;
    b.param16_out = p.next_master_bf16;
    b.exp_avg_out = p.next_exp_avg8;
    b.exp_avg_sq_out = p.next_exp_avg_sq8;
    if (task.job.speculate && b.param_bf16 && !stochastic) b.param_bf16 = p.next_bf16;
  }
  b.numel = p.numel;
  // What goes up (upload_weights): the rounding, or the new bf16 weights themselves (a commit's
  // swap makes the second set the state before the upload).
  task.buffers.param_bf16 = b.param_bf16 ? b.param_bf16 : second_set ? b.param16_out : b.param16;
  AdamW8bitHyper hyper;  // torchao keeps lr and the step count as fp32 tensors
  hyper.lr = static_cast<float>(h.lr);
  hyper.beta1 = h.beta1;
  hyper.beta2 = h.beta2;
  hyper.eps = h.eps;
  hyper.weight_decay = h.weight_decay;
  hyper.step = h.step;
  hyper.grad_scale = static_cast<float>(h.grad_scale);
  hyper.stochastic_round = stochastic;
  hyper.seed = p.rounding_seed;
  try {
    TS_EXPECTS(!h.maximize, "OffloadPipeline: blockwise 8-bit moments do not maximize");
    task.step8.emplace(b, hyper, engine_.isa());
  } catch (...) {
    if (!error_) error_ = std::current_exception();
    task.skip = true;
  }
}

void OffloadPipeline::run_chunk(Task& task, std::size_t chunk) {
  if (task.skip) return;
  HostParam& p = *task.param;
  const GradJob& job = task.job;
  const std::size_t begin = chunk * task.chunk, end = std::min(p.numel, begin + task.chunk);
  if (job.accumulate) {
    const char* grad = static_cast<const char*>(p.grad) + begin * dtype_size(task.landed);
    accumulate_grad(p.accumulator + begin, grad, task.landed, end - begin, job.overwrite);
  }
  if (job.norm) {
    squared_norm_blocks(task.grad, task.grad_dtype, begin, end, p.numel, task.partial.data() + begin / kNormBlock);
  }
  // An update writes the term buffer that the speculated term may still be going up from.
  // So does a redo of stochastically rounded weights: their speculated ones went up from there.
  if (job.update && (task.held_term || (job.commit && p.moments == Moments::blockwise8_sr))) {
    transfer_->wait_upload(*p.slot_);
  }
  if (job.update && task.step8) {
    task.step8->run(begin / kQuantBlock, end / kQuantBlock);  // (chunks hold whole blocks)
  } else if (job.update) {
    engine_.kernel()(task.buffers, task.coeffs, begin, end);
  }
}

// After the job's last chunk, on the thread that ran it (without the mutex: the parameter's jobs
// run one at a time): the norm, a commit's swap and the upload. Returns the bytes it queued for
// upload.
std::size_t OffloadPipeline::finish(Task& task) {
  if (task.skip) return 0;
  HostParam& p = *task.param;
  if (task.job.norm) {
    double total = 0;
    for (double s : task.partial) total += s;
    p.squared_norm = total;
  }
  if (task.job.commit) {
    // The speculated (or redone) step becomes the state: this parameter's jobs run in order, so
    // no other job reads these pointers now.
    std::swap(p.exp_avg, p.next_exp_avg);
    std::swap(p.exp_avg_sq, p.next_exp_avg_sq);
    std::swap(p.exp_avg8, p.next_exp_avg8);
    std::swap(p.exp_avg_sq8, p.next_exp_avg_sq8);
    if (p.next_master) std::swap(p.master, p.next_master);  // (bf16 weights, or 8-bit moments)
    if (p.next_master_bf16) std::swap(p.master_bf16, p.next_master_bf16);
  }
  return upload_weights(task);
}

}  // namespace trainstream
