// Sends an fp32 gradient to pinned host memory as bf16 when that loses nothing. Under bf16
// autocast a matmul's weight gradient is computed in bf16 and widened to fp32, so its low 16 bits
// are zero: the high halves alone carry it, which halves the bytes crossing PCIe and landing in
// host memory, and the host then reads half as many for the update.
//
// Two kernels on the download stream: the first reads the gradient where it lies (in VRAM, at
// HBM speed) and raises a flag in host memory if any low half is non-zero; the second reads the
// flag and writes, through the mapped address of the landing buffer, either the high halves or
// the whole fp32 values. The flag is the host's record of which one it got. Where the gradient's
// norm is wanted too (clipping), the first kernel takes it in the same read.
#include <algorithm>
#include <cstdint>

#include "norm_block.cuh"
#include "pack_bf16.hpp"
#include "trainstream/cuda/cuda_check.hpp"

namespace trainstream {

namespace {

constexpr int kThreads = 256;
constexpr int kScanBlocks = 264;  // the scan reads VRAM: a couple of waves of the GPU's SMs
constexpr int kPackBlocks = 32;   // the pack writes across PCIe: a few SMs saturate the link

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

int blocks_for(std::size_t work, int most) {
  return static_cast<int>(std::max<std::size_t>(1, std::min<std::size_t>(most, (work + kThreads - 1) / kThreads)));
}

// *flag = 1 if any element of g has a non-zero low half. `vec`: g is 16-byte aligned.
__global__ void __launch_bounds__(kThreads)
    scan_kernel(const std::uint32_t* __restrict__ g, std::size_t numel, bool vec, std::uint32_t* flag) {
  const std::size_t first = std::size_t(blockIdx.x) * kThreads + threadIdx.x;
  const std::size_t stride = std::size_t(gridDim.x) * kThreads;
  std::uint32_t bits = 0;
  std::size_t done = 0;
  if (vec) {
    const auto* g4 = reinterpret_cast<const uint4*>(g);
    const std::size_t n4 = numel / 4;
    for (std::size_t k = first; k < n4; k += stride) {
      const uint4 w = g4[k];
      bits |= w.x | w.y | w.z | w.w;
    }
    done = n4 * 4;
  }
  for (std::size_t k = done + first; k < numel; k += stride) bits |= g[k];
  // Every writer stores the same 1, so plain stores suffice (no atomics on host memory).
  if (__syncthreads_or((bits & 0xFFFFu) != 0) && threadIdx.x == 0) *reinterpret_cast<volatile std::uint32_t*>(flag) = 1;
}

// The scan, a warp per norm block, also taking the squared norm as grad_ops.hpp defines it: each
// warp leaves its block's partial in `partials`, and the thread block that finishes last (counted
// in `done`, which it sets back to 0 for the next launch) adds them in order into *out. One launch
// where a separate scan and the two norm kernels of device_adamw.cu took three, each of them a
// call on the thread that runs backward.
__global__ void __launch_bounds__(kThreads)
    scan_norm_kernel(const std::uint32_t* __restrict__ g, std::size_t numel, std::uint32_t* flag,
                     double* __restrict__ partials, unsigned* done, double* __restrict__ out) {
  const std::size_t blocks = norm_blocks(numel);
  const std::size_t index = (std::size_t(blockIdx.x) * kThreads + threadIdx.x) / 32;
  const unsigned lane = threadIdx.x % 32;
  std::uint32_t bits = 0;
  if (index < blocks) {  // (a whole warp, either way)
    const std::size_t begin = index * kNormBlock, end = min(numel, begin + kNormBlock);
    const auto load = [g, &bits](std::size_t i) {
      const std::uint32_t word = g[i];
      bits |= word;
      return double(__uint_as_float(word));
    };
    const double partial = norm_block_partial(load, begin, end, lane);
    if (lane == 0) partials[index] = partial;
  }
  __threadfence();  // this thread's partial, seen by whichever block adds them
  if (__syncthreads_or((bits & 0xFFFFu) != 0) && threadIdx.x == 0) *reinterpret_cast<volatile std::uint32_t*>(flag) = 1;
  __shared__ bool last;
  if (threadIdx.x == 0) last = atomicAdd(done, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last || threadIdx.x >= 32) return;
  const double total = sum_partials(partials, 0, blocks, lane);
  if (lane == 0) {
    *out = total;
    *done = 0;
  }
}

// Two fp32 words' high halves as one word of two bf16, the first element in the low half.
__device__ __forceinline__ std::uint32_t high_halves(std::uint32_t a, std::uint32_t b) {
  return (a >> 16) | (b & 0xFFFF0000u);
}

// dst = high halves of g (flag clear) or dst = g (flag set). `vec`: g and dst 16-byte aligned.
__global__ void __launch_bounds__(kThreads)
    pack_kernel(void* __restrict__ dst, const std::uint32_t* __restrict__ g, std::size_t numel, bool vec,
                const std::uint32_t* flag) {
  __shared__ std::uint32_t inexact;
  if (threadIdx.x == 0) inexact = *reinterpret_cast<const volatile std::uint32_t*>(flag);
  __syncthreads();
  const std::size_t first = std::size_t(blockIdx.x) * kThreads + threadIdx.x;
  const std::size_t stride = std::size_t(gridDim.x) * kThreads;
  const auto* g4 = reinterpret_cast<const uint4*>(g);
  std::size_t done = 0;
  if (inexact) {
    auto* out = static_cast<std::uint32_t*>(dst);
    if (vec) {
      const std::size_t n4 = numel / 4;
      for (std::size_t k = first; k < n4; k += stride) reinterpret_cast<uint4*>(out)[k] = g4[k];
      done = n4 * 4;
    }
    for (std::size_t k = done + first; k < numel; k += stride) out[k] = g[k];
    return;
  }
  auto* out = static_cast<std::uint16_t*>(dst);
  if (vec) {
    const std::size_t n8 = numel / 8;
    for (std::size_t k = first; k < n8; k += stride) {
      const uint4 a = g4[2 * k], b = g4[2 * k + 1];
      reinterpret_cast<uint4*>(out)[k] =
          make_uint4(high_halves(a.x, a.y), high_halves(a.z, a.w), high_halves(b.x, b.y), high_halves(b.z, b.w));
    }
    done = n8 * 8;
  }
  for (std::size_t k = done + first; k < numel; k += stride) out[k] = static_cast<std::uint16_t>(g[k] >> 16);
}

}  // namespace

void launch_scan_bf16(const float* grad, std::size_t numel, std::uint32_t* flag, double* norm_scratch,
                      double* norm_out, cudaStream_t stream) {
  if (numel == 0) return;
  const auto* g = reinterpret_cast<const std::uint32_t*>(grad);
  if (norm_out) {
    constexpr std::size_t kWarps = kThreads / 32;  // norm blocks per thread block
    const std::size_t blocks = norm_blocks(numel);
    auto* done = reinterpret_cast<unsigned*>(norm_scratch + blocks);
    scan_norm_kernel<<<static_cast<unsigned>((blocks + kWarps - 1) / kWarps), kThreads, 0, stream>>>(
        g, numel, flag, norm_scratch, done, norm_out);
  } else {
    scan_kernel<<<blocks_for(numel / 4, kScanBlocks), kThreads, 0, stream>>>(g, numel, aligned16(grad), flag);
  }
  TS_CUDA_CHECK(cudaGetLastError());
}

void launch_pack_bf16(void* dst, const float* grad, std::size_t numel, const std::uint32_t* flag, cudaStream_t stream) {
  if (numel == 0) return;
  const auto* g = reinterpret_cast<const std::uint32_t*>(grad);
  const bool vec = aligned16(grad) && aligned16(dst);
  pack_kernel<<<blocks_for(numel / 8, kPackBlocks), kThreads, 0, stream>>>(dst, g, numel, vec, flag);
  TS_CUDA_CHECK(cudaGetLastError());
}

}  // namespace trainstream
