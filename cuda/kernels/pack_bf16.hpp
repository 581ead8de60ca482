// Host-side entry to the bf16-exact gradient download (pack_bf16.cu), for CudaTransfer.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace trainstream {

// Queues on `stream`, on the current device, the two halves of a bf16-exact download. First
// *flag = 1 if any element of the fp32 `grad` (device memory) has non-zero low 16 bits (the
// caller clears *flag beforehand); where `norm_out` is given, the same pass also queues
// *norm_out = grad's squared norm as grad_ops.hpp defines it, with `norm_scratch` as
// launch_squared_norms takes it (device_adamw.hpp: squared_norm_scratch doubles, zeroed before
// their first use). Then, as the flag says, dst = the high halves of grad as bf16, or dst = grad.
// `dst` and `flag` are device addresses, typically of mapped pinned host memory. Throw CudaError
// if a launch fails.
void launch_scan_bf16(const float* grad, std::size_t numel, std::uint32_t* flag, double* norm_scratch,
                      double* norm_out, cudaStream_t stream);
void launch_pack_bf16(void* dst, const float* grad, std::size_t numel, const std::uint32_t* flag, cudaStream_t stream);

}  // namespace trainstream
