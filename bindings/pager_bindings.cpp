// Bindings for activation paging: the host pager always, the CUDA pager in CUDA builds.
#include "common.hpp"
#include "trainstream/activation_pager.hpp"

#ifdef TRAINSTREAM_HAS_CUDA
#include "trainstream/cuda/activation_pager.hpp"
#endif

namespace trainstream::bindings {

void bind_pager(py::module_& m) {
  py::class_<PagedActivation, std::shared_ptr<PagedActivation>>(m, "PagedActivation",
      "One activation's host copy; its slot returns to the pool when this object goes.")
      .def_property_readonly("nbytes", &PagedActivation::bytes);

  py::class_<ActivationPager>(m, "ActivationPager")
      .def("page_out", &ActivationPager::page_out, py::arg("device"), py::arg("nbytes"),
           py::arg("compute_stream"),
           "Copy nbytes at a device address to a host slot after the compute stream's queued work.")
      .def("page_in", &ActivationPager::page_in, py::arg("paged"), py::arg("device"), py::arg("compute_stream"),
           "Copy a paged activation back to a device address on the prefetch stream.")
      .def("order_after_page_in", &ActivationPager::order_after_page_in, py::arg("paged"),
           py::arg("compute_stream"), "Make the compute stream wait (on the device) for the page-in.")
      .def("wait_paged_out", &ActivationPager::wait_paged_out, py::arg("paged"),
           py::call_guard<py::gil_scoped_release>(), "Block until the page-out has landed in host memory.")
      .def_property_readonly("memory_kind", &ActivationPager::memory_kind)
      .def("mark", &ActivationPager::mark, "Start counting which slots the steps from now on use.")
      .def("trim", &ActivationPager::trim, py::call_guard<py::gil_scoped_release>(),
           "Give back the free slots not used since mark(); returns the host bytes no longer reserved.")
      .def("stats", [](const ActivationPager& p) {
        const ActivationPager::Stats s = p.stats();
        py::dict d;
        d["slots"] = s.slots;
        d["reserved_bytes"] = s.reserved_bytes;
        d["in_use_bytes"] = s.in_use_bytes;
        d["paged_out_bytes"] = s.paged_out_bytes;
        d["paged_in_bytes"] = s.paged_in_bytes;
        return d;
      });

  m.def("host_activation_pager", [] { return std::unique_ptr<ActivationPager>(new HostActivationPager()); },
        "An activation pager for CPU tensors (plain copies into pageable slots).");
#ifdef TRAINSTREAM_HAS_CUDA
  m.def("cuda_activation_pager",
        [](int device, std::uintptr_t offload_stream, std::uintptr_t prefetch_stream) {
          return std::unique_ptr<ActivationPager>(new CudaActivationPager(device, offload_stream, prefetch_stream));
        },
        py::arg("device"), py::arg("offload_stream"), py::arg("prefetch_stream"),
        "An activation pager over pinned slots, copying on the two given CUDA streams.");
#endif
}

}  // namespace trainstream::bindings
