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

double squared_norm_block(const void* data, DType dtype, std::size_t begin, std::size_t end) {
  double lanes[kNormLanes] = {};
  auto add = [&](auto load) {
    std::size_t i = begin;
    for (; i + kNormLanes <= end; i += kNormLanes) {
      for (std::size_t l = 0; l < kNormLanes; ++l) {
        const double x = load(i + l);
        lanes[l] += x * x;
      }
    }
    for (std::size_t l = 0; i + l < end; ++l) {
      const double x = load(i + l);
      lanes[l] += x * x;
    }
  };
  if (dtype == DType::bfloat16) {
    const auto* g = static_cast<const std::uint16_t*>(data);
    add([g](std::size_t k) { return static_cast<double>(bf16_to_float(g[k])); });
  } else {
    const auto* g = static_cast<const float*>(data);
    add([g](std::size_t k) { return static_cast<double>(g[k]); });
  }
  for (std::size_t width = kNormLanes / 2; width > 0; width /= 2) {
    for (std::size_t l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  }
  return lanes[0];
}

void squared_norm_blocks(const void* data, DType dtype, std::size_t begin, std::size_t end, std::size_t numel,
                         double* partials) {
  for (std::size_t b = begin; b < end; b += kNormBlock) {
    *partials++ = squared_norm_block(data, dtype, b, std::min(numel, b + kNormBlock));
  }
}

double squared_norm(ThreadPool& pool, const void* data, DType dtype, std::size_t numel) {
  std::vector<double> partial((numel + kNormBlock - 1) / kNormBlock, 0.0);
  for_chunks(pool, numel, [&](std::size_t b, std::size_t e, std::size_t) {
    squared_norm_blocks(data, dtype, b, e, numel, partial.data() + b / kNormBlock);
  });
  double total = 0;
  for (double p : partial) total += p;
  return total;
}

void to_float32(ThreadPool& pool, float* dst, const void* src, DType dtype, std::size_t numel) {
  accumulate_grad(pool, dst, src, dtype, numel, /*overwrite=*/true);
}

void zero_fill(ThreadPool& pool, void* dst, std::size_t bytes) {
  auto* base = static_cast<char*>(dst);
  for_chunks(pool, bytes, [base](std::size_t b, std::size_t e, std::size_t) { std::memset(base + b, 0, e - b); });
}

}  // namespace trainstream
