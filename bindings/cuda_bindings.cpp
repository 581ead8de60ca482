// Bindings for the CUDA layer: what the runtime reports, the pipeline over CUDA streams, and AdamW
// and gradient norms on the GPU. Compiled only in CUDA builds.
#include "common.hpp"
#include <pybind11/stl.h>

#include "trainstream/cuda/cuda_transfer.hpp"
#include "trainstream/cuda/device.hpp"
#include "trainstream/cuda/device_adamw.hpp"
#include "trainstream/offload_pipeline.hpp"

namespace trainstream::bindings {

namespace {

using Addresses = std::vector<std::uintptr_t>;

std::vector<DType> parse_dtypes(const std::vector<std::string>& names) {
  std::vector<DType> out;
  for (const auto& n : names) out.push_back(parse_dtype(n));
  return out;
}

void check_sizes(std::size_t n, std::initializer_list<std::size_t> sizes) {
  for (std::size_t s : sizes) {
    if (s != n) throw std::invalid_argument("device AdamW: the per-tensor lists differ in length");
  }
}

}  // namespace

void bind_cuda(py::module_& m) {
  m.def("cuda_info", [] {
    const CudaInfo info = cuda_info();
    py::dict d;
    d["runtime_version"] = info.runtime_version;
    d["driver_version"] = info.driver_version;
    d["device_count"] = info.device_count;
    d["error"] = info.error;
    return d;
  }, "CUDA runtime and driver versions and the device count; never raises.");

  m.def("cuda_pipeline",
        [](int device, std::uintptr_t download_stream, std::uintptr_t upload_stream, std::size_t threads,
           const std::optional<std::string>& isa, std::size_t max_download_bytes, bool device_accumulate,
           int niceness, bool register_pinned) {
          return std::make_unique<OffloadPipeline>(
              std::make_unique<CudaTransfer>(device, download_stream, upload_stream, register_pinned), threads,
              parse_optional_isa(isa), max_download_bytes, device_accumulate, niceness);
        },
        py::arg("device"), py::arg("download_stream"), py::arg("upload_stream"), py::arg("threads") = 0,
        py::arg("isa") = py::none(), py::arg("max_download_bytes") = std::size_t(512) << 20, py::kw_only(),
        py::arg("device_accumulate") = true, py::arg("niceness") = 0, py::arg("register_pinned") = true,
        "An offload pipeline over pinned host memory, copying on the two given CUDA streams. With "
        "device_accumulate, micro-batch gradients are added into the host accumulator by a kernel "
        "on the download stream instead of being copied and added on the host. Its engine threads "
        "run `niceness` nicer than the calling thread. With register_pinned, host memory is allocated, "
        "faulted in from every CPU and registered with cudaHostRegister instead of cudaHostAlloc'ed.");

  def_with_hyper(
      m, "device_adamw_step", HyperKeywords::required,
      [](const AdamWHyper& hyper, int device, std::uintptr_t stream, const Addresses& params, const Addresses& grads,
         const std::vector<std::string>& grad_dtypes, const Addresses& exp_avgs, const Addresses& exp_avg_sqs,
         const Addresses& params_bf16, const std::vector<std::size_t>& numels, std::uintptr_t device_scale) {
        const std::size_t n = params.size();
        check_sizes(n, {grads.size(), grad_dtypes.size(), exp_avgs.size(), exp_avg_sqs.size(), params_bf16.size(),
                        numels.size()});
        const std::vector<DType> dtypes = parse_dtypes(grad_dtypes);
        std::vector<DeviceAdamWTensor> tensors(n);
        for (std::size_t k = 0; k < n; ++k) {
          tensors[k] = {as_ptr<float>(params[k]), as_ptr<const void>(grads[k]), dtypes[k], as_ptr<float>(exp_avgs[k]),
                        as_ptr<float>(exp_avg_sqs[k]), as_ptr<std::uint16_t>(params_bf16[k]), numels[k]};
        }
        py::gil_scoped_release release;
        launch_device_adamw(device, tensors.data(), n, hyper, stream, as_ptr<const float>(device_scale));
      },
      py::arg("device"), py::arg("stream"), py::arg("params"), py::arg("grads"), py::arg("grad_dtypes"),
      py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("params_bf16"), py::arg("numels"), py::kw_only(),
      py::arg("device_scale") = 0,
      "Queues AdamW over device tensors (fp32 weights or masters; bf16 weights written beside, where "
      "given) on `stream`, with the host engine's arithmetic bit for bit; device_scale, where given, "
      "is a float in device memory that replaces grad_scale.");
  m.def(
      "device_adamw8bit_step",
      [](int device, std::uintptr_t stream, const Addresses& params, const Addresses& grads,
         const std::vector<std::string>& grad_dtypes, const Addresses& m_codes, const Addresses& m_scales,
         const Addresses& v_codes, const Addresses& v_scales, const Addresses& params_bf16,
         const std::vector<std::size_t>& numels, std::uintptr_t signed_qmap, std::uintptr_t unsigned_qmap, float lr,
         double beta1, double beta2, double eps, double weight_decay, std::int64_t step, float grad_scale,
         std::uintptr_t device_scale, const std::vector<std::int64_t>& seeds) {
        const std::size_t n = params.size();
        check_sizes(n, {grads.size(), grad_dtypes.size(), m_codes.size(), m_scales.size(), v_codes.size(),
                        v_scales.size(), params_bf16.size(), numels.size()});
        if (!seeds.empty()) check_sizes(n, {seeds.size()});
        const std::vector<DType> dtypes = parse_dtypes(grad_dtypes);
        std::vector<DeviceAdamW8bitTensor> tensors(n);
        for (std::size_t k = 0; k < n; ++k) {
          tensors[k] = {as_ptr<float>(params[k]), as_ptr<const void>(grads[k]), dtypes[k],
                        {as_ptr<std::uint8_t>(m_codes[k]), as_ptr<float>(m_scales[k])},
                        {as_ptr<std::uint8_t>(v_codes[k]), as_ptr<float>(v_scales[k])},
                        as_ptr<std::uint16_t>(params_bf16[k])};
          tensors[k].numel = numels[k];
          if (!seeds.empty() && seeds[k] >= 0) {  // bf16 weights without a master
            tensors[k].param16 = as_ptr<std::uint16_t>(params[k]);
            tensors[k].param = nullptr;
            tensors[k].seed = static_cast<std::uint64_t>(seeds[k]);
          }
        }
        const AdamW8bitHyper hyper{lr, beta1, beta2, eps, weight_decay, step, grad_scale};
        py::gil_scoped_release release;
        launch_device_adamw8bit(device, tensors.data(), n, hyper, as_ptr<const float>(signed_qmap),
                                as_ptr<const float>(unsigned_qmap), stream, as_ptr<const float>(device_scale));
      },
      py::arg("device"), py::arg("stream"), py::arg("params"), py::arg("grads"), py::arg("grad_dtypes"),
      py::arg("exp_avg_codes"), py::arg("exp_avg_scales"), py::arg("exp_avg_sq_codes"), py::arg("exp_avg_sq_scales"),
      py::arg("params_bf16"), py::arg("numels"), py::arg("signed_qmap"), py::arg("unsigned_qmap"), py::kw_only(),
      py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("step"),
      py::arg("grad_scale") = 1.0f, py::arg("device_scale") = 0, py::arg("seeds") = std::vector<std::int64_t>{},
      "Queues torchao's blockwise 8-bit AdamW over device tensors (uint8 codes and fp32 block scales of each "
      "moment; the two maps in device memory) on `stream`, with the host engine's bits; device_scale as for "
      "device_adamw_step. seeds, where given, one a tensor: a seed >= 0 makes that tensor's `params` address bf16 "
      "weights without a master, rounded stochastically as the host engine rounds them; -1 keeps fp32.");
  m.def("device_clip_scale",
        [](int device, std::uintptr_t stream, std::uintptr_t squares, std::size_t count, double max_norm, double eps,
           std::uintptr_t scale, std::uintptr_t verdict) {
          py::gil_scoped_release release;
          launch_clip_scale(device, as_ptr<const double>(squares), count, max_norm, eps, as_ptr<float>(scale),
                            as_ptr<double>(verdict), stream);
        },
        py::arg("device"), py::arg("stream"), py::arg("squares"), py::arg("count"), py::arg("max_norm"), py::arg("eps"),
        py::arg("scale"), py::arg("verdict") = 0,
        "Queues *scale = min(1, max_norm / (sqrt(sum of squares, in order) + eps)) as a float in device memory "
        "(scale 0: not written); verdict, where given, receives two doubles: that float and the norm.");
  m.def("device_norm_scratch", [](const std::vector<std::size_t>& numels) {
    return squared_norm_scratch(numels.data(), numels.size());
  }, py::arg("numels"), "Doubles of device scratch device_squared_norms (or a device norm taken as a gradient "
     "lands) needs, zeroed before its first use.");
  m.def("device_squared_norms",
        [](int device, std::uintptr_t stream, const Addresses& grads, const std::vector<std::string>& grad_dtypes,
           const std::vector<std::size_t>& numels, std::uintptr_t scratch, std::uintptr_t out) {
          check_sizes(grads.size(), {grad_dtypes.size(), numels.size()});
          const std::vector<DType> dtypes = parse_dtypes(grad_dtypes);
          std::vector<const void*> pointers;
          for (std::uintptr_t g : grads) pointers.push_back(as_ptr<const void>(g));
          py::gil_scoped_release release;
          launch_squared_norms(device, pointers.data(), dtypes.data(), numels.data(), pointers.size(),
                               as_ptr<double>(scratch), as_ptr<double>(out), stream);
        },
        py::arg("device"), py::arg("stream"), py::arg("grads"), py::arg("grad_dtypes"), py::arg("numels"),
        py::arg("scratch"), py::arg("out"),
        "Queues out[k] = the squared norm of gradient k (float64, device memory), computed as the host "
        "engine computes it.");
}

}  // namespace trainstream::bindings
