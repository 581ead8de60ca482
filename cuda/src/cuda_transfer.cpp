#include "trainstream/cuda/cuda_transfer.hpp"

#include <cuda_runtime_api.h>

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "accumulate.hpp"
#include "apply_update.hpp"
#include "pack_bf16.hpp"
#include "trainstream/cuda/cuda_check.hpp"
#include "trainstream/cuda/device_adamw.hpp"
#include "trainstream/cuda/streams.hpp"
#include "trainstream/errors.hpp"

namespace trainstream {

namespace {

// cudaLaunchHostFunc target: runs one landed-callback, then frees it.
void CUDART_CB run_landed(void* data) {
  auto* fn = static_cast<std::function<void()>*>(data);
  (*fn)();
  delete fn;
}

struct CudaSlot : TransferSlot {
  cudaEvent_t produced = nullptr;    // on the producer stream: the gradient is complete
  cudaEvent_t downloaded = nullptr;  // on the download stream: the host copy has landed
  cudaEvent_t uploaded = nullptr;    // on the upload stream: the new weights are on the device
  bool has_upload = false;

  CudaSlot() {
    TS_CUDA_CHECK(cudaEventCreateWithFlags(&produced, cudaEventDisableTiming));
    // The worker thread sleeps on this one rather than spinning a core away from AdamW.
    TS_CUDA_CHECK(cudaEventCreateWithFlags(&downloaded, cudaEventDisableTiming | cudaEventBlockingSync));
    TS_CUDA_CHECK(cudaEventCreateWithFlags(&uploaded, cudaEventDisableTiming));
  }
  ~CudaSlot() override {
    cudaEventDestroy(produced);
    cudaEventDestroy(downloaded);
    cudaEventDestroy(uploaded);
  }
};

// Marks the slot's download point and queues `landed` behind it.
void mark_landed(CudaSlot& slot, cudaStream_t download_stream, std::function<void()> landed) {
  TS_CUDA_CHECK(cudaEventRecord(slot.downloaded, download_stream));
  if (landed) {
    auto* fn = new std::function<void()>(std::move(landed));
    const cudaError_t status = cudaLaunchHostFunc(download_stream, run_landed, fn);
    if (status != cudaSuccess) {
      delete fn;
      TS_CUDA_CHECK(status);
    }
  }
}

constexpr std::size_t kHugePage = std::size_t(2) << 20;

// Zeroes [p, p + bytes) from as many threads as there are CPUs: fresh memory costs a page fault
// per page, and faults taken side by side finish sooner than one thread's (or the driver's).
void fault_in_parallel(char* p, std::size_t bytes) {
  constexpr std::size_t kPiece = std::size_t(64) << 20;
  const std::size_t pieces = (bytes + kPiece - 1) / kPiece;
  const std::size_t cpus = std::max(1u, std::thread::hardware_concurrency());
  std::atomic<std::size_t> next{0};
  auto work = [&] {
    for (std::size_t k = next++; k < pieces; k = next++) std::memset(p + k * kPiece, 0, std::min(kPiece, bytes - k * kPiece));
  };
  std::vector<std::thread> helpers;
  for (std::size_t t = 1; t < std::min(cpus, pieces); ++t) helpers.emplace_back(work);
  work();
  for (auto& t : helpers) t.join();
}

[[noreturn]] void cannot_pin(std::size_t bytes, const char* why) {
  throw Error("cannot pin " + std::to_string(bytes >> 20) + " MiB of host memory (" + why +
              "); lower the memory TrainStream needs or free host RAM");
}

}  // namespace

void* PinnedSlabs::allocate(std::size_t bytes) {
  void* p = nullptr;
  if (registered_) {
    const std::size_t size = (bytes + kHugePage - 1) / kHugePage * kHugePage;
    p = std::aligned_alloc(kHugePage, size);
    if (p == nullptr) cannot_pin(bytes, "out of memory");
    madvise(p, size, MADV_HUGEPAGE);  // (advice: fewer pages to fault in and to pin; ignored if unsupported)
    fault_in_parallel(static_cast<char*>(p), size);
    const cudaError_t status = cudaHostRegister(p, size, cudaHostRegisterMapped | cudaHostRegisterPortable);
    if (status != cudaSuccess) {
      cudaGetLastError();
      std::free(p);
      cannot_pin(bytes, cudaGetErrorString(status));
    }
    return p;
  }
  // Mapped: kernels address it directly (accumulate_download); portable: on every device.
  const cudaError_t status = cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable);
  if (status != cudaSuccess) {
    cudaGetLastError();
    cannot_pin(bytes, cudaGetErrorString(status));
  }
  return p;
}

void PinnedSlabs::release(void* slab, std::size_t) noexcept {
  if (!registered_) {
    cudaFreeHost(slab);
    return;
  }
  cudaHostUnregister(slab);
  std::free(slab);
}

CudaTransfer::CudaTransfer(int device, std::uintptr_t download_stream, std::uintptr_t upload_stream,
                           bool register_pinned)
    : device_(device),
      download_stream_(download_stream),
      upload_stream_(upload_stream),
      register_pinned_(register_pinned),
      arena_(std::make_unique<PinnedSlabs>(register_pinned)) {
  TS_CUDA_CHECK(cudaSetDevice(device_));
  cudaEvent_t event = nullptr;
  TS_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  measured_ = event;
}

CudaTransfer::~CudaTransfer() { cudaEventDestroy(static_cast<cudaEvent_t>(measured_)); }

std::unique_ptr<TransferSlot> CudaTransfer::make_slot() { return std::make_unique<CudaSlot>(); }

void CudaTransfer::download(TransferSlot& s, void* host, const void* device, std::size_t bytes,
                            std::uintptr_t producer_stream, std::function<void()> landed) {
  auto& slot = static_cast<CudaSlot&>(s);
  const cudaStream_t stream = as_stream(download_stream_);
  // The copy must not start before the kernel that produced the gradient has finished.
  order_after(slot.produced, as_stream(producer_stream), stream);
  TS_CUDA_CHECK(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, stream));
  mark_landed(slot, stream, std::move(landed));
}

void CudaTransfer::accumulate_download(TransferSlot& s, float* host_acc, const void* device_grad, DType grad_dtype,
                                       std::size_t numel, bool overwrite, std::uintptr_t producer_stream,
                                       std::function<void()> landed) {
  auto& slot = static_cast<CudaSlot&>(s);
  const cudaStream_t stream = as_stream(download_stream_);
  DeviceScope on_device(device_);
  float* acc = nullptr;  // the same bytes as host_acc, as the GPU addresses them
  TS_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&acc), host_acc, 0));
  order_after(slot.produced, as_stream(producer_stream), stream);  // as in download()
  launch_accumulate(acc, device_grad, grad_dtype, numel, overwrite, stream);
  mark_landed(slot, stream, std::move(landed));
}

void CudaTransfer::download_bf16_exact(TransferSlot& s, void* host, const float* device_grad, std::size_t numel,
                                       std::uint32_t* inexact, std::uintptr_t producer_stream, const DeviceNorm& norm,
                                       std::function<void()> landed) {
  auto& slot = static_cast<CudaSlot&>(s);
  const cudaStream_t stream = as_stream(download_stream_);
  DeviceScope on_device(device_);
  void* dst = nullptr;  // host and inexact as the GPU addresses them
  std::uint32_t* flag = nullptr;
  TS_CUDA_CHECK(cudaHostGetDevicePointer(&dst, host, 0));
  TS_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&flag), inexact, 0));
  *inexact = 0;  // pinned memory is coherent: the scan kernel, launched after this store, sees it
  order_after(slot.produced, as_stream(producer_stream), stream);  // as in download()
  launch_scan_bf16(device_grad, numel, flag, norm.scratch, norm.out, stream);
  if (norm.out) mark_measured();
  launch_pack_bf16(dst, device_grad, numel, flag, stream);
  mark_landed(slot, stream, std::move(landed));
}

std::uintptr_t CudaTransfer::measure(TransferSlot& s, const void* device_grad, DType grad_dtype, std::size_t numel,
                                     const DeviceNorm& norm, std::uintptr_t producer_stream) {
  auto& slot = static_cast<CudaSlot&>(s);
  const cudaStream_t stream = as_stream(download_stream_);
  order_after(slot.produced, as_stream(producer_stream), stream);  // as in download()
  launch_squared_norms(device_, &device_grad, &grad_dtype, &numel, 1, norm.scratch, norm.out, download_stream_);
  mark_measured();
  return download_stream_;
}

void CudaTransfer::mark_measured() {
  TS_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(measured_), as_stream(download_stream_)));
  has_measure_ = true;
}

void CudaTransfer::order_after_measures(std::uintptr_t stream) {
  if (has_measure_) TS_CUDA_CHECK(cudaStreamWaitEvent(as_stream(stream), static_cast<cudaEvent_t>(measured_), 0));
}

void CudaTransfer::wait_download(TransferSlot& s) {
  TS_CUDA_CHECK(cudaEventSynchronize(static_cast<CudaSlot&>(s).downloaded));
}

void CudaTransfer::upload(TransferSlot& s, void* device, const void* host, std::size_t bytes) {
  auto& slot = static_cast<CudaSlot&>(s);
  TS_CUDA_CHECK(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, as_stream(upload_stream_)));
  TS_CUDA_CHECK(cudaEventRecord(slot.uploaded, as_stream(upload_stream_)));
  slot.has_upload = true;
}

void CudaTransfer::set_staging(std::uintptr_t device, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(staging_mutex_);
  staging_ = reinterpret_cast<float*>(device);
  staging_floats_ = bytes / sizeof(float);
}

void CudaTransfer::upload_update(TransferSlot& s, float* device, const float* term, std::size_t numel,
                                 float decay) {
  auto& slot = static_cast<CudaSlot&>(s);
  const cudaStream_t stream = as_stream(upload_stream_);
  std::lock_guard<std::mutex> lock(staging_mutex_);
  TS_EXPECTS(staging_ != nullptr && staging_floats_ > 0,
             "CudaTransfer: upload_update needs a staging buffer (set_staging)");
  DeviceScope on_device(device_);
  // Each piece's copy waits, in stream order, for the kernel that read the previous piece.
  for (std::size_t begin = 0; begin < numel; begin += staging_floats_) {
    const std::size_t n = std::min(staging_floats_, numel - begin);
    TS_CUDA_CHECK(cudaMemcpyAsync(staging_, term + begin, 4 * n, cudaMemcpyHostToDevice, stream));
    launch_apply_update(device + begin, staging_, n, decay, stream);
  }
  TS_CUDA_CHECK(cudaEventRecord(slot.uploaded, stream));
  slot.has_upload = true;
}

void CudaTransfer::apply_update(TransferSlot& s, float* device, const float* device_term, std::size_t numel,
                                float decay) {
  auto& slot = static_cast<CudaSlot&>(s);
  const cudaStream_t stream = as_stream(upload_stream_);
  DeviceScope on_device(device_);
  launch_apply_update(device, device_term, numel, decay, stream);
  TS_CUDA_CHECK(cudaEventRecord(slot.uploaded, stream));
  slot.has_upload = true;
}

void CudaTransfer::wait_upload(TransferSlot& s) {
  auto& slot = static_cast<CudaSlot&>(s);
  if (slot.has_upload) TS_CUDA_CHECK(cudaEventSynchronize(slot.uploaded));
}

void CudaTransfer::order_after_upload(TransferSlot& s, std::uintptr_t stream) {
  auto& slot = static_cast<CudaSlot&>(s);
  if (slot.has_upload) TS_CUDA_CHECK(cudaStreamWaitEvent(as_stream(stream), slot.uploaded, 0));
}

bool CudaTransfer::upload_complete(TransferSlot& s) {
  auto& slot = static_cast<CudaSlot&>(s);
  if (!slot.has_upload) return true;
  const cudaError_t status = cudaEventQuery(slot.uploaded);
  if (status == cudaErrorNotReady) return false;
  TS_CUDA_CHECK(status);
  return true;
}

void CudaTransfer::bind_thread() { TS_CUDA_CHECK(cudaSetDevice(device_)); }

}  // namespace trainstream
