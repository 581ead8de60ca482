// bf16 to and from vector registers, for the kernels built for AVX2 or AVX-512 (each form only
// where its translation unit is compiled for it). Internal to cpp/src/adamw/.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "trainstream/adamw.hpp"

namespace trainstream::simd {

#if defined(__AVX2__)
// Eight gradient elements as fp32, from fp32 or bf16.
inline __m256 load_grad8(const void* grad, DType dtype, std::size_t i) {
  if (dtype == DType::bfloat16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const std::uint16_t*>(grad) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  return _mm256_loadu_ps(static_cast<const float*>(grad) + i);
}

// Round to nearest even, NaN -> 0x7fc0, exactly as float_to_bf16().
inline __m128i to_bf16(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  const __m256i out = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(out), _mm256_extracti128_si256(out, 1));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
// Sixteen gradient elements as fp32 (lanes outside `k` zero), from fp32 or bf16.
inline __m512 load_grad16(const void* grad, DType dtype, std::size_t i, __mmask16 k = 0xffff) {
  if (dtype == DType::bfloat16) {
    const __m256i h = _mm256_maskz_loadu_epi16(k, static_cast<const std::uint16_t*>(grad) + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  return _mm512_maskz_loadu_ps(k, static_cast<const float*>(grad) + i);
}

// Round to nearest even, NaN -> 0x7fc0, exactly as float_to_bf16().
inline __m256i to_bf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(rounded);
}
#endif

}  // namespace trainstream::simd
