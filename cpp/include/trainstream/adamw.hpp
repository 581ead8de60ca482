// The host AdamW engine: torch.optim.AdamW's update, run over host buffers by a thread pool with
// the fastest kernel the CPU supports.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "trainstream/cpu_features.hpp"
#include "trainstream/thread_pool.hpp"

namespace trainstream {

enum class DType : int { float32 = 0, bfloat16 = 1 };

std::size_t dtype_size(DType dtype);

struct AdamWHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  std::int64_t step = 1;     // the step count including this update (torch's state["step"])
  double grad_scale = 1.0;   // multiplies the gradient first: clip coefficient, 1/accumulation
  bool maximize = false;
};

// One parameter's host buffers. All pointers are element-aligned; none may overlap, except that
// `param_bf16` may be the `grad` buffer itself when the gradient is bf16 (each element's
// gradient is read before its bf16 weight is written).
struct AdamWBuffers {
  float* param = nullptr;       // fp32 (master) weights, updated in place
  const void* grad = nullptr;   // fp32 or bf16 gradient
  DType grad_dtype = DType::float32;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  std::uint16_t* param_bf16 = nullptr;  // optional: the updated weights rounded to bf16 (RNE)
  std::size_t numel = 0;
  // Instead of updating `param` in place, write into it the update term -lr/bc1 * m / denom
  // (with non-temporal stores, without reading it): for fp32 weights kept on a device, which
  // applies weight * decay + term itself with the same two roundings (Transfer::upload_update).
  // The host then reads 24 B a parameter instead of 28. Not with param_bf16.
  bool term_only = false;
  // Where the new moments and (without term_only) weights go; null: in place. A speculative
  // update writes elsewhere and leaves its inputs as they were, to be redone from them if the
  // speculation turns out wrong. Each must not overlap any other buffer.
  float* exp_avg_out = nullptr;
  float* exp_avg_sq_out = nullptr;
  float* param_out = nullptr;
};

// Per-call constants, rounded to float exactly where torch's for-loop AdamW rounds them.
struct AdamWCoeffs {
  float decay;          // 1 - lr * weight_decay
  // exp_avg.lerp_(g, 1 - beta1) as torch vectorises it: fma(lerp_coeff, g - m, base) with
  // base = m, coeff = w when w < 0.5, else base = g, coeff = w - 1.
  float lerp_coeff;
  bool lerp_from_start;
  float beta2;
  float one_minus_beta2;
  float bc2_sqrt;       // sqrt(1 - beta2^step)
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^step)
  float grad_scale;
  bool maximize;
};

// Validates the hyperparameters (std::invalid_argument) and derives the kernel constants.
AdamWCoeffs adamw_coeffs(const AdamWHyper& hyper);

// Validates buffers: non-null, aligned, non-empty, non-overlapping (std::invalid_argument).
void validate_buffers(const AdamWBuffers& buffers);

// Updates elements [begin, end). One implementation per ISA, each in its own translation unit.
using AdamWKernel = void (*)(const AdamWBuffers&, const AdamWCoeffs&, std::size_t begin,
                             std::size_t end);
AdamWKernel adamw_kernel(Isa isa);

namespace kernels {
void adamw_scalar(const AdamWBuffers&, const AdamWCoeffs&, std::size_t, std::size_t);
void adamw_avx2(const AdamWBuffers&, const AdamWCoeffs&, std::size_t, std::size_t);
void adamw_avx512(const AdamWBuffers&, const AdamWCoeffs&, std::size_t, std::size_t);
}  // namespace kernels

// Round-to-nearest-even fp32 -> bf16, every NaN to 0x7fc0 (as torch converts): the reference the
// vector kernels must match bit for bit.
inline std::uint16_t float_to_bf16(float value) {
  std::uint32_t bits;
  __builtin_memcpy(&bits, &value, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<std::uint16_t>(bits >> 16);
}

inline float bf16_to_float(std::uint16_t value) {
  const std::uint32_t bits = static_cast<std::uint32_t>(value) << 16;
  float out;
  __builtin_memcpy(&out, &bits, sizeof out);
  return out;
}

class HostAdamW {
 public:
  // threads: 0 = every CPU this process may use. isa: see select_isa().
  explicit HostAdamW(std::size_t threads = 0, std::optional<Isa> isa = std::nullopt);

  // One AdamW update of one parameter, spread over the pool. Blocks until done.
  void step(const AdamWBuffers& buffers, const AdamWHyper& hyper);

  Isa isa() const { return isa_; }
  // The kernel step() spreads over the pool, for callers that schedule the chunks themselves.
  AdamWKernel kernel() const { return kernel_; }
  std::size_t threads() const { return pool_.size(); }
  ThreadPool& pool() { return pool_; }

 private:
  Isa isa_;
  AdamWKernel kernel_;
  ThreadPool pool_;
};

// Splits [0, numel) into chunks for a pool of `threads`: returns the chunk length in elements, a
// multiple of kChunkAlignment (cache-line aligned, and whole blocks of the gradient norm).
constexpr std::size_t kChunkAlignment = 4096;
std::size_t chunk_elements(std::size_t numel, std::size_t threads);

}  // namespace trainstream
