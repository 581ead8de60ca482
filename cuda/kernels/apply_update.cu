// Adds the host's AdamW update term to fp32 weights in VRAM: weight * decay + term, which is the
// last line of the host kernel moved to where the weights already are, so the host neither reads
// the weights nor keeps an fp32 copy current. __fmul_rn and __fadd_rn are never contracted into
// a fused multiply-add, so the result is the host kernel's bit for bit.
#include <algorithm>

#include "apply_update.hpp"
#include "trainstream/cuda/cuda_check.hpp"

namespace trainstream {

namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 264;  // two per SM on an H100/H200: it is a short, memory-bound pass

__global__ void __launch_bounds__(kThreads)
    apply_update_kernel(float* __restrict__ weight, const float* __restrict__ term, std::size_t numel, float decay) {
  const std::size_t stride = std::size_t(gridDim.x) * kThreads;
  for (std::size_t i = std::size_t(blockIdx.x) * kThreads + threadIdx.x; i < numel; i += stride) {
    weight[i] = __fadd_rn(__fmul_rn(weight[i], decay), term[i]);
  }
}

}  // namespace

void launch_apply_update(float* weight, const float* term, std::size_t numel, float decay, cudaStream_t stream) {
  if (numel == 0) return;
  const int blocks = static_cast<int>(std::min<std::size_t>(kMaxBlocks, (numel + kThreads - 1) / kThreads));
  apply_update_kernel<<<blocks, kThreads, 0, stream>>>(weight, term, numel, decay);
  TS_CUDA_CHECK(cudaGetLastError());
}

}  // namespace trainstream
