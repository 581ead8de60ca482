// Triad with 32-byte streaming stores. Built with -mavx2 -mfma.
#include <immintrin.h>

#include "trainstream/bandwidth.hpp"

namespace trainstream::kernels {

void triad_avx2(float* a, const float* b, const float* c, float s, std::size_t begin, std::size_t end) {
  std::size_t i = begin;
  for (; i < end && (reinterpret_cast<std::uintptr_t>(a + i) & 31); ++i) a[i] = b[i] + s * c[i];
  const __m256 vs = _mm256_set1_ps(s);
  for (; i + 8 <= end; i += 8) {
    _mm256_stream_ps(a + i, _mm256_add_ps(_mm256_loadu_ps(b + i), _mm256_mul_ps(vs, _mm256_loadu_ps(c + i))));
  }
  for (; i < end; ++i) a[i] = b[i] + s * c[i];
  _mm_sfence();
}

}  // namespace trainstream::kernels
