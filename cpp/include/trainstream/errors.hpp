// Error types of the native core. Everything the core rejects or fails at is thrown as one of
// these (or std::invalid_argument for bad arguments; the CUDA layer adds CudaError, in
// trainstream/cuda/cuda_error.hpp); nothing here ever aborts the process.
#pragma once

#include <stdexcept>
#include <string>

namespace trainstream {

// A failure of the core that is not the caller's fault (a CUDA call, the operating system).
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A request this build or this machine cannot honour (an ISA the CPU lacks, CUDA in a CPU build).
class Unsupported : public Error {
 public:
  using Error::Error;
};

namespace detail {
// "file.cpp:123": the file's base name and the line, as error messages cite a place in the source.
std::string source_location(const char* file, int line);
[[noreturn]] void throw_invalid(const std::string& what, const char* file, int line);
}  // namespace detail

}  // namespace trainstream

// Argument check: throws std::invalid_argument (ValueError in Python) naming the location.
#define TS_EXPECTS(cond, msg)                                                 \
  do {                                                                        \
    if (!(cond)) ::trainstream::detail::throw_invalid((msg), __FILE__, __LINE__); \
  } while (0)
