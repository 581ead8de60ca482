// TS_CUDA_CHECK: a failed CUDA runtime call becomes a trainstream::CudaError carrying the status,
// the call, the file and the line.
#pragma once

#include <cuda_runtime_api.h>

#include "trainstream/cuda/cuda_error.hpp"

// The failed call's status is also taken off the runtime's last-error slot, so that a failure we
// raised (and the caller handled) does not resurface at the next kernel launch's check.
#define TS_CUDA_CHECK(call)                                                                       \
  do {                                                                                            \
    const cudaError_t ts_status = (call);                                                         \
    if (ts_status != cudaSuccess) {                                                               \
      (void)cudaGetLastError();                                                                   \
      throw ::trainstream::CudaError(static_cast<int>(ts_status), #call, __FILE__, __LINE__);     \
    }                                                                                             \
  } while (0)
