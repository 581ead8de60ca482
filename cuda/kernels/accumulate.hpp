// Host-side entry to the gradient accumulation kernel (accumulate.cu), for CudaTransfer.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "trainstream/adamw.hpp"  // DType

namespace trainstream {

// Queues acc[i] = float(grad[i]) (overwrite) or acc[i] = acc[i] + float(grad[i]) for i < numel
// on `stream`, on the current device. `acc` is fp32, typically pinned host memory seen through its
// mapped device address; `grad` is fp32 or bf16 in device memory, at any element alignment.
// Throws CudaError if the launch fails.
void launch_accumulate(float* acc, const void* grad, DType grad_dtype, std::size_t numel, bool overwrite,
                       cudaStream_t stream);

}  // namespace trainstream
