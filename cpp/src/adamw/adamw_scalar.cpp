// Portable AdamW: the reference for the vector kernels, and the fallback on any CPU.
// Built with -ffp-contract=off: the only fused multiply-adds are the two torch's own vectorised
// kernels use (lerp_ and addcmul_), so results match torch.optim.AdamW to the last bit but for
// its sqrt, which on some builds is not correctly rounded.
#include <cmath>

#include "trainstream/adamw.hpp"

namespace trainstream::kernels {

void adamw_scalar(const AdamWBuffers& b, const AdamWCoeffs& c, std::size_t begin, std::size_t end) {
  const float* p = b.param;
  const float* m = b.exp_avg;
  const float* v = b.exp_avg_sq;
  float* p_out = b.param_out ? b.param_out : b.param;
  float* m_out = b.exp_avg_out ? b.exp_avg_out : b.exp_avg;
  float* v_out = b.exp_avg_sq_out ? b.exp_avg_sq_out : b.exp_avg_sq;
  const float* g32 = static_cast<const float*>(b.grad);
  const std::uint16_t* g16 = static_cast<const std::uint16_t*>(b.grad);
  const bool bf16_grad = b.grad_dtype == DType::bfloat16;
  for (std::size_t i = begin; i < end; ++i) {
    float g = (bf16_grad ? bf16_to_float(g16[i]) : g32[i]) * c.grad_scale;
    if (c.maximize) g = -g;
    const float mi = std::fma(c.lerp_coeff, g - m[i], c.lerp_from_start ? m[i] : g);
    const float vi = std::fma(c.one_minus_beta2 * g, g, v[i] * c.beta2);  // as torch's addcmul_
    const float denom = std::sqrt(vi) / c.bc2_sqrt + c.eps;
    const float term = c.neg_step_size * mi / denom;
    m_out[i] = mi;
    v_out[i] = vi;
    if (b.term_only) {
      b.param[i] = term;
      continue;
    }
    const float pn = p[i] * c.decay + term;
    p_out[i] = pn;
    if (b.param_bf16) b.param_bf16[i] = float_to_bf16(pn);
  }
}

}  // namespace trainstream::kernels
