#include "trainstream/host_arena.hpp"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "trainstream/errors.hpp"

namespace trainstream {

namespace {
std::string gib(std::size_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(bytes) / (1ull << 30));
  return buf;
}
}  // namespace

void* PageableSlabs::allocate(std::size_t bytes) {
  void* p = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
  if (!p) throw Error("cannot allocate " + gib(bytes) + " of host memory");
  return p;
}

void PageableSlabs::release(void* slab, std::size_t) noexcept { std::free(slab); }

std::size_t host_memory_available() {
  FILE* f = std::fopen("/proc/meminfo", "r");
  if (!f) return 0;
  char line[256];
  std::size_t kib = 0;
  while (std::fgets(line, sizeof line, f)) {
    if (std::sscanf(line, "MemAvailable: %zu kB", &kib) == 1) break;
  }
  std::fclose(f);
  return kib * 1024;
}

HostArena::HostArena(std::unique_ptr<SlabSource> source, std::size_t slab_bytes)
    : source_(std::move(source)), slab_bytes_(slab_bytes) {
  TS_EXPECTS(source_ != nullptr, "HostArena: no slab source");
  TS_EXPECTS(slab_bytes_ >= 4096, "HostArena: slabs must be at least 4096 bytes");
}

HostArena::~HostArena() {
  for (auto& s : slabs_) source_->release(s.base, s.bytes);
}

void* HostArena::allocate(std::size_t bytes) {
  TS_EXPECTS(bytes > 0, "HostArena: zero-byte allocation");
  const std::size_t size = rounded(bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& s : slabs_) {  // first fit: few slabs, and blocks are never returned
    if (s.bytes - s.used >= size) {
      char* p = s.base + s.used;
      s.used += size;
      s.live += size;
      used_ += size;
      return p;
    }
  }
  const std::size_t slab = std::max(slab_bytes_, size);
  const std::size_t available = host_memory_available();
  if (available != 0 && slab > available) {
    throw Error("host memory: need " + gib(slab) + " more " + source_->kind() +
                " memory (arena already holds " + gib(reserved_bytes_locked()) +
                ") but only " + gib(available) + " is available");
  }
  char* base = static_cast<char*>(source_->allocate(slab));
  slabs_.push_back({base, slab, size, size});
  used_ += size;
  return base;
}

void HostArena::release(void* block, std::size_t bytes) {
  if (block == nullptr) return;
  const std::size_t size = rounded(bytes);
  char* p = static_cast<char*>(block);
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = slabs_.begin(); it != slabs_.end(); ++it) {
    if (p < it->base || p >= it->base + it->bytes) continue;
    TS_EXPECTS(p + size <= it->base + it->used && size <= it->live,
               "HostArena: released a block it did not hand out");
    it->live -= size;
    used_ -= size;
    if (it->live == 0) {
      source_->release(it->base, it->bytes);
      slabs_.erase(it);
    }
    return;
  }
  throw std::invalid_argument("HostArena: released a block of another arena");
}

bool HostArena::owns(const void* block) const {
  const char* p = static_cast<const char*>(block);
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& s : slabs_) {
    if (p >= s.base && p < s.base + s.bytes) return true;
  }
  return false;
}

std::size_t HostArena::reserved_bytes_locked() const {
  std::size_t total = 0;
  for (const auto& s : slabs_) total += s.bytes;
  return total;
}

std::size_t HostArena::reserved_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return reserved_bytes_locked();
}

std::size_t HostArena::used_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return used_;
}

std::size_t HostArena::slab_count() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return slabs_.size();
}

}  // namespace trainstream
