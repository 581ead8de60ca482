// The CUDA transfer backend: pinned host slabs, a download stream and an upload stream given by
// the caller (torch streams), and per-parameter events that order the copies.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>

#include "trainstream/host_arena.hpp"
#include "trainstream/transfer.hpp"

namespace trainstream {

// Page-locked slabs: pinned once, reused for the arena's whole life, and mapped into the device's
// address space so that kernels can read and write them. From cudaHostAlloc, or (`registered`)
// allocated here, faulted in (zeroed) from every core at once, then registered with
// cudaHostRegister: cudaHostAlloc faults and pins its pages on one thread.
class PinnedSlabs : public SlabSource {
 public:
  explicit PinnedSlabs(bool registered = false) : registered_(registered) {}
  void* allocate(std::size_t bytes) override;
  void release(void* slab, std::size_t bytes) noexcept override;
  const char* kind() const override { return "pinned"; }

 private:
  bool registered_;
};

class CudaTransfer : public Transfer {
 public:
  // Streams are cudaStream_t handles owned by the caller, who keeps them alive.
  // `register_pinned`: PinnedSlabs(registered) for this transfer's host memory.
  CudaTransfer(int device, std::uintptr_t download_stream, std::uintptr_t upload_stream,
               bool register_pinned = false);
  ~CudaTransfer() override;

  std::unique_ptr<TransferSlot> make_slot() override;
  HostArena& arena() override { return arena_; }
  std::unique_ptr<SlabSource> slab_source() const override {
    return std::make_unique<PinnedSlabs>(register_pinned_);
  }
  bool is_device() const override { return true; }
  void download(TransferSlot& slot, void* host, const void* device, std::size_t bytes,
                std::uintptr_t producer_stream, std::function<void()> landed) override;
  // The add runs as a kernel on the download stream (cuda/kernels/accumulate.cu).
  void accumulate_download(TransferSlot& slot, float* host_acc, const void* device_grad, DType grad_dtype,
                           std::size_t numel, bool overwrite, std::uintptr_t producer_stream,
                           std::function<void()> landed) override;
  // Two kernels on the download stream (cuda/kernels/pack_bf16.cu), the first also measuring.
  void download_bf16_exact(TransferSlot& slot, void* host, const float* device_grad, std::size_t numel,
                           std::uint32_t* inexact, std::uintptr_t producer_stream, const DeviceNorm& norm,
                           std::function<void()> landed) override;
  // The norm kernels of device_adamw.hpp, on the download stream.
  std::uintptr_t measure(TransferSlot& slot, const void* device_grad, DType grad_dtype, std::size_t numel,
                         const DeviceNorm& norm, std::uintptr_t producer_stream) override;
  void order_after_measures(std::uintptr_t stream) override;
  void wait_download(TransferSlot& slot) override;
  void upload(TransferSlot& slot, void* device, const void* host, std::size_t bytes) override;
  // On the upload stream: the term is copied to the staging buffer, then a kernel
  // (cuda/kernels/apply_update.cu) adds it to the decayed weights, a staging buffer's worth at a
  // time. Calls from several threads are serialised, since they share the staging buffer.
  void upload_update(TransferSlot& slot, float* device, const float* term, std::size_t numel, float decay) override;
  void apply_update(TransferSlot& slot, float* device, const float* device_term, std::size_t numel,
                    float decay) override;
  void wait_upload(TransferSlot& slot) override;
  void set_staging(std::uintptr_t device, std::size_t bytes) override;
  void order_after_upload(TransferSlot& slot, std::uintptr_t stream) override;
  bool upload_complete(TransferSlot& slot) override;
  void bind_thread() override;

 private:
  void mark_measured();  // records measured_ after the norm just queued on the download stream

  int device_;
  std::uintptr_t download_stream_;
  std::uintptr_t upload_stream_;
  bool register_pinned_;
  HostArena arena_;
  std::mutex staging_mutex_;
  float* staging_ = nullptr;  // device memory owned by the caller
  std::size_t staging_floats_ = 0;
  void* measured_ = nullptr;  // cudaEvent_t on the download stream, after the last norm
  bool has_measure_ = false;
};

}  // namespace trainstream
