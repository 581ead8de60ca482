// Blockwise 8-bit AdamW with AVX-512 (F/BW/VL): adamw8bit_avx512_body.hpp, decoding the
// moments by permutes of the map's floats. Built with -mavx512f -mavx512bw -mavx512vl
// -ffp-contract=off; only called when CPUID says so.
#include "adamw8bit_avx512_body.hpp"

namespace trainstream::eight_bit {

void blocks_avx512(const AdamW8bitBuffers& buf, const Coeffs& c, const QuantTable& signed_table,
                   const QuantTable& unsigned_table, std::size_t first, std::size_t last) {
  blocks(buf, c, signed_table, unsigned_table, first, last,
         [](const QuantTable& t, const std::uint8_t* codes, __m512 out[4]) { decode64(t, codes, out); });
}

}  // namespace trainstream::eight_bit
