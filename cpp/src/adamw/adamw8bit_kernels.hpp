// The blockwise 8-bit AdamW kernels' shared pieces: the per-call constants and the thresholds
// that let vector code quantize without the scalar kernel's search (by a table, or by a search
// of its own held in registers). Internal to cpp/src/adamw/.
#pragma once

#include <cstddef>
#include <cstdint>

#include "trainstream/adamw8bit.hpp"

namespace trainstream::eight_bit {

using Coeffs = AdamW8bitCoeffs;

// Quantizing x in [-1, 1] (or NaN) to the code quantize_with_qmap() picks, without its search.
// (AVX2 counts with the table below; AVX-512 finds the group of eight codes by a binary search
// over `levels`, then counts the group's thresholds in `group`.)
// That code is the number of thresholds t_0 < ... < t_254 at or below x, t_i being the least
// float from which the search rounds code i up (t_i in (map[i], map[i+1]]; NaN counts none). A
// table indexed by x's position in float order gives the count at its cell's lowest float; at
// most `steps` more thresholds lie in a cell, each one comparison away.
struct QuantTable {
  static constexpr int kShift = 16;  // float-order positions per cell: 2^16 (1/128 of a binade)
  static constexpr std::int32_t kOrigin = -1065353217;  // order(-1.0f)
  static constexpr std::uint32_t kCells = ((std::uint32_t(0x7f000000) + 1) >> kShift) + 1;
  // Float bits to a signed integer of the same order (-0 just below +0).
  static std::int32_t order(std::int32_t bits) { return bits ^ ((bits >> 31) & 0x7fffffff); }

  alignas(64) float thresholds[264];  // t_0..t_254, then +inf (never <= x)
  // The thresholds laid out for vector registers: the first five levels of a binary search
  // (level l, step s = 128 >> l: t[s - 1 + k * 2s] for k < 128 / s, from levels[l][0]) find
  // the group of eight codes, and group[j][k] = t[8k + j] (j < 7) are the thresholds inside group k.
  alignas(64) float levels[5][16];
  alignas(64) float group[7][32];
  alignas(64) float map[256];         // the map it was made for
  alignas(64) std::uint8_t planes[4][256];  // planes[k][i]: byte k (from the least) of map[i]'s bits
  alignas(64) std::uint8_t start[kCells + 4];  // (+4: vector code gathers 32 bits at a cell)
  int steps = 0;

  explicit QuantTable(const float* qmap);
};

// The table for this map (built on first use; a few distinct maps are ever seen).
const QuantTable& quant_table(const float* qmap);

// The vector AdamW8bitKernels (the scalar one is adamw8bit.cpp's own).
void blocks_avx2(const AdamW8bitBuffers&, const Coeffs&, const QuantTable&, const QuantTable&, std::size_t,
                 std::size_t);
void blocks_avx512(const AdamW8bitBuffers&, const Coeffs&, const QuantTable&, const QuantTable&, std::size_t,
                   std::size_t);
// The same update, decoding by byte permutes (AVX-512 VBMI): the same bits.
void blocks_avx512_vbmi(const AdamW8bitBuffers&, const Coeffs&, const QuantTable&, const QuantTable&, std::size_t,
                        std::size_t);

}  // namespace trainstream::eight_bit
