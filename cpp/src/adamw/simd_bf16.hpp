// bf16 to and from vector registers, for the kernels built for AVX2 or AVX-512 (each form only
// where its translation unit is compiled for it, with internal linkage: files built for different
// instructions each keep their own). Internal to cpp/src/adamw/.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "trainstream/adamw.hpp"

namespace trainstream::simd {
namespace {

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

inline __m256i mix32(__m256i x) {  // adamw8bit.hpp's mix32, lane by lane
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x85ebca6bu)));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 13));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0xc2b2ae35u)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

// Elements first..first+7 rounded as bf16_stochastic(x, rounding_bits(key, index)) rounds them.
inline __m128i to_bf16_stochastic(__m256 x, std::uint32_t k0, std::uint32_t k1, std::size_t first) {
  const __m256i index =
      _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(first)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256i r = _mm256_add_epi32(_mm256_mullo_epi32(index, _mm256_set1_epi32(static_cast<int>(0x9e3779b1u))),
                               _mm256_set1_epi32(static_cast<int>(k0)));
  r = _mm256_srli_epi32(mix32(_mm256_xor_si256(mix32(r), _mm256_set1_epi32(static_cast<int>(k1)))), 16);
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i toward_zero = _mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
  const __m256i up = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0xffff)), r);  // (both below 2^16)
  __m256i out = _mm256_srli_epi32(_mm256_add_epi32(toward_zero, _mm256_and_si256(up, _mm256_set1_epi32(0x10000))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  out = _mm256_blendv_epi8(out, _mm256_set1_epi32(0x7fc0), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(out), _mm256_extracti128_si256(out, 1));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
// Sixteen gradient elements as fp32 (lanes outside `k` zero), from fp32 or bf16.
inline __m512 load_grad16(const void* grad, DType dtype, std::size_t i, __mmask16 k = 0xffff) {
  const bool whole = k == 0xffff;  // (a masked access is slower on some CPUs: only the tail's are)
  if (dtype == DType::bfloat16) {
    const auto* at = static_cast<const std::uint16_t*>(grad) + i;
    const __m256i h = whole ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)) : _mm256_maskz_loadu_epi16(k, at);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  const auto* at = static_cast<const float*>(grad) + i;
  return whole ? _mm512_loadu_ps(at) : _mm512_maskz_loadu_ps(k, at);
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

inline __m512i mix32(__m512i x) {  // adamw8bit.hpp's mix32, lane by lane
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x85ebca6bu)));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 13));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0xc2b2ae35u)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

// Elements first..first+15 rounded as bf16_stochastic(x, rounding_bits(key, index)) rounds them.
inline __m256i to_bf16_stochastic(__m512 x, std::uint32_t k0, std::uint32_t k1, std::size_t first) {
  const __m512i index = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(first)),
                                         _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  __m512i r = _mm512_add_epi32(_mm512_mullo_epi32(index, _mm512_set1_epi32(static_cast<int>(0x9e3779b1u))),
                               _mm512_set1_epi32(static_cast<int>(k0)));
  r = _mm512_srli_epi32(mix32(_mm512_xor_si512(mix32(r), _mm512_set1_epi32(static_cast<int>(k1)))), 16);
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i toward_zero = _mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  const __mmask16 up = _mm512_cmplt_epu32_mask(r, _mm512_and_si512(bits, _mm512_set1_epi32(0xffff)));
  __m512i out = _mm512_srli_epi32(_mm512_mask_add_epi32(toward_zero, up, toward_zero, _mm512_set1_epi32(0x10000)), 16);
  out = _mm512_mask_mov_epi32(out, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(out);
}
#endif

}  // namespace
}  // namespace trainstream::simd
