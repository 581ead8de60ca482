#include "trainstream/cuda/cuda_check.hpp"

#include <string>

namespace trainstream {

namespace {
std::string describe(cudaError_t code, const char* call, const std::string& location) {
  return std::string("CUDA error ") + cudaGetErrorName(code) + " (" + cudaGetErrorString(code) + ") in " + call +
         " [" + location + "]";
}
}  // namespace

CudaError::CudaError(int code, const char* call, const char* file, int line)
    : Error(describe(static_cast<cudaError_t>(code), call, detail::source_location(file, line))),
      code_(code),
      name_(cudaGetErrorName(static_cast<cudaError_t>(code))),
      call_(call),
      location_(detail::source_location(file, line)) {}

}  // namespace trainstream
