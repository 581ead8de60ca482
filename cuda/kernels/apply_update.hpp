// Host-side entry to the weight-update kernel (apply_update.cu), for CudaTransfer.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace trainstream {

// Queues weight[i] = weight[i] * decay + term[i] for i < numel on `stream`, on the current device,
// the multiply and the add each rounded once. Both pointers are fp32 device memory, at any element
// alignment. Throws CudaError if the launch fails.
void launch_apply_update(float* weight, const float* term, std::size_t numel, float decay, cudaStream_t stream);

}  // namespace trainstream
