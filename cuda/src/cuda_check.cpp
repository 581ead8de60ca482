#include "trainstream/cuda/cuda_check.hpp"

#include <cstring>
#include <string>

namespace trainstream {

namespace {
std::string describe(cudaError_t code, const char* call, const char* file, int line) {
  const char* base = std::strrchr(file, '/');
  return std::string("CUDA error ") + cudaGetErrorName(code) + " (" + cudaGetErrorString(code) +
         ") in " + call + " [" + (base ? base + 1 : file) + ":" + std::to_string(line) + "]";
}
}  // namespace

CudaError::CudaError(cudaError_t code, const char* call, const char* file, int line)
    : Error(describe(code, call, file, line)), code_(code) {}

}  // namespace trainstream
