#include "trainstream/errors.hpp"

#include <cstring>

namespace trainstream::detail {

void throw_invalid(const std::string& what, const char* file, int line) {
  const char* base = std::strrchr(file, '/');
  throw std::invalid_argument(what + " [" + (base ? base + 1 : file) + ":" + std::to_string(line) +
                              "]");
}

}  // namespace trainstream::detail
