// The host half of an offloaded training step. Gradients land in host buffers as autograd
// produces them; the engine's threads then fold them into the accumulator, take their norm, run
// AdamW and upload the new weights, each parameter as soon as its own gradient is there.
// Python only enqueues work (from autograd hooks) and waits where ordering demands it.
#pragma once

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "trainstream/adamw.hpp"
#include "trainstream/adamw8bit.hpp"
#include "trainstream/transfer.hpp"

namespace trainstream {

// How a parameter's moments are held: fp32 (torch's AdamW), or blockwise 8-bit codes and scales
// (torchao's AdamW8bit, adamw8bit.hpp: its update, over the fp32 master); blockwise8_sr: the same
// over bf16 weights that are their own state, without a master, each update rounded
// stochastically (AdamW8bit(bf16_stochastic_round=True)).
enum class Moments : int { fp32 = 0, blockwise8 = 1, blockwise8_sr = 2 };
inline bool quantized(Moments m) { return m != Moments::fp32; }

// One parameter's host state: fp32 master weights, AdamW moments, the landing buffer for its
// gradient (in the weight dtype; for bf16 weights it also carries the bf16 weights back up; an
// fp32 gradient that is bf16-exact lands in its first half as bf16) and, with gradient
// accumulation, an fp32 accumulator. fp32 weights with an accumulator land their gradients in it
// and take a landing buffer only when one is sent there instead (land_gradient).
class HostParam {
 public:
  std::size_t numel = 0;
  DType weight_dtype = DType::float32;
  // The fp32 master weights; for fp32 weights with OffloadPipeline::upload_terms, the last update
  // term instead (the weights themselves are then only on the device).
  float* master = nullptr;
  // Moments::blockwise8_sr: the bf16 weights, which are the state (master null), and the seed of
  // their stochastic rounding (AdamW8bitHyper::seed), fixed for the parameter's life.
  std::uint16_t* master_bf16 = nullptr;
  std::uint64_t rounding_seed = 0;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  // Moments::blockwise8: the moments as codes and block scales instead (exp_avg, exp_avg_sq null).
  Moments moments = Moments::fp32;
  Quantized exp_avg8;
  Quantized exp_avg_sq8;
  void* grad = nullptr;  // the landing buffer (null until needed: see above)
  float* accumulator = nullptr;
  double squared_norm = 0.0;  // of the last gradient measured with GradJob::norm (grad_ops.hpp)
  // Speculation (OffloadPipeline::enable_speculation): where a speculative update writes the new
  // moments and, for bf16 weights, the new fp32 master and its bf16 rounding, leaving the state
  // above untouched until a commit swaps the two sets. Null until enabled.
  float* next_exp_avg = nullptr;
  float* next_exp_avg_sq = nullptr;
  float* next_master = nullptr;  // (8-bit moments: for fp32 weights too, whose master is state)
  std::uint16_t* next_bf16 = nullptr;
  std::uint16_t* next_master_bf16 = nullptr;  // (blockwise8_sr: the next weights, which also go up)
  Quantized next_exp_avg8;  // Moments::blockwise8: the second set of codes and scales
  Quantized next_exp_avg_sq8;
  // Weights kept in host memory (OffloadPipeline::keep_weights_on_host): bf16 weights' rounding is
  // written here by each update instead of into the landing buffer, where the next gradient would
  // overwrite it. Null unless kept (fp32 weights need none: the master is the weights).
  std::uint16_t* host_bf16 = nullptr;
  // Position in the forward pass (lower runs first): updates are done in this order when
  // several are ready, so the next forward can start while later layers still update.
  std::int64_t priority = 0;

  std::size_t weight_bytes() const { return numel * dtype_size(weight_dtype); }
  // Whether this fp32 parameter's gradients are still tried as bf16 (see land_gradient), and
  // whether the last one that has been consumed crossed as bf16.
  bool packs_gradients() const { return packs_; }
  bool keeps_weights_on_host() const { return keeps_weights_; }
  bool last_gradient_as_bf16() const { return sent_bf16_; }
  // False once OffloadPipeline::release_state gave its buffers back (the parameter is resident),
  // until take_state takes new ones.
  bool holds_state() const { return master != nullptr || master_bf16 != nullptr; }
  // Whether enable_speculation gave it a second state set.
  bool has_next_state() const { return next_exp_avg != nullptr || next_exp_avg8.codes != nullptr; }

 private:
  friend class OffloadPipeline;
  std::unique_ptr<TransferSlot> slot_;
  std::uint32_t* inexact_ = nullptr;  // fp32 weights: Transfer::download_bf16_exact's verdict
  std::atomic<bool> packs_{false};
  std::atomic<bool> sent_bf16_{false};
  bool keeps_weights_ = false;
  bool accumulates_ = false;  // its state has an accumulator (take_state makes it one again)
  // Where the last speculated fp32 term went up (GradJob::device_term), until a job consumes it:
  // a commit applies it there, an update waits for its copy before writing the term buffer again.
  std::uintptr_t held_term_ = 0;
  // The hyperparameters of its last speculative update, while no other update or commit has been
  // queued since (OffloadPipeline::commit takes them). Under the pipeline's mutex.
  std::optional<AdamWHyper> speculated_;
  // What the landing buffer holds, as decided by the job that consumed its last download: later
  // jobs on it (the update queued at step() after a norm) read it the same way. Engine threads only.
  DType landing_dtype_ = DType::float32;
  // Under the pipeline's mutex: jobs enqueued / finished, downloads issued / landed.
  std::uint64_t queued_ = 0;
  std::uint64_t done_ = 0;
  std::uint64_t downloads_ = 0;
  std::uint64_t landed_ = 0;
};

// One window's clip coefficient, computed where the gradients' norms are (the device) and landed
// in host memory behind the work that produced it (OffloadPipeline::land_scale). Jobs that carry
// it wait for it on the engine's threads, so the caller never waits for the norm.
class ClipScale {
 public:
  bool landed() const { return landed_.load(std::memory_order_acquire); }
  float value() const { return value_; }  // once landed
  double norm() const { return norm_; }   // the global norm it came from, once landed
  // Whether updates speculated with a coefficient of 1 stand: it is 1 and the norm is finite.
  bool commits() const { return value_ == 1.0f && std::isfinite(norm_); }

 private:
  friend class OffloadPipeline;
  float value_ = 1.0f;
  double norm_ = 0.0;
  std::atomic<bool> landed_{false};
};

// What the engine does for one parameter, in this order.
struct GradJob {
  bool accumulate = false;      // fold the landed gradient into the accumulator...
  bool overwrite = false;       // ...replacing it (first micro-batch) instead of adding
  bool from_accumulator = false;  // norm/update read the accumulator, not the landed gradient
  bool norm = false;            // store the gradient's squared norm in HostParam::squared_norm
  bool update = false;          // AdamW step with `hyper`
  AdamWHyper hyper;
  std::uintptr_t device_weight = 0;  // after the update, upload the weights here (0: don't)
  // Clipping without waiting for the global norm: `update` with `speculate` writes the parameter's
  // next-state buffers, and uploads bf16 weights' rounding at once but an fp32 term not. Once the
  // norm says the clip coefficient is 1, a job with `commit` (and the same hyperparameters and
  // device_weight) makes them the state and uploads the term; otherwise a plain update redoes the
  // step from the untouched state and uploads its own weights behind the speculated ones.
  bool speculate = false;
  bool commit = false;
  // A speculative fp32 update (upload_terms) whose term need not wait in host memory: it goes up
  // here at once, device memory of numel floats that the caller keeps until the parameter's next
  // job has run. A commit that redoes nothing then applies it where it lies, and the link carries
  // nothing after the verdict; a redo uploads its own term as usual.
  std::uintptr_t device_term = 0;
  // land_gradient only, on a device: before the gradient leaves, its squared norm (a double) is
  // written here, on the download stream (Transfer::measure; scratch: device memory, one double a
  // norm block). order_after_norms() orders a stream after every norm measured so far.
  std::uintptr_t device_norm = 0;
  std::uintptr_t device_norm_scratch = 0;
  // The clip coefficient as landed from the device: the job waits for it, and it replaces
  // hyper.grad_scale. A commit that carries it is also an update (`update` set): when the
  // coefficient is not 1 (ClipScale::commits), the step is redone from the untouched state into
  // the next-state buffers first, so the commit makes the redone step the state either way.
  std::shared_ptr<const ClipScale> scale;
};

// The engine itself. This class is the face (offload_pipeline.cpp: construction, parameters);
// each role has its own file under cpp/src/pipeline/, and the comment that opens its section
// below is that file's contract. One mutex, mutex_, guards every queue, list and count the roles
// share; the engine threads hold it only to pick, start and retire jobs, never while they run one.
class OffloadPipeline {
 public:
  // `max_download_bytes`: gradient bytes allowed between hand-over and landing in host memory;
  // a hook that would exceed it waits, so gradients never pile up in device memory.
  // `device_accumulate`: fold micro-batch gradients into the accumulator with
  // Transfer::accumulate_download (on the GPU, in the CUDA build) instead of copying them to the
  // landing buffer and adding them on the host; see land_gradient.
  // `niceness`: how much nicer than their creator the engine threads run
  // (lower_this_thread_priority).
  OffloadPipeline(std::unique_ptr<Transfer> transfer, std::size_t threads, std::optional<Isa> isa,
                  std::size_t max_download_bytes = std::size_t(512) << 20, bool device_accumulate = true,
                  int niceness = 0);
  ~OffloadPipeline();
  OffloadPipeline(const OffloadPipeline&) = delete;
  OffloadPipeline& operator=(const OffloadPipeline&) = delete;

  // Registers a parameter and allocates its host buffers from the arena (zeroed moments); with
  // `with_state` false, none yet (a parameter resident for now: take_state() when it is offloaded).
  // Moments::blockwise8 needs a whole number of kQuantBlock blocks and the maps first
  // (set_quantization_maps); its updates are torchao's AdamW8bit, and do not speculate.
  std::shared_ptr<HostParam> add_param(std::size_t numel, DType weight_dtype, bool accumulate,
                                       std::int64_t priority = 0, bool with_state = true,
                                       Moments moments = Moments::fp32);
  // The two 256-value maps blockwise 8-bit moments are decoded by (signed: the first moment),
  // copied; once, before the first such parameter.
  void set_quantization_maps(const float* signed_map, const float* unsigned_map);
  // A parameter that became resident gives its host buffers back (speculation's included), once
  // its queued jobs are done; a slab whose buffers are all back leaves the process. Returns the
  // bytes given back. Jobs, landings and views on it are refused until take_state(), which takes
  // fresh buffers, moments zeroed, for a parameter offloaded again (the caller fills them).
  std::size_t release_state(HostParam& p);
  std::size_t take_state(HostParam& p);
  // Host bytes of a parameter's state as take_state takes it (and wrap() plans): fp32 master and
  // moments (or their codes and scales), with `accumulate` an fp32 accumulator, and a landing
  // buffer in the weight dtype unless its gradients land in the accumulator (fp32 weights with one).
  static std::size_t state_bytes(std::size_t numel, DType weight_dtype, bool accumulate,
                                 Moments moments = Moments::fp32);
  static bool lands_in_accumulator(DType weight_dtype, bool accumulate) {
    return accumulate && weight_dtype == DType::float32;
  }
  // What `p` holds now (a landing buffer taken since included).
  static std::size_t state_bytes(const HostParam& p) {
    return state_bytes(p.numel, p.weight_dtype, p.accumulates_, p.moments) +
           (p.grad != nullptr && lands_in_accumulator(p.weight_dtype, p.accumulates_) ? p.weight_bytes() : 0);
  }

  HostAdamW& engine() { return engine_; }
  int niceness() const { return niceness_; }
  Transfer& transfer() { return *transfer_; }

  // ---- Gradient landing (pipeline/gradient_landing.cpp) ----
  // Takes each gradient off the device as autograd hands it over, on the hook's thread: chooses
  // its route (the landing buffer, the accumulator in place, or added into the accumulator by the
  // transfer), sends a bf16-exact fp32 gradient as bf16, measures its norm on the device when
  // asked, and queues the job that consumes it. Owns the download budget (downloading_bytes_
  // against max_download_bytes_) and each parameter's count of downloads issued and landed: the
  // download's completion callback (a CUDA host function, or the caller itself on the host)
  // counts a landing under mutex_ and wakes the engine threads. A call waits while the parameter's
  // queued jobs are unfinished or the budget is full, never for its own download.

  // Queues the download of a freshly produced gradient (ordered after `producer_stream`) and the
  // job that consumes it. Blocks while an earlier job of this parameter is unfinished (it may read
  // the landing buffer or the accumulator this download writes), or while more than
  // max_download_bytes of gradients are still on their way to the host. The first micro-batch of
  // fp32 gradients lands straight in the accumulator. With device_accumulate, the other
  // micro-batches are added into the accumulator by the transfer (job.accumulate is done there),
  // and no job is queued when nothing else is asked: within an accumulation window the hook then
  // never waits for the previous micro-batch. An fp32 gradient bound for the landing buffer is
  // sent as bf16 when its values are bf16 (Transfer::download_bf16_exact; lossless, half the
  // bytes on the bus and in host memory), until the first one of that parameter that is not.
  void land_gradient(const std::shared_ptr<HostParam>& p, std::uintptr_t device_grad,
                     std::uintptr_t producer_stream, const GradJob& job);

  // Orders `stream` (on the device) after every norm that land_gradient has measured so far
  // (GradJob::device_norm), so that work queued on it next may read them.
  void order_after_norms(std::uintptr_t stream) { transfer_->order_after_measures(stream); }

  bool device_accumulate() const { return device_accumulate_; }
  // Safe at any time: each gradient takes one path, and either path orders itself after the other.
  void set_device_accumulate(bool on) { device_accumulate_ = on; }
  // Whether bf16-exact fp32 gradients are sent as bf16 (default on); safe at any time.
  bool pack_gradients() const { return pack_gradients_; }
  void set_pack_gradients(bool on) { pack_gradients_ = on; }
  std::size_t downloading_bytes() const;

  // ---- The job queue (pipeline/job_queue.cpp) ----
  // Holds the jobs not yet started (queue_), each with its place in its parameter's sequence and
  // the number of that parameter's downloads it waits for; checks a job's flags before anything
  // is queued (check_job); and chooses the next job to start (pick_locked). Owns each parameter's
  // counts of jobs queued and finished, the count of jobs in flight, and the first error a job
  // raised: every wait rethrows it, and after it jobs are drained unrun. All of it is under
  // mutex_; any thread may submit and wait, and a wait is on the host (nothing is ordered on the
  // device).

  // Queues a job on what has already landed or been accumulated (e.g. the update at step()); it
  // runs after every download of this parameter issued so far has landed.
  void submit(const std::shared_ptr<HostParam>& p, const GradJob& job);
  // The same for several parameters, queued under one lock and with one wake-up (a window's
  // updates and commits at step(), while every engine thread is taking chunks under that lock).
  void submit(const std::vector<std::shared_ptr<HostParam>>& params, const std::vector<GradJob>& jobs);

  // Waits until the parameters' queued jobs have finished (on the host; nothing is ordered on the
  // device). Rethrows the first error a job raised.
  void wait(const std::vector<HostParam*>& params);

  // Waits for every issued download to land and every queued job to finish. Rethrows the first
  // error a job raised.
  void synchronize();

  std::size_t pending() const;
  // How fast the engine updates, for the placement planner: wall seconds during which at least one
  // thread ran a chunk of an update (jobs that only add micro-batches or measure are left out), and
  // elements updated, since construction. Beside them, where an accumulation window's time goes on
  // the host: wall seconds during which some thread added a micro-batch into a host sum (in a job
  // with no update) and the elements added so, and the seconds land_gradient() waited before a
  // download could start (for the parameter's queued jobs, or for room in the download budget):
  // the backward's hooks wait so.
  struct Stats {
    double busy_seconds = 0;
    std::uint64_t updated_elements = 0;
    double adding_seconds = 0;
    std::uint64_t added_elements = 0;
    double landing_wait_seconds = 0;
  };
  Stats stats() const;

 private:
  struct Task;  // a queued job (src/pipeline/task.hpp)
  // `landing`: the job comes with a download into the landing buffer (taken then where missing).
  static void check_job(const HostParam& p, const GradJob& job, bool landing);
  void enqueue(const std::shared_ptr<HostParam>& p, const GradJob& job, bool landing = false, bool packed = false);
  void enqueue_locked(const std::shared_ptr<HostParam>& p, const GradJob& job, bool landing, bool packed);
  std::unique_ptr<Task> pick_locked();
  void wait_idle(HostParam& p, std::unique_lock<std::mutex>& lock);
  void record_error();
  void rethrow_locked();

  // ---- The engine threads (pipeline/workers.cpp) ----
  // Each runs worker_loop: under mutex_ it takes the next chunk of the earliest started job that
  // has one left, or picks and starts a new job (start() decides what its chunks read and write);
  // it runs the chunk (accumulation, norm blocks, the AdamW kernel) without the lock; and the
  // thread that ran a job's last chunk finishes it, still without the lock (the norm's sum, a
  // commit's swap, the upload), then counts it done under the lock and wakes who waits for it. A
  // parameter's jobs run one at a time and in order, so a job uses its parameter's buffers without
  // a lock. Owns the started jobs (running_) and the busy-time statistics, under mutex_.
  void worker_loop();
  Task* next_chunk_locked(std::size_t& chunk);
  void start(Task& task);
  void start_8bit(Task& task);
  void run_chunk(Task& task, std::size_t chunk);
  std::size_t finish(Task& task);

 public:
  // ---- Speculation (pipeline/speculation.cpp) ----
  // Updates queued before a window's global norm is known write to next-state buffers, which this
  // unit gives each parameter (from spare_, apart from the state's arena), and leave the state
  // untouched; the window's clip verdict lands from the device into a host slot of its own
  // (land_scale); a verdict that does not commit drops what is left of that window's speculative
  // updates, and commit() queues the jobs that make the speculated (or redone) step the state.
  // Owns each parameter's last speculated hyperparameters (under mutex_) and the verdict slot,
  // which only the caller's one thread touches. The verdict's completion callback takes mutex_;
  // dropping only marks jobs to skip, so a running one stops at its next chunk.

  // Queues, as that submit() does, the commit of each parameter's speculative update (the one
  // queued since its last update or commit): a job with `commit`, that update's hyperparameters
  // and the parameter's `device_weight`; with a `verdict` still on its way, also `update` and that
  // scale (GradJob::scale). Throws std::invalid_argument, queuing none, where a parameter has no
  // such speculation.
  void commit(const std::vector<std::shared_ptr<HostParam>>& params, const std::vector<std::uintptr_t>& device_weights,
              const std::shared_ptr<const ClipScale>& verdict);

  // Gives the parameter its next-state buffers (GradJob::speculate), once; returns the host bytes
  // they took (0 if it had them), from the transfer's slab source (pinned memory on CUDA, like
  // the state) apart from the arena, which counts state only; touched here so that the first
  // speculative update takes no page faults.
  std::size_t enable_speculation(HostParam& p);
  // Host bytes enable_speculation takes for a parameter of this size, weight dtype and moments.
  static std::size_t speculation_bytes(std::size_t numel, DType weight_dtype, Moments moments = Moments::fp32);

  // Queues the download of one window's clip verdict, two doubles in device memory (the
  // coefficient, rounded to float, and the global norm) written by work queued on
  // `producer_stream`. Speculative updates queued so far belong to that window: when the verdict
  // lands and does not commit, what is left of them is dropped (as abandon_speculation does).
  std::shared_ptr<ClipScale> land_scale(std::uintptr_t device_verdict, std::uintptr_t producer_stream);
  // Waits (on the host) until the verdict has landed.
  void wait(const ClipScale& scale);

  // Drops the work left in every speculative update (jobs not started are drained unrun, running
  // ones stop at their next chunk): they wrote only next-state buffers, which a redo replaces.
  // Returns how many jobs it cut short.
  std::size_t abandon_speculation();

 private:
  // Under the mutex: drops what is left of every speculative update not yet dropped, or of those
  // `verdict` decides (null: all); returns how many.
  std::size_t drop_speculation_locked(const ClipScale* verdict);

 public:
  // ---- Upload scheduling (pipeline/uploads.cpp) ----
  // Decides what goes up when a job finishes (a bf16 rounding, the fp32 master or its update
  // term, now or at the commit), on the finishing thread and the parameter's slot; tracks the
  // uploads on their way up (under mutex_), so that pick_locked lets a commit jump the queue only
  // while they are under the upload window; and, for the forward's pre-hooks, orders a stream
  // after a parameter's upload (gate) or tells whether it is done (settled). Also where the
  // weights live on the host: load_weights fills the master from the device, keep_weights_on_host
  // keeps them there for weight streaming; both first wait until the parameter has no queued job.

  // Copies the device weights into the fp32 master (synchronously). For bf16 weights the landing
  // buffer is used as the staging area.
  void load_weights(HostParam& p, std::uintptr_t device_weight, std::uintptr_t stream);

  // Keeps the parameter's current weights in host memory from now on, in its weight dtype, for a
  // caller that brings them to the device itself (weight streaming): fp32 weights in the master,
  // which an update without device_weight rewrites whole even with upload_terms; bf16 weights in
  // a buffer of their own from the arena, filled by the caller and rewritten by each update
  // (stochastically rounded ones in their state, which they are).
  // Its updates no longer speculate (check_job refuses). Returns the host bytes it took (0 if it
  // had them).
  std::size_t keep_weights_on_host(HostParam& p);

  // Waits until the parameters' queued jobs have finished, then orders `stream` after their
  // uploads (on the device). This is what a module's forward pre-hook calls.
  void gate(const std::vector<HostParam*>& params, std::uintptr_t stream);

  // Whether the parameters have no queued jobs and their last uploads have finished, so that any
  // stream may read their weights without gating. Never waits (beyond the pipeline's lock).
  bool settled(const std::vector<HostParam*>& params);

  // Whether an fp32 parameter's update sends only its term (AdamW in term_only mode, then
  // Transfer::upload_update) rather than the updated master (default off; the CUDA transfer
  // needs its staging buffer first): the host neither reads nor keeps current an fp32 copy of
  // those weights; the device's are the weights. Switch it off only with no job queued, and
  // reload the masters (load_weights) before the next update.
  bool upload_terms() const { return upload_terms_; }
  void set_upload_terms(bool on) { upload_terms_ = on; }
  // How many bytes of uploads may be on their way up ahead of a commit that redoes nothing before
  // it stops jumping the queue of updates (see pick_locked).
  void set_upload_window(std::size_t bytes) { upload_window_ = bytes; }

 private:
  // Whether a commit that redoes nothing uploads (after the parameter's last job has finished).
  static bool commit_uploads(const HostParam& p);
  // After a finished job (finish()): issues its upload, if any; returns the bytes it queued.
  std::size_t upload_weights(const Task& task);
  // Under the mutex: counts an upload issued until it is seen complete.
  void track_upload_locked(const std::shared_ptr<HostParam>& p, std::size_t bytes);
  // Under the mutex: whether the uploads issued and not yet seen complete are under the window.
  bool upload_room_locked();

  std::unique_ptr<Transfer> transfer_;
  // Next-state moments and masters: memory of the state's kind (pinned on CUDA: the engine ran
  // about 9% slower a parameter with them pageable), apart from the state's arena and its count.
  HostArena spare_;
  HostAdamW engine_;
  std::vector<float> quantization_maps_;  // signed, then unsigned (set_quantization_maps)
  std::size_t max_download_bytes_;
  std::atomic<bool> device_accumulate_;
  const int niceness_;
  std::atomic<bool> pack_gradients_{true};
  std::atomic<bool> upload_terms_{false};
  std::atomic<std::size_t> upload_window_{std::size_t(256) << 20};  // about 5 ms of PCIe Gen5

  mutable std::mutex mutex_;
  std::condition_variable work_ready_;
  std::condition_variable job_done_;
  std::condition_variable landed_;
  // The job queue and the engine threads:
  std::deque<std::unique_ptr<Task>> queue_;    // not started
  std::deque<std::unique_ptr<Task>> running_;  // started, in start order
  std::size_t in_flight_ = 0;
  std::size_t running_update_chunks_ = 0, running_add_chunks_ = 0;
  std::chrono::steady_clock::time_point busy_since_, adding_since_;
  Stats stats_;
  // Gradient landing (and land_scale's verdicts):
  std::size_t downloading_bytes_ = 0;
  // Upload scheduling:
  struct Upload {
    std::shared_ptr<HostParam> param;
    std::size_t bytes;
  };
  std::deque<Upload> uploads_;  // issued by finish(), oldest first, until seen complete
  std::size_t uploading_bytes_ = 0;  // their sum
  // Speculation:
  std::unique_ptr<TransferSlot> verdict_slot_;  // land_scale's downloads, one after another
  // Where they land, on first use: a page of its own, so that no slab of the state waits for it
  // to go back (release_state).
  std::unique_ptr<HostArena> verdict_arena_;
  double* verdict_host_ = nullptr;
  bool stopping_ = false;
  std::exception_ptr error_;
  std::vector<std::thread> workers_;
};

}  // namespace trainstream
