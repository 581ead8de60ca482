// Blockwise 8-bit AdamW (torchao's AdamW8bit) for parameters whose state lives in VRAM, with the
// host scalar kernel's arithmetic (cpp/src/adamw/adamw8bit.cpp) rounding for rounding: every
// operation an explicitly rounded intrinsic in its order, lerp's fused multiply-add where torch's
// CPU kernel has it, IEEE division and square root, and the same search for each new code. So a
// parameter updated here and one updated on the host end with the same codes, scales and weights.
//
// One thread block of kQuantBlock threads updates one quantization block: each thread one
// element, the block's new scale (its largest magnitude) reduced through shared memory. Up to
// kBatch tensors a launch, by value. bf16 weights without a master are rounded stochastically with
// the host kernels' random bits (rounding_bits of adamw8bit.hpp), so they too end the same.
#include <algorithm>
#include <string>

#include "trainstream/adamw8bit.hpp"
#include "trainstream/cuda/device_adamw.hpp"
#include "trainstream/cuda/streams.hpp"
#include "trainstream/errors.hpp"

namespace trainstream {

namespace {

constexpr int kBatch = 32;
constexpr int kThreads = static_cast<int>(kQuantBlock);
static_assert(kThreads == 256, "one thread per element of a quantization block");

struct Batch8bit {
  float* param[kBatch];
  const void* grad[kBatch];
  std::uint8_t* m_codes[kBatch];
  float* m_scale[kBatch];
  std::uint8_t* v_codes[kBatch];
  float* v_scale[kBatch];
  std::uint16_t* param_bf16[kBatch];
  std::uint16_t* param16[kBatch];  // bf16 weights rounded stochastically (param null), or null
  RoundingKey key[kBatch];
  unsigned int first_block[kBatch + 1];  // tensor k owns quantization blocks [first_block[k], first_block[k+1])
  bool bf16_grad[kBatch];
  int count;
  const float* signed_qmap;    // device memory, 256 floats each
  const float* unsigned_qmap;
  const float* scale;  // where given, the gradient scale in device memory (replaces coeffs.grad_scale)
};

__device__ __forceinline__ int owner(const unsigned int* starts, int count, unsigned int index) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (starts[mid] <= index) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

__device__ __forceinline__ float bf16_bits_to_float(std::uint16_t bits) {
  return __uint_as_float(static_cast<unsigned>(bits) << 16);
}

// float_to_bf16 of adamw.hpp: round to nearest even, every NaN to 0x7fc0.
__device__ __forceinline__ std::uint16_t float_to_bf16_bits(float value) {
  unsigned bits = __float_as_uint(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<std::uint16_t>(bits >> 16);
}

// quantize_with_qmap of adamw8bit.hpp over a map in shared memory.
__device__ __forceinline__ std::uint8_t quantize(float x, const float* qmap) {
  unsigned code = x >= qmap[128] ? 128 : 0;
  for (unsigned step = 64; step > 0; step >>= 1) code += x >= qmap[code + step] ? step : 0;
  const unsigned up = min(code + 1, 255u);
  const float down_value = qmap[code];
  return static_cast<std::uint8_t>(__fsub_rn(x, down_value) >= __fmul_rn(__fsub_rn(qmap[up], down_value), 0.5f) ? up
                                                                                                             : code);
}

// The block's largest magnitude (NaN ignored, as std::max ignores it), at least 1e-12.
__device__ __forceinline__ float block_scale(float magnitude, float* shared) {
  shared[threadIdx.x] = magnitude;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) shared[threadIdx.x] = fmaxf(shared[threadIdx.x], shared[threadIdx.x + half]);
    __syncthreads();
  }
  const float scale = fmaxf(shared[0], 1e-12f);
  __syncthreads();  // (shared is reused)
  return scale;
}

__global__ void __launch_bounds__(kThreads) adamw8bit_kernel(const Batch8bit batch, const AdamW8bitCoeffs c) {
  __shared__ float maps[2][256];
  __shared__ float reduce[kThreads];
  maps[0][threadIdx.x] = batch.signed_qmap[threadIdx.x];
  maps[1][threadIdx.x] = batch.unsigned_qmap[threadIdx.x];
  const int k = owner(batch.first_block, batch.count, blockIdx.x);
  const std::size_t b = blockIdx.x - batch.first_block[k];
  const std::size_t i = b * kQuantBlock + threadIdx.x;
  __syncthreads();
  float g = batch.bf16_grad[k] ? bf16_bits_to_float(static_cast<const std::uint16_t*>(batch.grad[k])[i])
                               : static_cast<const float*>(batch.grad[k])[i];
  g = __fmul_rn(g, batch.scale ? *batch.scale : c.grad_scale);
  const float m0 = __fmul_rn(maps[0][batch.m_codes[k][i]], batch.m_scale[k][b]);
  const float v0 = __fmul_rn(maps[1][batch.v_codes[k][i]], batch.v_scale[k][b]);
  const float g2 = __fmul_rn(g, g);
  const float m = __fmaf_rn(c.m_coeff, __fsub_rn(g, m0), c.m_from_start ? m0 : g);
  const float v = __fmaf_rn(c.v_coeff, __fsub_rn(g2, v0), c.v_from_start ? v0 : g2);
  std::uint16_t* const weights16 = batch.param16[k];
  const float p = weights16 ? bf16_bits_to_float(weights16[i]) : batch.param[k][i];
  const float decayed = __fsub_rn(p, __fmul_rn(c.lr_wd, p));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), c.bc2_sqrt), c.eps);
  const float updated = __fsub_rn(decayed, __fdiv_rn(__fmul_rn(c.lr, __fdiv_rn(m, c.bc1)), denom));
  if (weights16) {
    const std::uint16_t rounded =
        bf16_stochastic(__float_as_uint(updated), rounding_bits(batch.key[k], static_cast<std::uint32_t>(i)));
    weights16[i] = rounded;
    if (batch.param_bf16[k]) batch.param_bf16[k][i] = rounded;
  } else {
    batch.param[k][i] = updated;
    if (batch.param_bf16[k]) batch.param_bf16[k][i] = float_to_bf16_bits(updated);
  }
  const float m_scale = block_scale(fabsf(m), reduce);
  const float v_scale = block_scale(fabsf(v), reduce);
  batch.m_codes[k][i] = quantize(__fdiv_rn(m, m_scale), maps[0]);
  batch.v_codes[k][i] = quantize(__fdiv_rn(v, v_scale), maps[1]);
  if (threadIdx.x == 0) {
    batch.m_scale[k][b] = m_scale;
    batch.v_scale[k][b] = v_scale;
  }
}

}  // namespace

void launch_device_adamw8bit(int device, const DeviceAdamW8bitTensor* tensors, std::size_t count,
                             const AdamW8bitHyper& hyper, const float* signed_qmap, const float* unsigned_qmap,
                             std::uintptr_t stream_handle, const float* device_scale) {
  const cudaStream_t stream = as_stream(stream_handle);
  const AdamW8bitCoeffs coeffs = adamw8bit_coeffs(hyper);  // the host kernels' constants
  TS_EXPECTS(signed_qmap && unsigned_qmap, "device AdamW8bit: the quantization maps are missing");
  DeviceScope on_device(device);
  for (std::size_t start = 0; start < count; start += kBatch) {
    Batch8bit batch{};
    batch.count = static_cast<int>(std::min<std::size_t>(kBatch, count - start));
    unsigned int blocks = 0;
    for (int k = 0; k < batch.count; ++k) {
      const DeviceAdamW8bitTensor& t = tensors[start + k];
      TS_EXPECTS(t.numel > 0 && t.numel % kQuantBlock == 0,
                 "device AdamW8bit: numel must be a positive multiple of " + std::to_string(kQuantBlock));
      TS_EXPECTS(!t.param != !t.param16, "device AdamW8bit: fp32 weights (param) or bf16 ones (param16), one of them");
      TS_EXPECTS(!t.param16 || t.numel <= (std::size_t(1) << 32),
                 "device AdamW8bit: stochastic rounding numbers at most 2^32 elements a parameter");
      TS_EXPECTS(t.grad && t.exp_avg.codes && t.exp_avg.scale && t.exp_avg_sq.codes && t.exp_avg_sq.scale,
                 "device AdamW8bit: null buffer pointer");
      batch.param[k] = t.param;
      batch.grad[k] = t.grad;
      batch.m_codes[k] = t.exp_avg.codes;
      batch.m_scale[k] = t.exp_avg.scale;
      batch.v_codes[k] = t.exp_avg_sq.codes;
      batch.v_scale[k] = t.exp_avg_sq.scale;
      batch.param_bf16[k] = t.param_bf16;
      batch.param16[k] = t.param16;
      if (t.param16) batch.key[k] = rounding_key(t.seed, hyper.step);
      batch.bf16_grad[k] = t.grad_dtype == DType::bfloat16;
      batch.first_block[k] = blocks;
      const std::size_t more = t.numel / kQuantBlock;
      TS_EXPECTS(blocks + more < (1u << 31), "device AdamW8bit: too many elements in one launch");
      blocks += static_cast<unsigned int>(more);
    }
    batch.first_block[batch.count] = blocks;
    batch.signed_qmap = signed_qmap;
    batch.unsigned_qmap = unsigned_qmap;
    batch.scale = device_scale;
    adamw8bit_kernel<<<blocks, kThreads, 0, stream>>>(batch, coeffs);
    TS_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace trainstream
