// Bindings for the CUDA copy engine; compiled only in CUDA builds.
#include "common.hpp"
#include "trainstream/cuda/device.hpp"

namespace trainstream::bindings {

void bind_cuda(py::module_& m) {
  m.def("cuda_info", [] {
    const CudaInfo info = cuda_info();
    py::dict d;
    d["runtime_version"] = info.runtime_version;
    d["driver_version"] = info.driver_version;
    d["device_count"] = info.device_count;
    d["error"] = info.error;
    return d;
  }, "CUDA runtime and driver versions and the device count; never raises.");
}

}  // namespace trainstream::bindings
