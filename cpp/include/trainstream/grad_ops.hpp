// Host-side gradient arithmetic the offload pipeline needs besides AdamW: summing micro-batch
// gradients (fp32 accumulator) and squared norms for clipping. Spread over a thread pool.
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

// Sum of squares, accumulated in double: the partial sums of chunk_elements(numel, pool.size())
// long chunks, added in order.
double squared_norm(ThreadPool& pool, const void* data, DType dtype, std::size_t numel);
// One chunk's partial sum, over elements [begin, end).
double squared_norm(const void* data, DType dtype, std::size_t begin, std::size_t end);

// dst[i] = float(src[i]) for bf16 src; a plain copy for fp32.
void to_float32(ThreadPool& pool, float* dst, const void* src, DType src_dtype, std::size_t numel);

// dst[i] = bf16(src[i]), round to nearest even.
void to_bfloat16(ThreadPool& pool, std::uint16_t* dst, const float* src, std::size_t numel);

}  // namespace trainstream
