// The two halves of grad_ops.hpp's squared norm as device code, shared by every kernel that takes
// a norm (device_adamw.cu's, and the bf16 scan of pack_bf16.cu that measures as it tests), so
// that they all give its bits.
#pragma once

#include <cstddef>

#include "trainstream/grad_ops.hpp"

namespace trainstream {

// Norm blocks of a tensor of `numel` elements: its partials, one each.
__host__ __device__ constexpr std::size_t norm_blocks(std::size_t numel) { return (numel + kNormBlock - 1) / kNormBlock; }

// One norm block's partial, by a warp: lane `lane` adds the squares of elements begin + lane,
// begin + lane + 32, ... below `end` in order, as `load(i)` gives them; the lanes then fold as
// squared_norm_block() folds them. The partial is lane 0's result.
template <typename Load>
__device__ __forceinline__ double norm_block_partial(Load load, std::size_t begin, std::size_t end, unsigned lane) {
  static_assert(kNormLanes == 32, "a norm block's lanes are a warp");
  double s = 0;
#pragma unroll 4  // (loads ahead of the adds, which keep their order)
  for (std::size_t i = begin + lane; i < end; i += 32) {
    const double x = load(i);
    s = __dadd_rn(s, __dmul_rn(x, x));
  }
  for (int width = 16; width > 0; width /= 2) s = __dadd_rn(s, __shfl_down_sync(0xffffffffu, s, width));
  return s;
}

// Partials [first, last) added in order, by a warp, every lane's result the sum. The lanes load
// 32 partials at a time, the next 32 on their way while these are added, and every lane adds them
// in order from the lanes' registers: one memory round trip per 32 partials rather than one per
// partial (a single thread adding a large tensor's thousands of partials took milliseconds).
// Loads bypass L1: the partials may have been written by other thread blocks of the same launch.
__device__ __forceinline__ double sum_partials(const double* partials, unsigned long long first,
                                               unsigned long long last, unsigned lane) {
  double total = 0;
  double next = first + lane < last ? __ldcg(partials + first + lane) : 0.0;
  for (unsigned long long base = first; base < last; base += 32) {
    const double here = next;
    if (base + 32 + lane < last) next = __ldcg(partials + base + 32 + lane);
    const unsigned n = static_cast<unsigned>(min(32ull, last - base));  // (the same in every lane)
    for (unsigned j = 0; j < n; ++j) total = __dadd_rn(total, __shfl_sync(0xffffffffu, here, j));
  }
  return total;
}

}  // namespace trainstream
