// CUDA failures become trainstream::CudaError carrying the call, file and line.
#pragma once

#include <cuda_runtime_api.h>

#include "trainstream/errors.hpp"

namespace trainstream {

class CudaError : public Error {
 public:
  CudaError(cudaError_t code, const char* call, const char* file, int line);
  cudaError_t code() const { return code_; }

 private:
  cudaError_t code_;
};

}  // namespace trainstream

#define TS_CUDA_CHECK(call)                                                   \
  do {                                                                        \
    const cudaError_t ts_status = (call);                                     \
    if (ts_status != cudaSuccess) throw ::trainstream::CudaError(ts_status, #call, __FILE__, __LINE__); \
  } while (0)
