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

namespace trainstream {

constexpr std::size_t kQuantBlock = 256;

// One moment's compact state: numel codes and numel / kQuantBlock scales.
struct Quantized {
  std::uint8_t* codes = nullptr;
  float* scale = nullptr;
};

struct AdamW8bitBuffers {
  float* param = nullptr;  // fp32 weights, updated in place
  const void* grad = nullptr;
  DType grad_dtype = DType::float32;
  Quantized exp_avg;     // signed map
  Quantized exp_avg_sq;  // unsigned map
  const float* signed_qmap = nullptr;    // 256 ascending values in [-1, 1]
  const float* unsigned_qmap = nullptr;  // 256 ascending values in [0, 1]
  // Optional: the updated weights rounded to bf16 (RNE). May be the gradient buffer when the
  // gradient is bf16 (each element's gradient is read before its weight is written).
  std::uint16_t* param_bf16 = nullptr;
  std::size_t numel = 0;  // a positive multiple of kQuantBlock
  // Optional: where the new moments and weights go, leaving the ones read untouched (a
  // speculative update's second state set). Null: in place. AdamW8bitStep resolves them.
  Quantized exp_avg_out;
  Quantized exp_avg_sq_out;
  float* param_out = nullptr;
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
};

// Per-call constants, rounded to float where torchao rounds them.
struct AdamW8bitCoeffs {
  float lr, lr_wd, bc1, bc2_sqrt, eps, grad_scale;
  float m_coeff, v_coeff;  // lerp weights as fma coefficients (see AdamWCoeffs::lerp_coeff)
  bool m_from_start, v_from_start;
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
