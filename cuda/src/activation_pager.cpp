#include "trainstream/cuda/activation_pager.hpp"

#include <cuda_runtime_api.h>

#include "trainstream/cuda/cuda_check.hpp"
#include "trainstream/cuda/cuda_transfer.hpp"
#include "trainstream/cuda/streams.hpp"

namespace trainstream {

namespace {

// A slot's two copies. A slot is reused every step, so each copy also waits for the previous
// copy of the other direction on the same host bytes.
struct PagerSync : TransferSlot {
  cudaEvent_t out_done = nullptr;  // offload stream: the host copy is complete
  cudaEvent_t in_done = nullptr;   // prefetch stream: the device copy is complete
  bool ever_in = false;

  PagerSync() {
    // The host waits on out_done only to bound the bytes in flight: sleep rather than spin.
    TS_CUDA_CHECK(cudaEventCreateWithFlags(&out_done, cudaEventDisableTiming | cudaEventBlockingSync));
    TS_CUDA_CHECK(cudaEventCreateWithFlags(&in_done, cudaEventDisableTiming));
  }
  void finish() override {
    TS_CUDA_CHECK(cudaEventSynchronize(out_done));
    if (ever_in) TS_CUDA_CHECK(cudaEventSynchronize(in_done));
  }
  ~PagerSync() override {
    cudaEventDestroy(out_done);
    cudaEventDestroy(in_done);
  }
};

}  // namespace

CudaActivationPager::CudaActivationPager(int device, std::uintptr_t offload_stream,
                                         std::uintptr_t prefetch_stream)
    : ActivationPager(std::make_unique<PinnedSlabs>()),
      device_(device),
      offload_stream_(offload_stream),
      prefetch_stream_(prefetch_stream),
      point_(nullptr) {
  TS_CUDA_CHECK(cudaSetDevice(device_));
  cudaEvent_t point;
  TS_CUDA_CHECK(cudaEventCreateWithFlags(&point, cudaEventDisableTiming));
  point_ = point;
}

CudaActivationPager::~CudaActivationPager() { cudaEventDestroy(static_cast<cudaEvent_t>(point_)); }

std::unique_ptr<TransferSlot> CudaActivationPager::make_sync() { return std::make_unique<PagerSync>(); }

void CudaActivationPager::copy_out(TransferSlot& s, void* host, const void* device, std::size_t bytes,
                                   std::uintptr_t compute_stream) {
  auto& sync = static_cast<PagerSync&>(s);
  cudaStream_t offload = as_stream(offload_stream_);
  // The activation is complete once the work queued so far on the compute stream has run.
  order_after(static_cast<cudaEvent_t>(point_), as_stream(compute_stream), offload);
  // A reused slot may still be read by the last prefetch of whoever held it before.
  if (sync.ever_in) TS_CUDA_CHECK(cudaStreamWaitEvent(offload, sync.in_done, 0));
  TS_CUDA_CHECK(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, offload));
  TS_CUDA_CHECK(cudaEventRecord(sync.out_done, offload));
}

void CudaActivationPager::copy_in(TransferSlot& s, void* device, const void* host, std::size_t bytes,
                                  std::uintptr_t compute_stream) {
  auto& sync = static_cast<PagerSync&>(s);
  cudaStream_t prefetch = as_stream(prefetch_stream_);
  // The destination was just allocated on the compute stream: earlier kernels there may still
  // use that memory. And the host bytes must have landed.
  order_after(static_cast<cudaEvent_t>(point_), as_stream(compute_stream), prefetch);
  TS_CUDA_CHECK(cudaStreamWaitEvent(prefetch, sync.out_done, 0));
  TS_CUDA_CHECK(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, prefetch));
  TS_CUDA_CHECK(cudaEventRecord(sync.in_done, prefetch));
  sync.ever_in = true;
}

void CudaActivationPager::order_after_page_in(PagedActivation& a, std::uintptr_t compute_stream) {
  auto& sync = static_cast<PagerSync&>(a.sync());
  TS_EXPECTS(sync.ever_in, "ActivationPager: waiting for a page-in that was never queued");
  TS_CUDA_CHECK(cudaStreamWaitEvent(as_stream(compute_stream), sync.in_done, 0));
}

void CudaActivationPager::wait_paged_out(PagedActivation& a) {
  TS_CUDA_CHECK(cudaEventSynchronize(static_cast<PagerSync&>(a.sync()).out_done));
}

}  // namespace trainstream
