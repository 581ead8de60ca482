// The dispatcher: validation, per-call constants, and splitting one parameter over the pool.
#include "trainstream/adamw.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "trainstream/errors.hpp"

namespace trainstream {

std::size_t dtype_size(DType dtype) { return dtype == DType::bfloat16 ? 2 : 4; }

AdamWCoeffs adamw_coeffs(const AdamWHyper& h) {
  TS_EXPECTS(std::isfinite(h.lr) && h.lr >= 0, "AdamW: lr must be finite and >= 0, got " + std::to_string(h.lr));
  TS_EXPECTS(h.beta1 >= 0 && h.beta1 < 1, "AdamW: beta1 must be in [0, 1), got " + std::to_string(h.beta1));
  TS_EXPECTS(h.beta2 >= 0 && h.beta2 < 1, "AdamW: beta2 must be in [0, 1), got " + std::to_string(h.beta2));
  TS_EXPECTS(std::isfinite(h.eps) && h.eps >= 0, "AdamW: eps must be finite and >= 0");
  TS_EXPECTS(std::isfinite(h.weight_decay) && h.weight_decay >= 0,
             "AdamW: weight_decay must be finite and >= 0");
  TS_EXPECTS(h.step >= 1, "AdamW: step counts from 1, got " + std::to_string(h.step));
  TS_EXPECTS(std::isfinite(h.grad_scale), "AdamW: grad_scale must be finite");
  // Same expressions, in double, as torch's Python-side scalar math; each becomes a float where
  // torch hands it to a float tensor op.
  const double step = static_cast<double>(h.step);
  const double bc1 = 1.0 - std::pow(h.beta1, step);
  const double bc2 = 1.0 - std::pow(h.beta2, step);
  AdamWCoeffs c;
  c.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  const float weight = static_cast<float>(1.0 - h.beta1);
  c.lerp_from_start = weight < 0.5f;
  c.lerp_coeff = c.lerp_from_start ? weight : weight - 1.0f;
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  c.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  c.eps = static_cast<float>(h.eps);
  c.neg_step_size = static_cast<float>(-(h.lr / bc1));
  c.grad_scale = static_cast<float>(h.grad_scale);
  c.maximize = h.maximize;
  return c;
}

namespace {

bool aligned(const void* p, std::size_t alignment) {
  return reinterpret_cast<std::uintptr_t>(p) % alignment == 0;
}

struct Range {
  const char* name;
  std::uintptr_t begin, end;
};

}  // namespace

void validate_buffers(const AdamWBuffers& b) {
  TS_EXPECTS(b.numel > 0, "AdamW: zero-size parameter (numel == 0)");
  // Byte ranges below must not wrap around the address space.
  TS_EXPECTS(b.numel <= (std::numeric_limits<std::uintptr_t>::max() >> 3), "AdamW: numel is impossibly large");
  TS_EXPECTS(b.param && b.grad && b.exp_avg && b.exp_avg_sq, "AdamW: null buffer pointer");
  TS_EXPECTS(b.grad_dtype == DType::float32 || b.grad_dtype == DType::bfloat16,
             "AdamW: gradient dtype must be float32 or bfloat16");
  const std::size_t gsize = dtype_size(b.grad_dtype);
  TS_EXPECTS(aligned(b.param, 4) && aligned(b.exp_avg, 4) && aligned(b.exp_avg_sq, 4),
             "AdamW: fp32 buffers must be 4-byte aligned");
  TS_EXPECTS(aligned(b.grad, gsize), "AdamW: gradient buffer is not aligned to its element size");
  TS_EXPECTS(!b.param_bf16 || aligned(b.param_bf16, 2), "AdamW: bf16 output must be 2-byte aligned");
  TS_EXPECTS(!(b.term_only && b.param_bf16), "AdamW: term_only is for fp32 weights, not with param_bf16");

  std::vector<Range> ranges = {
      {"param", reinterpret_cast<std::uintptr_t>(b.param), 0},
      {"grad", reinterpret_cast<std::uintptr_t>(b.grad), 0},
      {"exp_avg", reinterpret_cast<std::uintptr_t>(b.exp_avg), 0},
      {"exp_avg_sq", reinterpret_cast<std::uintptr_t>(b.exp_avg_sq), 0},
  };
  ranges[0].end = ranges[0].begin + 4 * b.numel;
  ranges[1].end = ranges[1].begin + gsize * b.numel;
  ranges[2].end = ranges[2].begin + 4 * b.numel;
  ranges[3].end = ranges[3].begin + 4 * b.numel;
  TS_EXPECTS(!(b.term_only && b.param_out), "AdamW: term_only writes the term into param; no param_out");
  const std::pair<const char*, float*> outs[] = {
      {"exp_avg_out", b.exp_avg_out}, {"exp_avg_sq_out", b.exp_avg_sq_out}, {"param_out", b.param_out}};
  for (const auto& [name, out] : outs) {
    if (!out) continue;
    TS_EXPECTS(aligned(out, 4), std::string("AdamW: ") + name + " must be 4-byte aligned");
    const auto at = reinterpret_cast<std::uintptr_t>(out);
    ranges.push_back({name, at, at + 4 * b.numel});
  }
  if (b.param_bf16) {
    const auto out = reinterpret_cast<std::uintptr_t>(b.param_bf16);
    const bool is_grad = b.grad_dtype == DType::bfloat16 && out == ranges[1].begin;
    if (!is_grad) ranges.push_back({"param_bf16", out, out + 2 * b.numel});
  }
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    for (std::size_t j = i + 1; j < ranges.size(); ++j) {
      const bool overlap = ranges[i].begin < ranges[j].end && ranges[j].begin < ranges[i].end;
      TS_EXPECTS(!overlap, std::string("AdamW: buffers ") + ranges[i].name + " and " +
                               ranges[j].name + " overlap");
    }
  }
}

AdamWKernel adamw_kernel(Isa isa) {
  switch (isa) {
    case Isa::scalar: return kernels::adamw_scalar;
    case Isa::avx2: return kernels::adamw_avx2;
    case Isa::avx512: return kernels::adamw_avx512;
  }
  throw std::invalid_argument("unknown ISA");
}

std::size_t chunk_elements(std::size_t numel, std::size_t threads) {
  // A few chunks per thread balance a late-waking thread; each chunk stays long enough
  // (>= 64 KiB of every stream) for the hardware prefetchers to run ahead. Whole blocks of
  // kChunkAlignment elements: a chunk then holds whole blocks of the gradient norm (grad_ops.hpp).
  constexpr std::size_t kMinChunk = 16384;
  threads = std::max<std::size_t>(threads, 1);
  const std::size_t per_task = (numel + 4 * threads - 1) / (4 * threads);
  const std::size_t chunk = std::max(kMinChunk, per_task);
  return (chunk + kChunkAlignment - 1) / kChunkAlignment * kChunkAlignment;
}

HostAdamW::HostAdamW(std::size_t threads, std::optional<Isa> isa)
    : isa_(select_isa(isa)), kernel_(adamw_kernel(isa_)), pool_(threads) {}

void HostAdamW::step(const AdamWBuffers& buffers, const AdamWHyper& hyper) {
  validate_buffers(buffers);
  const AdamWCoeffs coeffs = adamw_coeffs(hyper);
  const std::size_t chunk = chunk_elements(buffers.numel, pool_.size());
  const std::size_t tasks = (buffers.numel + chunk - 1) / chunk;
  if (tasks == 1) {
    kernel_(buffers, coeffs, 0, buffers.numel);
    return;
  }
  pool_.parallel_for(tasks, [&](std::size_t t) {
    const std::size_t begin = t * chunk;
    kernel_(buffers, coeffs, begin, std::min(buffers.numel, begin + chunk));
  });
}

}  // namespace trainstream
