#include <pybind11/stl.h>

#include "common.hpp"
#include "trainstream/errors.hpp"

namespace trainstream::bindings {

DType parse_dtype(const std::string& name) {
  if (name == "float32") return DType::float32;
  if (name == "bfloat16") return DType::bfloat16;
  throw std::invalid_argument("unsupported dtype '" + name + "': expected float32 or bfloat16");
}

std::optional<Isa> parse_optional_isa(const std::optional<std::string>& name) {
  if (!name || *name == "auto") return std::nullopt;
  return parse_isa(*name);
}

}  // namespace trainstream::bindings

PYBIND11_MODULE(_C, m) {
  namespace py = pybind11;
  using namespace trainstream;
  m.doc() = "TrainStream native core (host AdamW engine; CUDA copies, paging and GPU AdamW)";

  bindings::bind_errors(m);

  m.attr("__version__") = TRAINSTREAM_VERSION;
#ifdef TRAINSTREAM_HAS_CUDA
  m.attr("has_cuda") = true;
#else
  m.attr("has_cuda") = false;
#endif

  m.def("cpu_features", [] {
    const CpuFeatures f = detect_cpu_features();
    py::dict d;
    d["avx2_fma"] = f.avx2_fma;
    d["avx512"] = f.avx512;
    d["best_isa"] = isa_name(f.avx512 ? Isa::avx512 : f.avx2_fma ? Isa::avx2 : Isa::scalar);
    d["available_cpus"] = available_cpus();
    return d;
  }, "What the host CPU supports, and how many CPUs this process may use.");
  m.def("isa_supported", [](const std::string& name) { return isa_supported(parse_isa(name)); });
  m.def("select_isa", [](const std::optional<std::string>& name) {
    return std::string(isa_name(select_isa(bindings::parse_optional_isa(name))));
  }, py::arg("isa") = py::none(),
     "The ISA the engine would run: the one given, else $TRAINSTREAM_ISA, else the best.");

  bindings::bind_adamw(m);
  bindings::bind_pipeline(m);
  bindings::bind_pager(m);
#ifdef TRAINSTREAM_HAS_CUDA
  bindings::bind_cuda(m);
#endif
}
