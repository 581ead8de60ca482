// AdamW and gradient norms for parameters whose state lives in VRAM (cuda/kernels/device_adamw.cu):
// the host engine's update and the gradient norm of grad_ops.hpp, bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>

#include "trainstream/adamw.hpp"
#include "trainstream/adamw8bit.hpp"

namespace trainstream {

// One parameter's device buffers, as AdamWBuffers describes host ones: `param` is the fp32 weight
// (or, for bf16 weights, the fp32 master, with the bf16 weight in `param_bf16`).
struct DeviceAdamWTensor {
  float* param = nullptr;
  const void* grad = nullptr;
  DType grad_dtype = DType::float32;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  std::uint16_t* param_bf16 = nullptr;
  std::size_t numel = 0;
};

// Queues AdamW with `hyper` over `count` tensors on `stream` (a cudaStream_t) of `device`: the host kernel's
// arithmetic with the same roundings, so a parameter updated here and one updated on the host end
// with the same bits. `device_scale`, where given, is a float in device memory that replaces
// hyper.grad_scale (a clip coefficient the GPU computed: launch_clip_scale). Throws
// std::invalid_argument for bad hyperparameters, CudaError if a launch fails.
void launch_device_adamw(int device, const DeviceAdamWTensor* tensors, std::size_t count, const AdamWHyper& hyper,
                         std::uintptr_t stream, const float* device_scale = nullptr);

// One parameter's device buffers under blockwise 8-bit moments (AdamW8bitBuffers' device twin);
// numel a positive multiple of kQuantBlock.
struct DeviceAdamW8bitTensor {
  float* param = nullptr;
  const void* grad = nullptr;
  DType grad_dtype = DType::float32;
  Quantized exp_avg;
  Quantized exp_avg_sq;
  std::uint16_t* param_bf16 = nullptr;
  // bf16 weights without a master instead of `param` (null then): updated in place, rounded
  // stochastically with the bits of rounding_key(seed, step), as the host kernels round them.
  std::uint16_t* param16 = nullptr;
  std::uint64_t seed = 0;
  std::size_t numel = 0;
};

// Queues torchao's AdamW8bit update with `hyper` over `count` tensors on `stream` of `device`
// (cuda/kernels/device_adamw8bit.cu), with the host kernels' roundings and codes: the same bits as
// adamw8bit_step(). The maps are 256 floats each in device memory; `device_scale` as for
// launch_device_adamw. Throws std::invalid_argument for bad sizes or hyperparameters.
void launch_device_adamw8bit(int device, const DeviceAdamW8bitTensor* tensors, std::size_t count,
                             const AdamW8bitHyper& hyper, const float* signed_qmap, const float* unsigned_qmap,
                             std::uintptr_t stream, const float* device_scale = nullptr);

// Doubles of scratch launch_squared_norms needs for these sizes: one per norm block, and one more
// that pack_bf16.hpp's measuring scan counts in (zero before its first use; the scan leaves it so).
std::size_t squared_norm_scratch(const std::size_t* numels, std::size_t count);

// Queues out[k] = the squared norm of grads[k] as grad_ops.hpp defines it, on `stream` of
// `device` (out and scratch are device memory; scratch holds squared_norm_scratch(numels) doubles).
void launch_squared_norms(int device, const void* const* grads, const DType* dtypes, const std::size_t* numels,
                          std::size_t count, double* scratch, double* out, std::uintptr_t stream);

// Queues *scale = min(1, max_norm / (sqrt(squares[0] + ... + squares[count-1]) + eps)) in float,
// the squares added in order in double: the clip coefficient, with the bits the host computes.
// Where `verdict` is given (two doubles), also verdict[0] = *scale and verdict[1] = the norm: what
// OffloadPipeline::land_scale takes to the host. Either output may be null.
void launch_clip_scale(int device, const double* squares, std::size_t count, double max_norm, double eps,
                       float* scale, double* verdict, std::uintptr_t stream);

}  // namespace trainstream
