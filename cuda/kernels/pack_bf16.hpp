// Host-side entry to the bf16-exact gradient download (pack_bf16.cu), for CudaTransfer.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace trainstream {

// Queues on `stream`, on the current device: *flag = 1 if any element of the fp32 `grad` (device
// memory) has non-zero low 16 bits; then, as the flag says, dst = the high halves of grad as
// bf16, or dst = grad. `dst` and `flag` are device addresses, typically of mapped pinned host
// memory; the caller clears *flag beforehand. Throws CudaError if a launch fails.
void launch_pack_bf16(void* dst, const float* grad, std::size_t numel, std::uint32_t* flag, cudaStream_t stream);

}  // namespace trainstream
