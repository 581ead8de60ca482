// How bytes move between the device that computes and the host that updates. The offload
// pipeline is written against this interface: the CUDA build supplies streams and events
// (cuda/), and HostTransfer below runs the same pipeline on a CPU-only machine with plain copies.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "trainstream/adamw.hpp"  // DType
#include "trainstream/host_arena.hpp"

namespace trainstream {

// A parameter's synchronisation objects (CUDA: events for its gradient's production, download and
// upload).
class TransferSlot {
 public:
  virtual ~TransferSlot() = default;
  // Blocks until the copies queued on this slot have run (before its host memory is freed).
  virtual void finish() {}
};

// Where a gradient's squared norm is taken on the device (device memory): the norm into *out, with
// `scratch` as launch_squared_norms takes it in cuda/include/trainstream/cuda/device_adamw.hpp,
// zeroed before its first use. No norm where `out` is null.
struct DeviceNorm {
  double* out = nullptr;
  double* scratch = nullptr;
};

class Transfer {
 public:
  virtual ~Transfer() = default;

  virtual std::unique_ptr<TransferSlot> make_slot() = 0;
  virtual HostArena& arena() = 0;
  // Slabs of the kind arena() holds, for other host buffers that the engine reads and writes.
  virtual std::unique_ptr<SlabSource> slab_source() const { return std::make_unique<PageableSlabs>(); }
  virtual bool is_device() const = 0;  // copies cross PCIe and are asynchronous

  // Queue a device->host copy that starts after the work queued so far on `producer_stream`;
  // `landed` runs (on a runtime thread, so it must not call CUDA) once the bytes are in host memory.
  virtual void download(TransferSlot& slot, void* host, const void* device, std::size_t bytes,
                        std::uintptr_t producer_stream, std::function<void()> landed) = 0;
  // Like download, but instead of copying, fold the device gradient into an fp32 host buffer:
  // host_acc[i] = float(grad[i]) (overwrite) or host_acc[i] + float(grad[i]), one plain fp32 add
  // so the result is bit-identical to accumulate_grad on the host. `host_acc` must come from
  // arena(). CUDA: a kernel on the download stream that reads the gradient in VRAM and the
  // accumulator through its mapped device address, so each element crosses PCIe once each way
  // and the host's memory sees 8 B instead of the 16 B of copy-then-add.
  virtual void accumulate_download(TransferSlot& slot, float* host_acc, const void* device_grad,
                                   DType grad_dtype, std::size_t numel, bool overwrite,
                                   std::uintptr_t producer_stream, std::function<void()> landed) = 0;
  // Like download(), for an fp32 gradient, sending no more than its values need. When every
  // element is a bf16 value widened to fp32 (low 16 bits zero, as weight gradients under bf16
  // autocast are), only the high halves are sent, as bf16, to the start of `host`; otherwise all
  // four bytes of each element. Once landed, *inexact (host memory from arena()) is 0 if halves
  // were sent. The caller keeps other users of `host` and `inexact` away until then. Where `norm`
  // has an output, the gradient is also measured as measure() would (the caller does not call it
  // for this gradient), in the same pass that tests its halves. This default always sends four
  // bytes; backends that can test the gradient where it lies override it.
  virtual void download_bf16_exact(TransferSlot& slot, void* host, const float* device_grad, std::size_t numel,
                                   std::uint32_t* inexact, std::uintptr_t producer_stream, const DeviceNorm& norm,
                                   std::function<void()> landed);
  // Queue, on the download stream after the work queued so far on `producer_stream`, the squared
  // norm of the device gradient as grad_ops.hpp defines it into `norm`: taken where the gradient
  // is copied from, off the stream that produces the next gradients. Before any download of the same
  // gradient, so that the download's landing (and what the host then writes back over the
  // gradient's memory) follows it. Returns the stream that download is then to follow (the one the
  // norm was queued on), so that it need not be ordered after the producer again. Only device
  // backends measure; this default throws.
  virtual std::uintptr_t measure(TransferSlot& slot, const void* device_grad, DType grad_dtype, std::size_t numel,
                                 const DeviceNorm& norm, std::uintptr_t producer_stream);
  // Make `stream` wait (on the device) for every norm queued so far (measure(), download_bf16_exact).
  virtual void order_after_measures(std::uintptr_t /*stream*/) {}
  // Block the calling thread until the slot's last download (or accumulate_download) has landed.
  virtual void wait_download(TransferSlot& slot) = 0;
  // Queue a host->device copy on the upload stream and mark the slot's upload point. The host
  // buffer must stay untouched until order_after_upload'ed work has run.
  virtual void upload(TransferSlot& slot, void* device, const void* host, std::size_t bytes) = 0;
  // Queue, on the upload stream, the weight update whose term AdamW wrote in term_only mode:
  // device[i] = device[i] * decay + term[i] in fp32, the multiply and the add each rounded once,
  // as the host kernel does, so the weights come out bit-identical to uploading an updated
  // master. Marks the slot's upload point; `term` stays untouched until order_after_upload'ed
  // work has run. This default does it on the calling thread, for backends whose "device" memory
  // is host memory.
  virtual void upload_update(TransferSlot& slot, float* device, const float* term, std::size_t numel, float decay);
  // The same update with a term already in device memory (uploaded earlier with upload()): no copy,
  // only the kernel, on the upload stream; marks the slot's upload point. This default does it on
  // the calling thread.
  virtual void apply_update(TransferSlot& slot, float* device, const float* device_term, std::size_t numel,
                            float decay);
  // Block the calling thread until the slot's last upload has finished (its host buffer may be
  // written again). This default suits backends whose uploads finish before upload() returns.
  virtual void wait_upload(TransferSlot& /*slot*/) {}
  // Device memory that upload_update may stage terms in (CUDA: it copies a term there, then runs
  // the update kernel, a piece at a time when the term is larger). Unused by this default.
  virtual void set_staging(std::uintptr_t /*device*/, std::size_t /*bytes*/) {}
  // Make `stream` wait (on the device, not the host) for the slot's last upload.
  virtual void order_after_upload(TransferSlot& slot, std::uintptr_t stream) = 0;
  // Whether the slot's last upload has finished (without waiting); true if there was none. This
  // default suits backends whose uploads finish before upload() returns.
  virtual bool upload_complete(TransferSlot& slot);
  // Called once on each thread that will issue copies (CUDA: select the device).
  virtual void bind_thread() {}
};

// CPU mode: "device" memory is host memory; copies are synchronous memcpys and accumulation a
// plain loop on the calling thread.
class HostTransfer : public Transfer {
 public:
  HostTransfer();
  std::unique_ptr<TransferSlot> make_slot() override;
  HostArena& arena() override { return arena_; }
  bool is_device() const override { return false; }
  void download(TransferSlot&, void* host, const void* device, std::size_t bytes, std::uintptr_t,
                std::function<void()> landed) override;
  void accumulate_download(TransferSlot&, float* host_acc, const void* device_grad, DType grad_dtype,
                           std::size_t numel, bool overwrite, std::uintptr_t,
                           std::function<void()> landed) override;
  void download_bf16_exact(TransferSlot&, void* host, const float* device_grad, std::size_t numel,
                           std::uint32_t* inexact, std::uintptr_t, const DeviceNorm& norm,
                           std::function<void()> landed) override;
  void wait_download(TransferSlot&) override {}
  void upload(TransferSlot&, void* device, const void* host, std::size_t bytes) override;
  void order_after_upload(TransferSlot&, std::uintptr_t) override {}

 private:
  HostArena arena_;
};

}  // namespace trainstream
