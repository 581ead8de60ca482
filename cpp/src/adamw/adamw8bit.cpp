// Blockwise 8-bit AdamW: validation, dispatch, the quantization tables and the scalar kernel.
// Built with -ffp-contract=off: every rounding is one torchao's eager ops make (lerp's fused
// multiply-add included, as torch's CPU kernel computes it), but for the square root: ours is
// correctly rounded, torch's vectorised CPU sqrt not always.
#include "trainstream/adamw8bit.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "adamw8bit_kernels.hpp"
#include "trainstream/cpu_features.hpp"
#include "trainstream/errors.hpp"

namespace trainstream {

std::uint8_t quantize_with_qmap(float x, const float* qmap) {
  unsigned code = x >= qmap[128] ? 128 : 0;
  for (unsigned step = 64; step > 0; step >>= 1) code += x >= qmap[code + step] ? step : 0;
  const unsigned up = std::min(code + 1, 255u);
  const float down_value = qmap[code];
  return static_cast<std::uint8_t>(x - down_value >= (qmap[up] - down_value) * 0.5f ? up : code);
}

namespace eight_bit {

namespace {

std::int64_t to_order(float x) {
  std::int32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return QuantTable::order(bits);
}

float from_order(std::int64_t o) {
  const auto u = static_cast<std::int32_t>(o);
  const std::int32_t bits = u ^ ((u >> 31) & 0x7fffffff);  // (order() is its own inverse)
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

}  // namespace

QuantTable::QuantTable(const float* qmap) {
  std::memcpy(map, qmap, sizeof map);
  for (int i = 0; i < 256; ++i) {
    std::uint32_t bits;
    std::memcpy(&bits, qmap + i, sizeof bits);
    for (int k = 0; k < 4; ++k) planes[k][i] = static_cast<std::uint8_t>(bits >> (8 * k));
  }
  const std::int64_t top = QuantTable::order(0x3f800000);  // order(1.0f)
  for (unsigned i = 0; i < 255; ++i) {  // t_i: the least x in (map[i], map[i+1]] that rounds up
    std::int64_t lo = to_order(qmap[i]), hi = to_order(qmap[i + 1]);
    while (lo + 1 < hi) {  // quantize_with_qmap(from_order(lo)) == i, (hi) == i + 1
      const std::int64_t mid = lo + (hi - lo) / 2;
      (quantize_with_qmap(from_order(mid), qmap) > i ? hi : lo) = mid;
    }
    thresholds[i] = from_order(hi);
  }
  for (std::size_t i = 255; i < sizeof thresholds / sizeof thresholds[0]; ++i) {
    thresholds[i] = std::numeric_limits<float>::infinity();
  }
  for (int level = 0; level < 5; ++level) {
    const unsigned step = 128u >> level;
    for (unsigned k = 0; k < 16; ++k) levels[level][k] = k < 128 / step ? thresholds[step - 1 + k * 2 * step] : 0.0f;
  }
  for (unsigned j = 0; j < 7; ++j) {
    for (unsigned k = 0; k < 32; ++k) group[j][k] = thresholds[8 * k + j];
  }
  const auto count = [this](float x) {
    return static_cast<int>(std::upper_bound(thresholds, thresholds + 255, x) - thresholds);
  };
  for (std::uint32_t cell = 0; cell < kCells; ++cell) {
    const std::int64_t lo = kOrigin + (std::int64_t(cell) << kShift);
    const std::int64_t hi = std::min(top, lo + (std::int64_t(1) << kShift) - 1);
    const int first = count(from_order(lo));
    start[cell] = static_cast<std::uint8_t>(first);
    steps = std::max(steps, count(from_order(hi)) - first);
  }
  std::memset(start + kCells, 0, sizeof start - kCells);
}

const QuantTable& quant_table(const float* qmap) {
  static std::mutex mutex;
  static std::vector<std::unique_ptr<QuantTable>> tables;
  std::lock_guard<std::mutex> lock(mutex);
  for (const auto& t : tables) {
    if (std::memcmp(t->map, qmap, 256 * sizeof(float)) == 0) return *t;
  }
  TS_EXPECTS(std::adjacent_find(qmap, qmap + 256, std::greater_equal<float>()) == qmap + 256 && qmap[0] >= -1.0f &&
                 qmap[255] <= 1.0f,
             "AdamW8bit: a quantization map holds 256 strictly ascending values in [-1, 1]");
  tables.push_back(std::make_unique<QuantTable>(qmap));
  return *tables.back();
}

}  // namespace eight_bit

namespace {

using eight_bit::Coeffs;

// torch.lerp with a scalar weight w, as its CPU kernel rounds it.
inline float lerp(float start, float end, float coeff, bool from_start) {
  return std::fma(coeff, end - start, from_start ? start : end);
}

}  // namespace

RoundingKey rounding_key(std::uint64_t seed, std::int64_t step) {
  std::uint64_t z = seed + 0x9e3779b97f4a7c15ull * (static_cast<std::uint64_t>(step) + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return RoundingKey{static_cast<std::uint32_t>(z), static_cast<std::uint32_t>(z >> 32)};
}

AdamW8bitCoeffs adamw8bit_coeffs(const AdamW8bitHyper& h) {
  TS_EXPECTS(std::isfinite(h.lr) && h.lr >= 0, "AdamW8bit: lr must be finite and >= 0");
  TS_EXPECTS(h.beta1 >= 0 && h.beta1 < 1 && h.beta2 >= 0 && h.beta2 < 1, "AdamW8bit: betas must be in [0, 1)");
  TS_EXPECTS(std::isfinite(h.eps) && h.eps >= 0, "AdamW8bit: eps must be finite and >= 0");
  TS_EXPECTS(std::isfinite(h.weight_decay) && h.weight_decay >= 0, "AdamW8bit: weight_decay must be finite and >= 0");
  TS_EXPECTS(h.step >= 1, "AdamW8bit: step counts from 1, got " + std::to_string(h.step));
  TS_EXPECTS(std::isfinite(h.grad_scale), "AdamW8bit: grad_scale must be finite");
  const float step = static_cast<float>(h.step);
  AdamW8bitCoeffs c;
  c.lr = h.lr;
  c.lr_wd = h.lr * static_cast<float>(h.weight_decay);
  c.bc1 = 1.0f - std::pow(static_cast<float>(h.beta1), step);
  c.bc2_sqrt = std::sqrt(1.0f - std::pow(static_cast<float>(h.beta2), step));
  c.eps = static_cast<float>(h.eps);
  c.grad_scale = h.grad_scale;
  const float wm = static_cast<float>(1.0 - h.beta1), wv = static_cast<float>(1.0 - h.beta2);
  c.m_from_start = wm < 0.5f;
  c.m_coeff = c.m_from_start ? wm : wm - 1.0f;
  c.v_from_start = wv < 0.5f;
  c.v_coeff = c.v_from_start ? wv : wv - 1.0f;
  if (h.stochastic_round) c.key = rounding_key(h.seed, h.step);
  return c;
}

namespace {

// Requantizes one block of new moment values into `q` at block `b`.
void store_block(const float* values, Quantized q, std::size_t b, const float* qmap) {
  float amax = 0.0f;
  for (std::size_t i = 0; i < kQuantBlock; ++i) amax = std::max(amax, std::fabs(values[i]));
  const float scale = std::max(amax, 1e-12f);
  q.scale[b] = scale;
  for (std::size_t i = 0; i < kQuantBlock; ++i) q.codes[b * kQuantBlock + i] = quantize_with_qmap(values[i] / scale, qmap);
}

void update_blocks(const AdamW8bitBuffers& buf, const Coeffs& c, const eight_bit::QuantTable&,
                   const eight_bit::QuantTable&, std::size_t first, std::size_t last) {
  const float* g32 = static_cast<const float*>(buf.grad);
  const auto* g16 = static_cast<const std::uint16_t*>(buf.grad);
  float m[kQuantBlock], v[kQuantBlock];
  for (std::size_t b = first; b < last; ++b) {
    const std::size_t at = b * kQuantBlock;
    const float m_scale = buf.exp_avg.scale[b], v_scale = buf.exp_avg_sq.scale[b];
    for (std::size_t i = 0; i < kQuantBlock; ++i) {
      float g = buf.grad_dtype == DType::bfloat16 ? bf16_to_float(g16[at + i]) : g32[at + i];
      g = g * c.grad_scale;
      m[i] = lerp(buf.signed_qmap[buf.exp_avg.codes[at + i]] * m_scale, g, c.m_coeff, c.m_from_start);
      v[i] = lerp(buf.unsigned_qmap[buf.exp_avg_sq.codes[at + i]] * v_scale, g * g, c.v_coeff, c.v_from_start);
      const float p = buf.param16 ? bf16_to_float(buf.param16[at + i]) : buf.param[at + i];
      const float decayed = p - c.lr_wd * p;
      const float denom = std::sqrt(v[i]) / c.bc2_sqrt + c.eps;
      const float updated = decayed - c.lr * (m[i] / c.bc1) / denom;
      if (buf.param16) {
        std::uint32_t bits;
        std::memcpy(&bits, &updated, sizeof bits);
        const std::uint16_t rounded = bf16_stochastic(bits, rounding_bits(c.key, static_cast<std::uint32_t>(at + i)));
        buf.param16_out[at + i] = rounded;
        if (buf.param_bf16) buf.param_bf16[at + i] = rounded;
      } else {
        buf.param_out[at + i] = updated;
        if (buf.param_bf16) buf.param_bf16[at + i] = float_to_bf16(updated);
      }
    }
    store_block(m, buf.exp_avg_out, b, buf.signed_qmap);
    store_block(v, buf.exp_avg_sq_out, b, buf.unsigned_qmap);
  }
}

}  // namespace

AdamW8bitStep::AdamW8bitStep(const AdamW8bitBuffers& buf, const AdamW8bitHyper& hyper, Isa isa) : buffers_(buf) {
  TS_EXPECTS(buf.numel > 0 && buf.numel % kQuantBlock == 0,
             "AdamW8bit: numel must be a positive multiple of " + std::to_string(kQuantBlock) + ", got " +
                 std::to_string(buf.numel));
  TS_EXPECTS(!buf.param != !buf.param16, "AdamW8bit: fp32 weights (param) or bf16 ones (param16), one of them");
  TS_EXPECTS(!buf.param16 == !hyper.stochastic_round,
             "AdamW8bit: bf16 weights without a master are rounded stochastically, and only they are");
  TS_EXPECTS(!buf.param16 || buf.numel <= (std::size_t(1) << 32),
             "AdamW8bit: stochastic rounding numbers at most 2^32 elements a parameter");
  TS_EXPECTS(buf.grad && buf.exp_avg.codes && buf.exp_avg.scale && buf.exp_avg_sq.codes &&
                 buf.exp_avg_sq.scale && buf.signed_qmap && buf.unsigned_qmap,
             "AdamW8bit: null buffer pointer");
  TS_EXPECTS(buf.grad_dtype == DType::float32 || buf.grad_dtype == DType::bfloat16,
             "AdamW8bit: gradient dtype must be float32 or bfloat16");
  if (buf.param_bf16 && buf.param_bf16 != buf.grad) {
    const auto* g = static_cast<const char*>(buf.grad);
    const auto* w = reinterpret_cast<const char*>(buf.param_bf16);
    const std::size_t g_bytes = buf.numel * dtype_size(buf.grad_dtype), w_bytes = 2 * buf.numel;
    TS_EXPECTS(w + w_bytes <= g || g + g_bytes <= w, "AdamW8bit: the bf16 weights overlap the gradient without being it");
  }
  TS_EXPECTS(buf.param_bf16 != buf.grad || buf.grad_dtype == DType::bfloat16,
             "AdamW8bit: bf16 weights written into the gradient's buffer need a bf16 gradient");
  const bool in_place = !buf.param_out && !buf.param16_out && !buf.exp_avg_out.codes && !buf.exp_avg_sq_out.codes;
  TS_EXPECTS(in_place || ((buf.param ? buf.param_out && !buf.param16_out : buf.param16_out && !buf.param_out) &&
                          buf.exp_avg_out.codes && buf.exp_avg_out.scale && buf.exp_avg_sq_out.codes &&
                          buf.exp_avg_sq_out.scale),
             "AdamW8bit: the weights and both moments go out of place together, or none");
  if (in_place) {  // (the kernels always write through the _out pointers)
    buffers_.param_out = buf.param;
    buffers_.param16_out = buf.param16;
    buffers_.exp_avg_out = buf.exp_avg;
    buffers_.exp_avg_sq_out = buf.exp_avg_sq;
  }
  coeffs_ = adamw8bit_coeffs(hyper);
  signed_table_ = &eight_bit::quant_table(buf.signed_qmap);
  unsigned_table_ = &eight_bit::quant_table(buf.unsigned_qmap);
  static const bool vbmi = detect_cpu_features().avx512_vbmi;
  kernel_ = isa == Isa::avx512 ? (vbmi ? eight_bit::blocks_avx512_vbmi : eight_bit::blocks_avx512)
            : isa == Isa::avx2 ? eight_bit::blocks_avx2
                               : update_blocks;
}

void AdamW8bitStep::run(std::size_t first, std::size_t last) const {
  kernel_(buffers_, coeffs_, *signed_table_, *unsigned_table_, first, std::min(last, blocks()));
}

void adamw8bit_step(ThreadPool& pool, const AdamW8bitBuffers& buf, const AdamW8bitHyper& hyper, Isa isa) {
  const AdamW8bitStep step(buf, hyper, isa);
  const std::size_t blocks = step.blocks();
  const std::size_t per_task = chunk_elements(buf.numel, pool.size()) / kQuantBlock;  // whole blocks
  const std::size_t tasks = (blocks + per_task - 1) / per_task;
  pool.parallel_for(tasks, [&](std::size_t t) { step.run(t * per_task, (t + 1) * per_task); });
}

}  // namespace trainstream
