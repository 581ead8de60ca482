// The offload pipeline's scheduling, driven through a transfer backend whose downloads land
// only when the test says so.
#include <atomic>
#include <cmath>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "check.hpp"
#include "trainstream/errors.hpp"
#include "trainstream/offload_pipeline.hpp"

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
  void wait_download(TransferSlot&) override {}
  void upload(TransferSlot&, void* device, const void* host, std::size_t bytes) override {
    ++uploads_entered;
    while (hold_uploads) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (fail_uploads) throw Error("upload failed on purpose");
    std::memcpy(device, host, bytes);
    std::lock_guard<std::mutex> lock(mu);
    uploads.push_back(device);
  }
  void order_after_upload(TransferSlot&, std::uintptr_t) override {}

  void land_all() {
    std::vector<std::function<void()>> now;
    {
      std::lock_guard<std::mutex> lock(mu);
      now.swap(pending);
    }
    for (auto& f : now) f();
  }

  std::mutex mu;
  std::vector<std::function<void()>> pending;
  std::vector<void*> uploads;
  std::atomic<bool> fail_uploads{false};
  std::atomic<bool> hold_uploads{false};  // parks the worker inside upload()
  std::atomic<int> uploads_entered{0};

 private:
  HostArena arena_;
};

struct Rig {
  ManualTransfer* transfer;
  std::unique_ptr<OffloadPipeline> pipeline;
  explicit Rig(std::size_t max_download_bytes = std::size_t(1) << 30) {
    auto t = std::make_unique<ManualTransfer>();
    transfer = t.get();
    pipeline = std::make_unique<OffloadPipeline>(std::move(t), 2, Isa::scalar, max_download_bytes);
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
  Rig rig;
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

  // Park the worker in an earlier parameter's upload, land all three, then let it go: it must
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

TS_TEST_MAIN
