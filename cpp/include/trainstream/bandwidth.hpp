// A STREAM-style triad, a[i] = b[i] + s * c[i], over all pool threads with streaming stores where
// the ISA has them: the host memory bandwidth that the AdamW engine is judged against.
#pragma once

#include <cstddef>

#include "trainstream/cpu_features.hpp"
#include "trainstream/thread_pool.hpp"

namespace trainstream {

struct TriadResult {
  double best_gbps;  // fastest repeat
  double median_gbps;
  std::size_t bytes_per_element;  // 12: read b and c, write a (STREAM's count)
};

// Allocates three arrays of `numel` floats, touches them from the pool, then times `repeats`
// triads. numel must be large enough to defeat the caches (>= 4x LLC).
TriadResult measure_triad(ThreadPool& pool, std::size_t numel, int repeats, Isa isa);

namespace kernels {
void triad_scalar(float* a, const float* b, const float* c, float s, std::size_t begin, std::size_t end);
void triad_avx2(float* a, const float* b, const float* c, float s, std::size_t begin, std::size_t end);
void triad_avx512(float* a, const float* b, const float* c, float s, std::size_t begin, std::size_t end);
}  // namespace kernels

}  // namespace trainstream
