// AdamW with AVX2 + FMA, 8 lanes. Built with -mavx2 -mfma; only called when CPUID says so.
#include <immintrin.h>

#include "simd_bf16.hpp"
#include "trainstream/adamw.hpp"

namespace trainstream::kernels {

using simd::to_bf16;

void adamw_avx2(const AdamWBuffers& b, const AdamWCoeffs& c, std::size_t begin, std::size_t end) {
  const __m256 decay = _mm256_set1_ps(c.decay);
  const __m256 lerp = _mm256_set1_ps(c.lerp_coeff);
  const __m256 beta2 = _mm256_set1_ps(c.beta2);
  const __m256 omb2 = _mm256_set1_ps(c.one_minus_beta2);
  const __m256 bc2 = _mm256_set1_ps(c.bc2_sqrt);
  const __m256 eps = _mm256_set1_ps(c.eps);
  const __m256 nss = _mm256_set1_ps(c.neg_step_size);
  const __m256 scale = _mm256_set1_ps(c.grad_scale);
  const __m256 sign = _mm256_set1_ps(c.maximize ? -0.0f : 0.0f);
  float* p_out = b.param_out ? b.param_out : b.param;
  float* m_out = b.exp_avg_out ? b.exp_avg_out : b.exp_avg;
  float* v_out = b.exp_avg_sq_out ? b.exp_avg_sq_out : b.exp_avg_sq;
  // Out of place, the new state is streamed (see adamw_avx512.cpp).
  const bool streamed = b.exp_avg_out != nullptr;
  const auto store = [streamed](float* at, __m256 x) {
    if (streamed && reinterpret_cast<std::uintptr_t>(at) % 32 == 0) {
      _mm256_stream_ps(at, x);
    } else {
      _mm256_storeu_ps(at, x);
    }
  };
  std::size_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m256 g = _mm256_xor_ps(_mm256_mul_ps(simd::load_grad8(b.grad, b.grad_dtype, i), scale), sign);
    const __m256 m0 = _mm256_loadu_ps(b.exp_avg + i);
    const __m256 m = _mm256_fmadd_ps(lerp, _mm256_sub_ps(g, m0), c.lerp_from_start ? m0 : g);
    const __m256 v = _mm256_fmadd_ps(_mm256_mul_ps(omb2, g), g,
                                     _mm256_mul_ps(_mm256_loadu_ps(b.exp_avg_sq + i), beta2));
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bc2), eps);
    const __m256 term = _mm256_div_ps(_mm256_mul_ps(nss, m), denom);
    store(m_out + i, m);
    store(v_out + i, v);
    if (b.term_only) {  // streamed past the caches: nothing here reads it again
      if (reinterpret_cast<std::uintptr_t>(b.param + i) % 32 == 0) {
        _mm256_stream_ps(b.param + i, term);
      } else {
        _mm256_storeu_ps(b.param + i, term);
      }
      continue;
    }
    const __m256 pn = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(b.param + i), decay), term);
    store(p_out + i, pn);
    if (b.param_bf16) {
      auto* at = reinterpret_cast<__m128i*>(b.param_bf16 + i);
      if (streamed && reinterpret_cast<std::uintptr_t>(at) % 16 == 0) {
        _mm_stream_si128(at, to_bf16(pn));
      } else {
        _mm_storeu_si128(at, to_bf16(pn));
      }
    }
  }
  if (b.term_only || streamed) _mm_sfence();  // the streamed stores are visible before the caller moves on
  if (i < end) adamw_scalar(b, c, i, end);
}

}  // namespace trainstream::kernels
