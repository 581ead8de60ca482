// Blockwise 8-bit AdamW with AVX-512 and VBMI: adamw8bit_avx512_body.hpp, decoding 64 codes at
// once by byte permutes. Each byte of a value comes from its own 256-byte plane of the map
// (QuantTable::planes): two 128-byte lookups and a blend on the code's top bit; unpacks then
// interleave the four planes into floats. A third of the instructions of sixteen codes at a time
// by permutes of floats, the same floats. Built with -mavx512f -mavx512bw -mavx512vl -mavx512vbmi
// -ffp-contract=off; only called when CPUID says so.
#include "adamw8bit_avx512_body.hpp"

namespace trainstream::eight_bit {

namespace {

// The unpacks work within 128-bit lanes: output vector q, lane L, position p takes the byte at
// 16L + 4q + p. So that the values come out in order, that byte is code 16q + 4L + p.
alignas(64) constexpr std::uint8_t kSpread[64] = {
    0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51,
    4, 5, 6, 7, 20, 21, 22, 23, 36, 37, 38, 39, 52, 53, 54, 55,
    8, 9, 10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59,
    12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};

inline void decode64_bytes(const QuantTable& t, const std::uint8_t* codes, __m512 out[4]) {
  const __m512i spread = _mm512_permutexvar_epi8(_mm512_load_si512(kSpread), _mm512_loadu_si512(codes));
  const __mmask64 high = _mm512_movepi8_mask(spread);  // codes 128-255: the planes' upper halves
  __m512i plane[4];
  for (int k = 0; k < 4; ++k) {
    const std::uint8_t* p = t.planes[k];
    const __m512i low = _mm512_permutex2var_epi8(_mm512_load_si512(p), spread, _mm512_load_si512(p + 64));
    const __m512i up = _mm512_permutex2var_epi8(_mm512_load_si512(p + 128), spread, _mm512_load_si512(p + 192));
    plane[k] = _mm512_mask_blend_epi8(high, low, up);
  }
  const __m512i lo01 = _mm512_unpacklo_epi8(plane[0], plane[1]), hi01 = _mm512_unpackhi_epi8(plane[0], plane[1]);
  const __m512i lo23 = _mm512_unpacklo_epi8(plane[2], plane[3]), hi23 = _mm512_unpackhi_epi8(plane[2], plane[3]);
  out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(lo01, lo23));
  out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(lo01, lo23));
  out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(hi01, hi23));
  out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(hi01, hi23));
}

}  // namespace

void blocks_avx512_vbmi(const AdamW8bitBuffers& buf, const Coeffs& c, const QuantTable& signed_table,
                        const QuantTable& unsigned_table, std::size_t first, std::size_t last) {
  blocks(buf, c, signed_table, unsigned_table, first, last,
         [](const QuantTable& t, const std::uint8_t* codes, __m512 out[4]) { decode64_bytes(t, codes, out); });
}

}  // namespace trainstream::eight_bit
