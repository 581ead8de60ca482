// Folds a micro-batch gradient held in VRAM into the fp32 accumulator in pinned host memory,
// reading and writing the accumulator in place over PCIe (zero-copy), while backward keeps the
// GPU busy. So the kernel is shaped for latency, not for compute: a few dozen blocks walk the
// tensor grid-stride, and each thread issues all its loads before its first add, so that enough
// bytes are in flight to cover the PCIe round trip without taking many SMs from backward.
//
// The add must match the host's accumulate_grad bit for bit: one IEEE fp32 add per element, in
// round-to-nearest, denormals kept. This file is compiled without fast math and with
// --fmad=false (there is no multiply to contract with anyway) and --ftz=false.
#include <algorithm>
#include <cstdint>

#include "accumulate.hpp"
#include "trainstream/cuda/cuda_check.hpp"

namespace trainstream {

namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;      // independent packs per thread per pass: loads in flight
constexpr int kMaxBlocks = 32;  // 32 x 256 x 4 x 16 B = 512 KiB of reads in flight, ample for PCIe

// W consecutive elements moved by one access: 16 B for four floats, 8 B for four bf16.
template <typename T, int W>
struct alignas(sizeof(T) * W) Pack {
  T v[W];
};

__device__ __forceinline__ float to_float(float g) { return g; }
__device__ __forceinline__ float to_float(std::uint16_t bf16) {
  return __uint_as_float(static_cast<unsigned>(bf16) << 16);
}

// acc[k] (+)= grad[k] for packs k < packs; G is float or the bf16 bits.
template <typename G, int W, bool kOverwrite>
__global__ void __launch_bounds__(kThreads)
    accumulate_kernel(Pack<float, W>* __restrict__ acc, const Pack<G, W>* __restrict__ grad, std::size_t packs) {
  const std::size_t stride = std::size_t(gridDim.x) * kThreads * kUnroll;
  for (std::size_t base = std::size_t(blockIdx.x) * kThreads * kUnroll + threadIdx.x; base < packs;
       base += stride) {
    Pack<float, W> a[kUnroll];
    Pack<G, W> g[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const std::size_t k = base + std::size_t(u) * kThreads;
      if (k < packs) {
        g[u] = grad[k];
        if constexpr (!kOverwrite) a[u] = acc[k];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const std::size_t k = base + std::size_t(u) * kThreads;
      if (k < packs) {
        Pack<float, W> r;
#pragma unroll
        for (int j = 0; j < W; ++j) {
          if constexpr (kOverwrite) {
            r.v[j] = to_float(g[u].v[j]);
          } else {
            r.v[j] = a[u].v[j] + to_float(g[u].v[j]);
          }
        }
        acc[k] = r;
      }
    }
  }
}

template <typename G, int W>
void launch_packs(float* acc, const G* grad, std::size_t packs, bool overwrite, cudaStream_t stream) {
  if (packs == 0) return;
  const std::size_t per_block = std::size_t(kThreads) * kUnroll;
  const int blocks = static_cast<int>(std::min<std::size_t>(kMaxBlocks, (packs + per_block - 1) / per_block));
  auto* a = reinterpret_cast<Pack<float, W>*>(acc);
  const auto* g = reinterpret_cast<const Pack<G, W>*>(grad);
  if (overwrite) {
    accumulate_kernel<G, W, true><<<blocks, kThreads, 0, stream>>>(a, g, packs);
  } else {
    accumulate_kernel<G, W, false><<<blocks, kThreads, 0, stream>>>(a, g, packs);
  }
  TS_CUDA_CHECK(cudaGetLastError());
}

template <typename G>
void launch_typed(float* acc, const G* grad, std::size_t numel, bool overwrite, cudaStream_t stream) {
  constexpr int W = 4;
  const bool aligned = reinterpret_cast<std::uintptr_t>(acc) % sizeof(Pack<float, W>) == 0 &&
                       reinterpret_cast<std::uintptr_t>(grad) % sizeof(Pack<G, W>) == 0;
  if (!aligned) {  // e.g. a gradient that is a slice at an odd offset: element by element
    launch_packs<G, 1>(acc, grad, numel, overwrite, stream);
    return;
  }
  const std::size_t packs = numel / W;
  launch_packs<G, W>(acc, grad, packs, overwrite, stream);
  const std::size_t done = packs * W;  // the last numel % 4 elements, if any
  launch_packs<G, 1>(acc + done, grad + done, numel - done, overwrite, stream);
}

}  // namespace

void launch_accumulate(float* acc, const void* grad, DType grad_dtype, std::size_t numel, bool overwrite,
                       cudaStream_t stream) {
  if (grad_dtype == DType::bfloat16) {
    launch_typed(acc, static_cast<const std::uint16_t*>(grad), numel, overwrite, stream);
  } else {
    launch_typed(acc, static_cast<const float*>(grad), numel, overwrite, stream);
  }
}

}  // namespace trainstream
