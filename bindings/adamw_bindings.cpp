#include <pybind11/stl.h>

#include <optional>

#include "common.hpp"
#include "trainstream/adamw8bit.hpp"
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
  engine.def(
      "step_8bit",
      [](HostAdamW& self, std::uintptr_t param, std::uintptr_t grad, const std::string& grad_dtype,
         std::uintptr_t m_codes, std::uintptr_t m_scale, std::uintptr_t v_codes, std::uintptr_t v_scale,
         std::uintptr_t signed_qmap, std::uintptr_t unsigned_qmap, std::size_t numel, float lr, double beta1,
         double beta2, double eps, double weight_decay, std::int64_t step, float grad_scale,
         std::uintptr_t param_bf16, std::optional<std::uint64_t> stochastic_seed) {
        AdamW8bitBuffers b;
        if (stochastic_seed) {
          b.param16 = as_ptr<std::uint16_t>(param);
        } else {
          b.param = as_ptr<float>(param);
        }
        b.grad = as_ptr<const void>(grad);
        b.grad_dtype = parse_dtype(grad_dtype);
        b.exp_avg = {as_ptr<std::uint8_t>(m_codes), as_ptr<float>(m_scale)};
        b.exp_avg_sq = {as_ptr<std::uint8_t>(v_codes), as_ptr<float>(v_scale)};
        b.signed_qmap = as_ptr<const float>(signed_qmap);
        b.unsigned_qmap = as_ptr<const float>(unsigned_qmap);
        b.param_bf16 = as_ptr<std::uint16_t>(param_bf16);
        b.numel = numel;
        AdamW8bitHyper hyper{lr, beta1, beta2, eps, weight_decay, step, grad_scale};
        hyper.stochastic_round = stochastic_seed.has_value();
        hyper.seed = stochastic_seed.value_or(0);
        py::gil_scoped_release release;
        adamw8bit_step(self.pool(), b, hyper, self.isa());
      },
      py::arg("param"), py::arg("grad"), py::arg("grad_dtype"), py::arg("exp_avg_codes"),
      py::arg("exp_avg_scale"), py::arg("exp_avg_sq_codes"), py::arg("exp_avg_sq_scale"), py::arg("signed_qmap"),
      py::arg("unsigned_qmap"), py::arg("numel"), py::kw_only(), py::arg("lr"), py::arg("beta1"),
      py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("step"), py::arg("grad_scale") = 1.0f,
      py::arg("param_bf16") = 0, py::arg("stochastic_seed") = py::none(),
      "One blockwise 8-bit AdamW update (torchao's AdamW8bit) of fp32 weights given by host addresses: "
      "uint8 codes and fp32 block scales for each moment, torchao's two quantization maps; param_bf16, where "
      "given, receives the new weights rounded to bf16. With stochastic_seed, `param` holds bf16 weights "
      "without a master, rounded stochastically (bf16_stochastic_round) with that parameter's seed. "
      "Releases the GIL.");
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
