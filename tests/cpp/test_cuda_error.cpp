// TS_CUDA_CHECK and CudaError; no GPU needed (CUDA builds only).
#include <cuda_runtime_api.h>

#include <string>

#include "check.hpp"
#include "trainstream/cuda/cuda_check.hpp"

using trainstream::CudaError;

TEST_CASE("a failed call becomes a CudaError with its status, call and location") {
  bool caught = false;
  int line = 0;
  try {
    line = __LINE__ + 1;
    TS_CUDA_CHECK(cudaErrorInvalidValue);  // the status a failed call would return
  } catch (const CudaError& e) {
    caught = true;
    CHECK(e.code() == static_cast<int>(cudaErrorInvalidValue));
    CHECK(e.name() == "cudaErrorInvalidValue");
    CHECK(e.call() == "cudaErrorInvalidValue");
    CHECK(e.location() == "test_cuda_error.cpp:" + std::to_string(line));
    const std::string what = e.what();
    CHECK(what.find("CUDA error cudaErrorInvalidValue (") == 0);
    CHECK(what.find(") in cudaErrorInvalidValue [test_cuda_error.cpp:") != std::string::npos);
  }
  CHECK(caught);
}

TEST_CASE("a device that does not exist is a CudaError, with or without a GPU") {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  cudaGetLastError();
  bool caught = false;
  try {
    TS_CUDA_CHECK(cudaSetDevice(count));  // one past the last device
  } catch (const trainstream::Error& e) {  // the core's base class
    caught = true;
    const auto* cuda = dynamic_cast<const CudaError*>(&e);
    CHECK(cuda != nullptr);
    CHECK(cuda && cuda->code() != static_cast<int>(cudaSuccess));
    CHECK(cuda && cuda->call() == "cudaSetDevice(count)");
  }
  CHECK(caught);
}

TS_TEST_MAIN
