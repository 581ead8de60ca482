// Stream handles as they cross the native boundary, the one ordering both copy engines use, and
// the device a launch runs on.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "trainstream/cuda/cuda_check.hpp"

namespace trainstream {

// A cudaStream_t handed over from Python (torch's stream.cuda_stream) as an integer.
inline cudaStream_t as_stream(std::uintptr_t handle) { return reinterpret_cast<cudaStream_t>(handle); }

// Makes `consumer` wait, on the device, for the work queued so far on `producer`; `event` marks
// that point and may be re-recorded by the next call.
inline void order_after(cudaEvent_t event, cudaStream_t producer, cudaStream_t consumer) {
  if (producer == consumer) return;  // (a stream's work already runs in its order)
  TS_CUDA_CHECK(cudaEventRecord(event, producer));
  TS_CUDA_CHECK(cudaStreamWaitEvent(consumer, event, 0));
}

// Makes `device` current on this thread for a scope, then restores the caller's device (torch's,
// on autograd's threads): a kernel launches on the current device, which must own its stream.
class DeviceScope {
 public:
  explicit DeviceScope(int device) : device_(device) {
    TS_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device_) TS_CUDA_CHECK(cudaSetDevice(device_));
  }
  ~DeviceScope() {
    if (previous_ != device_) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int device_;
  int previous_ = 0;
};

}  // namespace trainstream
