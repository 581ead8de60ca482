// Activation paging: saved activations copied to host slots during forward and copied back
// (prefetched) during backward. The pool of host slots is shared by both backends: pinned slabs
// with CUDA streams and events (cuda/), pageable memory with plain copies (CPU mode, tests).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "trainstream/host_arena.hpp"
#include "trainstream/transfer.hpp"

namespace trainstream {

// Host slots keyed by size class. A slot is carved from the arena once and reused every step:
// a model saves the same shapes each step, so after the first step nothing new is pinned.
class SlotPool {
 public:
  struct Slot {
    void* data;
    std::size_t capacity;
    std::unique_ptr<TransferSlot> sync;  // the backend's events for this slot
    std::uint64_t epoch = 0;             // the mark() current when it was last acquired
  };

  explicit SlotPool(std::unique_ptr<SlabSource> source);
  Slot* acquire(std::size_t bytes, const std::function<std::unique_ptr<TransferSlot>()>& make_sync);
  void release(Slot* slot) noexcept;
  // For when a plan pages less than the steps before it: mark() when the plan starts, trim() after
  // a step in it. trim() gives back the free slots not acquired since the last mark() (their slabs
  // go to the OS once every slot in them is back) and returns the host bytes no longer reserved.
  void mark();
  std::size_t trim();

  std::size_t slot_count() const;
  std::size_t reserved_bytes() const { return arena_.reserved_bytes(); }
  std::size_t in_use_bytes() const;
  const char* kind() const { return arena_.kind(); }

  static std::size_t size_class(std::size_t bytes);

 private:
  HostArena arena_;
  mutable std::mutex mutex_;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::multimap<std::size_t, Slot*> free_;  // capacity -> free slot
  std::size_t in_use_ = 0;
  std::uint64_t epoch_ = 0;
};

// One activation's host copy. The slot goes back to the pool when the last reference goes.
class PagedActivation {
 public:
  PagedActivation(std::shared_ptr<SlotPool> pool, SlotPool::Slot* slot, std::size_t bytes)
      : pool_(std::move(pool)), slot_(slot), bytes_(bytes) {}
  ~PagedActivation() { pool_->release(slot_); }
  PagedActivation(const PagedActivation&) = delete;
  PagedActivation& operator=(const PagedActivation&) = delete;

  std::size_t bytes() const { return bytes_; }
  void* host() const { return slot_->data; }
  TransferSlot& sync() const { return *slot_->sync; }

 private:
  std::shared_ptr<SlotPool> pool_;
  SlotPool::Slot* slot_;
  std::size_t bytes_;
};

class ActivationPager {
 public:
  struct Stats {
    std::size_t slots = 0;
    std::size_t reserved_bytes = 0;  // host memory held by the pool
    std::size_t in_use_bytes = 0;    // held by live paged activations
    std::uint64_t paged_out_bytes = 0;
    std::uint64_t paged_in_bytes = 0;
  };

  explicit ActivationPager(std::unique_ptr<SlabSource> source);
  virtual ~ActivationPager() = default;
  ActivationPager(const ActivationPager&) = delete;
  ActivationPager& operator=(const ActivationPager&) = delete;

  // Copies `bytes` at `device` into a host slot once the work queued so far on `compute_stream`
  // has run. The caller keeps the device memory from reuse until wait_paged_out() or an ordered
  // stream use (CUDA: record_stream on the offload stream).
  std::shared_ptr<PagedActivation> page_out(std::uintptr_t device, std::size_t bytes,
                                            std::uintptr_t compute_stream);
  // Copies it back into `device` (freshly allocated on `compute_stream`) on the prefetch stream.
  void page_in(PagedActivation& a, std::uintptr_t device, std::uintptr_t compute_stream);
  // Makes `compute_stream` wait, on the device, for a's page_in.
  virtual void order_after_page_in(PagedActivation& a, std::uintptr_t compute_stream) = 0;
  // Blocks the calling thread until a's page_out has landed in host memory.
  virtual void wait_paged_out(PagedActivation& a) = 0;

  Stats stats() const;
  const char* memory_kind() const { return pool_->kind(); }
  void mark() { pool_->mark(); }
  std::size_t trim() { return pool_->trim(); }

 protected:
  virtual std::unique_ptr<TransferSlot> make_sync() = 0;
  virtual void copy_out(TransferSlot& sync, void* host, const void* device, std::size_t bytes,
                        std::uintptr_t compute_stream) = 0;
  virtual void copy_in(TransferSlot& sync, void* device, const void* host, std::size_t bytes,
                       std::uintptr_t compute_stream) = 0;

 private:
  std::shared_ptr<SlotPool> pool_;
  std::uint64_t paged_out_ = 0;
  std::uint64_t paged_in_ = 0;
};

// CPU mode: "device" memory is host memory and copies are plain memcpys.
class HostActivationPager : public ActivationPager {
 public:
  HostActivationPager();
  void order_after_page_in(PagedActivation&, std::uintptr_t) override {}
  void wait_paged_out(PagedActivation&) override {}

 protected:
  std::unique_ptr<TransferSlot> make_sync() override { return std::make_unique<TransferSlot>(); }
  void copy_out(TransferSlot&, void* host, const void* device, std::size_t bytes, std::uintptr_t) override;
  void copy_in(TransferSlot&, void* device, const void* host, std::size_t bytes, std::uintptr_t) override;
};

}  // namespace trainstream
