#include "trainstream/bandwidth.hpp"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <vector>

#include "trainstream/errors.hpp"

namespace trainstream {

namespace kernels {
void triad_scalar(float* a, const float* b, const float* c, float s, std::size_t begin, std::size_t end) {
  for (std::size_t i = begin; i < end; ++i) a[i] = b[i] + s * c[i];
}
}  // namespace kernels

namespace {

struct FreeDeleter {
  void operator()(float* p) const { std::free(p); }
};

std::unique_ptr<float[], FreeDeleter> alloc_floats(std::size_t n) {
  void* p = std::aligned_alloc(4096, (n * sizeof(float) + 4095) / 4096 * 4096);
  if (!p) throw Error("triad: cannot allocate " + std::to_string(n * 4) + " bytes");
  return std::unique_ptr<float[], FreeDeleter>(static_cast<float*>(p));
}

}  // namespace

TriadResult measure_triad(ThreadPool& pool, std::size_t numel, int repeats, Isa isa) {
  TS_EXPECTS(numel >= 1024, "triad: numel must be >= 1024");
  TS_EXPECTS(repeats >= 1, "triad: repeats must be >= 1");
  if (!isa_supported(isa)) throw Unsupported(std::string("triad: CPU lacks ") + isa_name(isa));
  auto kernel = isa == Isa::avx512 ? kernels::triad_avx512
                : isa == Isa::avx2 ? kernels::triad_avx2
                                   : kernels::triad_scalar;
  auto a = alloc_floats(numel), b = alloc_floats(numel), c = alloc_floats(numel);
  // One contiguous, 64-byte aligned range per task, as the AdamW engine splits its work.
  const std::size_t chunk = std::max<std::size_t>(16, (numel / (4 * pool.size()) + 15) / 16 * 16);
  const std::size_t tasks = (numel + chunk - 1) / chunk;
  pool.parallel_for(tasks, [&](std::size_t t) {  // first touch from the threads that stream it
    const std::size_t lo = t * chunk, hi = std::min(numel, lo + chunk);
    for (std::size_t i = lo; i < hi; ++i) {
      a[i] = 0.f;
      b[i] = 1.f + static_cast<float>(i % 7);
      c[i] = 2.f;
    }
  });
  std::vector<double> gbps;
  const std::size_t bytes = 12 * numel;
  for (int r = 0; r < repeats + 1; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    pool.parallel_for(tasks, [&](std::size_t t) {
      const std::size_t lo = t * chunk;
      kernel(a.get(), b.get(), c.get(), 0.5f, lo, std::min(numel, lo + chunk));
    });
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r > 0) gbps.push_back(bytes / s / 1e9);  // the first pass is a warm-up
  }
  std::sort(gbps.begin(), gbps.end());
  return {gbps.back(), gbps[gbps.size() / 2], 12};
}

}  // namespace trainstream
