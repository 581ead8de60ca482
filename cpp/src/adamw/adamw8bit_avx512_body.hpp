// The blockwise 8-bit AdamW update with AVX-512 (F/BW/VL), 16 lanes: adamw8bit_avx2.cpp's
// arithmetic, rounding for rounding, quantizing with a search of its own held in registers
// (store_block), decoding the moments as the including file chooses. Included by
// adamw8bit_avx512.cpp and adamw8bit_avx512vbmi.cpp, each built for its instructions: everything
// here has internal linkage, so that neither file's code can stand in for the other's.
// Internal to cpp/src/adamw/.
#pragma once

#include <immintrin.h>

#include <algorithm>

#include "adamw8bit_kernels.hpp"
#include "simd_bf16.hpp"

namespace trainstream::eight_bit {
namespace {

inline __m512 absolute(__m512 x) {
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff)));
}

// Sixteen of a table's 256 floats, by index, from registers (a gather is slower: it reads
// memory a lane at a time): eight 32-entry lookups, then the index's top three bits choose.
inline __m512 lookup256(const float* table, __m512i index) {
  __m512 part[8];
  for (int k = 0; k < 8; ++k) {
    part[k] = _mm512_permutex2var_ps(_mm512_load_ps(table + 32 * k), index, _mm512_load_ps(table + 32 * k + 16));
  }
  for (int bit = 5, width = 8; bit < 8; ++bit, width /= 2) {
    const __mmask16 high = _mm512_test_epi32_mask(index, _mm512_set1_epi32(1 << bit));
    for (int k = 0; k < width / 2; ++k) part[k] = _mm512_mask_blend_ps(high, part[2 * k], part[2 * k + 1]);
  }
  return part[0];
}

// Sixty-four codes' values, by lookup256, sixteen at a time.
inline void decode64(const QuantTable& t, const std::uint8_t* codes, __m512 out[4]) {
  for (int k = 0; k < 4; ++k) {
    out[k] = lookup256(t.map, _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * k))));
  }
}

constexpr int kAtOnce = 8;  // vectors searched side by side: each level waits on the one before

// Requantizes one block's new moment values into `q` at block `b` (as store_block does): each
// code is the count of thresholds at or below its value. Five levels of a binary search, each
// level's thresholds in one register, find its group of eight codes; the group's seven
// thresholds are then compared side by side, none waiting on another (NaN compares false
// everywhere: code 0).
inline void store_block(const float* values, __m512 amax, Quantized q, std::size_t b, const QuantTable& t) {
  const float scale_value = std::max(_mm512_reduce_max_ps(amax), 1e-12f);
  q.scale[b] = scale_value;
  const __m512 scale = _mm512_set1_ps(scale_value);
  for (std::size_t i = 0; i < kQuantBlock; i += 16 * kAtOnce) {
    __m512 x[kAtOnce];
    __m512i code[kAtOnce];
    for (int j = 0; j < kAtOnce; ++j) {
      x[j] = _mm512_div_ps(_mm512_load_ps(values + i + 16 * j), scale);
      code[j] = _mm512_setzero_si512();
    }
    for (int level = 0; level < 5; ++level) {
      const __m512 bounds = _mm512_load_ps(t.levels[level]);
      const __m512i step = _mm512_set1_epi32(128 >> level);
      for (int j = 0; j < kAtOnce; ++j) {
        const __m512 bound = _mm512_permutexvar_ps(_mm512_srli_epi32(code[j], 8 - level), bounds);
        code[j] = _mm512_mask_add_epi32(code[j], _mm512_cmp_ps_mask(bound, x[j], _CMP_LE_OQ), code[j], step);
      }
    }
    __m512i group[kAtOnce];
    for (int j = 0; j < kAtOnce; ++j) group[j] = _mm512_srli_epi32(code[j], 3);
    for (int s = 0; s < 7; ++s) {
      const __m512 low = _mm512_load_ps(t.group[s]), high = _mm512_load_ps(t.group[s] + 16);
      for (int j = 0; j < kAtOnce; ++j) {
        const __mmask16 le = _mm512_cmp_ps_mask(_mm512_permutex2var_ps(low, group[j], high), x[j], _CMP_LE_OQ);
        code[j] = _mm512_mask_add_epi32(code[j], le, code[j], _mm512_set1_epi32(1));
      }
    }
    for (int j = 0; j < kAtOnce; ++j) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q.codes + b * kQuantBlock + i + 16 * j), _mm512_cvtepi32_epi8(code[j]));
    }
  }
}

// The update of blocks [first, last): `decode(table, codes, out)` gives the values of 64 codes of
// a map as four vectors, in order (decode64 by permutes of floats; adamw8bit_avx512vbmi.cpp's by
// byte permutes).
template <typename Decode>
inline void blocks(const AdamW8bitBuffers& buf, const Coeffs& c, const QuantTable& signed_table,
                   const QuantTable& unsigned_table, std::size_t first, std::size_t last, Decode decode) {
  const __m512 grad_scale = _mm512_set1_ps(c.grad_scale), lr = _mm512_set1_ps(c.lr), lr_wd = _mm512_set1_ps(c.lr_wd);
  const __m512 bc1 = _mm512_set1_ps(c.bc1), bc2_sqrt = _mm512_set1_ps(c.bc2_sqrt), eps = _mm512_set1_ps(c.eps);
  const __m512 m_coeff = _mm512_set1_ps(c.m_coeff), v_coeff = _mm512_set1_ps(c.v_coeff);
  alignas(64) float m[kQuantBlock], v[kQuantBlock];
  __m512 m_codes[4], v_codes[4];  // the values of the next 64 codes of each moment
  for (std::size_t b = first; b < last; ++b) {
    const std::size_t at = b * kQuantBlock;
    const __m512 m_scale = _mm512_set1_ps(buf.exp_avg.scale[b]), v_scale = _mm512_set1_ps(buf.exp_avg_sq.scale[b]);
    __m512 m_max = _mm512_setzero_ps(), v_max = _mm512_setzero_ps();
    for (std::size_t i = 0; i < kQuantBlock; i += 16) {
      const std::size_t e = at + i;
      if (i % 64 == 0) {
        decode(signed_table, buf.exp_avg.codes + e, m_codes);
        decode(unsigned_table, buf.exp_avg_sq.codes + e, v_codes);
      }
      const __m512 g = _mm512_mul_ps(simd::load_grad16(buf.grad, buf.grad_dtype, e), grad_scale);
      const __m512 m0 = _mm512_mul_ps(m_codes[i % 64 / 16], m_scale);
      const __m512 v0 = _mm512_mul_ps(v_codes[i % 64 / 16], v_scale);
      const __m512 g2 = _mm512_mul_ps(g, g);
      const __m512 m1 = _mm512_fmadd_ps(m_coeff, _mm512_sub_ps(g, m0), c.m_from_start ? m0 : g);
      const __m512 v1 = _mm512_fmadd_ps(v_coeff, _mm512_sub_ps(g2, v0), c.v_from_start ? v0 : g2);
      _mm512_store_ps(m + i, m1);
      _mm512_store_ps(v + i, v1);
      m_max = _mm512_max_ps(absolute(m1), m_max);  // (a NaN is skipped, as std::max skips it)
      v_max = _mm512_max_ps(absolute(v1), v_max);
      const __m512 p = buf.param16 ? simd::load_grad16(buf.param16, DType::bfloat16, e) : _mm512_loadu_ps(buf.param + e);
      const __m512 decayed = _mm512_sub_ps(p, _mm512_mul_ps(lr_wd, p));
      const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v1), bc2_sqrt), eps);
      const __m512 step = _mm512_div_ps(_mm512_mul_ps(lr, _mm512_div_ps(m1, bc1)), denom);
      const __m512 updated = _mm512_sub_ps(decayed, step);
      if (buf.param16) {
        const __m256i rounded = simd::to_bf16_stochastic(updated, c.key.k0, c.key.k1, e);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(buf.param16_out + e), rounded);
        if (buf.param_bf16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(buf.param_bf16 + e), rounded);
      } else {
        _mm512_storeu_ps(buf.param_out + e, updated);
        if (buf.param_bf16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(buf.param_bf16 + e), simd::to_bf16(updated));
      }
    }
    store_block(m, m_max, buf.exp_avg_out, b, signed_table);
    store_block(v, v_max, buf.exp_avg_sq_out, b, unsigned_table);
  }
}

}  // namespace
}  // namespace trainstream::eight_bit
