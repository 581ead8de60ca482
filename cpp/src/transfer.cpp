#include "trainstream/transfer.hpp"

#include <cstring>
#include <stdexcept>

#include "trainstream/grad_ops.hpp"

namespace trainstream {

bool Transfer::upload_complete(TransferSlot&) { return true; }

void Transfer::upload_update(TransferSlot&, float* device, const float* term, std::size_t numel, float decay) {
  // Two roundings, never one fused multiply-add: this file is built with -ffp-contract=off.
  for (std::size_t i = 0; i < numel; ++i) device[i] = device[i] * decay + term[i];
}

void Transfer::apply_update(TransferSlot& slot, float* device, const float* device_term, std::size_t numel,
                            float decay) {
  Transfer::upload_update(slot, device, device_term, numel, decay);  // (both in host memory here)
}

void Transfer::download_bf16_exact(TransferSlot& slot, void* host, const float* device_grad, std::size_t numel,
                                   std::uint32_t* inexact, std::uintptr_t producer_stream, const DeviceNorm& norm,
                                   std::function<void()> landed) {
  if (norm.out) producer_stream = measure(slot, device_grad, DType::float32, numel, norm, producer_stream);
  *inexact = 1;
  download(slot, host, device_grad, 4 * numel, producer_stream, std::move(landed));
}

std::uintptr_t Transfer::measure(TransferSlot&, const void*, DType, std::size_t, const DeviceNorm&, std::uintptr_t) {
  throw std::invalid_argument("Transfer: only a device backend measures gradients where they are");
}

HostTransfer::HostTransfer() : arena_(std::make_unique<PageableSlabs>()) {}

std::unique_ptr<TransferSlot> HostTransfer::make_slot() { return std::make_unique<TransferSlot>(); }

void HostTransfer::download(TransferSlot&, void* host, const void* device, std::size_t bytes, std::uintptr_t,
                            std::function<void()> landed) {
  std::memcpy(host, device, bytes);
  if (landed) landed();
}

void HostTransfer::accumulate_download(TransferSlot&, float* host_acc, const void* device_grad, DType grad_dtype,
                                       std::size_t numel, bool overwrite, std::uintptr_t,
                                       std::function<void()> landed) {
  accumulate_grad(host_acc, device_grad, grad_dtype, numel, overwrite);
  if (landed) landed();
}

void HostTransfer::download_bf16_exact(TransferSlot& slot, void* host, const float* device_grad, std::size_t numel,
                                       std::uint32_t* inexact, std::uintptr_t producer_stream, const DeviceNorm& norm,
                                       std::function<void()> landed) {
  if (norm.out) measure(slot, device_grad, DType::float32, numel, norm, producer_stream);  // (refused)
  const bool exact = bf16_exact(device_grad, numel);
  if (exact) {
    pack_bf16_exact(static_cast<std::uint16_t*>(host), device_grad, numel);
  } else {
    std::memcpy(host, device_grad, 4 * numel);
  }
  *inexact = exact ? 0 : 1;
  if (landed) landed();
}

void HostTransfer::upload(TransferSlot&, void* device, const void* host, std::size_t bytes) {
  std::memcpy(device, host, bytes);
}

}  // namespace trainstream
