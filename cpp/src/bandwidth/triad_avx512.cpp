// Triad with 64-byte streaming stores. Built with -mavx512f -mavx512bw -mavx512vl -mfma.
#include <immintrin.h>

#include "trainstream/bandwidth.hpp"

namespace trainstream::kernels {

void triad_avx512(float* a, const float* b, const float* c, float s, std::size_t begin, std::size_t end) {
  std::size_t i = begin;
  for (; i < end && (reinterpret_cast<std::uintptr_t>(a + i) & 63); ++i) a[i] = b[i] + s * c[i];
  const __m512 vs = _mm512_set1_ps(s);
  for (; i + 16 <= end; i += 16) {
    _mm512_stream_ps(a + i, _mm512_add_ps(_mm512_loadu_ps(b + i), _mm512_mul_ps(vs, _mm512_loadu_ps(c + i))));
  }
  for (; i < end; ++i) a[i] = b[i] + s * c[i];
  _mm_sfence();
}

}  // namespace trainstream::kernels
