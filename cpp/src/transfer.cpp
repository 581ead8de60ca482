#include "trainstream/transfer.hpp"

#include <cstring>

namespace trainstream {

HostTransfer::HostTransfer() : arena_(std::make_unique<PageableSlabs>()) {}

std::unique_ptr<TransferSlot> HostTransfer::make_slot() { return std::make_unique<TransferSlot>(); }

void HostTransfer::download(TransferSlot&, void* host, const void* device, std::size_t bytes, std::uintptr_t,
                            std::function<void()> landed) {
  std::memcpy(host, device, bytes);
  if (landed) landed();
}

void HostTransfer::upload(TransferSlot&, void* device, const void* host, std::size_t bytes) {
  std::memcpy(device, host, bytes);
}

}  // namespace trainstream
