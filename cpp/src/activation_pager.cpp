#include "trainstream/activation_pager.hpp"

#include <algorithm>
#include <cstring>
#include <unordered_set>

#include "trainstream/errors.hpp"

namespace trainstream {

SlotPool::SlotPool(std::unique_ptr<SlabSource> source) : arena_(std::move(source)) {}

// Exact sizes below 1 MiB would rarely repeat across shapes; round to 64 KiB there and to
// 1 MiB above, so a slot fits the same tensor every step without wasting much.
std::size_t SlotPool::size_class(std::size_t bytes) {
  const std::size_t step = bytes <= (std::size_t(1) << 20) ? (std::size_t(64) << 10) : (std::size_t(1) << 20);
  return (bytes + step - 1) / step * step;
}

SlotPool::Slot* SlotPool::acquire(std::size_t bytes,
                                  const std::function<std::unique_ptr<TransferSlot>()>& make_sync) {
  TS_EXPECTS(bytes > 0, "SlotPool: zero-byte slot");
  const std::size_t capacity = size_class(bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = free_.find(capacity);
  Slot* slot;
  if (it != free_.end()) {
    slot = it->second;
    free_.erase(it);
  } else {
    auto fresh = std::make_unique<Slot>(Slot{arena_.allocate(capacity), capacity, make_sync()});
    slot = fresh.get();
    slots_.push_back(std::move(fresh));
  }
  in_use_ += slot->capacity;
  slot->epoch = epoch_;
  return slot;
}

void SlotPool::release(Slot* slot) noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  in_use_ -= slot->capacity;
  free_.emplace(slot->capacity, slot);
}

void SlotPool::mark() {
  std::lock_guard<std::mutex> lock(mutex_);
  ++epoch_;
}

std::size_t SlotPool::trim() {
  std::lock_guard<std::mutex> lock(mutex_);
  const std::size_t before = arena_.reserved_bytes();
  std::unordered_set<const Slot*> freed;
  for (auto it = free_.begin(); it != free_.end();) {
    Slot* slot = it->second;
    if (slot->epoch == epoch_) {
      ++it;
      continue;
    }
    slot->sync->finish();  // (its last copies may still read or write it)
    arena_.release(slot->data, slot->capacity);
    freed.insert(slot);
    it = free_.erase(it);
  }
  slots_.erase(std::remove_if(slots_.begin(), slots_.end(),
                              [&freed](const std::unique_ptr<Slot>& s) { return freed.count(s.get()) > 0; }),
               slots_.end());
  return before - arena_.reserved_bytes();
}

std::size_t SlotPool::slot_count() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return slots_.size();
}

std::size_t SlotPool::in_use_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return in_use_;
}

ActivationPager::ActivationPager(std::unique_ptr<SlabSource> source)
    : pool_(std::make_shared<SlotPool>(std::move(source))) {}

std::shared_ptr<PagedActivation> ActivationPager::page_out(std::uintptr_t device, std::size_t bytes,
                                                           std::uintptr_t compute_stream) {
  TS_EXPECTS(device != 0, "ActivationPager: null device address");
  SlotPool::Slot* slot = pool_->acquire(bytes, [this] { return make_sync(); });
  auto paged = std::make_shared<PagedActivation>(pool_, slot, bytes);
  copy_out(*slot->sync, slot->data, reinterpret_cast<const void*>(device), bytes, compute_stream);
  paged_out_ += bytes;
  return paged;
}

void ActivationPager::page_in(PagedActivation& a, std::uintptr_t device, std::uintptr_t compute_stream) {
  TS_EXPECTS(device != 0, "ActivationPager: null device address");
  copy_in(a.sync(), reinterpret_cast<void*>(device), a.host(), a.bytes(), compute_stream);
  paged_in_ += a.bytes();
}

ActivationPager::Stats ActivationPager::stats() const {
  Stats s;
  s.slots = pool_->slot_count();
  s.reserved_bytes = pool_->reserved_bytes();
  s.in_use_bytes = pool_->in_use_bytes();
  s.paged_out_bytes = paged_out_;
  s.paged_in_bytes = paged_in_;
  return s;
}

HostActivationPager::HostActivationPager() : ActivationPager(std::make_unique<PageableSlabs>()) {}

void HostActivationPager::copy_out(TransferSlot&, void* host, const void* device, std::size_t bytes,
                                   std::uintptr_t) {
  std::memcpy(host, device, bytes);
}

void HostActivationPager::copy_in(TransferSlot&, void* device, const void* host, std::size_t bytes,
                                  std::uintptr_t) {
  std::memcpy(device, host, bytes);
}

}  // namespace trainstream
