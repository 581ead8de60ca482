#include "trainstream/cuda/device.hpp"

#include <cuda_runtime_api.h>

namespace trainstream {

CudaInfo cuda_info() {
  CudaInfo info;
  cudaRuntimeGetVersion(&info.runtime_version);
  if (cudaDriverGetVersion(&info.driver_version) != cudaSuccess) info.driver_version = 0;
  const cudaError_t status = cudaGetDeviceCount(&info.device_count);
  if (status != cudaSuccess) {
    info.device_count = 0;
    info.error = cudaGetErrorString(status);
    cudaGetLastError();  // clear it (it is not sticky) so later calls start clean
  }
  return info;
}

}  // namespace trainstream
