// Stream handles as they cross the native boundary, and the one ordering both copy engines use.
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
  TS_CUDA_CHECK(cudaEventRecord(event, producer));
  TS_CUDA_CHECK(cudaStreamWaitEvent(consumer, event, 0));
}

}  // namespace trainstream
