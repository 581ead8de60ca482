// The offload pipeline's scheduling, driven through a transfer backend whose downloads (and
// device accumulations) land only when the test says so.
#include <atomic>
#include <cmath>
#include <chrono>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "check.hpp"
#include "trainstream/errors.hpp"
#include "trainstream/grad_ops.hpp"
#include "trainstream/offload_pipeline.hpp"
#include "trainstream/thread_pool.hpp"

using namespace trainstream;

namespace {

class ManualTransfer : public Transfer {
 public:
  ManualTransfer() : arena_(std::make_unique<PageableSlabs>(), 1 << 20) {}
  std::unique_ptr<TransferSlot> make_slot() override { return std::make_unique<TransferSlot>(); }
  HostArena& arena() override { return arena_; }
  bool is_device() const override { return false; }
  void download(TransferSlot&, void* host, const void* device, std::size_t bytes, std::uintptr_t,
                std::function<void()> landed) override {
    std::memcpy(host, device, bytes);
    std::lock_guard<std::mutex> lock(mu);
    if (landed) pending.push_back(std::move(landed));
  }
  // Like the GPU, the add itself happens only when the test lands it: a host job that read the
  // accumulator too early would see it unchanged.
  void accumulate_download(TransferSlot&, float* host_acc, const void* device_grad, DType grad_dtype,
                           std::size_t numel, bool overwrite, std::uintptr_t,
                           std::function<void()> landed) override {
    if (fail_accumulate) throw Error("accumulate_download failed on purpose");
    ++accumulations;
    std::lock_guard<std::mutex> lock(mu);
    pending.push_back([=, landed = std::move(landed)] {
      accumulate_grad(host_acc, device_grad, grad_dtype, numel, overwrite);
      if (landed) landed();
    });
  }
  void wait_download(TransferSlot&) override {}
  void upload(TransferSlot&, void* device, const void* host, std::size_t bytes) override {
    enter_upload();
    std::memcpy(device, host, bytes);
    std::lock_guard<std::mutex> lock(mu);
    uploads.push_back(device);
  }
  void upload_update(TransferSlot& slot, float* device, const float* term, std::size_t numel,
                     float decay) override {
    enter_upload();
    Transfer::upload_update(slot, device, term, numel, decay);
    std::lock_guard<std::mutex> lock(mu);
    uploads.push_back(device);
    ++term_uploads;
  }
  void apply_update(TransferSlot& slot, float* device, const float* device_term, std::size_t numel,
                    float decay) override {
    Transfer::apply_update(slot, device, device_term, numel, decay);
    std::lock_guard<std::mutex> lock(mu);
    ++term_applies;
  }
  void wait_upload(TransferSlot&) override { ++upload_waits; }
  void order_after_upload(TransferSlot&, std::uintptr_t) override {}
  bool upload_complete(TransferSlot&) override { return uploads_finished; }

  void enter_upload() {
    ++uploads_entered;
    while (hold_uploads) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (fail_uploads) throw Error("upload failed on purpose");
  }

  void land_all() {
    std::vector<std::function<void()>> now;
    {
      std::lock_guard<std::mutex> lock(mu);
      now.swap(pending);
    }
    for (auto& f : now) f();
  }

  // Lands the download queued `index`-th among those still pending (the last with -1).
  void land_one(int index) {
    std::function<void()> f;
    {
      std::lock_guard<std::mutex> lock(mu);
      auto it = index < 0 ? pending.end() - 1 : pending.begin() + index;
      f = std::move(*it);
      pending.erase(it);
    }
    f();
  }

  std::mutex mu;
  std::vector<std::function<void()>> pending;
  std::vector<void*> uploads;
  std::atomic<bool> fail_uploads{false};
  std::atomic<bool> hold_uploads{false};  // parks the worker inside upload()
  std::atomic<bool> uploads_finished{true};  // what upload_complete() reports
  std::atomic<int> uploads_entered{0};
  int term_uploads = 0;  // of `uploads`, those that sent an update term
  int term_applies = 0;  // apply_update calls: terms already in device memory
  std::atomic<int> upload_waits{0};
  std::atomic<bool> fail_accumulate{false};
  std::atomic<int> accumulations{0};

 private:
  HostArena arena_;
};

struct Rig {
  ManualTransfer* transfer;
  std::unique_ptr<OffloadPipeline> pipeline;
  explicit Rig(std::size_t max_download_bytes = std::size_t(1) << 30, bool device_accumulate = true,
               std::size_t threads = 2) {
    auto t = std::make_unique<ManualTransfer>();
    transfer = t.get();
    pipeline = std::make_unique<OffloadPipeline>(std::move(t), threads, Isa::scalar, max_download_bytes,
                                                 device_accumulate);
    pipeline->set_upload_terms(true);  // as wrap() runs it; one test compares with it off
  }
};

GradJob update_job(std::uintptr_t device_weight) {
  GradJob job;
  job.update = true;
  job.hyper.lr = 0.1;
  job.device_weight = device_weight;
  return job;
}

}  // namespace

TEST_CASE("updates run in forward (priority) order once their gradients have landed") {
  Rig rig(std::size_t(1) << 30, true, /*threads=*/1);  // one engine thread: jobs start one at a time
  const std::size_t n = 1000;
  std::vector<float> grads(n, 0.5f);
  std::vector<std::vector<float>> weights(3, std::vector<float>(n, 1.0f));
  std::vector<std::shared_ptr<HostParam>> params;
  for (int priority : {2, 0, 1}) params.push_back(rig.pipeline->add_param(n, DType::float32, false, priority));
  for (int i = 0; i < 3; ++i) {
    rig.pipeline->load_weights(*params[i], reinterpret_cast<std::uintptr_t>(weights[i].data()), 0);
    rig.pipeline->land_gradient(params[i], reinterpret_cast<std::uintptr_t>(grads.data()), 0,
                                update_job(reinterpret_cast<std::uintptr_t>(weights[i].data())));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK(rig.transfer->uploads_entered == 0);  // nothing has landed: nothing may run
  CHECK(rig.pipeline->pending() == 3);

  // Park the engine in an earlier parameter's upload, land all three, then let it go: it must
  // choose among the three ready updates by priority, not by arrival.
  std::vector<float> blocker(n, 1.0f);
  auto first = rig.pipeline->add_param(n, DType::float32, false, 99);
  rig.transfer->hold_uploads = true;
  rig.pipeline->land_gradient(first, reinterpret_cast<std::uintptr_t>(grads.data()), 0,
                              update_job(reinterpret_cast<std::uintptr_t>(blocker.data())));
  {
    std::function<void()> landed_first;
    {
      std::lock_guard<std::mutex> lock(rig.transfer->mu);
      landed_first = std::move(rig.transfer->pending.back());
      rig.transfer->pending.pop_back();
    }
    landed_first();
  }
  while (rig.transfer->uploads_entered == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  rig.transfer->land_all();
  rig.transfer->hold_uploads = false;
  rig.pipeline->synchronize();
  CHECK(rig.transfer->uploads.size() == 4);
  if (rig.transfer->uploads.size() == 4) {
    CHECK(rig.transfer->uploads[0] == blocker.data());
    CHECK(rig.transfer->uploads[1] == weights[1].data());  // priority 0
    CHECK(rig.transfer->uploads[2] == weights[2].data());  // priority 1
    CHECK(rig.transfer->uploads[3] == weights[0].data());  // priority 2
  }
  CHECK(weights[0][0] < 1.0f);  // AdamW moved the weights against the gradient
}

TEST_CASE("jobs submitted together give what they give one at a time; a bad one queues none") {
  const std::size_t n = 1000;
  std::vector<float> grad(n);
  for (std::size_t i = 0; i < n; ++i) grad[i] = std::sin(0.29f * i);
  std::vector<std::vector<float>> weights;  // three parameters in each of two rigs
  Rig one, together;
  std::vector<std::shared_ptr<HostParam>> singles, batch;
  std::vector<GradJob> jobs;
  for (int k = 0; k < 6; ++k) {
    Rig& rig = k < 3 ? one : together;
    weights.emplace_back(n, 0.5f + 0.1f * (k % 3));
    auto p = rig.pipeline->add_param(n, DType::float32, false, k % 3);
    const auto w = reinterpret_cast<std::uintptr_t>(weights.back().data());
    rig.pipeline->load_weights(*p, w, 0);
    rig.pipeline->land_gradient(p, reinterpret_cast<std::uintptr_t>(grad.data()), 0, GradJob{});
    GradJob job = update_job(w);
    job.hyper.step = 1 + k % 3;
    (k < 3 ? singles : batch).push_back(p);
    if (k < 3) {
      one.pipeline->submit(p, job);
    } else {
      jobs.push_back(job);
    }
  }
  one.transfer->land_all();
  together.transfer->land_all();
  together.pipeline->submit(batch, jobs);
  one.pipeline->synchronize();
  together.pipeline->synchronize();
  for (int k = 0; k < 3; ++k) {
    CHECK(std::memcmp(weights[k].data(), weights[k + 3].data(), 4 * n) == 0);
    CHECK(std::memcmp(singles[k]->exp_avg_sq, batch[k]->exp_avg_sq, 4 * n) == 0);
  }

  const std::vector<float> before = weights[3];
  GradJob commit = jobs[1];  // a commit, but no next-state buffers to commit from
  commit.update = false;
  commit.commit = true;
  CHECK_THROWS_AS(together.pipeline->submit(batch, {jobs[0], commit, jobs[2]}), std::invalid_argument);
  CHECK_THROWS_AS(together.pipeline->submit(batch, {jobs[0]}), std::invalid_argument);
  together.pipeline->synchronize();
  CHECK(std::memcmp(before.data(), weights[3].data(), 4 * n) == 0);  // nothing ran
}

TEST_CASE("a slab goes back once every block in it is given back, not before") {
  HostArena arena(std::make_unique<PageableSlabs>(), 1 << 20);
  void* a = arena.allocate(300 << 10);
  void* b = arena.allocate(300 << 10);
  void* big = arena.allocate(3 << 20);  // a slab of its own
  CHECK(arena.slab_count() == 2 && arena.reserved_bytes() == (1 << 20) + (3 << 20));
  arena.release(big, 3 << 20);
  CHECK(arena.slab_count() == 1 && arena.reserved_bytes() == (1 << 20));
  arena.release(a, 300 << 10);
  CHECK(arena.slab_count() == 1 && arena.used_bytes() == HostArena::rounded(300 << 10));
  void* c = arena.allocate(100 << 10);  // a's space is not handed out again: after b
  CHECK(c == static_cast<char*>(b) + HostArena::rounded(300 << 10));
  arena.release(b, 300 << 10);
  CHECK(arena.slab_count() == 1);
  arena.release(c, 100 << 10);
  CHECK(arena.slab_count() == 0 && arena.reserved_bytes() == 0 && arena.used_bytes() == 0);
  int elsewhere = 0;
  CHECK_THROWS_AS(arena.release(&elsewhere, 4), std::invalid_argument);
}

TEST_CASE("a released parameter's host state goes back, is refused, and comes back zeroed") {
  const std::size_t n = 1 << 16;  // 256 KiB a buffer: a 1 MiB slab holds few of them
  Rig rig;
  std::vector<float> weights(n, 0.5f), grad(n, 0.25f);
  const auto w = reinterpret_cast<std::uintptr_t>(weights.data());
  std::vector<std::shared_ptr<HostParam>> params;
  for (int k = 0; k < 3; ++k) {
    params.push_back(rig.pipeline->add_param(n, DType::float32, k == 2, k));
    rig.pipeline->load_weights(*params.back(), w, 0);
  }
  HostArena& arena = rig.transfer->arena();
  const std::size_t held = arena.reserved_bytes();
  rig.pipeline->land_gradient(params[0], reinterpret_cast<std::uintptr_t>(grad.data()), 0, update_job(w));
  rig.transfer->land_all();
  rig.pipeline->enable_speculation(*params[0]);
  // the first parameter's queued update runs before its buffers go
  CHECK(rig.pipeline->release_state(*params[0]) == OffloadPipeline::state_bytes(*params[0]));
  CHECK(weights[0] != 0.5f);
  CHECK(!params[0]->holds_state() && params[0]->next_exp_avg == nullptr);
  CHECK(rig.pipeline->release_state(*params[0]) == 0);
  for (auto& p : params) rig.pipeline->release_state(*p);
  CHECK(arena.reserved_bytes() == 0 && arena.used_bytes() == 0 && held > 0);
  CHECK_THROWS_AS(rig.pipeline->submit(params[1], update_job(w)), std::invalid_argument);
  CHECK_THROWS_AS(rig.pipeline->land_gradient(params[1], reinterpret_cast<std::uintptr_t>(grad.data()), 0,
                                              GradJob{}), std::invalid_argument);
  CHECK_THROWS_AS(rig.pipeline->load_weights(*params[1], w, 0), std::invalid_argument);
  CHECK_THROWS_AS(rig.pipeline->enable_speculation(*params[1]), std::invalid_argument);
  // offloaded again: fresh buffers, moments zero, an accumulator where it had one
  CHECK(rig.pipeline->take_state(*params[2]) == OffloadPipeline::state_bytes(*params[2]));
  CHECK(params[2]->holds_state() && params[2]->accumulator != nullptr);
  bool zero = true;
  for (std::size_t i = 0; i < n; ++i) zero = zero && params[2]->exp_avg[i] == 0.0f && params[2]->exp_avg_sq[i] == 0.0f;
  CHECK(zero);
  rig.pipeline->load_weights(*params[2], w, 0);
  rig.pipeline->land_gradient(params[2], reinterpret_cast<std::uintptr_t>(grad.data()), 0, update_job(w));
  rig.transfer->land_all();
  rig.pipeline->synchronize();
  CHECK(params[2]->exp_avg[0] != 0.0f);
}

TEST_CASE("a parameter registered without state holds no host memory until it takes some") {
  Rig rig;
  HostArena& arena = rig.transfer->arena();
  auto p = rig.pipeline->add_param(1 << 16, DType::bfloat16, true, 0, /*with_state=*/false);
  CHECK(!p->holds_state() && arena.reserved_bytes() == 0);
  CHECK(OffloadPipeline::state_bytes(*p) == OffloadPipeline::state_bytes(1 << 16, DType::bfloat16, true));  // to take
  std::vector<float> grad(1 << 16, 0.25f);
  CHECK_THROWS_AS(rig.pipeline->land_gradient(p, reinterpret_cast<std::uintptr_t>(grad.data()), 0, GradJob{}),
                  std::invalid_argument);
  CHECK(rig.pipeline->take_state(*p) == OffloadPipeline::state_bytes(*p));
  CHECK(p->holds_state() && p->accumulator != nullptr && arena.used_bytes() >= OffloadPipeline::state_bytes(*p));
}

TEST_CASE("fp32 weights with an accumulator take a landing buffer only when a gradient is sent there") {
  const std::size_t n = 1 << 12;
  Rig rig;
  auto p = rig.pipeline->add_param(n, DType::float32, true);
  CHECK(p->grad == nullptr && OffloadPipeline::state_bytes(*p) == 16 * n);
  std::vector<float> weights(n, 0.5f), grad(n, 0.25f);
  const auto g = reinterpret_cast<std::uintptr_t>(grad.data());
  GradJob first;
  first.accumulate = first.overwrite = true;
  rig.pipeline->land_gradient(p, g, 0, first);  // straight into the accumulator
  GradJob second;
  second.accumulate = true;
  rig.pipeline->land_gradient(p, g, 0, second);  // added there by the transfer
  rig.transfer->land_all();
  rig.pipeline->synchronize();
  CHECK(p->grad == nullptr && p->accumulator[7] == 0.5f);
  // a job that reads a landed gradient is refused before anything is queued
  GradJob reads;
  reads.norm = true;
  CHECK_THROWS_AS(rig.pipeline->submit(p, reads), std::invalid_argument);
  reads.from_accumulator = true;
  rig.pipeline->submit(p, reads);
  rig.pipeline->synchronize();
  CHECK(p->squared_norm == n * 0.25);
  // micro-batches added on the host land in a landing buffer, taken then and counted
  rig.pipeline->set_device_accumulate(false);
  rig.pipeline->land_gradient(p, g, 0, second);
  rig.transfer->land_all();
  rig.pipeline->synchronize();
  CHECK(p->grad != nullptr && p->accumulator[7] == 0.75f && OffloadPipeline::state_bytes(*p) == 20 * n);
  CHECK(rig.pipeline->release_state(*p) == 20 * n);
  CHECK(rig.transfer->arena().used_bytes() == 0);
  // bf16 weights always take one: their updated weights go up from it
  CHECK(OffloadPipeline::state_bytes(n, DType::bfloat16, true) == 18 * n);
  CHECK(OffloadPipeline::state_bytes(n, DType::float32, false) == 16 * n);
}

TEST_CASE("the update matches HostAdamW on the same buffers") {
  Rig rig;
  const std::size_t n = 4099;
  std::vector<float> grad(n), weight(n), ref_p(n), ref_m(n, 0.f), ref_v(n, 0.f);
  for (std::size_t i = 0; i < n; ++i) {
    grad[i] = std::sin(0.37f * i);
    weight[i] = ref_p[i] = std::cos(0.11f * i);
  }
  auto p = rig.pipeline->add_param(n, DType::float32, false);
  rig.pipeline->load_weights(*p, reinterpret_cast<std::uintptr_t>(weight.data()), 0);
  rig.pipeline->land_gradient(p, reinterpret_cast<std::uintptr_t>(grad.data()), 0,
                              update_job(reinterpret_cast<std::uintptr_t>(weight.data())));
  rig.transfer->land_all();
  rig.pipeline->synchronize();
  HostAdamW engine(1, Isa::scalar);
  AdamWBuffers b{ref_p.data(), grad.data(), DType::float32, ref_m.data(), ref_v.data(), nullptr, n};
  engine.step(b, update_job(0).hyper);
  CHECK(std::memcmp(weight.data(), ref_p.data(), 4 * n) == 0);
  CHECK(std::memcmp(p->exp_avg, ref_m.data(), 4 * n) == 0);
  const OffloadPipeline::Stats stats = rig.pipeline->stats();  // what the planner reads
  CHECK(stats.updated_elements == n);
  CHECK(stats.busy_seconds > 0);
}

TEST_CASE("the engine's rate times its updates alone, not the micro-batches it adds") {
  Rig rig(std::size_t(1) << 30, /*device_accumulate=*/false);
  const std::size_t n = 1 << 20;
  std::vector<float> grad(n, 0.5f), weight(n, 1.0f);
  auto p = rig.pipeline->add_param(n, DType::float32, true);
  rig.pipeline->load_weights(*p, reinterpret_cast<std::uintptr_t>(weight.data()), 0);
  GradJob add;
  add.accumulate = true;
  for (int micro = 0; micro < 3; ++micro) {  // added on the engine's threads
    add.overwrite = micro == 0;
    rig.pipeline->land_gradient(p, reinterpret_cast<std::uintptr_t>(grad.data()), 0, add);
    rig.transfer->land_all();
    rig.pipeline->synchronize();
  }
  CHECK(p->accumulator[n - 1] == 1.5f);
  CHECK(rig.pipeline->stats().busy_seconds == 0.0);
  GradJob update = update_job(reinterpret_cast<std::uintptr_t>(weight.data()));
  update.from_accumulator = true;
  rig.pipeline->submit(p, update);
  rig.pipeline->synchronize();
  CHECK(rig.pipeline->stats().busy_seconds > 0.0);
  CHECK(rig.pipeline->stats().updated_elements == n);
}

TEST_CASE("jobs cut into chunks across threads give HostAdamW's updates and the pool's norms") {
  const std::size_t threads = 4, n = 300000;  // 16 chunks a parameter on 4 threads
  Rig rig(std::size_t(1) << 30, true, threads);
  rig.pipeline->set_pack_gradients(false);
  HostAdamW engine(threads, Isa::scalar);
  GradJob job = update_job(0);
  job.norm = true;
  std::vector<std::vector<float>> grads, weights, refs;
  std::vector<std::shared_ptr<HostParam>> params;
  for (int k = 0; k < 3; ++k) {
    grads.emplace_back(n);
    weights.emplace_back(n);
    for (std::size_t i = 0; i < n; ++i) {
      grads[k][i] = std::sin(0.37f * i + k);
      weights[k][i] = std::cos(0.11f * i - k);
    }
    refs.push_back(weights[k]);
    params.push_back(rig.pipeline->add_param(n, DType::float32, false, k));
    rig.pipeline->load_weights(*params[k], reinterpret_cast<std::uintptr_t>(weights[k].data()), 0);
  }
  for (int k = 0; k < 3; ++k) {
    job.device_weight = reinterpret_cast<std::uintptr_t>(weights[k].data());
    rig.pipeline->land_gradient(params[k], reinterpret_cast<std::uintptr_t>(grads[k].data()), 0, job);
  }
  rig.transfer->land_all();
  rig.pipeline->synchronize();
  CHECK(rig.transfer->uploads.size() == 3);
  for (int k = 0; k < 3; ++k) {
    std::vector<float> m(n, 0.f), v(n, 0.f);
    AdamWBuffers b{refs[k].data(), grads[k].data(), DType::float32, m.data(), v.data(), nullptr, n};
    engine.step(b, job.hyper);
    CHECK(std::memcmp(weights[k].data(), refs[k].data(), 4 * n) == 0);
    CHECK(std::memcmp(params[k]->exp_avg_sq, v.data(), 4 * n) == 0);
    CHECK(params[k]->squared_norm == squared_norm(engine.pool(), grads[k].data(), DType::float32, n));
  }
}

// The norm as grad_ops.hpp defines it, written out one element at a time.
static double reference_norm(const float* x, std::size_t numel) {
  double total = 0;
  for (std::size_t b = 0; b < numel; b += kNormBlock) {
    std::vector<double> lane(kNormLanes, 0.0);
    for (std::size_t i = b; i < std::min(numel, b + kNormBlock); ++i) lane[(i - b) % kNormLanes] += double(x[i]) * x[i];
    for (std::size_t w = kNormLanes / 2; w > 0; w /= 2) {
      for (std::size_t l = 0; l < w; ++l) lane[l] = lane[l] + lane[l + w];
    }
    total += lane[0];
  }
  return total;
}

TEST_CASE("the gradient norm has the same bits for any number of engine threads") {
  for (std::size_t n : {std::size_t(1), std::size_t(7), std::size_t(4099), std::size_t(16384 * 3 + 5),
                        std::size_t(250001)}) {
    std::vector<float> g(n);
    for (std::size_t i = 0; i < n; ++i) g[i] = std::sin(0.37f * i) * (1e-3f + i % 13);
    const double want = reference_norm(g.data(), n);
    for (std::size_t threads : {1, 2, 3, 8}) {
      HostAdamW engine(threads, Isa::scalar);
      CHECK(squared_norm(engine.pool(), g.data(), DType::float32, n) == want);
      Rig rig(std::size_t(1) << 30, true, threads);
      auto p = rig.pipeline->add_param(n, DType::float32, false);
      GradJob job;
      job.norm = true;
      rig.pipeline->land_gradient(p, reinterpret_cast<std::uintptr_t>(g.data()), 0, job);
      rig.transfer->land_all();
      rig.pipeline->synchronize();
      CHECK(p->squared_norm == want);
    }
  }
}

TEST_CASE("an update queued after the norm reads a gradient that landed as bf16 as bf16") {
  // With clipping, the gradient's job takes only its norm; the update comes later, from step().
  // A bf16-exact fp32 gradient lands packed (half the bytes): the later job must read it so.
  const std::size_t n = 5000;
  std::vector<float> grad(n);
  for (std::size_t i = 0; i < n; ++i) grad[i] = bf16_to_float(float_to_bf16(std::sin(0.37f * i)));
  std::vector<std::vector<float>> weights;
  std::vector<std::shared_ptr<HostParam>> params;
  std::vector<std::unique_ptr<OffloadPipeline>> pipes;
  for (bool pack : {true, false}) {
    pipes.push_back(std::make_unique<OffloadPipeline>(std::make_unique<HostTransfer>(), 2, Isa::scalar));
    OffloadPipeline& pipe = *pipes.back();
    pipe.set_pack_gradients(pack);
    weights.emplace_back(n);
    for (std::size_t i = 0; i < n; ++i) weights.back()[i] = std::cos(0.11f * i);
    params.push_back(pipe.add_param(n, DType::float32, false));
    pipe.load_weights(*params.back(), reinterpret_cast<std::uintptr_t>(weights.back().data()), 0);
    GradJob norm;
    norm.norm = true;
    pipe.land_gradient(params.back(), reinterpret_cast<std::uintptr_t>(grad.data()), 0, norm);
    pipe.synchronize();
    pipe.submit(params.back(), update_job(reinterpret_cast<std::uintptr_t>(weights.back().data())));
    pipe.synchronize();
  }
  CHECK(params[0]->last_gradient_as_bf16() && !params[1]->last_gradient_as_bf16());
  CHECK(params[0]->squared_norm == params[1]->squared_norm);
  CHECK(std::memcmp(weights[0].data(), weights[1].data(), 4 * n) == 0);
  CHECK(std::memcmp(params[0]->exp_avg, params[1]->exp_avg, 4 * n) == 0);
  CHECK(std::memcmp(params[0]->exp_avg_sq, params[1]->exp_avg_sq, 4 * n) == 0);
}

TEST_CASE("fp32 weights updated through the update term match an uploaded master, bit for bit") {
  const std::size_t n = 5000;
  std::vector<std::vector<float>> weights;
  std::vector<std::shared_ptr<HostParam>> params;
  std::vector<std::unique_ptr<Rig>> rigs;
  for (bool terms : {true, false}) {
    rigs.push_back(std::make_unique<Rig>());
    rigs.back()->pipeline->set_upload_terms(terms);
    weights.emplace_back(n);
    for (std::size_t i = 0; i < n; ++i) weights.back()[i] = std::cos(0.11f * i) * (1.f + i % 7);
    params.push_back(rigs.back()->pipeline->add_param(n, DType::float32, false));
    rigs.back()->pipeline->load_weights(*params.back(), reinterpret_cast<std::uintptr_t>(weights.back().data()), 0);
  }
  std::vector<float> grad(n);
  for (int step = 1; step <= 3; ++step) {
    for (std::size_t i = 0; i < n; ++i) grad[i] = std::sin(0.37f * i + step) * std::ldexp(1.f, int(i % 23) - 11);
    GradJob job = update_job(0);
    job.hyper.step = step;
    job.hyper.weight_decay = 0.1;
    for (int k = 0; k < 2; ++k) {
      job.device_weight = reinterpret_cast<std::uintptr_t>(weights[k].data());
      rigs[k]->pipeline->land_gradient(params[k], reinterpret_cast<std::uintptr_t>(grad.data()), 0, job);
      rigs[k]->transfer->land_all();
      rigs[k]->pipeline->synchronize();
    }
  }
  CHECK(rigs[0]->transfer->term_uploads == 3);
  CHECK(rigs[1]->transfer->term_uploads == 0);
  CHECK(weights[0] != std::vector<float>(n, 0.f));
  CHECK(std::memcmp(weights[0].data(), weights[1].data(), 4 * n) == 0);
  CHECK(std::memcmp(params[0]->exp_avg, params[1]->exp_avg, 4 * n) == 0);
  CHECK(std::memcmp(params[0]->exp_avg_sq, params[1]->exp_avg_sq, 4 * n) == 0);
}

TEST_CASE("one job's upload does not hold up the next job on another thread") {
  Rig rig;  // two engine threads
  const std::size_t n = 1000;
  std::vector<float> grad(n, 0.5f);
  std::vector<std::vector<float>> weights(2, std::vector<float>(n, 1.0f));
  rig.transfer->hold_uploads = true;
  for (int k = 0; k < 2; ++k) {
    auto p = rig.pipeline->add_param(n, DType::float32, false, k);
    rig.pipeline->land_gradient(p, reinterpret_cast<std::uintptr_t>(grad.data()), 0,
                                update_job(reinterpret_cast<std::uintptr_t>(weights[k].data())));
  }
  rig.transfer->land_all();
  for (int i = 0; i < 2000 && rig.transfer->uploads_entered < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  CHECK(rig.transfer->uploads_entered == 2);  // both threads are inside an upload at once
  rig.transfer->hold_uploads = false;
  rig.pipeline->synchronize();
  CHECK(rig.transfer->uploads.size() == 2);
}

TEST_CASE("accumulation sums micro-batches in fp32; the first lands in the accumulator") {
  Rig rig;
  const std::size_t n = 100;
  std::vector<float> g1(n, 1.5f), g2(n, 2.25f);
  auto p = rig.pipeline->add_param(n, DType::float32, true);
  GradJob first;
  first.accumulate = first.overwrite = first.from_accumulator = true;
  rig.pipeline->land_gradient(p, reinterpret_cast<std::uintptr_t>(g1.data()), 0, first);
  rig.transfer->land_all();
  GradJob second;
  second.accumulate = second.from_accumulator = second.norm = true;
  rig.pipeline->land_gradient(p, reinterpret_cast<std::uintptr_t>(g2.data()), 0, second);
  rig.transfer->land_all();
  rig.pipeline->synchronize();
  CHECK(p->accumulator[0] == 3.75f && p->accumulator[n - 1] == 3.75f);
  CHECK(p->squared_norm == 3.75 * 3.75 * n);
}

TEST_CASE("gradients beyond the in-flight byte limit wait for earlier ones to land") {
  const std::size_t n = 1024;  // 4 KiB each
  Rig rig(6 * 1024);
  std::vector<float> g(n, 1.f);
  auto a = rig.pipeline->add_param(n, DType::float32, false);
  auto b = rig.pipeline->add_param(n, DType::float32, false);
  GradJob norm_only;
  norm_only.norm = true;
  rig.pipeline->land_gradient(a, reinterpret_cast<std::uintptr_t>(g.data()), 0, norm_only);
  CHECK(rig.pipeline->downloading_bytes() == 4096);
  std::atomic<bool> second_issued{false};
  std::thread hook([&] {
    rig.pipeline->land_gradient(b, reinterpret_cast<std::uintptr_t>(g.data()), 0, norm_only);
    second_issued = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  CHECK(!second_issued.load());  // 8 KiB would exceed the 6 KiB limit
  rig.transfer->land_all();
  hook.join();
  CHECK(second_issued.load());
  rig.transfer->land_all();
  rig.pipeline->synchronize();
  CHECK(rig.pipeline->downloading_bytes() == 0);
  CHECK(b->squared_norm == static_cast<double>(n));
}

TEST_CASE("parameters are settled only with no job queued and their uploads finished") {
  Rig rig;
  const std::size_t n = 64;
  std::vector<float> g(n, 1.f), w(n, 1.f);
  auto p = rig.pipeline->add_param(n, DType::float32, false);
  auto q = rig.pipeline->add_param(n, DType::float32, false);
  CHECK(rig.pipeline->settled({p.get(), q.get()}));  // nothing queued yet
  rig.pipeline->land_gradient(p, reinterpret_cast<std::uintptr_t>(g.data()), 0,
                              update_job(reinterpret_cast<std::uintptr_t>(w.data())));
  CHECK(!rig.pipeline->settled({p.get(), q.get()}));  // its gradient has not landed
  CHECK(rig.pipeline->settled({q.get()}));
  rig.transfer->uploads_finished = false;
  rig.transfer->land_all();
  rig.pipeline->synchronize();
  CHECK(!rig.pipeline->settled({p.get()}));  // the job is done, its upload is not
  rig.transfer->uploads_finished = true;
  CHECK(rig.pipeline->settled({p.get(), q.get()}));
}

TEST_CASE("a failure in the worker reaches the next synchronize, and later calls") {
  Rig rig;
  const std::size_t n = 64;
  std::vector<float> g(n, 1.f), w(n, 1.f);
  auto p = rig.pipeline->add_param(n, DType::float32, false);
  rig.transfer->fail_uploads = true;
  rig.pipeline->land_gradient(p, reinterpret_cast<std::uintptr_t>(g.data()), 0,
                              update_job(reinterpret_cast<std::uintptr_t>(w.data())));
  rig.transfer->land_all();
  CHECK_THROWS_AS(rig.pipeline->synchronize(), Error);
  CHECK_THROWS_AS(rig.pipeline->submit(p, update_job(0)), Error);
}

TEST_CASE("bf16 weights travel back up from the landing buffer, rounded from the master") {
  Rig rig;
  const std::size_t n = 257;
  std::vector<std::uint16_t> weight(n), grad(n);
  for (std::size_t i = 0; i < n; ++i) {
    weight[i] = float_to_bf16(0.01f * i - 1.f);
    grad[i] = float_to_bf16(0.5f - 0.003f * i);
  }
  auto p = rig.pipeline->add_param(n, DType::bfloat16, false);
  rig.pipeline->load_weights(*p, reinterpret_cast<std::uintptr_t>(weight.data()), 0);
  CHECK(p->master[3] == bf16_to_float(weight[3]));
  rig.pipeline->land_gradient(p, reinterpret_cast<std::uintptr_t>(grad.data()), 0,
                              update_job(reinterpret_cast<std::uintptr_t>(weight.data())));
  rig.transfer->land_all();
  rig.pipeline->synchronize();
  bool all_rounded = true;
  for (std::size_t i = 0; i < n; ++i) all_rounded = all_rounded && weight[i] == float_to_bf16(p->master[i]);
  CHECK(all_rounded);
}

// ------------------------------------------------------------------ accumulation on the "device"

namespace {

std::uintptr_t addr(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

// Gradient k of a window, spread over many binades so that the fp32 sums round.
float grad_value(std::size_t i, int k) {
  return std::sin(0.37f * i + k) * std::ldexp(1.f, static_cast<int>((7 * i + 3 * k) % 41) - 20);
}

// A device buffer of n elements of `dtype`, as raw bytes.
std::vector<unsigned char> device_buffer(DType dtype, std::size_t n, float (*value)(std::size_t, int), int k) {
  std::vector<unsigned char> bytes(n * dtype_size(dtype));
  for (std::size_t i = 0; i < n; ++i) {
    const float v = value(i, k);
    if (dtype == DType::bfloat16) {
      const std::uint16_t b = float_to_bf16(v);
      std::memcpy(bytes.data() + 2 * i, &b, 2);
    } else {
      std::memcpy(bytes.data() + 4 * i, &v, 4);
    }
  }
  return bytes;
}

GradJob micro_batch(int k, int count, std::uintptr_t device_weight) {
  GradJob job;
  job.accumulate = job.from_accumulator = true;
  job.overwrite = k == 0;
  if (k == count - 1) {
    job.norm = true;
    job.update = true;
    job.hyper.lr = 0.01;
    job.device_weight = device_weight;
  }
  return job;
}

struct WindowResult {
  std::vector<float> acc, master, exp_avg, exp_avg_sq;
  std::vector<unsigned char> weight;
  double squared_norm = 0;
};

// Two accumulation windows of four micro-batches through `pipeline`, landing each download at
// once when `manual` is given (HostTransfer lands synchronously by itself).
WindowResult run_windows(OffloadPipeline& pipeline, ManualTransfer* manual, DType dtype, std::size_t n) {
  const int count = 4;
  auto weight = device_buffer(dtype, n, [](std::size_t i, int) { return std::cos(0.11f * i); }, 0);
  auto p = pipeline.add_param(n, dtype, true);
  pipeline.load_weights(*p, addr(weight.data()), 0);
  for (int window = 0; window < 2; ++window) {
    for (int k = 0; k < count; ++k) {
      const auto grad = device_buffer(dtype, n, grad_value, 10 * window + k);
      pipeline.land_gradient(p, addr(grad.data()), 0, micro_batch(k, count, addr(weight.data())));
      if (manual) manual->land_all();
    }
  }
  pipeline.synchronize();
  WindowResult r;
  r.acc.assign(p->accumulator, p->accumulator + n);
  r.master.assign(p->master, p->master + n);
  r.exp_avg.assign(p->exp_avg, p->exp_avg + n);
  r.exp_avg_sq.assign(p->exp_avg_sq, p->exp_avg_sq + n);
  r.weight = weight;
  r.squared_norm = p->squared_norm;
  return r;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), 4 * a.size()) == 0;
}

bool same_result(const WindowResult& a, const WindowResult& b) {
  return same_bits(a.acc, b.acc) && same_bits(a.master, b.master) && same_bits(a.exp_avg, b.exp_avg) &&
         same_bits(a.exp_avg_sq, b.exp_avg_sq) && a.weight == b.weight && a.squared_norm == b.squared_norm;
}

}  // namespace

TEST_CASE("device accumulation gives bit-identical sums, norms and updates to the host path") {
  for (DType dtype : {DType::float32, DType::bfloat16}) {
    for (std::size_t n : {std::size_t(1), std::size_t(17), std::size_t(4099)}) {
      Rig off(std::size_t(1) << 30, false), on(std::size_t(1) << 30, true);
      const WindowResult base = run_windows(*off.pipeline, off.transfer, dtype, n);
      const WindowResult dev = run_windows(*on.pipeline, on.transfer, dtype, n);
      CHECK(off.transfer->accumulations == 0);
      // fp32: the first micro-batch of each window is a plain copy into the accumulator.
      CHECK(on.transfer->accumulations == (dtype == DType::float32 ? 6 : 8));
      CHECK(same_result(base, dev));
      // ...and both are the plain sequential fp32 sum of the last window's gradients.
      std::vector<float> sum(n);
      for (int k = 0; k < 4; ++k) {
        const auto g = device_buffer(dtype, n, grad_value, 10 + k);
        accumulate_grad(sum.data(), g.data(), dtype, n, k == 0);
      }
      CHECK(same_bits(dev.acc, sum));
      // CPU mode: HostTransfer, the transfer wrap() uses without a GPU, either way.
      for (bool device_accumulate : {false, true}) {
        OffloadPipeline host(std::make_unique<HostTransfer>(), 2, Isa::scalar, std::size_t(1) << 30,
                             device_accumulate);
        host.set_upload_terms(true);
        CHECK(same_result(run_windows(host, nullptr, dtype, n), base));
      }
    }
  }
}

TEST_CASE("with device accumulation, micro-batches neither queue jobs nor wait for each other") {
  Rig rig;
  const std::size_t n = 1000;
  std::vector<std::vector<unsigned char>> grads;
  for (int k = 0; k < 3; ++k) grads.push_back(device_buffer(DType::float32, n, grad_value, k));
  auto p = rig.pipeline->add_param(n, DType::float32, true);
  std::atomic<int> issued{0};
  std::thread hook([&] {
    for (int k = 0; k < 3; ++k) {
      GradJob job;
      job.accumulate = job.from_accumulator = true;
      job.overwrite = k == 0;
      rig.pipeline->land_gradient(p, addr(grads[k].data()), 0, job);
      ++issued;
    }
  });
  for (int i = 0; i < 500 && issued < 3; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  CHECK(issued == 3);  // nothing has landed, yet no hook waited
  CHECK(rig.pipeline->pending() == 0);
  std::atomic<bool> synced{false};
  std::thread sync([&] {
    rig.pipeline->synchronize();
    synced = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK(!synced.load());  // synchronize waits for the accumulations to land, not just for jobs
  while (issued < 3) {  // (a loop, so that a hook that did wait fails the checks above, not hangs)
    rig.transfer->land_all();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  rig.transfer->land_all();
  hook.join();
  sync.join();
  rig.pipeline->synchronize();
  std::vector<float> sum(n);
  for (int k = 0; k < 3; ++k) accumulate_grad(sum.data(), grads[k].data(), DType::float32, n, k == 0);
  CHECK(std::memcmp(p->accumulator, sum.data(), 4 * n) == 0);
}

TEST_CASE("a new window's first micro-batch waits for the last window's update from the accumulator") {
  for (DType dtype : {DType::float32, DType::bfloat16}) {
    Rig rig;
    const std::size_t n = 257;
    auto weight = device_buffer(dtype, n, [](std::size_t i, int) { return std::cos(0.11f * i); }, 0);
    auto p = rig.pipeline->add_param(n, dtype, true);
    rig.pipeline->load_weights(*p, addr(weight.data()), 0);
    std::vector<float> master0(p->master, p->master + n);
    const auto g0 = device_buffer(dtype, n, grad_value, 0), g1 = device_buffer(dtype, n, grad_value, 1);
    const auto next = device_buffer(dtype, n, grad_value, 2);
    rig.pipeline->land_gradient(p, addr(g0.data()), 0, micro_batch(0, 2, 0));
    rig.pipeline->land_gradient(p, addr(g1.data()), 0, micro_batch(1, 2, addr(weight.data())));
    rig.transfer->hold_uploads = true;  // the update's job stays unfinished, parked in its upload
    rig.transfer->land_all();
    while (rig.transfer->uploads_entered == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::vector<float> window_sum(p->accumulator, p->accumulator + n);
    std::atomic<bool> issued{false};
    std::thread hook([&] {
      rig.pipeline->land_gradient(p, addr(next.data()), 0, micro_batch(0, 2, 0));
      issued = true;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    CHECK(!issued.load());
    CHECK(std::memcmp(p->accumulator, window_sum.data(), 4 * n) == 0);  // untouched while in use
    rig.transfer->hold_uploads = false;
    hook.join();
    rig.transfer->land_all();
    rig.pipeline->synchronize();
    std::vector<float> expect(n);
    accumulate_grad(expect.data(), next.data(), dtype, n, true);
    CHECK(std::memcmp(p->accumulator, expect.data(), 4 * n) == 0);
    // The update used the whole first window.
    std::vector<float> ref_m(n, 0.f), ref_v(n, 0.f);
    HostAdamW engine(1, Isa::scalar);
    AdamWBuffers b{master0.data(), window_sum.data(), DType::float32, ref_m.data(), ref_v.data(), nullptr, n};
    engine.step(b, micro_batch(1, 2, 0).hyper);
    // fp32 weights are updated where they live (upload_terms); bf16 ones keep their host master.
    const void* updated = dtype == DType::float32 ? static_cast<const void*>(weight.data()) : p->master;
    CHECK(std::memcmp(updated, master0.data(), 4 * n) == 0);
  }
}

TEST_CASE("an update submitted after device accumulations (an early step) waits for them to land") {
  Rig rig;
  const std::size_t n = 300;
  std::vector<float> weight(n, 1.f);
  auto p = rig.pipeline->add_param(n, DType::float32, true);
  rig.pipeline->load_weights(*p, addr(weight.data()), 0);
  const auto g0 = device_buffer(DType::float32, n, grad_value, 0);
  const auto g1 = device_buffer(DType::float32, n, grad_value, 1);
  rig.pipeline->land_gradient(p, addr(g0.data()), 0, micro_batch(0, 4, 0));
  rig.pipeline->land_gradient(p, addr(g1.data()), 0, micro_batch(1, 4, 0));
  GradJob update = update_job(addr(weight.data()));
  update.from_accumulator = true;
  rig.pipeline->submit(p, update);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK(rig.transfer->uploads_entered == 0);
  rig.transfer->land_all();
  rig.pipeline->synchronize();
  std::vector<float> sum(n), ref_p(n, 1.f), ref_m(n, 0.f), ref_v(n, 0.f);
  accumulate_grad(sum.data(), g0.data(), DType::float32, n, true);
  accumulate_grad(sum.data(), g1.data(), DType::float32, n, false);
  HostAdamW engine(1, Isa::scalar);
  AdamWBuffers b{ref_p.data(), sum.data(), DType::float32, ref_m.data(), ref_v.data(), nullptr, n};
  engine.step(b, update.hyper);
  CHECK(std::memcmp(weight.data(), ref_p.data(), 4 * n) == 0);
}

TEST_CASE("a device norm needs its scratch, a gradient as it lands, and a device to measure on") {
  Rig rig;
  const std::size_t n = 64;
  const auto g = device_buffer(DType::float32, n, grad_value, 0);
  auto p = rig.pipeline->add_param(n, DType::float32, true);
  std::vector<double> out(1), scratch(1);
  GradJob job;
  job.device_norm = addr(out.data());
  CHECK_THROWS_AS(rig.pipeline->land_gradient(p, addr(g.data()), 0, job), std::invalid_argument);
  job.device_norm_scratch = addr(scratch.data());
  job.norm = true;
  CHECK_THROWS_AS(rig.pipeline->land_gradient(p, addr(g.data()), 0, job), std::invalid_argument);
  job.norm = false;
  // This transfer's "device" is host memory: it cannot measure there, in the pass that packs the
  // gradient or apart from the copy, and the landing is undone.
  for (bool pack : {true, false}) {
    rig.pipeline->set_pack_gradients(pack);
    CHECK_THROWS_AS(rig.pipeline->land_gradient(p, addr(g.data()), 0, job), std::invalid_argument);
    CHECK(rig.pipeline->downloading_bytes() == 0);
  }
  CHECK(rig.pipeline->pending() == 0);
  rig.pipeline->land_gradient(p, addr(g.data()), 0, GradJob{});
  rig.transfer->land_all();
  rig.pipeline->synchronize();
}

TEST_CASE("a failed device accumulation throws and leaves nothing in flight") {
  Rig rig;
  const std::size_t n = 64;
  const auto g = device_buffer(DType::float32, n, grad_value, 0);
  auto p = rig.pipeline->add_param(n, DType::float32, true);
  rig.pipeline->land_gradient(p, addr(g.data()), 0, micro_batch(0, 4, 0));
  rig.transfer->land_all();
  rig.transfer->fail_accumulate = true;
  CHECK_THROWS_AS(rig.pipeline->land_gradient(p, addr(g.data()), 0, micro_batch(1, 4, 0)), Error);
  CHECK(rig.pipeline->downloading_bytes() == 0);
  rig.transfer->fail_accumulate = false;
  GradJob norm = micro_batch(1, 4, 0);
  norm.norm = true;
  rig.pipeline->land_gradient(p, addr(g.data()), 0, norm);
  rig.transfer->land_all();
  rig.pipeline->synchronize();  // would hang if the failed one were still counted
  CHECK(p->accumulator[5] == grad_value(5, 0) + grad_value(5, 0));
}

// ------------------------------------------------------------------ bf16-exact gradients

namespace {

float bf16_valued(std::size_t i, int k) { return bf16_to_float(float_to_bf16(grad_value(i, k))); }

struct StepResult {
  std::vector<float> master, exp_avg, exp_avg_sq, weight;
  double squared_norm = 0;
  bool packs = false, sent_bf16 = false;
};

// Three plain steps of one fp32 parameter (gradients without accumulation, as at acc 1) with the
// given gradient values per step, on a CPU-mode pipeline.
StepResult three_steps(bool pack, std::size_t n, float (*const values[3])(std::size_t, int)) {
  OffloadPipeline pipeline(std::make_unique<HostTransfer>(), 2, Isa::scalar);
  pipeline.set_pack_gradients(pack);
  std::vector<float> weight(n);
  for (std::size_t i = 0; i < n; ++i) weight[i] = std::cos(0.11f * i);
  auto p = pipeline.add_param(n, DType::float32, false);
  pipeline.load_weights(*p, addr(weight.data()), 0);
  StepResult r;
  for (int step = 0; step < 3; ++step) {
    const auto grad = device_buffer(DType::float32, n, values[step], step);
    GradJob job = update_job(addr(weight.data()));
    job.norm = true;
    job.hyper.step = step + 1;
    pipeline.land_gradient(p, addr(grad.data()), 0, job);
    pipeline.synchronize();
    if (step == 0 && pack) {  // landed as bf16: the first half of the landing buffer holds the halves
      std::vector<std::uint16_t> halves(n);
      for (std::size_t i = 0; i < n; ++i) halves[i] = float_to_bf16(values[0](i, 0));
      CHECK(std::memcmp(p->grad, halves.data(), 2 * n) == 0);
      CHECK(p->packs_gradients() && p->last_gradient_as_bf16());
    }
  }
  r.master.assign(p->master, p->master + n);
  r.exp_avg.assign(p->exp_avg, p->exp_avg + n);
  r.exp_avg_sq.assign(p->exp_avg_sq, p->exp_avg_sq + n);
  r.weight = weight;
  r.squared_norm = p->squared_norm;
  r.packs = p->packs_gradients();
  r.sent_bf16 = p->last_gradient_as_bf16();
  return r;
}

}  // namespace

TEST_CASE("bf16-exact fp32 gradients land as bf16 and update bit-identically; others stop the packing") {
  for (std::size_t n : {std::size_t(1), std::size_t(17), std::size_t(4099)}) {
    float (*const exact[3])(std::size_t, int) = {bf16_valued, bf16_valued, bf16_valued};
    float (*const mixed[3])(std::size_t, int) = {bf16_valued, grad_value, bf16_valued};
    for (const auto& values : {exact, mixed}) {
      const StepResult plain = three_steps(false, n, values), packed = three_steps(true, n, values);
      CHECK(same_bits(plain.master, packed.master) && same_bits(plain.exp_avg, packed.exp_avg) &&
            same_bits(plain.exp_avg_sq, packed.exp_avg_sq) && same_bits(plain.weight, packed.weight));
      CHECK(plain.squared_norm == packed.squared_norm);
      CHECK(packed.packs == (values == exact));  // one inexact gradient ends the attempts
      CHECK(packed.sent_bf16 == (values == exact) && !plain.sent_bf16);
    }
  }
  // The Transfer default (a backend that cannot test where the gradient lies) sends fp32.
  Rig rig;
  std::vector<float> g(8, 0.5f);
  std::uint32_t inexact = 0;
  std::vector<float> host(8);
  TransferSlot slot;
  rig.transfer->download_bf16_exact(slot, host.data(), g.data(), 8, &inexact, 0, {}, {});
  CHECK(inexact == 1 && host == g);
}

namespace {

// A map of 256 ascending values: signed in [-1, 1], else in [0, 1] (the kernels take any such).
std::vector<float> test_map(bool is_signed) {
  std::vector<float> map(256);
  for (int i = 0; i < 256; ++i) {
    const float u = static_cast<float>(i) / 255.0f;
    map[i] = is_signed ? std::copysign(std::pow(2.0f * u - 1.0f, 2.0f), 2.0f * u - 1.0f) : u * u * u;
  }
  return map;
}

}  // namespace

TEST_CASE("8-bit moments update as adamw8bit_step does, in chunks across threads, fp32 and bf16 weights") {
  const std::vector<float> signed_map = test_map(true), unsigned_map = test_map(false);
  for (DType dtype : {DType::float32, DType::bfloat16}) {
    Rig rig(std::size_t(1) << 30, true, 3);
    rig.pipeline->set_quantization_maps(signed_map.data(), unsigned_map.data());
    const std::size_t n = 5 * 4096 + 768;  // several chunks, the last one short
    std::vector<float> master(n), grad32(n);
    for (std::size_t i = 0; i < n; ++i) {
      master[i] = std::cos(0.11f * i);
      grad32[i] = std::sin(0.37f * i) * (1.0f + (i % 300));
    }
    std::vector<std::uint16_t> weight16(n), grad16(n);
    for (std::size_t i = 0; i < n; ++i) {
      weight16[i] = float_to_bf16(master[i]);
      grad16[i] = float_to_bf16(grad32[i]);
      if (dtype == DType::bfloat16) master[i] = bf16_to_float(weight16[i]);
    }
    std::vector<float> weight32 = master;
    void* weight = dtype == DType::float32 ? static_cast<void*>(weight32.data()) : weight16.data();
    const void* grad = dtype == DType::float32 ? static_cast<const void*>(grad32.data()) : grad16.data();
    auto p = rig.pipeline->add_param(n, dtype, false, 0, true, Moments::blockwise8);
    CHECK(p->exp_avg == nullptr && p->exp_avg8.codes != nullptr);
    CHECK(OffloadPipeline::state_bytes(*p) == OffloadPipeline::state_bytes(n, dtype, false, Moments::blockwise8));
    CHECK(OffloadPipeline::state_bytes(*p) == (4 + dtype_size(dtype) + 2) * n + 2 * HostArena::rounded(4 * n / kQuantBlock));
    rig.pipeline->load_weights(*p, addr(weight), 0);
    // the reference: the same steps, straight
    std::vector<float> ref_p = master, ref_ms(n / kQuantBlock, 0.f), ref_vs(n / kQuantBlock, 0.f);
    std::vector<std::uint8_t> ref_mc(n, 0), ref_vc(n, 0);
    std::vector<std::uint16_t> ref_bf16(n);
    ThreadPool pool(1);
    for (int step = 1; step <= 3; ++step) {
      GradJob job = update_job(addr(weight));
      job.hyper.lr = 0.01;
      job.hyper.weight_decay = 0.1;
      job.hyper.step = step;
      job.hyper.grad_scale = step == 2 ? 0.25 : 1.0;  // a clip coefficient
      rig.pipeline->land_gradient(p, addr(grad), 0, job);
      rig.transfer->land_all();
      rig.pipeline->synchronize();
      AdamW8bitBuffers b;
      b.param = ref_p.data();
      b.grad = grad;
      b.grad_dtype = dtype;
      b.exp_avg = {ref_mc.data(), ref_ms.data()};
      b.exp_avg_sq = {ref_vc.data(), ref_vs.data()};
      b.signed_qmap = signed_map.data();
      b.unsigned_qmap = unsigned_map.data();
      b.param_bf16 = dtype == DType::bfloat16 ? ref_bf16.data() : nullptr;
      b.numel = n;
      AdamW8bitHyper h;
      h.lr = 0.01f;
      h.weight_decay = 0.1;
      h.step = step;
      h.grad_scale = step == 2 ? 0.25f : 1.0f;
      adamw8bit_step(pool, b, h, Isa::scalar);
    }
    CHECK(std::memcmp(p->master, ref_p.data(), 4 * n) == 0);
    CHECK(std::memcmp(p->exp_avg8.codes, ref_mc.data(), n) == 0 && std::memcmp(p->exp_avg_sq8.codes, ref_vc.data(), n) == 0);
    CHECK(std::memcmp(p->exp_avg_sq8.scale, ref_vs.data(), 4 * (n / kQuantBlock)) == 0);
    if (dtype == DType::float32) {  // the master goes up whole (no update term: it is state)
      CHECK(std::memcmp(weight32.data(), ref_p.data(), 4 * n) == 0);
      CHECK(rig.transfer->term_uploads == 0);
    } else {
      CHECK(std::memcmp(weight16.data(), ref_bf16.data(), 2 * n) == 0);
    }
    const std::size_t held = OffloadPipeline::state_bytes(*p);
    CHECK(rig.pipeline->release_state(*p) == held);
    CHECK(p->exp_avg8.codes == nullptr && !p->holds_state());
    CHECK(rig.pipeline->take_state(*p) == held);
    CHECK(p->exp_avg8.codes[5] == 0 && p->exp_avg_sq8.scale[1] == 0.0f);  // zeroed, as torchao's state starts
  }
}

TEST_CASE("stochastically rounded bf16 weights are their own state: 6 bytes a parameter, adamw8bit_step's bits") {
  const std::vector<float> signed_map = test_map(true), unsigned_map = test_map(false);
  Rig rig(std::size_t(1) << 30, true, 3);
  rig.pipeline->set_quantization_maps(signed_map.data(), unsigned_map.data());
  CHECK_THROWS_AS(rig.pipeline->add_param(4096, DType::float32, false, 0, true, Moments::blockwise8_sr),
                  std::invalid_argument);  // fp32 weights have no stochastic rounding
  const std::size_t n = 5 * 4096 + 768;
  std::vector<std::uint16_t> weight(n), grad(n);
  for (std::size_t i = 0; i < n; ++i) {
    weight[i] = float_to_bf16(std::cos(0.11f * i));
    grad[i] = float_to_bf16(std::sin(0.37f * i) * (1.0f + (i % 300)));
  }
  auto p = rig.pipeline->add_param(n, DType::bfloat16, false, 0, true, Moments::blockwise8_sr);
  p->rounding_seed = 42;
  CHECK(p->master == nullptr && p->master_bf16 != nullptr && p->holds_state());
  const std::size_t blocks = 2 * HostArena::rounded(4 * n / kQuantBlock);
  CHECK(OffloadPipeline::state_bytes(*p) == (2 + 2 + 2) * n + blocks);  // weights, gradient, codes
  CHECK(OffloadPipeline::state_bytes(n, DType::bfloat16, false, Moments::blockwise8) == (4 + 2 + 2) * n + blocks);
  rig.pipeline->load_weights(*p, addr(weight.data()), 0);
  CHECK(std::memcmp(p->master_bf16, weight.data(), 2 * n) == 0);
  std::vector<std::uint16_t> ref_w = weight;
  std::vector<float> ref_s(2 * (n / kQuantBlock), 0.f);
  std::vector<std::uint8_t> ref_c(2 * n, 0);
  ThreadPool pool(1);
  for (int step = 1; step <= 3; ++step) {
    GradJob job = update_job(addr(weight.data()));
    job.hyper.lr = 0.01;
    job.hyper.step = step;
    rig.pipeline->land_gradient(p, addr(grad.data()), 0, job);
    rig.transfer->land_all();
    rig.pipeline->synchronize();
    AdamW8bitBuffers b;
    b.param16 = ref_w.data();
    b.grad = grad.data();
    b.grad_dtype = DType::bfloat16;
    b.exp_avg = {ref_c.data(), ref_s.data()};
    b.exp_avg_sq = {ref_c.data() + n, ref_s.data() + n / kQuantBlock};
    b.signed_qmap = signed_map.data();
    b.unsigned_qmap = unsigned_map.data();
    b.numel = n;
    AdamW8bitHyper h;
    h.lr = 0.01f;
    h.step = step;
    h.stochastic_round = true;
    h.seed = 42;
    adamw8bit_step(pool, b, h, Isa::scalar);
  }
  CHECK(std::memcmp(p->master_bf16, ref_w.data(), 2 * n) == 0);
  CHECK(weight == ref_w);  // what went up is the state
  CHECK(std::memcmp(p->exp_avg_sq8.codes, ref_c.data() + n, n) == 0);
  const std::size_t held = OffloadPipeline::state_bytes(*p);
  CHECK(rig.pipeline->release_state(*p) == held);
  CHECK(p->master_bf16 == nullptr && !p->holds_state());
  CHECK(rig.pipeline->take_state(*p) == held);
}

TEST_CASE("8-bit moments are refused without maps, for partial blocks, and when maximizing") {
  Rig rig;
  CHECK_THROWS_AS(rig.pipeline->add_param(4096, DType::float32, false, 0, true, Moments::blockwise8),
                  std::invalid_argument);
  const std::vector<float> signed_map = test_map(true), unsigned_map = test_map(false);
  rig.pipeline->set_quantization_maps(signed_map.data(), unsigned_map.data());
  CHECK_THROWS_AS(rig.pipeline->set_quantization_maps(unsigned_map.data(), signed_map.data()), std::invalid_argument);
  CHECK_THROWS_AS(rig.pipeline->add_param(4100, DType::float32, false, 0, true, Moments::blockwise8),
                  std::invalid_argument);
  auto p = rig.pipeline->add_param(4096, DType::bfloat16, false, 0, true, Moments::blockwise8);
  std::vector<std::uint16_t> weight(4096), grad(4096);
  GradJob job = update_job(addr(weight.data()));
  job.hyper.maximize = true;
  rig.pipeline->land_gradient(p, addr(grad.data()), 0, job);
  rig.transfer->land_all();
  CHECK_THROWS_AS(rig.pipeline->synchronize(), std::invalid_argument);
}

TEST_CASE("8-bit moments speculate: a commit gives the waiting path's bits, a redo starts from untouched state") {
  const std::vector<float> signed_map = test_map(true), unsigned_map = test_map(false);
  const std::size_t n = 3 * 4096 + 256;
  // fp32 and bf16 weights over an fp32 master, and bf16 weights without one (stochastic rounding)
  for (auto [dtype, moments] : {std::pair{DType::float32, Moments::blockwise8}, {DType::bfloat16, Moments::blockwise8},
                                {DType::bfloat16, Moments::blockwise8_sr}}) {
    const bool stochastic = moments == Moments::blockwise8_sr;
    Rig waiting(std::size_t(1) << 30, true, 3), speculating(std::size_t(1) << 30, true, 3);
    Rig* rigs[2] = {&waiting, &speculating};
    std::vector<std::vector<unsigned char>> weights;
    std::vector<std::shared_ptr<HostParam>> params;
    for (Rig* rig : rigs) {
      rig->pipeline->set_quantization_maps(signed_map.data(), unsigned_map.data());
      weights.push_back(device_buffer(dtype, n, grad_value, 99));
      params.push_back(rig->pipeline->add_param(n, dtype, false, 0, true, moments));
      params.back()->rounding_seed = 5;
      rig->pipeline->load_weights(*params.back(), addr(weights.back().data()), 0);
    }
    HostParam& p = *params[1];
    const std::size_t bytes = speculating.pipeline->enable_speculation(p);
    CHECK(bytes == OffloadPipeline::speculation_bytes(n, dtype, moments));
    CHECK(bytes < OffloadPipeline::speculation_bytes(n, dtype));  // a second set of codes, not of floats
    CHECK(p.has_next_state() && p.next_exp_avg8.codes != nullptr);
    CHECK((stochastic ? p.next_master_bf16 != nullptr && p.next_master == nullptr && p.next_bf16 == nullptr
                      : p.next_master != nullptr));
    // the weights the state holds: an fp32 master, or the bf16 weights themselves
    const auto master = [&](const HostParam& q) {
      const auto* at = stochastic ? static_cast<const unsigned char*>(static_cast<const void*>(q.master_bf16))
                                  : static_cast<const unsigned char*>(static_cast<const void*>(q.master));
      return std::vector<unsigned char>(at, at + (stochastic ? 2 : 4) * n);
    };
    const double scales[] = {1.0, 0.25, 1.0, 0.5};  // hit, miss, hit, miss
    for (int step = 1; step <= 4; ++step) {
      const double scale = scales[step - 1];
      auto grad = device_buffer(dtype, n, grad_value, step);
      GradJob job = update_job(addr(weights[0].data()));
      job.hyper.step = step;
      job.hyper.weight_decay = 0.1;
      job.hyper.grad_scale = scale;
      waiting.pipeline->land_gradient(params[0], addr(grad.data()), 0, job);
      waiting.transfer->land_all();
      waiting.pipeline->synchronize();

      const std::vector<std::uint8_t> codes0(p.exp_avg8.codes, p.exp_avg8.codes + n);
      const std::vector<unsigned char> master0 = master(p);
      const std::vector<unsigned char> w0 = weights[1];
      GradJob spec = job;
      spec.device_weight = addr(weights[1].data());
      spec.hyper.grad_scale = 1.0;
      spec.speculate = true;
      speculating.pipeline->land_gradient(params[1], addr(grad.data()), 0, spec);
      speculating.transfer->land_all();
      speculating.pipeline->synchronize();
      // nothing committed: the state as it was; fp32 weights wait for the commit, bf16 ones went up
      CHECK(std::memcmp(codes0.data(), p.exp_avg8.codes, n) == 0);
      CHECK(master0 == master(p));
      if (dtype == DType::float32) CHECK(weights[1] == w0);
      if (stochastic) CHECK(weights[1] != w0);  // (went up from the second set)
      if (scale == 1.0) {
        speculating.pipeline->commit({params[1]}, {spec.device_weight}, nullptr);
      } else {
        GradJob redo = spec;
        redo.speculate = false;
        redo.hyper.grad_scale = scale;
        speculating.pipeline->submit(params[1], redo);
      }
      speculating.pipeline->synchronize();
      CHECK(weights[0] == weights[1]);
      CHECK(master(*params[0]) == master(p));
      if (stochastic) CHECK(std::memcmp(p.master_bf16, weights[1].data(), 2 * n) == 0);  // the state went up
      CHECK(std::memcmp(params[0]->exp_avg8.codes, p.exp_avg8.codes, n) == 0);
      CHECK(std::memcmp(params[0]->exp_avg_sq8.codes, p.exp_avg_sq8.codes, n) == 0);
      CHECK(std::memcmp(params[0]->exp_avg_sq8.scale, p.exp_avg_sq8.scale, 4 * (n / kQuantBlock)) == 0);
    }
    const std::size_t held = OffloadPipeline::state_bytes(p);
    CHECK(speculating.pipeline->release_state(p) == held);  // (each buffer back where it came from)
    CHECK(!p.has_next_state());
  }
}

TS_TEST_MAIN

// ------------------------------------------------------------------------------- speculation

TEST_CASE("a speculative update commits the waiting path's bits, or is redone from untouched state") {
  const std::size_t n = 9000;  // several chunks and a ragged tail
  // fp32 weights twice: the term waiting in host memory, then held in device memory (device_term)
  for (auto [dtype, held] : {std::pair{DType::float32, false}, {DType::float32, true}, {DType::bfloat16, false}}) {
    // Rig 0 waits for the clip coefficient; rig 1 speculates with 1 and commits or redoes.
    Rig waiting(std::size_t(1) << 30, true, 3), speculating(std::size_t(1) << 30, true, 3);
    Rig* rigs[2] = {&waiting, &speculating};
    std::vector<std::vector<unsigned char>> weights;
    std::vector<std::shared_ptr<HostParam>> params;
    for (Rig* rig : rigs) {
      weights.push_back(device_buffer(dtype, n, grad_value, 99));
      params.push_back(rig->pipeline->add_param(n, dtype, false));
      rig->pipeline->load_weights(*params.back(), addr(weights.back().data()), 0);
    }
    CHECK(speculating.pipeline->enable_speculation(*params[1]) == OffloadPipeline::speculation_bytes(n, dtype));
    CHECK(speculating.pipeline->enable_speculation(*params[1]) == 0);  // once
    const double scales[] = {1.0, 0.25, 1.0, 1.0, 0.5};  // hit, miss, hit, hit, miss
    for (int step = 1; step <= 5; ++step) {
      const double scale = scales[step - 1];
      auto grad = device_buffer(dtype, n, grad_value, step);
      GradJob job = update_job(addr(weights[0].data()));
      job.hyper.step = step;
      job.hyper.weight_decay = 0.1;
      job.hyper.grad_scale = scale;
      waiting.pipeline->land_gradient(params[0], addr(grad.data()), 0, job);
      waiting.transfer->land_all();
      waiting.pipeline->synchronize();

      const std::vector<float> m0(params[1]->exp_avg, params[1]->exp_avg + n);
      const std::vector<float> v0(params[1]->exp_avg_sq, params[1]->exp_avg_sq + n);
      const std::vector<float> master0(params[1]->master, params[1]->master + n);
      const std::vector<unsigned char> w0 = weights[1];
      GradJob spec = job;
      spec.device_weight = addr(weights[1].data());
      spec.hyper.grad_scale = 1.0;
      spec.speculate = true;
      std::vector<float> term(n, -1.f);  // the device memory lent for the term
      if (held) spec.device_term = addr(term.data());
      ManualTransfer& t = *speculating.transfer;
      const int uploads0 = t.term_uploads, applies0 = t.term_applies, waits0 = t.upload_waits;
      speculating.pipeline->land_gradient(params[1], addr(grad.data()), 0, spec);
      speculating.transfer->land_all();
      speculating.pipeline->synchronize();
      if (held) CHECK(std::memcmp(term.data(), params[1]->master, 4 * n) == 0);  // went up at once
      // Nothing committed yet: the state as it was (the fp32 master holds a term). An fp32 term
      // waits for the commit; bf16 weights went up with the speculated rounding.
      CHECK(std::memcmp(m0.data(), params[1]->exp_avg, 4 * n) == 0);
      CHECK(std::memcmp(v0.data(), params[1]->exp_avg_sq, 4 * n) == 0);
      if (dtype == DType::float32) CHECK(weights[1] == w0);
      if (dtype == DType::bfloat16 && scale == 1.0) CHECK(weights[1] == weights[0]);
      if (dtype == DType::bfloat16 && scale != 1.0) CHECK(weights[1] != weights[0] && weights[1] != w0);
      if (dtype == DType::bfloat16) CHECK(std::memcmp(master0.data(), params[1]->master, 4 * n) == 0);
      if (scale == 1.0) {  // committed with the hyperparameters the speculation ran with
        speculating.pipeline->commit({params[1]}, {spec.device_weight}, nullptr);
      } else {
        GradJob redo = spec;  // redone from the untouched state
        redo.speculate = false;
        redo.hyper.grad_scale = scale;
        redo.device_term = 0;
        speculating.pipeline->submit(params[1], redo);
      }
      speculating.pipeline->synchronize();
      if (dtype == DType::float32) {
        // A held term is applied where it lies; a redo waits for its copy, then uploads its own.
        CHECK(t.term_applies - applies0 == (held && scale == 1.0 ? 1 : 0));
        CHECK(t.term_uploads - uploads0 == (held && scale == 1.0 ? 0 : 1));
        CHECK((t.upload_waits > waits0) == (held && scale != 1.0));  // (once a chunk)
      }
      CHECK(weights[0] == weights[1]);
      CHECK(std::memcmp(params[0]->exp_avg, params[1]->exp_avg, 4 * n) == 0);
      CHECK(std::memcmp(params[0]->exp_avg_sq, params[1]->exp_avg_sq, 4 * n) == 0);
      if (dtype == DType::bfloat16) CHECK(std::memcmp(params[0]->master, params[1]->master, 4 * n) == 0);
    }
    CHECK(weights[0] != device_buffer(dtype, n, grad_value, 99));
    // The last window was redone: there is no speculation left to commit.
    CHECK_THROWS_AS(speculating.pipeline->commit({params[1]}, {addr(weights[1].data())}, nullptr),
                    std::invalid_argument);
    CHECK(speculating.pipeline->pending() == 0);
    // The commits swapped state and second set between the arenas: each goes back where it lies.
    CHECK(speculating.pipeline->release_state(*params[1]) == OffloadPipeline::state_bytes(*params[1]));
    CHECK(speculating.transfer->arena().used_bytes() == 0);
  }
}

TEST_CASE("speculation is refused where it could not be undone") {
  Rig rig;
  const std::size_t n = 64;
  std::vector<float> weight(n, 1.f), grad(n, 0.5f);
  auto p = rig.pipeline->add_param(n, DType::float32, false);
  GradJob spec = update_job(addr(weight.data()));
  spec.speculate = true;
  bool threw = false;
  try {
    rig.pipeline->land_gradient(p, addr(grad.data()), 0, spec);  // no next-state buffers
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw);
  rig.pipeline->enable_speculation(*p);
  rig.pipeline->set_upload_terms(false);  // the fp32 master is then state, with no twin
  rig.pipeline->land_gradient(p, addr(grad.data()), 0, spec);
  rig.transfer->land_all();
  threw = false;
  try {
    rig.pipeline->synchronize();
  } catch (const std::exception&) {
    threw = true;
  }
  CHECK(threw);
}

TEST_CASE("abandoned speculative updates leave the state untouched, and a redo gives the waiting bits") {
  const std::size_t n = 4096 * 8;
  Rig waiting, speculating;
  std::vector<float> w0(n), w1(n), grad(n);
  for (std::size_t i = 0; i < n; ++i) {
    w0[i] = w1[i] = grad_value(i, 7);
    grad[i] = grad_value(i, 1);
  }
  auto p0 = waiting.pipeline->add_param(n, DType::float32, false);
  auto p1 = speculating.pipeline->add_param(n, DType::float32, false);
  speculating.pipeline->enable_speculation(*p1);
  GradJob job = update_job(addr(w0.data()));
  job.hyper.grad_scale = 0.125;
  waiting.pipeline->land_gradient(p0, addr(grad.data()), 0, job);
  waiting.transfer->land_all();
  waiting.pipeline->synchronize();

  GradJob spec = update_job(addr(w1.data()));
  spec.speculate = true;
  speculating.pipeline->land_gradient(p1, addr(grad.data()), 0, spec);  // not landed: cannot start
  CHECK(speculating.pipeline->abandon_speculation() == 1);
  CHECK(speculating.pipeline->abandon_speculation() == 0);
  GradJob redo = update_job(addr(w1.data()));
  redo.hyper.grad_scale = 0.125;
  speculating.pipeline->submit(p1, redo);
  speculating.transfer->land_all();
  speculating.pipeline->synchronize();
  CHECK(w0 == w1);
  CHECK(std::memcmp(p0->exp_avg, p1->exp_avg, 4 * n) == 0);
  CHECK(std::memcmp(p0->exp_avg_sq, p1->exp_avg_sq, 4 * n) == 0);
  CHECK(speculating.pipeline->stats().updated_elements == n);  // the abandoned one updated nothing
}

TEST_CASE("updates that carry the clip verdict wait for it to land; a commit redoes the step it clips") {
  const std::size_t n = 9000;
  const double verdicts[][2] = {{0.25, 4.0}, {1.0, 0.5}, {1.0, std::nan("")}};  // (coefficient, norm)
  for (DType dtype : {DType::float32, DType::bfloat16}) {
    for (const auto& verdict : verdicts) {
      // Rig 0 knows the coefficient up front. In rig 1 the verdict lands from the "device": p has
      // speculated with 1 and commits, q waits for it.
      Rig waiting(std::size_t(1) << 30, true, 3), deferred(std::size_t(1) << 30, true, 3);
      std::vector<std::vector<unsigned char>> weights;
      std::vector<std::shared_ptr<HostParam>> params;  // waiting p, q; deferred p, q
      for (Rig* rig : {&waiting, &deferred}) {
        for (int k = 0; k < 2; ++k) {
          weights.push_back(device_buffer(dtype, n, grad_value, 90 + k));
          params.push_back(rig->pipeline->add_param(n, dtype, false));
          rig->pipeline->load_weights(*params.back(), addr(weights.back().data()), 0);
        }
      }
      deferred.pipeline->enable_speculation(*params[2]);
      const auto grad = device_buffer(dtype, n, grad_value, 1);
      for (int k = 0; k < 2; ++k) {
        GradJob job = update_job(addr(weights[k].data()));
        job.hyper.weight_decay = 0.1;
        job.hyper.grad_scale = verdict[0];
        waiting.pipeline->land_gradient(params[k], addr(grad.data()), 0, job);
      }
      waiting.transfer->land_all();
      waiting.pipeline->synchronize();

      deferred.pipeline->land_gradient(params[3], addr(grad.data()), 0, GradJob{});
      GradJob spec = update_job(addr(weights[2].data()));
      spec.hyper.weight_decay = 0.1;
      spec.speculate = true;
      deferred.pipeline->land_gradient(params[2], addr(grad.data()), 0, spec);
      const double on_device[2] = {verdict[0], verdict[1]};
      const auto scale = deferred.pipeline->land_scale(addr(on_device), 0);
      GradJob resolve = spec;
      resolve.speculate = false;
      resolve.commit = true;
      resolve.scale = scale;
      deferred.pipeline->submit(params[2], resolve);
      GradJob later = update_job(addr(weights[3].data()));
      later.hyper.weight_decay = 0.1;
      later.scale = scale;
      deferred.pipeline->submit(params[3], later);

      deferred.transfer->land_one(0);  // q's gradient: its update still waits for the verdict
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      CHECK(!scale->landed());
      CHECK(deferred.transfer->uploads.empty());
      deferred.transfer->land_one(-1);  // the verdict, before p's gradient: a clipped speculation is dropped unrun
      CHECK(scale->landed() && scale->value() == static_cast<float>(verdict[0]));
      deferred.transfer->land_all();
      deferred.pipeline->synchronize();
      for (int k = 0; k < 2; ++k) {
        CHECK(weights[k] == weights[k + 2]);
        CHECK(std::memcmp(params[k]->exp_avg, params[k + 2]->exp_avg, 4 * n) == 0);
        CHECK(std::memcmp(params[k]->exp_avg_sq, params[k + 2]->exp_avg_sq, 4 * n) == 0);
        if (dtype == DType::bfloat16) CHECK(std::memcmp(params[k]->master, params[k + 2]->master, 4 * n) == 0);
      }
      // p's step ran once either way: speculated and committed, or dropped and redone
      CHECK(deferred.pipeline->stats().updated_elements == 2 * n);
    }
  }
}

TEST_CASE("a clip verdict is refused where it could not be honoured") {
  Rig rig;
  auto p = rig.pipeline->add_param(64, DType::float32, false);
  rig.pipeline->enable_speculation(*p);
  const double on_device[2] = {1.0, 0.5};
  const auto scale = rig.pipeline->land_scale(addr(on_device), 0);
  rig.transfer->land_all();
  GradJob bad[3];
  bad[0].scale = scale;  // on no update
  bad[1] = update_job(0);
  bad[1].speculate = true;
  bad[1].scale = scale;  // a speculation has a coefficient of 1
  bad[2].commit = true;
  bad[2].scale = scale;  // a commit that waits for it must also carry the update it may redo
  for (const GradJob& job : bad) {
    bool threw = false;
    try {
      rig.pipeline->submit(p, job);
    } catch (const std::invalid_argument&) {
      threw = true;
    }
    CHECK(threw);
  }
}

TEST_CASE("commits that redo nothing jump ahead of updates only while the uploads in flight are under the window") {
  const std::size_t n = 1000;
  for (bool room : {true, false}) {
    Rig rig(std::size_t(1) << 30, true, /*threads=*/1);  // one engine thread: jobs start one at a time
    if (!room) rig.pipeline->set_upload_window(1);  // any upload not seen complete fills it
    rig.transfer->uploads_finished = room;
    std::vector<std::vector<float>> weights(4, std::vector<float>(n, 1.0f));
    std::vector<float> grad(n, 0.5f);
    std::vector<std::shared_ptr<HostParam>> params;  // the first layer's, two later ones', a blocker
    for (int priority : {0, 5, 6, 99}) {
      params.push_back(rig.pipeline->add_param(n, DType::float32, false, priority));
      rig.pipeline->load_weights(*params.back(), addr(weights[params.size() - 1].data()), 0);
    }
    auto spec = [&](int k) {
      GradJob job = update_job(addr(weights[k].data()));
      job.speculate = true;
      return job;
    };
    for (int k = 0; k < 3; ++k) rig.pipeline->enable_speculation(*params[k]);
    // The later layers' gradients arrive first and speculate before the verdict is known.
    for (int k : {1, 2}) rig.pipeline->land_gradient(params[k], addr(grad.data()), 0, spec(k));
    rig.transfer->land_all();
    rig.pipeline->synchronize();
    CHECK(rig.transfer->uploads.empty());
    // Park the engine in the blocker's upload while the first layer's gradient and the verdict land.
    rig.transfer->hold_uploads = true;
    rig.pipeline->land_gradient(params[3], addr(grad.data()), 0, update_job(addr(weights[3].data())));
    rig.transfer->land_all();
    while (rig.transfer->uploads_entered == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    rig.pipeline->land_gradient(params[0], addr(grad.data()), 0, spec(0));
    const double on_device[2] = {1.0, 0.5};
    const auto scale = rig.pipeline->land_scale(addr(on_device), 0);
    for (int k : {1, 2, 0}) {
      GradJob resolve = spec(k);
      resolve.speculate = false;
      resolve.commit = true;
      resolve.scale = scale;
      rig.pipeline->submit(params[k], resolve);
    }
    rig.transfer->land_all();
    rig.transfer->hold_uploads = false;
    rig.pipeline->synchronize();
    CHECK(rig.transfer->uploads.size() == 4);
    if (rig.transfer->uploads.size() == 4) {
      CHECK(rig.transfer->uploads[0] == weights[3].data());
      // With room, the ready commits go up while the first layer still updates; without, the
      // first layer's update and commit come first, in forward order.
      const int order[2][3] = {{0, 1, 2}, {1, 2, 0}};
      for (int i = 0; i < 3; ++i) CHECK(rig.transfer->uploads[i + 1] == weights[order[room][i]].data());
    }
    CHECK(rig.pipeline->stats().updated_elements == 4 * n);
  }
}
