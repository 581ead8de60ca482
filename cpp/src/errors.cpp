#include "trainstream/errors.hpp"

#include <cstring>

namespace trainstream::detail {

std::string source_location(const char* file, int line) {
  const char* base = std::strrchr(file, '/');
  return std::string(base ? base + 1 : file) + ":" + std::to_string(line);
}

void throw_invalid(const std::string& what, const char* file, int line) {
  throw std::invalid_argument(what + " [" + source_location(file, line) + "]");
}

}  // namespace trainstream::detail
