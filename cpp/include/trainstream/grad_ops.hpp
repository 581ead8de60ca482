// Host-side gradient arithmetic the offload pipeline needs besides AdamW: summing micro-batch
// gradients (fp32 accumulator), squared norms for clipping, sending bf16-exact gradients as bf16
// and widening bf16 to fp32. The pooled ones spread over a thread pool.
#pragma once

#include <cstddef>

#include "trainstream/adamw.hpp"
#include "trainstream/thread_pool.hpp"

namespace trainstream {

// acc = grad (overwrite) or acc += grad, grad fp32 or bf16, acc fp32.
void accumulate_grad(ThreadPool& pool, float* acc, const void* grad, DType grad_dtype,
                     std::size_t numel, bool overwrite);
// The same on the calling thread alone.
void accumulate_grad(float* acc, const void* grad, DType grad_dtype, std::size_t numel, bool overwrite);

// Whether every element is a bf16 value widened to fp32: its low 16 bits are zero.
bool bf16_exact(const float* src, std::size_t numel);
// dst[i] = the high 16 bits of src[i]: bf16 without rounding, exact when bf16_exact(src).
void pack_bf16_exact(std::uint16_t* dst, const float* src, std::size_t numel);

// The squared L2 norm of a gradient, defined so that it has one value wherever it is computed
// (any number of host threads, or the GPU kernel in cuda/kernels/device_adamw.cu): the elements
// are cut into blocks of kNormBlock; within a block, lane l (of kNormLanes) adds x[i]^2 in double,
// in order, over the block's i with (i - start) % kNormLanes == l; the lanes are then folded
// pairwise, lane l taking lane l + w for w = 16, 8, 4, 2, 1, and lane 0 is the block's partial;
// the norm adds the block partials in order. The square of an fp32 or bf16 value is exact in
// double, so a fused multiply-add gives the same sums. (The lanes are a warp's on the GPU.)
constexpr std::size_t kNormBlock = 4096;
constexpr std::size_t kNormLanes = 32;
// One block's partial, over elements [begin, end) (at most kNormBlock of them).
double squared_norm_block(const void* data, DType dtype, std::size_t begin, std::size_t end);
// The partials of the blocks that start in [begin, end) (begin a multiple of kNormBlock), in order.
void squared_norm_blocks(const void* data, DType dtype, std::size_t begin, std::size_t end, std::size_t numel,
                         double* partials);
// The norm over all elements: blocks spread over the pool, their partials added in order.
double squared_norm(ThreadPool& pool, const void* data, DType dtype, std::size_t numel);

// dst[i] = float(src[i]) for bf16 src; a plain copy for fp32.
void to_float32(ThreadPool& pool, float* dst, const void* src, DType src_dtype, std::size_t numel);

// Zeroes `bytes` at `dst` from every thread of the pool: fresh host memory's first touch (its
// page faults) and a pinned buffer's fill both scale with threads.
void zero_fill(ThreadPool& pool, void* dst, std::size_t bytes);

}  // namespace trainstream
