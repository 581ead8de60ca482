// Blockwise 8-bit AdamW on host buffers: torchao.optim.AdamW8bit's update (Dettmers et al. 2021,
// torchao's dynamic quantization map and its rounding), in its own fp32 arithmetic. Each moment
// is one uint8 code a parameter and one fp32 scale (the block's largest magnitude) per block of
// kQuantBlock parameters.
#pragma once

#include <cstddef>
#include <cstdint>

#include "trainstream/adamw.hpp"
#include "trainstream/cpu_features.hpp"
#include "trainstream/thread_pool.hpp"

#if defined(__CUDACC__)
#define TS_HOST_DEVICE __host__ __device__
#else
#define TS_HOST_DEVICE
#endif

namespace trainstream {

constexpr std::size_t kQuantBlock = 256;

// Stochastic rounding of bf16 weights (torchao's bf16_stochastic_round): the fp32 result's low 16
// bits, read as a fraction of the bf16 step, are the chance it rounds away from zero. The random
// bits come from a counter-based generator (murmur3's finalizer twice, over the element's index
// in its parameter and a key drawn from the parameter's seed and the step), so every kernel, the
// GPU's included, draws the same bits for the same element of the same step.
struct RoundingKey {
  std::uint32_t k0 = 0, k1 = 0;
};

// The key of one parameter's update at `step` (splitmix64 of both).
RoundingKey rounding_key(std::uint64_t seed, std::int64_t step);

TS_HOST_DEVICE inline std::uint32_t mix32(std::uint32_t x) {
  x ^= x >> 16;
  x *= 0x85ebca6bu;
  x ^= x >> 13;
  x *= 0xc2b2ae35u;
  return x ^ (x >> 16);
}

// Sixteen random bits for element `index`.
TS_HOST_DEVICE inline std::uint32_t rounding_bits(RoundingKey key, std::uint32_t index) {
  return mix32(mix32(index * 0x9e3779b1u + key.k0) ^ key.k1) >> 16;
}

// `bits` (an fp32 value's) rounded to bf16 towards zero, or away from it when `random` (16 bits)
// is below the dropped fraction, as torchao's _fp32_to_bf16_sr rounds; every NaN to 0x7fc0.
TS_HOST_DEVICE inline std::uint16_t bf16_stochastic(std::uint32_t bits, std::uint32_t random) {
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
  const std::uint32_t toward_zero = bits & 0xffff0000u;
  return static_cast<std::uint16_t>((random < (bits & 0xffffu) ? toward_zero + 0x10000u : toward_zero) >> 16);
}

// One moment's compact state: numel codes and numel / kQuantBlock scales.
struct Quantized {
  std::uint8_t* codes = nullptr;
  float* scale = nullptr;
};

struct AdamW8bitBuffers {
  float* param = nullptr;  // fp32 weights (or master), updated in place
  // Or bf16 weights without a master (AdamW8bitHyper::stochastic_round), param null: read from
  // here and their stochastic rounding written back (to param16_out where given).
  std::uint16_t* param16 = nullptr;
  const void* grad = nullptr;
  DType grad_dtype = DType::float32;
  Quantized exp_avg;     // signed map
  Quantized exp_avg_sq;  // unsigned map
  const float* signed_qmap = nullptr;    // 256 ascending values in [-1, 1]
  const float* unsigned_qmap = nullptr;  // 256 ascending values in [0, 1]
  // Optional: the updated weights rounded to bf16 (RNE; with param16, the same stochastic
  // rounding). May be the gradient buffer when the gradient is bf16 (each element's gradient is
  // read before its weight is written).
  std::uint16_t* param_bf16 = nullptr;
  std::size_t numel = 0;  // a positive multiple of kQuantBlock
  // Optional: where the new moments and weights go, leaving the ones read untouched (a
  // speculative update's second state set). Null: in place. AdamW8bitStep resolves them.
  Quantized exp_avg_out;
  Quantized exp_avg_sq_out;
  float* param_out = nullptr;
  std::uint16_t* param16_out = nullptr;
};

// torchao keeps lr in an fp32 tensor and the step count in an fp32 tensor; the bias corrections
// are fp32 powers of the betas, as it computes them.
struct AdamW8bitHyper {
  float lr = 1e-3f;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  std::int64_t step = 1;
  float grad_scale = 1.0f;  // multiplies the gradient first, as clip_grad_norm_ scales it in place
  // bf16 weights rounded stochastically, without a master (AdamW8bitBuffers::param16), with the
  // random bits of rounding_key(seed, step): one seed per parameter, fixed for its life.
  bool stochastic_round = false;
  std::uint64_t seed = 0;
};

// Per-call constants, rounded to float where torchao rounds them.
struct AdamW8bitCoeffs {
  float lr, lr_wd, bc1, bc2_sqrt, eps, grad_scale;
  float m_coeff, v_coeff;  // lerp weights as fma coefficients (see AdamWCoeffs::lerp_coeff)
  bool m_from_start, v_from_start;
  RoundingKey key;  // (stochastic rounding)
};

// Validates (std::invalid_argument) `hyper` and rounds its constants as torchao does: what every
// kernel, the GPU's included (cuda/kernels/device_adamw8bit.cu), computes with.
AdamW8bitCoeffs adamw8bit_coeffs(const AdamW8bitHyper& hyper);

namespace eight_bit {
struct QuantTable;
}

// Updates blocks [first, last) (kQuantBlock elements each) of one update: one per ISA
// (cpp/src/adamw/adamw8bit*.cpp), every one giving the scalar kernel's bits.
using AdamW8bitKernel = void (*)(const AdamW8bitBuffers&, const AdamW8bitCoeffs&,
                                 const eight_bit::QuantTable& signed_table, const eight_bit::QuantTable& unsigned_table,
                                 std::size_t first, std::size_t last);

// One update, validated and prepared, for a caller that runs its blocks itself (the offload
// pipeline, chunk by chunk on its own threads); adamw8bit_step() spreads one over a pool.
class AdamW8bitStep {
 public:
  // Validates (std::invalid_argument) the buffers and hyperparameters.
  AdamW8bitStep(const AdamW8bitBuffers& buffers, const AdamW8bitHyper& hyper, Isa isa);
  // Updates blocks [first, last) (kQuantBlock elements each); blocks never overlap between calls.
  void run(std::size_t first, std::size_t last) const;
  std::size_t blocks() const { return buffers_.numel / kQuantBlock; }

 private:
  AdamW8bitBuffers buffers_;
  AdamW8bitCoeffs coeffs_;
  const eight_bit::QuantTable* signed_table_;
  const eight_bit::QuantTable* unsigned_table_;
  AdamW8bitKernel kernel_;
};

// The code whose value is nearest `x` (ties up), found as torchao finds it: a branchless binary
// search for the last value <= x, then a step up where x lies at least halfway to the next.
std::uint8_t quantize_with_qmap(float x, const float* qmap);

// Validates (std::invalid_argument) and runs one update over the pool, whole blocks per task, with
// the kernel for `isa` (the caller's choice: select_isa()). Every kernel gives the same bits.
void adamw8bit_step(ThreadPool& pool, const AdamW8bitBuffers& buffers, const AdamW8bitHyper& hyper, Isa isa);

}  // namespace trainstream
