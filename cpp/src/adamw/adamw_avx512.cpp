// AdamW with AVX-512 (F/BW/VL), 16 lanes, masked tail. Built with -mavx512f -mavx512bw
// -mavx512vl -mfma; only called when CPUID says so.
#include <immintrin.h>

#include "simd_bf16.hpp"
#include "trainstream/adamw.hpp"

namespace trainstream::kernels {

using simd::to_bf16;

void adamw_avx512(const AdamWBuffers& b, const AdamWCoeffs& c, std::size_t begin, std::size_t end) {
  const __m512 decay = _mm512_set1_ps(c.decay);
  const __m512 lerp = _mm512_set1_ps(c.lerp_coeff);
  const __m512 beta2 = _mm512_set1_ps(c.beta2);
  const __m512 omb2 = _mm512_set1_ps(c.one_minus_beta2);
  const __m512 bc2 = _mm512_set1_ps(c.bc2_sqrt);
  const __m512 eps = _mm512_set1_ps(c.eps);
  const __m512 nss = _mm512_set1_ps(c.neg_step_size);
  const __m512 scale = _mm512_set1_ps(c.grad_scale);
  const __m512i sign = _mm512_set1_epi32(c.maximize ? static_cast<int>(0x80000000u) : 0);
  float* p_out = b.param_out ? b.param_out : b.param;
  float* m_out = b.exp_avg_out ? b.exp_avg_out : b.exp_avg;
  float* v_out = b.exp_avg_sq_out ? b.exp_avg_sq_out : b.exp_avg_sq;
  // Out of place, the new state goes to lines nothing here reads: streamed, or each store that
  // missed the cache would read its line first (8 bytes a parameter more traffic for the moments).
  // Only the tail's loads and stores are masked: a masked store is several times slower than a
  // plain one on some CPUs (AMD Zen 4).
  const bool streamed = b.exp_avg_out != nullptr;
  const auto store = [](float* at, __mmask16 k, bool stream, __m512 x) {
    const bool whole = k == 0xffff;
    if (stream && whole && reinterpret_cast<std::uintptr_t>(at) % 64 == 0) {
      _mm512_stream_ps(at, x);
    } else if (whole) {
      _mm512_storeu_ps(at, x);
    } else {
      _mm512_mask_storeu_ps(at, k, x);
    }
  };
  const auto load = [](__mmask16 k, const float* at) {
    return k == 0xffff ? _mm512_loadu_ps(at) : _mm512_maskz_loadu_ps(k, at);
  };
  for (std::size_t i = begin; i < end; i += 16) {
    const std::size_t left = end - i;
    const __mmask16 k = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
    const __m512 g = _mm512_castsi512_ps(
        _mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(simd::load_grad16(b.grad, b.grad_dtype, i, k), scale)), sign));
    const __m512 m0 = load(k, b.exp_avg + i);
    const __m512 m = _mm512_fmadd_ps(lerp, _mm512_sub_ps(g, m0), c.lerp_from_start ? m0 : g);
    const __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(omb2, g), g,
                                     _mm512_mul_ps(load(k, b.exp_avg_sq + i), beta2));
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), bc2), eps);
    const __m512 term = _mm512_div_ps(_mm512_mul_ps(nss, m), denom);
    store(m_out + i, k, streamed, m);
    store(v_out + i, k, streamed, v);
    if (b.term_only) {
      // Streamed past the caches: nothing here reads it again, and a store that missed the
      // cache would first read the line (the 4 bytes this mode saves).
      store(b.param + i, k, true, term);
      continue;
    }
    const __m512 pn = _mm512_add_ps(_mm512_mul_ps(load(k, b.param + i), decay), term);
    store(p_out + i, k, streamed, pn);
    if (b.param_bf16) {
      // Out of place the rounding is streamed too: a speculation's buffer is not read here, and a
      // redo's (the landing buffer) only element by element just before.
      if (streamed && left >= 16 && reinterpret_cast<std::uintptr_t>(b.param_bf16 + i) % 32 == 0) {
        _mm256_stream_si256(reinterpret_cast<__m256i*>(b.param_bf16 + i), to_bf16(pn));
      } else if (left >= 16) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(b.param_bf16 + i), to_bf16(pn));
      } else {
        _mm256_mask_storeu_epi16(b.param_bf16 + i, k, to_bf16(pn));
      }
    }
  }
  if (b.term_only || streamed) _mm_sfence();  // the streamed stores are visible before the caller moves on
}

}  // namespace trainstream::kernels
