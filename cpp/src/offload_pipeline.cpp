#include "trainstream/offload_pipeline.hpp"

#include <algorithm>

#include "trainstream/errors.hpp"
#include "trainstream/grad_ops.hpp"
#include "trainstream/thread_pool.hpp"

namespace trainstream {

static_assert(kChunkAlignment % kNormBlock == 0, "a job's chunks must hold whole norm blocks");

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

void OffloadPipeline::wait_idle(HostParam& p, std::unique_lock<std::mutex>& lock) {
  job_done_.wait(lock, [&] { return p.done_ == p.queued_ || error_; });
  rethrow_locked();
}

void OffloadPipeline::rethrow_locked() {
  if (error_) std::rethrow_exception(error_);
}

void OffloadPipeline::record_error() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!error_) error_ = std::current_exception();
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
  check_job(*p, requested);  // before anything is written to it
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

void OffloadPipeline::submit(const std::shared_ptr<HostParam>& p, const GradJob& job) { enqueue(p, job); }

void OffloadPipeline::submit(const std::vector<std::shared_ptr<HostParam>>& params, const std::vector<GradJob>& jobs) {
  TS_EXPECTS(params.size() == jobs.size(), "OffloadPipeline: one job per parameter");
  for (std::size_t k = 0; k < params.size(); ++k) {
    TS_EXPECTS(params[k] != nullptr, "OffloadPipeline: no parameter");
    check_job(*params[k], jobs[k]);  // all before any is queued
  }
  if (params.empty()) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    rethrow_locked();
    for (std::size_t k = 0; k < params.size(); ++k) enqueue_locked(params[k], jobs[k], false, false);
  }
  work_ready_.notify_all();
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
      check_job(*params[k], job);  // all before any is queued
    }
    for (std::size_t k = 0; k < params.size(); ++k) enqueue_locked(params[k], jobs[k], false, false);
  }
  work_ready_.notify_all();
}

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

std::size_t OffloadPipeline::keep_weights_on_host(HostParam& p) {
  std::unique_lock<std::mutex> lock(mutex_);
  wait_idle(p, lock);  // no job may be writing the rounding where it used to go
  if (p.keeps_weights_) return 0;
  std::size_t bytes = 0;
  if (p.weight_dtype == DType::bfloat16 && p.host_bf16 == nullptr) {
    lock.unlock();  // (the arena has a lock of its own)
    auto* buffer = static_cast<std::uint16_t*>(transfer_->arena().allocate(2 * p.numel));
    lock.lock();
    p.host_bf16 = buffer;
    bytes = 2 * p.numel;
  }
  p.keeps_weights_ = true;
  return bytes;
}

std::shared_ptr<ClipScale> OffloadPipeline::land_scale(std::uintptr_t device_verdict, std::uintptr_t producer_stream) {
  constexpr std::size_t bytes = 2 * sizeof(double);
  if (verdict_host_ == nullptr) {  // (verdicts are queued from one thread, the caller's)
    verdict_slot_ = transfer_->make_slot();
    verdict_host_ = static_cast<double*>(transfer_->arena().allocate(bytes));
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

void OffloadPipeline::wait(const std::vector<HostParam*>& params) {
  std::unique_lock<std::mutex> lock(mutex_);
  for (HostParam* p : params) wait_idle(*p, lock);
}

void OffloadPipeline::check_job(const HostParam& p, const GradJob& job) {
  TS_EXPECTS(!(job.accumulate || job.from_accumulator) || p.accumulator,
             "OffloadPipeline: accumulation requested for a parameter without an accumulator");
  TS_EXPECTS(!job.speculate || !p.keeps_weights_, "OffloadPipeline: weights kept on the host do not speculate");
  TS_EXPECTS(!(job.speculate || job.commit) || p.next_exp_avg,
             "OffloadPipeline: speculation requested for a parameter without next-state buffers "
             "(enable_speculation)");
  TS_EXPECTS(!job.speculate || job.update, "OffloadPipeline: a speculative job must be an update");
  TS_EXPECTS(!(job.speculate && job.scale), "OffloadPipeline: a speculative update has a clip coefficient of 1");
  TS_EXPECTS(!job.scale || job.update, "OffloadPipeline: a clip coefficient is for an update");
  TS_EXPECTS(!job.commit || !(job.accumulate || job.norm || job.from_accumulator || job.speculate),
             "OffloadPipeline: a commit does nothing but commit (and redo the step, when clipped)");
  TS_EXPECTS(!job.commit || job.update == (job.scale != nullptr),
             "OffloadPipeline: a commit redoes the step only when it waits for a clip coefficient");
  TS_EXPECTS(!job.device_norm == !job.device_norm_scratch,
             "OffloadPipeline: a device norm needs both its output and its scratch");
  TS_EXPECTS(!job.device_norm || !(job.accumulate || job.norm),
             "OffloadPipeline: a device norm measures the gradient as it lands, not a sum, and not twice");
  TS_EXPECTS(!job.device_term || (job.speculate && p.weight_dtype == DType::float32 && job.device_weight),
             "OffloadPipeline: a device term is for a speculative update of fp32 weights on the device");
}

void OffloadPipeline::enqueue(const std::shared_ptr<HostParam>& p, const GradJob& job, bool landing, bool packed) {
  check_job(*p, job);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    rethrow_locked();
    enqueue_locked(p, job, landing, packed);
  }
  work_ready_.notify_one();
}

void OffloadPipeline::enqueue_locked(const std::shared_ptr<HostParam>& p, const GradJob& job, bool landing,
                                     bool packed) {
  // The job runs after every download of this parameter issued so far has landed: its own
  // gradient, and device accumulations that queued no job of their own.
  auto task = std::make_unique<Task>();
  task->param = p;
  task->job = job;
  task->seq = ++p->queued_;
  task->download = p->downloads_;
  task->landing = landing;
  task->packed = packed;
  if (job.speculate) {
    p->speculated_ = job.hyper;
  } else if (job.update || job.commit) {
    p->speculated_.reset();
  }
  queue_.push_back(std::move(task));
  ++in_flight_;
}

// An fp32 term waits for the commit in host memory, unless it went up to device memory when it was
// speculated, as bf16 weights did (finish()).
bool OffloadPipeline::commit_uploads(const HostParam& p) {
  return p.weight_dtype != DType::bfloat16 && p.held_term_ == 0;
}

// Chooses the next job to start: among jobs that are next in line for their parameter and whose
// gradient (and clip verdict) has landed, plain accumulation first (in arrival order: the next
// backward needs those landing buffers back in that order), then updates in forward order. A
// commit that redoes nothing only swaps buffers and uploads an fp32 term (bf16 weights went up
// when they were speculated, so it goes first). When a window's verdict lands, the
// parameters that speculated early are all ready to commit at once while the engine still updates
// the first layers: such a commit goes ahead of the updates while the uploads on their way up are
// under the window, so the stream stays busy, and otherwise waits its turn in forward order, so
// the weights the next forward needs first never queue behind more than the window of later ones.
std::unique_ptr<OffloadPipeline::Task> OffloadPipeline::pick_locked() {
  std::optional<bool> room;  // asked once, when a commit needs it
  auto ahead = [&](const GradJob& job, const HostParam& p) {
    const bool swap_only = job.commit && (!job.update || (job.scale && job.scale->commits()));
    if (!swap_only) return !job.update;
    if (job.device_weight == 0 || !commit_uploads(p)) return true;
    if (!room) room = upload_room_locked();
    return *room;
  };
  auto best = queue_.end();
  bool best_ahead = false;
  for (auto it = queue_.begin(); it != queue_.end(); ++it) {
    const Task& t = **it;
    const HostParam& p = *t.param;
    if (t.seq != p.done_ + 1 || p.landed_ < t.download || (t.job.scale && !t.job.scale->landed())) continue;
    const bool a = ahead(t.job, p);
    // (in one class, the earlier keeps its place: arrival order, or forward order among updates)
    if (best == queue_.end() || (a && !best_ahead) ||
        (a == best_ahead && !a && p.priority < (*best)->param->priority)) {
      best = it;
      best_ahead = a;
    }
  }
  if (best == queue_.end()) return nullptr;
  std::unique_ptr<Task> out = std::move(*best);
  queue_.erase(best);
  return out;
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
  const bool fp32_term = upload_terms_ && p.weight_dtype == DType::float32 && job.device_weight != 0;
  if (job.commit && !job.update && !task.skip) {  // (finish() swaps and uploads)
    task.buffers.term_only = fp32_term;
    task.coeffs = adamw_coeffs(job.hyper);  // validated when the job was made
  }
  task.chunks = elementwise ? (p.numel + task.chunk - 1) / task.chunk : 1;
  if (job.norm) task.partial.assign((p.numel + kNormBlock - 1) / kNormBlock, 0.0);
  if (job.update && !task.skip) {
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
  if (job.update && task.held_term) transfer_->wait_upload(*p.slot_);
  if (job.update) engine_.kernel()(task.buffers, task.coeffs, begin, end);
}

// After the job's last chunk, on the thread that ran it: the norm and the upload. Returns the
// bytes it queued for upload.
//
// Weights go up as soon as they are known, whatever a clip verdict later says, except fp32 update
// terms. A speculated bf16 rounding goes up at once, as an update without clipping does: the
// weights in VRAM are nobody's state (the master is, on the host), and if the verdict clips, the
// redo uploads the right rounding behind it on the same stream before the next forward reads
// them. An fp32 term cannot be taken back once applied: it waits for the commit in host memory, or
// in device memory the caller lent (GradJob::device_term), where the commit applies it.
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
    if (p.weight_dtype == DType::bfloat16) std::swap(p.master, p.next_master);
  }
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
  if (p.weight_dtype == DType::bfloat16) {
    transfer_->upload(*p.slot_, device, task.buffers.param_bf16, p.weight_bytes());
  } else {
    transfer_->upload(*p.slot_, device, p.master, p.weight_bytes());
  }
  return p.weight_bytes();
}

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
    if (running_chunks_++ == 0) busy_since_ = std::chrono::steady_clock::now();
    lock.unlock();
    bool ok = true;
    try {
      run_chunk(*task, chunk);
    } catch (...) {
      record_error();
      ok = false;
    }
    lock.lock();
    if (--running_chunks_ == 0) {
      stats_.busy_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - busy_since_).count();
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
    if (bytes) {
      uploads_.push_back({done->param, bytes});
      uploading_bytes_ += bytes;
      upload_room_locked();  // (drops those seen complete, so the list stays short)
    }
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

OffloadPipeline::Stats OffloadPipeline::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

std::size_t OffloadPipeline::downloading_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return downloading_bytes_;
}

}  // namespace trainstream
