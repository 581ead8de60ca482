// The core's exceptions as Python exceptions. The classes are made here, not in the Python
// package, because trainstream._C must import without torch; trainstream.errors re-exports them
// (they are named as its members) and derives the package's own errors from TrainStreamError.
#include "common.hpp"
#include "trainstream/errors.hpp"

#ifdef TRAINSTREAM_HAS_CUDA
#include "trainstream/cuda/cuda_error.hpp"
#endif

namespace trainstream::bindings {

namespace {

// Created once at import and kept for the life of the process, as pybind11 keeps its own.
PyObject* native_error = nullptr;
PyObject* unsupported_error = nullptr;
PyObject* cuda_error = nullptr;

PyObject* new_error(py::module_& m, const char* name, const char* doc, const py::tuple& bases,
                    const py::dict& attributes = py::dict()) {
  const std::string qualified = std::string("trainstream.errors.") + name;
  PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases.ptr(), attributes.ptr());
  if (type == nullptr) throw py::error_already_set();
  m.add_object(name, py::handle(type));
  return type;
}

#ifdef TRAINSTREAM_HAS_CUDA
void raise_cuda_error(const CudaError& e) {
  py::object error = py::reinterpret_borrow<py::object>(cuda_error)(e.what());
  error.attr("code") = e.code();
  error.attr("name") = e.name();
  error.attr("call") = e.call();
  error.attr("location") = e.location();
  PyErr_SetObject(cuda_error, error.ptr());
}
#endif

// The most derived class first. Anything else (std::invalid_argument: ValueError) is left to
// pybind11's own translation.
void translate(std::exception_ptr thrown) {
  try {
    std::rethrow_exception(thrown);
#ifdef TRAINSTREAM_HAS_CUDA
  } catch (const CudaError& e) {
    raise_cuda_error(e);
#endif
  } catch (const Unsupported& e) {
    PyErr_SetString(unsupported_error, e.what());
  } catch (const Error& e) {
    PyErr_SetString(native_error, e.what());
  }
}

}  // namespace

void bind_errors(py::module_& m) {
  PyObject* base = new_error(m, "TrainStreamError", "Base class of every exception TrainStream raises.",
                             py::make_tuple(py::handle(PyExc_Exception)));
  native_error = new_error(m, "NativeError",
                           "The native core failed: host memory could not be allocated or pinned, or a "
                           "CUDA call failed.",
                           py::make_tuple(py::handle(base), py::handle(PyExc_RuntimeError)));
  unsupported_error = new_error(m, "UnsupportedError",
                                "This build or this machine cannot do what was asked (an ISA the CPU lacks, "
                                "CUDA in a CPU-only build).",
                                py::make_tuple(py::handle(native_error)));
  py::dict unknown;  // class defaults, for a CudaError raised without the details
  for (const char* field : {"code", "name", "call", "location"}) unknown[field] = py::none();
  cuda_error = new_error(m, "CudaError",
                         "A CUDA runtime call failed. code: the cudaError_t value; name: its name (e.g. "
                         "'cudaErrorMemoryAllocation'); call: the call as written in the source; location: "
                         "'file:line' of the call.",
                         py::make_tuple(py::handle(native_error)), unknown);
  py::register_local_exception_translator(translate);
}

}  // namespace trainstream::bindings
