#include <pybind11/stl.h>

#include "common.hpp"
#include "trainstream/bandwidth.hpp"
#include "trainstream/grad_ops.hpp"

namespace trainstream::bindings {

void bind_adamw(py::module_& m) {
  py::class_<HostAdamW> engine(m, "HostAdamW", "AdamW over host buffers, on a persistent pool of threads.");
  engine
      .def(py::init([](std::size_t threads, const std::optional<std::string>& isa) {
             return new HostAdamW(threads, parse_optional_isa(isa));
           }),
           py::arg("threads") = 0, py::arg("isa") = py::none())
      .def_property_readonly("isa", [](const HostAdamW& a) { return std::string(isa_name(a.isa())); })
      .def_property_readonly("threads", &HostAdamW::threads);
  def_with_hyper(
      engine, "step", HyperKeywords::required,
      [](const AdamWHyper& hyper, HostAdamW& self, std::uintptr_t param, std::uintptr_t grad,
         const std::string& grad_dtype, std::uintptr_t exp_avg, std::uintptr_t exp_avg_sq, std::size_t numel,
         std::uintptr_t param_bf16) {
        AdamWBuffers b;
        b.param = as_ptr<float>(param);
        b.grad = as_ptr<const void>(grad);
        b.grad_dtype = parse_dtype(grad_dtype);
        b.exp_avg = as_ptr<float>(exp_avg);
        b.exp_avg_sq = as_ptr<float>(exp_avg_sq);
        b.param_bf16 = as_ptr<std::uint16_t>(param_bf16);
        b.numel = numel;
        py::gil_scoped_release release;
        self.step(b, hyper);
      },
      py::arg("param"), py::arg("grad"), py::arg("grad_dtype"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
      py::arg("numel"), py::kw_only(), py::arg("param_bf16") = 0,
      "One AdamW update of one parameter given by host addresses. Releases the GIL.");
  engine
      .def(
          "squared_norm",
          [](HostAdamW& self, std::uintptr_t data, const std::string& dtype, std::size_t numel) {
            const DType d = parse_dtype(dtype);
            py::gil_scoped_release release;
            return squared_norm(self.pool(), as_ptr<const void>(data), d, numel);
          },
          py::arg("data"), py::arg("dtype"), py::arg("numel"),
          "The gradient norm's square as every placement computes it (grad_ops.hpp), over the pool.");

  m.def(
      "measure_triad",
      [](std::size_t numel, int repeats, std::size_t threads, const std::optional<std::string>& isa) {
        TriadResult r;
        {
          py::gil_scoped_release release;
          ThreadPool pool(threads);
          r = measure_triad(pool, numel, repeats, select_isa(parse_optional_isa(isa)));
        }
        py::dict d;
        d["best_GBps"] = r.best_gbps;
        d["median_GBps"] = r.median_gbps;
        d["bytes_per_element"] = r.bytes_per_element;
        return d;
      },
      py::arg("numel"), py::arg("repeats") = 5, py::arg("threads") = 0, py::arg("isa") = py::none(),
      "STREAM triad bandwidth of host memory over `threads` threads (0: all), in GB/s.");
}

}  // namespace trainstream::bindings
