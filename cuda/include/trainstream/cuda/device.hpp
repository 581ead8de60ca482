// What the CUDA runtime and driver report about this machine.
#pragma once

#include <string>

namespace trainstream {

struct CudaInfo {
  int runtime_version = 0;  // the statically linked runtime, e.g. 13000
  int driver_version = 0;   // 0 when no driver is installed
  int device_count = 0;
  std::string error;        // why no device is usable, if none is
};

// Never throws: a machine without a driver or GPU reports device_count 0 and the reason.
CudaInfo cuda_info();

}  // namespace trainstream
