// Blockwise 8-bit AdamW with AVX2 + FMA, 8 lanes: the scalar kernel's arithmetic, rounding for
// rounding (adamw8bit.cpp), with the table-driven quantization of adamw8bit_kernels.hpp. Built
// with -mavx2 -mfma -ffp-contract=off; only called when CPUID says so.
#include <immintrin.h>

#include <algorithm>

#include "adamw8bit_kernels.hpp"
#include "simd_bf16.hpp"

namespace trainstream::eight_bit {

namespace {

inline __m256i load_codes(const std::uint8_t* at) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(at)));
}

inline __m256 absolute(__m256 x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }

inline float largest(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

// The codes of eight values in [-1, 1] (or NaN), as quantize_with_qmap() picks them.
inline __m256i quantize(__m256 x, const QuantTable& t) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i order = _mm256_xor_si256(bits, _mm256_and_si256(_mm256_srai_epi32(bits, 31), _mm256_set1_epi32(0x7fffffff)));
  __m256i cell = _mm256_srli_epi32(_mm256_sub_epi32(order, _mm256_set1_epi32(QuantTable::kOrigin)), QuantTable::kShift);
  cell = _mm256_min_epu32(cell, _mm256_set1_epi32(QuantTable::kCells - 1));  // (NaN's bits: anywhere)
  __m256i code = _mm256_and_si256(
      _mm256_i32gather_epi32(reinterpret_cast<const int*>(t.start), cell, 1), _mm256_set1_epi32(0xff));
  for (int s = 0; s < t.steps; ++s) {  // (true lanes are -1)
    code = _mm256_sub_epi32(code, _mm256_castps_si256(_mm256_cmp_ps(_mm256_i32gather_ps(t.thresholds, code, 4), x, _CMP_LE_OQ)));
  }
  return _mm256_andnot_si256(_mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)), code);
}

inline void store_codes(std::uint8_t* at, __m256i code) {
  const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(at), _mm_packus_epi16(words, words));
}

// Requantizes one block's new moment values into `q` at block `b` (as store_block does).
inline void store_block(const float* values, __m256 amax, Quantized q, std::size_t b, const QuantTable& t) {
  const float scale_value = std::max(largest(amax), 1e-12f);
  q.scale[b] = scale_value;
  const __m256 scale = _mm256_set1_ps(scale_value);
  for (std::size_t i = 0; i < kQuantBlock; i += 8) {
    store_codes(q.codes + b * kQuantBlock + i, quantize(_mm256_div_ps(_mm256_load_ps(values + i), scale), t));
  }
}

}  // namespace

void blocks_avx2(const AdamW8bitBuffers& buf, const Coeffs& c, const QuantTable& signed_table,
                 const QuantTable& unsigned_table, std::size_t first, std::size_t last) {
  const __m256 grad_scale = _mm256_set1_ps(c.grad_scale), lr = _mm256_set1_ps(c.lr), lr_wd = _mm256_set1_ps(c.lr_wd);
  const __m256 bc1 = _mm256_set1_ps(c.bc1), bc2_sqrt = _mm256_set1_ps(c.bc2_sqrt), eps = _mm256_set1_ps(c.eps);
  const __m256 m_coeff = _mm256_set1_ps(c.m_coeff), v_coeff = _mm256_set1_ps(c.v_coeff);
  alignas(32) float m[kQuantBlock], v[kQuantBlock];
  for (std::size_t b = first; b < last; ++b) {
    const std::size_t at = b * kQuantBlock;
    const __m256 m_scale = _mm256_set1_ps(buf.exp_avg.scale[b]), v_scale = _mm256_set1_ps(buf.exp_avg_sq.scale[b]);
    __m256 m_max = _mm256_setzero_ps(), v_max = _mm256_setzero_ps();
    for (std::size_t i = 0; i < kQuantBlock; i += 8) {
      const std::size_t e = at + i;
      const __m256 g = _mm256_mul_ps(simd::load_grad8(buf.grad, buf.grad_dtype, e), grad_scale);
      const __m256 m0 = _mm256_mul_ps(_mm256_i32gather_ps(buf.signed_qmap, load_codes(buf.exp_avg.codes + e), 4), m_scale);
      const __m256 v0 = _mm256_mul_ps(_mm256_i32gather_ps(buf.unsigned_qmap, load_codes(buf.exp_avg_sq.codes + e), 4), v_scale);
      const __m256 g2 = _mm256_mul_ps(g, g);
      const __m256 m1 = _mm256_fmadd_ps(m_coeff, _mm256_sub_ps(g, m0), c.m_from_start ? m0 : g);
      const __m256 v1 = _mm256_fmadd_ps(v_coeff, _mm256_sub_ps(g2, v0), c.v_from_start ? v0 : g2);
      _mm256_store_ps(m + i, m1);
      _mm256_store_ps(v + i, v1);
      m_max = _mm256_max_ps(absolute(m1), m_max);  // (a NaN is skipped, as std::max skips it)
      v_max = _mm256_max_ps(absolute(v1), v_max);
      const __m256 p = buf.param16 ? simd::load_grad8(buf.param16, DType::bfloat16, e) : _mm256_loadu_ps(buf.param + e);
      const __m256 decayed = _mm256_sub_ps(p, _mm256_mul_ps(lr_wd, p));
      const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v1), bc2_sqrt), eps);
      const __m256 step = _mm256_div_ps(_mm256_mul_ps(lr, _mm256_div_ps(m1, bc1)), denom);
      const __m256 updated = _mm256_sub_ps(decayed, step);
      if (buf.param16) {
        const __m128i rounded = simd::to_bf16_stochastic(updated, c.key.k0, c.key.k1, e);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(buf.param16_out + e), rounded);
        if (buf.param_bf16) _mm_storeu_si128(reinterpret_cast<__m128i*>(buf.param_bf16 + e), rounded);
      } else {
        _mm256_storeu_ps(buf.param_out + e, updated);
        if (buf.param_bf16) _mm_storeu_si128(reinterpret_cast<__m128i*>(buf.param_bf16 + e), simd::to_bf16(updated));
      }
    }
    store_block(m, m_max, buf.exp_avg_out, b, signed_table);
    store_block(v, v_max, buf.exp_avg_sq_out, b, unsigned_table);
  }
}

}  // namespace trainstream::eight_bit
