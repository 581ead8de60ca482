// AdamW and the gradient norm for parameters whose state lives in VRAM, with the host engine's
// arithmetic rounding for rounding: every operation is an explicitly rounded intrinsic, in the
// order adamw_scalar.cpp writes it (two fused multiply-adds where torch has them, IEEE division
// and square root), and the norm follows grad_ops.hpp's blocks and order. So whether the planner
// keeps a parameter on the GPU or offloads it, training gives the same bits.
//
// The AdamW and norm kernels take up to kBatch tensors at a time, by value (well inside the 4 KiB
// of kernel parameters), and cut them into fixed-size pieces (kChunk elements a thread block for
// AdamW, one norm block a warp for the norms), so a model's hundreds of parameters take a handful
// of launches.
#include <algorithm>

#include "norm_block.cuh"
#include "trainstream/cuda/device_adamw.hpp"
#include "trainstream/cuda/streams.hpp"
#include "trainstream/grad_ops.hpp"

namespace trainstream {

namespace {

constexpr int kBatch = 32;
constexpr int kThreads = 256;
constexpr std::size_t kChunk = 8192;  // elements a thread block updates

struct AdamWBatch {
  float* param[kBatch];
  const void* grad[kBatch];
  float* exp_avg[kBatch];
  float* exp_avg_sq[kBatch];
  std::uint16_t* param_bf16[kBatch];
  unsigned long long numel[kBatch];
  unsigned int first_chunk[kBatch + 1];  // tensor k owns chunks [first_chunk[k], first_chunk[k+1])
  bool bf16_grad[kBatch];
  int count;
  const float* scale;  // where given, the gradient scale in device memory (replaces coeffs.grad_scale)
};

struct NormBatch {
  const void* grad[kBatch];
  unsigned long long numel[kBatch];
  unsigned long long first_block[kBatch + 1];  // norm blocks, and the tensor's partials in scratch
  bool bf16[kBatch];
  int count;
};

// The tensor whose range of `starts` holds `index` (starts[0] == 0, ascending, count + 1 entries).
template <typename T>
__device__ __forceinline__ int owner(const T* starts, int count, unsigned long long index) {
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

__global__ void __launch_bounds__(kThreads) adamw_kernel(const AdamWBatch batch, const AdamWCoeffs c) {
  const int k = owner(batch.first_chunk, batch.count, blockIdx.x);
  const std::size_t begin = std::size_t(blockIdx.x - batch.first_chunk[k]) * kChunk;
  const std::size_t end = min(std::size_t(batch.numel[k]), begin + kChunk);
  float* __restrict__ p = batch.param[k];
  float* __restrict__ m = batch.exp_avg[k];
  float* __restrict__ v = batch.exp_avg_sq[k];
  std::uint16_t* __restrict__ p16 = batch.param_bf16[k];
  const float* g32 = static_cast<const float*>(batch.grad[k]);
  const std::uint16_t* g16 = static_cast<const std::uint16_t*>(batch.grad[k]);
  const bool bf16 = batch.bf16_grad[k];
  const float scale = batch.scale ? *batch.scale : c.grad_scale;
  for (std::size_t i = begin + threadIdx.x; i < end; i += kThreads) {
    float g = __fmul_rn(bf16 ? bf16_bits_to_float(g16[i]) : g32[i], scale);
    if (c.maximize) g = -g;
    const float m0 = m[i];
    const float mi = __fmaf_rn(c.lerp_coeff, __fsub_rn(g, m0), c.lerp_from_start ? m0 : g);
    const float vi = __fmaf_rn(__fmul_rn(c.one_minus_beta2, g), g, __fmul_rn(v[i], c.beta2));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), c.bc2_sqrt), c.eps);
    const float term = __fdiv_rn(__fmul_rn(c.neg_step_size, mi), denom);
    const float pn = __fadd_rn(__fmul_rn(p[i], c.decay), term);
    m[i] = mi;
    v[i] = vi;
    p[i] = pn;
    if (p16) p16[i] = float_to_bf16_bits(pn);
  }
}

// One warp per norm block (norm_block.cuh).
__global__ void __launch_bounds__(kThreads) norm_blocks_kernel(const NormBatch batch, double* __restrict__ partials) {
  const unsigned long long index = (std::size_t(blockIdx.x) * kThreads + threadIdx.x) / 32;
  if (index >= batch.first_block[batch.count]) return;  // whole warps leave together
  const int k = owner(batch.first_block, batch.count, index);
  const std::size_t begin = (index - batch.first_block[k]) * kNormBlock;
  const std::size_t end = min(std::size_t(batch.numel[k]), begin + kNormBlock);
  const unsigned lane = threadIdx.x % 32;
  double s;
  if (batch.bf16[k]) {
    const std::uint16_t* g = static_cast<const std::uint16_t*>(batch.grad[k]);
    s = norm_block_partial([g](std::size_t i) { return double(bf16_bits_to_float(g[i])); }, begin, end, lane);
  } else {
    const float* g = static_cast<const float*>(batch.grad[k]);
    s = norm_block_partial([g](std::size_t i) { return double(g[i]); }, begin, end, lane);
  }
  if (lane == 0) partials[index] = s;
}

// One warp per tensor: its block partials added in order, as the host adds them.
__global__ void norm_sum_kernel(const NormBatch batch, const double* __restrict__ partials, double* __restrict__ out) {
  const int k = blockIdx.x;
  const double total = sum_partials(partials, batch.first_block[k], batch.first_block[k + 1], threadIdx.x);
  if (threadIdx.x == 0) out[k] = total;
}

// The clip coefficient from per-tensor squared norms, as OffloadedAdamW computes it on the host:
// the squares added in order, sqrt, max_norm / (norm + eps), at most 1 (NaN gives 1, as Python's
// min(1.0, nan) does), rounded to float where the host hands it to the kernel. `verdict`, where
// given, receives that float (widened) and the norm, for the host engine.
__global__ void clip_scale_kernel(const double* __restrict__ squares, std::size_t count, double max_norm, double eps,
                                  float* __restrict__ scale, double* __restrict__ verdict) {
  double total = 0;
  for (std::size_t k = 0; k < count; ++k) total = __dadd_rn(total, squares[k]);
  const double norm = __dsqrt_rn(total);
  const double coefficient = __ddiv_rn(max_norm, __dadd_rn(norm, eps));
  const float rounded = __double2float_rn(coefficient < 1.0 ? coefficient : 1.0);
  if (scale) *scale = rounded;
  if (verdict) {
    verdict[0] = rounded;
    verdict[1] = norm;
  }
}

}  // namespace

void launch_device_adamw(int device, const DeviceAdamWTensor* tensors, std::size_t count, const AdamWHyper& hyper,
                         std::uintptr_t stream_handle, const float* device_scale) {
  const cudaStream_t stream = as_stream(stream_handle);
  const AdamWCoeffs coeffs = adamw_coeffs(hyper);  // the host engine's constants
  DeviceScope on_device(device);
  for (std::size_t start = 0; start < count; start += kBatch) {
    AdamWBatch batch{};
    batch.count = static_cast<int>(std::min<std::size_t>(kBatch, count - start));
    unsigned int chunks = 0;
    for (int k = 0; k < batch.count; ++k) {
      const DeviceAdamWTensor& t = tensors[start + k];
      TS_EXPECTS(t.numel > 0 && t.param && t.grad && t.exp_avg && t.exp_avg_sq, "device AdamW: empty tensor");
      batch.param[k] = t.param;
      batch.grad[k] = t.grad;
      batch.exp_avg[k] = t.exp_avg;
      batch.exp_avg_sq[k] = t.exp_avg_sq;
      batch.param_bf16[k] = t.param_bf16;
      batch.numel[k] = t.numel;
      batch.bf16_grad[k] = t.grad_dtype == DType::bfloat16;
      batch.first_chunk[k] = chunks;
      const std::size_t more = (t.numel + kChunk - 1) / kChunk;
      TS_EXPECTS(chunks + more < (1u << 31), "device AdamW: too many elements in one launch");
      chunks += static_cast<unsigned int>(more);
    }
    batch.first_chunk[batch.count] = chunks;
    batch.scale = device_scale;
    adamw_kernel<<<chunks, kThreads, 0, stream>>>(batch, coeffs);
    TS_CUDA_CHECK(cudaGetLastError());
  }
}

std::size_t squared_norm_scratch(const std::size_t* numels, std::size_t count) {
  std::size_t blocks = 0;
  for (std::size_t k = 0; k < count; ++k) blocks += norm_blocks(numels[k]);
  return blocks + 1;  // (the last: launch_scan_bf16's count of finished thread blocks)
}

void launch_squared_norms(int device, const void* const* grads, const DType* dtypes, const std::size_t* numels,
                          std::size_t count, double* scratch, double* out, std::uintptr_t stream_handle) {
  const cudaStream_t stream = as_stream(stream_handle);
  DeviceScope on_device(device);
  for (std::size_t start = 0; start < count; start += kBatch) {
    NormBatch batch{};
    batch.count = static_cast<int>(std::min<std::size_t>(kBatch, count - start));
    unsigned long long blocks = 0;
    for (int k = 0; k < batch.count; ++k) {
      const std::size_t i = start + k;
      TS_EXPECTS(numels[i] > 0 && grads[i], "device norm: empty tensor");
      batch.grad[k] = grads[i];
      batch.numel[k] = numels[i];
      batch.bf16[k] = dtypes[i] == DType::bfloat16;
      batch.first_block[k] = blocks;
      blocks += norm_blocks(numels[i]);
    }
    batch.first_block[batch.count] = blocks;
    constexpr unsigned kWarps = kThreads / 32;  // norm blocks per thread block
    const unsigned int grid = static_cast<unsigned int>((blocks + kWarps - 1) / kWarps);
    norm_blocks_kernel<<<grid, kThreads, 0, stream>>>(batch, scratch);
    TS_CUDA_CHECK(cudaGetLastError());
    norm_sum_kernel<<<batch.count, 32, 0, stream>>>(batch, scratch, out + start);
    TS_CUDA_CHECK(cudaGetLastError());
    scratch += blocks;
  }
}

void launch_clip_scale(int device, const double* squares, std::size_t count, double max_norm, double eps,
                       float* scale, double* verdict, std::uintptr_t stream_handle) {
  DeviceScope on_device(device);
  clip_scale_kernel<<<1, 1, 0, as_stream(stream_handle)>>>(squares, count, max_norm, eps, scale, verdict);
  TS_CUDA_CHECK(cudaGetLastError());
}

}  // namespace trainstream
