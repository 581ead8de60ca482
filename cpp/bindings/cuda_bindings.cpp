// Bindings for the CUDA copy engine; compiled only in CUDA builds.
#include "common.hpp"
#include <pybind11/stl.h>

#include "trainstream/cuda/cuda_transfer.hpp"
#include "trainstream/cuda/device.hpp"
#include "trainstream/offload_pipeline.hpp"

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

  m.def("cuda_pipeline",
        [](int device, std::uintptr_t download_stream, std::uintptr_t upload_stream, std::size_t threads,
           const std::optional<std::string>& isa, std::size_t max_download_bytes, bool device_accumulate) {
          return std::make_unique<OffloadPipeline>(
              std::make_unique<CudaTransfer>(device, download_stream, upload_stream), threads,
              parse_optional_isa(isa), max_download_bytes, device_accumulate);
        },
        py::arg("device"), py::arg("download_stream"), py::arg("upload_stream"), py::arg("threads") = 0,
        py::arg("isa") = py::none(), py::arg("max_download_bytes") = std::size_t(512) << 20, py::kw_only(),
        py::arg("device_accumulate") = true,
        "An offload pipeline over pinned host memory, copying on the two given CUDA streams. With "
        "device_accumulate, micro-batch gradients are added into the host accumulator by a kernel "
        "on the download stream instead of being copied and added on the host.");
}

}  // namespace trainstream::bindings
