// The CUDA activation pager: pinned slots, an offload stream for device->host copies and a
// prefetch stream for host->device copies, ordered against the compute stream with events only
// (no host synchronisation on the hot path).
#pragma once

#include <cstdint>

#include "trainstream/activation_pager.hpp"

namespace trainstream {

class CudaActivationPager : public ActivationPager {
 public:
  // Streams are cudaStream_t handles owned by the caller, who keeps them alive.
  CudaActivationPager(int device, std::uintptr_t offload_stream, std::uintptr_t prefetch_stream);
  ~CudaActivationPager() override;

  void order_after_page_in(PagedActivation& a, std::uintptr_t compute_stream) override;
  void wait_paged_out(PagedActivation& a) override;

 protected:
  std::unique_ptr<TransferSlot> make_sync() override;
  void copy_out(TransferSlot& sync, void* host, const void* device, std::size_t bytes,
                std::uintptr_t compute_stream) override;
  void copy_in(TransferSlot& sync, void* device, const void* host, std::size_t bytes,
               std::uintptr_t compute_stream) override;

 private:
  int device_;
  std::uintptr_t offload_stream_;
  std::uintptr_t prefetch_stream_;
  void* point_;  // cudaEvent_t, re-recorded on the compute stream before each copy is queued
};

}  // namespace trainstream
