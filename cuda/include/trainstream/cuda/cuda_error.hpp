// A failed CUDA runtime call, as the rest of the program sees it. This header needs no CUDA
// headers, so that code above the CUDA layer (the bindings) can catch and describe the error.
#pragma once

#include <string>

#include "trainstream/errors.hpp"

namespace trainstream {

// Thrown by TS_CUDA_CHECK (cuda_check.hpp). what() reads
// "CUDA error <name> (<description>) in <call> [<file>:<line>]".
class CudaError : public Error {
 public:
  CudaError(int code, const char* call, const char* file, int line);

  int code() const { return code_; }  // the cudaError_t value
  const std::string& name() const { return name_; }  // e.g. "cudaErrorMemoryAllocation"
  const std::string& call() const { return call_; }  // the call as written in the source
  const std::string& location() const { return location_; }  // e.g. "cuda_transfer.cpp:123"

 private:
  int code_;
  std::string name_;
  std::string call_;
  std::string location_;
};

}  // namespace trainstream
