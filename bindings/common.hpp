// Shared by the binding files: conversions between Python values and core types, and the AdamW
// hyperparameters as keyword arguments.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "trainstream/adamw.hpp"

namespace trainstream::bindings {

namespace py = pybind11;

// AdamW's hyperparameters, declared here once for every binding that takes them. A function
// f(const AdamWHyper&, its own arguments...) bound with def_with_hyper() takes its own arguments
// from Python, then the hyperparameters as keyword-only arguments: lr, beta1, beta2, eps,
// weight_decay, step, grad_scale = 1.0 and maximize = False.
enum class HyperKeywords {
  required,  // lr .. step have no default: calls that always update
  defaulted,  // kDefaultedHyper: jobs that may update nothing, where the hyperparameters then go unread
};

// The defaults of HyperKeywords::defaulted (and of a job given as a dict, submit_many).
inline constexpr AdamWHyper kDefaultedHyper{0.0, 0.9, 0.999, 1e-8, 0.0, 1, 1.0, false};

namespace detail {

template <typename Call>
struct CallSignature;
template <typename C, typename R, typename... Args>
struct CallSignature<R (C::*)(Args...) const> {
  using type = R(Args...);
};

// f(hyper, args...) as g(args..., lr, beta1, beta2, eps, weight_decay, step, grad_scale, maximize).
template <typename Signature>
struct HyperLast;
template <typename R, typename... Args>
struct HyperLast<R(const AdamWHyper&, Args...)> {
  template <typename F>
  static auto wrap(F f) {
    return [f = std::move(f)](Args... args, double lr, double beta1, double beta2, double eps, double weight_decay,
                              std::int64_t step, double grad_scale, bool maximize) -> R {
      return f(AdamWHyper{lr, beta1, beta2, eps, weight_decay, step, grad_scale, maximize},
               std::forward<Args>(args)...);
    };
  }
};

}  // namespace detail

// target.def(name, f, extra...) with the hyperparameters appended to f's arguments and to the
// argument list in `extra`, which must make them keyword-only (py::kw_only()).
template <typename Target, typename F, typename... Extra>
Target& def_with_hyper(Target& target, const char* name, HyperKeywords keywords, F f, const Extra&... extra) {
  static_assert((std::is_same_v<Extra, py::kw_only> || ...), "the AdamW hyperparameters are keyword-only");
  auto bound = detail::HyperLast<typename detail::CallSignature<decltype(&F::operator())>::type>::wrap(std::move(f));
  if (keywords == HyperKeywords::required) {
    return target.def(name, std::move(bound), extra..., py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
                      py::arg("eps"), py::arg("weight_decay"), py::arg("step"), py::arg("grad_scale") = 1.0,
                      py::arg("maximize") = false);
  }
  constexpr AdamWHyper d = kDefaultedHyper;
  return target.def(name, std::move(bound), extra..., py::arg("lr") = d.lr, py::arg("beta1") = d.beta1,
                    py::arg("beta2") = d.beta2, py::arg("eps") = d.eps, py::arg("weight_decay") = d.weight_decay,
                    py::arg("step") = d.step, py::arg("grad_scale") = d.grad_scale, py::arg("maximize") = d.maximize);
}

DType parse_dtype(const std::string& name);
std::optional<Isa> parse_optional_isa(const std::optional<std::string>& name);

template <typename T>
T* as_ptr(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

void bind_errors(py::module_& m);
void bind_adamw(py::module_& m);
void bind_pipeline(py::module_& m);
void bind_cuda(py::module_& m);
void bind_pager(py::module_& m);

}  // namespace trainstream::bindings
