#include "trainstream/grad_ops.hpp"

#include <algorithm>
#include <cstring>
#include <vector>

namespace trainstream {

namespace {

// Runs body(begin, end) over [0, numel) in pool-sized chunks.
template <typename Body>
void for_chunks(ThreadPool& pool, std::size_t numel, Body&& body) {
  const std::size_t chunk = chunk_elements(numel, pool.size());
  const std::size_t tasks = (numel + chunk - 1) / chunk;
  if (tasks <= 1) {
    body(std::size_t(0), numel, std::size_t(0));
    return;
  }
  pool.parallel_for(tasks, [&](std::size_t t) {
    const std::size_t begin = t * chunk;
    body(begin, std::min(numel, begin + chunk), t);
  });
}

template <typename Load>
void accumulate_range(float* acc, std::size_t numel, bool overwrite, Load load) {
  if (overwrite) {
    for (std::size_t i = 0; i < numel; ++i) acc[i] = load(i);
  } else {
    for (std::size_t i = 0; i < numel; ++i) acc[i] += load(i);
  }
}

}  // namespace

void accumulate_grad(float* acc, const void* grad, DType dtype, std::size_t numel, bool overwrite) {
  if (dtype == DType::bfloat16) {
    const auto* g = static_cast<const std::uint16_t*>(grad);
    accumulate_range(acc, numel, overwrite, [g](std::size_t i) { return bf16_to_float(g[i]); });
  } else {
    const auto* g = static_cast<const float*>(grad);
    accumulate_range(acc, numel, overwrite, [g](std::size_t i) { return g[i]; });
  }
}

void accumulate_grad(ThreadPool& pool, float* acc, const void* grad, DType dtype, std::size_t numel,
                     bool overwrite) {
  const std::size_t grad_bytes = dtype_size(dtype);
  for_chunks(pool, numel, [&](std::size_t b, std::size_t e, std::size_t) {
    accumulate_grad(acc + b, static_cast<const char*>(grad) + b * grad_bytes, dtype, e - b, overwrite);
  });
}

bool bf16_exact(const float* src, std::size_t numel) {
  std::uint32_t low = 0;
  for (std::size_t i = 0; i < numel; ++i) {
    std::uint32_t bits;
    std::memcpy(&bits, src + i, 4);
    low |= bits;
  }
  return (low & 0xFFFFu) == 0;
}

void pack_bf16_exact(std::uint16_t* dst, const float* src, std::size_t numel) {
  for (std::size_t i = 0; i < numel; ++i) {
    std::uint32_t bits;
    std::memcpy(&bits, src + i, 4);
    dst[i] = static_cast<std::uint16_t>(bits >> 16);
  }
}

double squared_norm(const void* data, DType dtype, std::size_t begin, std::size_t end) {
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0;  // independent sums keep the FPU pipelines busy
  std::size_t i = begin;
  auto at = [&](std::size_t k) -> double {
    return dtype == DType::bfloat16 ? bf16_to_float(static_cast<const std::uint16_t*>(data)[k])
                                    : static_cast<const float*>(data)[k];
  };
  for (; i + 4 <= end; i += 4) {
    const double a = at(i), b = at(i + 1), c = at(i + 2), d = at(i + 3);
    s0 += a * a;
    s1 += b * b;
    s2 += c * c;
    s3 += d * d;
  }
  for (; i < end; ++i) s0 += at(i) * at(i);
  return (s0 + s1) + (s2 + s3);
}

double squared_norm(ThreadPool& pool, const void* data, DType dtype, std::size_t numel) {
  const std::size_t chunk = chunk_elements(numel, pool.size());
  std::vector<double> partial((numel + chunk - 1) / chunk, 0.0);
  for_chunks(pool, numel, [&](std::size_t b, std::size_t e, std::size_t t) {
    partial[t] = squared_norm(data, dtype, b, e);
  });
  double total = 0;
  for (double p : partial) total += p;
  return total;
}

void to_float32(ThreadPool& pool, float* dst, const void* src, DType dtype, std::size_t numel) {
  accumulate_grad(pool, dst, src, dtype, numel, /*overwrite=*/true);
}

void to_bfloat16(ThreadPool& pool, std::uint16_t* dst, const float* src, std::size_t numel) {
  for_chunks(pool, numel, [&](std::size_t b, std::size_t e, std::size_t) {
    for (std::size_t i = b; i < e; ++i) dst[i] = float_to_bf16(src[i]);
  });
}

}  // namespace trainstream
