// Shared by the binding files: conversions between Python values and core types.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <optional>
#include <string>

#include "trainstream/adamw.hpp"

namespace trainstream::bindings {

namespace py = pybind11;

DType parse_dtype(const std::string& name);
std::optional<Isa> parse_optional_isa(const std::optional<std::string>& name);

template <typename T>
T* as_ptr(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

void bind_adamw(py::module_& m);
void bind_pipeline(py::module_& m);
void bind_cuda(py::module_& m);
void bind_pager(py::module_& m);

}  // namespace trainstream::bindings
