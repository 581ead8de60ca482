#include <pybind11/stl.h>

#include <string>

#include "common.hpp"
#include "trainstream/offload_pipeline.hpp"

namespace trainstream::bindings {

namespace {

// A view of one host buffer that keeps its owner alive: torch.frombuffer(view, dtype=...) gives a
// tensor over the buffer for as long as the tensor lives. The buffers are the pipeline's (its
// arenas), so the view also keeps the Python HostParam alive, which keeps the pipeline alive: an
// optimizer's state tensors stay valid after the optimizer is gone, as torch's do.
struct HostView {
  std::shared_ptr<HostParam> owner;
  void* data;
  std::size_t bytes;
};

GradJob make_job(const AdamWHyper& hyper, bool accumulate, bool overwrite, bool from_accumulator, bool norm,
                 bool update, std::uintptr_t device_weight, bool speculate, bool commit,
                 std::shared_ptr<ClipScale> scale = nullptr, std::uintptr_t device_term = 0,
                 std::uintptr_t device_norm = 0, std::uintptr_t device_norm_scratch = 0) {
  GradJob job;
  job.scale = std::move(scale);
  job.accumulate = accumulate;
  job.overwrite = overwrite;
  job.from_accumulator = from_accumulator;
  job.norm = norm;
  job.update = update;
  job.hyper = hyper;
  job.device_weight = device_weight;
  job.speculate = speculate;
  job.commit = commit;
  job.device_term = device_term;
  job.device_norm = device_norm;
  job.device_norm_scratch = device_norm_scratch;
  if (update || commit) adamw_coeffs(job.hyper);  // reject bad hyperparameters here, not in the worker
  return job;
}

// A job given as a dict of submit()'s keywords (hyperparameters included), with their defaults.
GradJob job_from(const py::dict& d) {
  AdamWHyper hyper = kDefaultedHyper;
  bool from_accumulator = false, norm = false, update = false, speculate = false, commit = false;
  std::uintptr_t device_weight = 0;
  std::shared_ptr<ClipScale> scale;
  for (const auto& item : d) {
    const auto key = item.first.cast<std::string>();
    const py::handle value = item.second;
    if (key == "lr") hyper.lr = value.cast<double>();
    else if (key == "beta1") hyper.beta1 = value.cast<double>();
    else if (key == "beta2") hyper.beta2 = value.cast<double>();
    else if (key == "eps") hyper.eps = value.cast<double>();
    else if (key == "weight_decay") hyper.weight_decay = value.cast<double>();
    else if (key == "step") hyper.step = value.cast<std::int64_t>();
    else if (key == "grad_scale") hyper.grad_scale = value.cast<double>();
    else if (key == "maximize") hyper.maximize = value.cast<bool>();
    else if (key == "from_accumulator") from_accumulator = value.cast<bool>();
    else if (key == "norm") norm = value.cast<bool>();
    else if (key == "update") update = value.cast<bool>();
    else if (key == "device_weight") device_weight = value.cast<std::uintptr_t>();
    else if (key == "speculate") speculate = value.cast<bool>();
    else if (key == "commit") commit = value.cast<bool>();
    else if (key == "scale") scale = value.is_none() ? nullptr : value.cast<std::shared_ptr<ClipScale>>();
    else throw py::type_error("submit_many: unknown job keyword '" + key + "'");
  }
  return make_job(hyper, false, false, from_accumulator, norm, update, device_weight, speculate, commit,
                  std::move(scale));
}

std::vector<HostParam*> raw_pointers(const std::vector<std::shared_ptr<HostParam>>& params) {
  std::vector<HostParam*> raw;
  raw.reserve(params.size());
  for (const auto& p : params) raw.push_back(p.get());
  return raw;
}

Moments parse_moments(const std::string& name) {
  if (name == "fp32") return Moments::fp32;
  if (name == "8bit") return Moments::blockwise8;
  if (name == "8bit-sr") return Moments::blockwise8_sr;
  throw std::invalid_argument("moments must be 'fp32', '8bit' or '8bit-sr', got '" + name + "'");
}

const char* moments_name(Moments m) {
  return m == Moments::blockwise8 ? "8bit" : m == Moments::blockwise8_sr ? "8bit-sr" : "fp32";
}

}  // namespace

void bind_pipeline(py::module_& m) {
  py::class_<HostView>(m, "HostView", py::buffer_protocol())
      .def_buffer([](HostView& v) {
        return py::buffer_info(v.data, 1, py::format_descriptor<std::uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(v.bytes)}, {1});
      })
      .def_property_readonly("address", [](const HostView& v) { return reinterpret_cast<std::uintptr_t>(v.data); })
      .def_property_readonly("nbytes", [](const HostView& v) { return v.bytes; });

  py::class_<HostParam, std::shared_ptr<HostParam>>(m, "HostParam")
      .def_property_readonly("numel", [](const HostParam& p) { return p.numel; })
      .def_property_readonly("weight_dtype", [](const HostParam& p) {
        return std::string(p.weight_dtype == DType::bfloat16 ? "bfloat16" : "float32");
      })
      .def_property_readonly("squared_norm", [](const HostParam& p) { return p.squared_norm; })
      .def_property_readonly("has_accumulator", [](const HostParam& p) { return p.accumulator != nullptr; })
      .def_property_readonly("moments", [](const HostParam& p) { return moments_name(p.moments); },
                             "'fp32', '8bit' (blockwise: torchao's AdamW8bit) or '8bit-sr' (the same over bf16 "
                             "weights without a master, rounded stochastically)")
      .def_property_readonly("has_landing_buffer", [](const HostParam& p) { return p.grad != nullptr; },
                             "False for fp32 weights whose gradients land in their accumulator")
      .def_property_readonly("state_bytes", [](const HostParam& p) { return OffloadPipeline::state_bytes(p); },
                             "Host bytes its state holds, or would take when take_state() takes it")
      .def_property_readonly("last_gradient_as_bf16", &HostParam::last_gradient_as_bf16,
                             "fp32 weights: whether the last gradient consumed crossed as bf16 (it was exact)")
      .def_property_readonly("holds_state", &HostParam::holds_state,
                             "False once release_state() gave its host buffers back (a resident parameter)")
      .def("view", [](const std::shared_ptr<HostParam>& p, const std::string& name) {
        if (!p->holds_state()) throw std::invalid_argument("HostParam: its host state was given back (resident)");
        if (name == "master" && p->master_bf16) return HostView{p, p->master_bf16, 2 * p->numel};
        if (name == "master") return HostView{p, p->master, 4 * p->numel};
        const std::size_t blocks = p->numel / kQuantBlock;
        const bool compact = quantized(p->moments);
        if (name == "exp_avg" && !compact) return HostView{p, p->exp_avg, 4 * p->numel};
        if (name == "exp_avg_sq" && !compact) return HostView{p, p->exp_avg_sq, 4 * p->numel};
        if (name == "exp_avg_codes" && compact) return HostView{p, p->exp_avg8.codes, p->numel};
        if (name == "exp_avg_scale" && compact) return HostView{p, p->exp_avg8.scale, 4 * blocks};
        if (name == "exp_avg_sq_codes" && compact) return HostView{p, p->exp_avg_sq8.codes, p->numel};
        if (name == "exp_avg_sq_scale" && compact) return HostView{p, p->exp_avg_sq8.scale, 4 * blocks};
        if (name == "grad") {
          if (!p->grad) throw std::invalid_argument("HostParam: no landing buffer (its gradients land in its accumulator)");
          return HostView{p, p->grad, p->weight_bytes()};
        }
        if (name == "accumulator" && p->accumulator) return HostView{p, p->accumulator, 4 * p->numel};
        if (name == "next_exp_avg" && p->next_exp_avg) return HostView{p, p->next_exp_avg, 4 * p->numel};
        if (name == "next_exp_avg_sq" && p->next_exp_avg_sq) return HostView{p, p->next_exp_avg_sq, 4 * p->numel};
        if (name == "next_master" && p->next_master) return HostView{p, p->next_master, 4 * p->numel};
        if (name == "next_master" && p->next_master_bf16) return HostView{p, p->next_master_bf16, 2 * p->numel};
        if (name == "next_exp_avg_codes" && p->next_exp_avg8.codes) return HostView{p, p->next_exp_avg8.codes, p->numel};
        if (name == "next_exp_avg_scale" && p->next_exp_avg8.scale) return HostView{p, p->next_exp_avg8.scale, 4 * blocks};
        if (name == "next_exp_avg_sq_codes" && p->next_exp_avg_sq8.codes) {
          return HostView{p, p->next_exp_avg_sq8.codes, p->numel};
        }
        if (name == "next_exp_avg_sq_scale" && p->next_exp_avg_sq8.scale) {
          return HostView{p, p->next_exp_avg_sq8.scale, 4 * blocks};
        }
        if (name == "weights" && p->keeps_weights_on_host()) {
          if (p->master_bf16) return HostView{p, p->master_bf16, 2 * p->numel};
          if (p->weight_dtype == DType::bfloat16) return HostView{p, p->host_bf16, 2 * p->numel};
          return HostView{p, p->master, 4 * p->numel};
        }
        throw std::invalid_argument("HostParam has no buffer '" + name + "'");
      }, py::arg("name"), py::keep_alive<0, 1>(),
      "Bytes of one buffer: master (8bit-sr: the bf16 weights), exp_avg, exp_avg_sq (blockwise 8-bit moments: exp_avg_codes, exp_avg_scale, "
      "exp_avg_sq_codes, exp_avg_sq_scale), grad, accumulator, or (with speculation) "
      "next_exp_avg, next_exp_avg_sq (8-bit: next_exp_avg_codes and the rest), next_master; with keep_weights_on_host, weights (the weights in their "
      "dtype). A commit swaps each next_ buffer with its twin.");

  py::class_<ClipScale, std::shared_ptr<ClipScale>>(m, "ClipScale",
                                                     "A window's clip coefficient on its way from the device.")
      .def_property_readonly("landed", &ClipScale::landed)
      .def_property_readonly("commits", [](const ClipScale& c) {
        return c.landed() ? std::optional<bool>(c.commits()) : std::nullopt;
      }, "Whether updates speculated with a coefficient of 1 stand (None until landed).");

  py::class_<OffloadPipeline> pipeline(m, "OffloadPipeline");
  pipeline
      .def_property_readonly("isa", [](OffloadPipeline& o) { return std::string(isa_name(o.engine().isa())); })
      .def_property_readonly("threads", [](OffloadPipeline& o) { return o.engine().threads(); })
      .def_property_readonly("niceness", &OffloadPipeline::niceness)
      .def_property_readonly("on_device", [](OffloadPipeline& o) { return o.transfer().is_device(); })
      .def_property_readonly("host_memory_kind", [](OffloadPipeline& o) { return std::string(o.transfer().arena().kind()); })
      .def_property_readonly("host_reserved_bytes", [](OffloadPipeline& o) { return o.transfer().arena().reserved_bytes(); })
      .def_property_readonly("host_used_bytes", [](OffloadPipeline& o) { return o.transfer().arena().used_bytes(); })
      .def_property("device_accumulate", &OffloadPipeline::device_accumulate,
                    &OffloadPipeline::set_device_accumulate,
                    "Whether micro-batch gradients are accumulated by the transfer (a GPU kernel) rather "
                    "than by host jobs; may be switched at any time.")
      .def_property("pack_gradients", &OffloadPipeline::pack_gradients, &OffloadPipeline::set_pack_gradients,
                    "Whether fp32 gradients whose values are bf16 (weight gradients under bf16 autocast) "
                    "are sent to the host as bf16, losslessly; may be switched at any time.")
      .def_property("upload_terms", &OffloadPipeline::upload_terms, &OffloadPipeline::set_upload_terms,
                    "Whether fp32 weights are updated by uploading AdamW's update term for the device to "
                    "add rather than an updated host master (default off; a CUDA pipeline needs "
                    "set_upload_staging first). Switch it off only when nothing is queued, then "
                    "load_weights every fp32 parameter.")
      .def("set_upload_staging", [](OffloadPipeline& o, std::uintptr_t device, std::size_t bytes) {
             o.transfer().set_staging(device, bytes);
           }, py::arg("device"), py::arg("nbytes"),
           "Device memory the CUDA transfer stages update terms in (the caller keeps it alive).")
      .def_property_readonly("pending", &OffloadPipeline::pending)
      .def("stats", [](const OffloadPipeline& o) {
             const OffloadPipeline::Stats s = o.stats();
             py::dict d;
             d["busy_seconds"] = s.busy_seconds;
             d["updated_elements"] = s.updated_elements;
             d["adding_seconds"] = s.adding_seconds;
             d["added_elements"] = s.added_elements;
             d["landing_wait_seconds"] = s.landing_wait_seconds;
             return d;
           }, "Since it started: wall seconds some engine thread ran an update (busy_seconds) and the "
              "elements updated; wall seconds some thread added a micro-batch into a host sum and the "
              "elements added; seconds gradients waited to start their download (for queued jobs or the "
              "download budget).")
      .def_property_readonly("downloading_bytes", &OffloadPipeline::downloading_bytes)
      .def("add_param", [](OffloadPipeline& o, std::size_t numel, const std::string& dtype, bool accumulate,
                           std::int64_t priority, bool with_state, const std::string& moments,
                           std::uint64_t rounding_seed) {
             const Moments format = parse_moments(moments);
             py::gil_scoped_release release;
             auto p = o.add_param(numel, parse_dtype(dtype), accumulate, priority, with_state, format);
             p->rounding_seed = rounding_seed;
             return p;
           }, py::arg("numel"), py::arg("weight_dtype"), py::arg("accumulate"), py::arg("priority") = 0,
           py::arg("with_state") = true, py::arg("moments") = "fp32", py::arg("rounding_seed") = 0,
           py::keep_alive<0, 1>())
      .def("set_quantization_maps", [](OffloadPipeline& o, std::uintptr_t signed_map, std::uintptr_t unsigned_map) {
             o.set_quantization_maps(reinterpret_cast<const float*>(signed_map), reinterpret_cast<const float*>(unsigned_map));
           }, py::arg("signed_map"), py::arg("unsigned_map"),
           "The two maps of 256 fp32 values (host addresses, copied) that 8-bit moments are decoded by; once.")
      .def("load_weights", [](OffloadPipeline& o, HostParam& p, std::uintptr_t weight, std::uintptr_t stream) {
             py::gil_scoped_release release;
             o.load_weights(p, weight, stream);
           }, py::arg("param"), py::arg("device_weight"), py::arg("stream") = 0);
  def_with_hyper(
      pipeline, "land_gradient", HyperKeywords::defaulted,
      [](const AdamWHyper& hyper, OffloadPipeline& o, const std::shared_ptr<HostParam>& p, std::uintptr_t grad,
         std::uintptr_t stream, bool accumulate, bool overwrite, bool from_accumulator, bool norm, bool update,
         std::uintptr_t device_weight, bool speculate, std::uintptr_t device_term, std::uintptr_t device_norm,
         std::uintptr_t device_norm_scratch) {
        const GradJob job = make_job(hyper, accumulate, overwrite, from_accumulator, norm, update, device_weight,
                                     speculate, false, nullptr, device_term, device_norm, device_norm_scratch);
        py::gil_scoped_release release;
        o.land_gradient(p, grad, stream, job);
      },
      py::arg("param"), py::arg("device_grad"), py::arg("stream"), py::kw_only(), py::arg("accumulate") = false,
      py::arg("overwrite") = false, py::arg("from_accumulator") = false, py::arg("norm") = false,
      py::arg("update") = false, py::arg("device_weight") = 0, py::arg("speculate") = false,
      py::arg("device_term") = 0, py::arg("device_norm") = 0, py::arg("device_norm_scratch") = 0);
  def_with_hyper(
      pipeline, "submit", HyperKeywords::defaulted,
      [](const AdamWHyper& hyper, OffloadPipeline& o, const std::shared_ptr<HostParam>& p, bool from_accumulator,
         bool norm, bool update, std::uintptr_t device_weight, bool speculate, bool commit, const py::object& scale) {
        const GradJob job = make_job(hyper, false, false, from_accumulator, norm, update, device_weight, speculate,
                                     commit, scale.is_none() ? nullptr : scale.cast<std::shared_ptr<ClipScale>>());
        py::gil_scoped_release release;
        o.submit(p, job);
      },
      py::arg("param"), py::kw_only(), py::arg("from_accumulator") = false, py::arg("norm") = false,
      py::arg("update") = false, py::arg("device_weight") = 0, py::arg("speculate") = false,
      py::arg("commit") = false, py::arg("scale") = py::none());
  pipeline
      .def("submit_many",
           [](OffloadPipeline& o, const std::vector<std::shared_ptr<HostParam>>& params,
              const std::vector<py::dict>& jobs) {
             if (jobs.size() != params.size()) throw py::value_error("submit_many: one job per parameter");
             std::vector<GradJob> built;
             built.reserve(jobs.size());
             for (const auto& job : jobs) built.push_back(job_from(job));
             py::gil_scoped_release release;
             o.submit(params, built);
           },
           py::arg("params"), py::arg("jobs"),
           "submit() for several parameters at once, each job a dict of submit()'s keywords: queued "
           "under one lock, with one wake-up.")
      .def("commit",
           [](OffloadPipeline& o, const std::vector<std::shared_ptr<HostParam>>& params,
              const std::vector<std::uintptr_t>& device_weights, const py::object& verdict) {
             std::shared_ptr<const ClipScale> scale;
             if (!verdict.is_none()) scale = verdict.cast<std::shared_ptr<ClipScale>>();
             py::gil_scoped_release release;
             o.commit(params, device_weights, scale);
           },
           py::arg("params"), py::arg("device_weights"), py::arg("verdict") = py::none(),
           "Queues the commit of each parameter's speculative update, with the hyperparameters it ran "
           "with; given the window's verdict (land_scale), the engine redoes it first if that clips.")
      .def("enable_speculation", [](OffloadPipeline& o, HostParam& p) {
             py::gil_scoped_release release;
             return o.enable_speculation(p);
           }, py::arg("param"), "Next-state buffers for speculative updates; returns the host bytes taken.")
      .def("release_state", [](OffloadPipeline& o, HostParam& p) {
             py::gil_scoped_release release;
             return o.release_state(p);
           }, py::arg("param"),
           "Gives a parameter's host buffers back once its jobs are done (it became resident); returns the bytes.")
      .def("take_state", [](OffloadPipeline& o, HostParam& p) {
             py::gil_scoped_release release;
             return o.take_state(p);
           }, py::arg("param"), "Fresh host buffers, moments zeroed, for a parameter offloaded again; returns the bytes.")
      .def("keep_weights_on_host", [](OffloadPipeline& o, HostParam& p) {
             py::gil_scoped_release release;
             return o.keep_weights_on_host(p);
           }, py::arg("param"), "Keeps the parameter's weights in host memory from now on; returns the host bytes taken.")
      .def_static("state_bytes", [](std::size_t numel, const std::string& dtype, bool accumulate,
                                    const std::string& moments) {
             return OffloadPipeline::state_bytes(numel, parse_dtype(dtype), accumulate, parse_moments(moments));
           }, py::arg("numel"), py::arg("weight_dtype"), py::arg("accumulate"), py::arg("moments") = "fp32",
           "Host bytes of an offloaded parameter's state (master, moments, landing buffer, accumulator).")
      .def_static("speculation_bytes", [](std::size_t numel, const std::string& dtype, const std::string& moments) {
             return OffloadPipeline::speculation_bytes(numel, parse_dtype(dtype), parse_moments(moments));
           }, py::arg("numel"), py::arg("weight_dtype"), py::arg("moments") = "fp32")
      .def("land_scale", [](OffloadPipeline& o, std::uintptr_t verdict, std::uintptr_t stream) {
             py::gil_scoped_release release;
             return o.land_scale(verdict, stream);
           }, py::arg("device_verdict"), py::arg("stream") = 0,
           "Queues the download of a window's clip verdict (two doubles in device memory: the coefficient "
           "and the norm, written by work queued on `stream`); jobs submitted with scale= wait for it.")
      .def("wait_scale", [](OffloadPipeline& o, const ClipScale& scale) {
             py::gil_scoped_release release;
             o.wait(scale);
           }, py::arg("scale"), "Waits until the verdict has landed.")
      .def("abandon_speculation", [](OffloadPipeline& o) {
             py::gil_scoped_release release;
             return o.abandon_speculation();
           }, "Drops what is left of every queued speculative update; returns how many it cut short.")
      .def("wait", [](OffloadPipeline& o, const std::vector<std::shared_ptr<HostParam>>& params) {
             const std::vector<HostParam*> raw = raw_pointers(params);
             py::gil_scoped_release release;
             o.wait(raw);
           }, py::arg("params"), "Waits (on the host) for the parameters' queued jobs.")
      .def("gate", [](OffloadPipeline& o, const std::vector<std::shared_ptr<HostParam>>& params, std::uintptr_t stream) {
             const std::vector<HostParam*> raw = raw_pointers(params);
             py::gil_scoped_release release;
             o.gate(raw, stream);
           }, py::arg("params"), py::arg("stream") = 0)
      .def("order_after_norms", [](OffloadPipeline& o, std::uintptr_t stream) {
             py::gil_scoped_release release;
             o.order_after_norms(stream);
           }, py::arg("stream"),
           "Orders `stream` (on the device) after every norm land_gradient measured (device_norm=).")
      .def("settled", [](OffloadPipeline& o, const std::vector<std::shared_ptr<HostParam>>& params) {
             const std::vector<HostParam*> raw = raw_pointers(params);
             py::gil_scoped_release release;
             return o.settled(raw);
           }, py::arg("params"),
           "Whether the parameters have no queued jobs and their last uploads have finished: no "
           "stream need wait for them until another update is queued. Does not wait.")
      .def("synchronize", [](OffloadPipeline& o) {
             py::gil_scoped_release release;
             o.synchronize();
           });

  m.def("host_pipeline", [](std::size_t threads, const std::optional<std::string>& isa,
                            std::size_t max_download_bytes, bool device_accumulate, int niceness) {
    return std::make_unique<OffloadPipeline>(std::make_unique<HostTransfer>(), threads, parse_optional_isa(isa),
                                             max_download_bytes, device_accumulate, niceness);
  }, py::arg("threads") = 0, py::arg("isa") = py::none(), py::arg("max_download_bytes") = std::size_t(512) << 20,
     py::kw_only(), py::arg("device_accumulate") = true, py::arg("niceness") = 0,
     "An offload pipeline whose 'device' is host memory (CPU mode); device_accumulate adds micro-batch "
     "gradients on the calling thread, as the CUDA build does on the GPU. Its engine threads run "
     "`niceness` nicer than the calling thread.");
  m.def("host_memory_available", &host_memory_available, "MemAvailable in bytes (0 if unknown).");
}

}  // namespace trainstream::bindings
