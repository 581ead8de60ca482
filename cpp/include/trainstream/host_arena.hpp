// Host memory for parameters and optimizer state, carved out of large slabs that are allocated
// (and, on CUDA, pinned) once; a slab whose blocks have all been given back goes back to the OS.
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace trainstream {

// Where slabs come from: pageable memory here, pinned memory in the CUDA build.
class SlabSource {
 public:
  virtual ~SlabSource() = default;
  virtual void* allocate(std::size_t bytes) = 0;  // throws on failure
  virtual void release(void* slab, std::size_t bytes) noexcept = 0;
  virtual const char* kind() const = 0;            // "pageable" | "pinned"
};

class PageableSlabs : public SlabSource {
 public:
  void* allocate(std::size_t bytes) override;
  void release(void* slab, std::size_t bytes) noexcept override;
  const char* kind() const override { return "pageable"; }
};

// Bytes the kernel reports as available to new allocations (MemAvailable), or 0 if unknown.
std::size_t host_memory_available();

class HostArena {
 public:
  static constexpr std::size_t kAlignment = 64;
  // What allocate(bytes) takes from a slab: bytes rounded up to kAlignment.
  static constexpr std::size_t rounded(std::size_t bytes) {
    return (bytes + kAlignment - 1) / kAlignment * kAlignment;
  }

  explicit HostArena(std::unique_ptr<SlabSource> source, std::size_t slab_bytes = std::size_t(256) << 20);
  ~HostArena();
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  // A 64-byte aligned block that lives until release() or the arena's end. Requests larger than a
  // slab get a slab of their own. Before growing, checks that the host can hold the new slab and
  // refuses with the bytes needed if not.
  void* allocate(std::size_t bytes);
  // Gives back a block allocate(bytes) returned. Its space is not handed out again, but once every
  // block of its slab is back, the slab goes back to its source (the OS, unpinned).
  void release(void* block, std::size_t bytes);
  // Whether `block` lies in one of this arena's slabs.
  bool owns(const void* block) const;

  std::size_t reserved_bytes() const;  // in slabs
  std::size_t used_bytes() const;      // handed out
  std::size_t slab_count() const;
  const char* kind() const { return source_->kind(); }

 private:
  std::size_t reserved_bytes_locked() const;

  struct Slab {
    char* base;
    std::size_t bytes;
    std::size_t used;  // handed out from the start of the slab (never reused)
    std::size_t live;  // of that, not given back
  };
  std::unique_ptr<SlabSource> source_;
  std::size_t slab_bytes_;
  mutable std::mutex mutex_;
  std::vector<Slab> slabs_;
  std::size_t used_ = 0;
};

}  // namespace trainstream
