// The job queue: what is queued for each parameter, which job runs next, who waits for them, errors.
#include <optional>

#include "task.hpp"
#include "trainstream/errors.hpp"

namespace trainstream {

void OffloadPipeline::check_job(const HostParam& p, const GradJob& job, bool landing) {
  TS_EXPECTS(p.holds_state(), kReleased);
  TS_EXPECTS(p.grad || landing || job.from_accumulator || !(job.norm || job.update || job.accumulate),
             "OffloadPipeline: this job reads a landed gradient, but the parameter's gradients land in its "
             "accumulator (from_accumulator)");
  TS_EXPECTS(!(job.accumulate || job.from_accumulator) || p.accumulator,
             "OffloadPipeline: accumulation requested for a parameter without an accumulator");
  TS_EXPECTS(!job.speculate || !p.keeps_weights_, "OffloadPipeline: weights kept on the host do not speculate");
  TS_EXPECTS(!(job.speculate || job.commit) || p.has_next_state(),
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

void OffloadPipeline::submit(const std::shared_ptr<HostParam>& p, const GradJob& job) { enqueue(p, job); }

void OffloadPipeline::submit(const std::vector<std::shared_ptr<HostParam>>& params, const std::vector<GradJob>& jobs) {
  TS_EXPECTS(params.size() == jobs.size(), "OffloadPipeline: one job per parameter");
  for (std::size_t k = 0; k < params.size(); ++k) {
    TS_EXPECTS(params[k] != nullptr, "OffloadPipeline: no parameter");
    check_job(*params[k], jobs[k], false);  // all before any is queued
  }
  if (params.empty()) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    rethrow_locked();
    for (std::size_t k = 0; k < params.size(); ++k) enqueue_locked(params[k], jobs[k], false, false);
  }
  work_ready_.notify_all();
}

void OffloadPipeline::enqueue(const std::shared_ptr<HostParam>& p, const GradJob& job, bool landing, bool packed) {
  check_job(*p, job, landing);
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

void OffloadPipeline::wait_idle(HostParam& p, std::unique_lock<std::mutex>& lock) {
  job_done_.wait(lock, [&] { return p.done_ == p.queued_ || error_; });
  rethrow_locked();
}

void OffloadPipeline::wait(const std::vector<HostParam*>& params) {
  std::unique_lock<std::mutex> lock(mutex_);
  for (HostParam* p : params) wait_idle(*p, lock);
}

void OffloadPipeline::synchronize() {
  std::unique_lock<std::mutex> lock(mutex_);
  // Downloads first: a device accumulation need not have a job that waits for it.
  landed_.wait(lock, [&] { return downloading_bytes_ == 0 || error_; });
  job_done_.wait(lock, [&] { return in_flight_ == 0; });
  rethrow_locked();
}

void OffloadPipeline::rethrow_locked() {
  if (error_) std::rethrow_exception(error_);
}

void OffloadPipeline::record_error() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!error_) error_ = std::current_exception();
}

std::size_t OffloadPipeline::pending() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return in_flight_;
}

OffloadPipeline::Stats OffloadPipeline::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

}  // namespace trainstream
