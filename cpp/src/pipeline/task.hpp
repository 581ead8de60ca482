// A queued job of the offload pipeline, as the job queue orders it and the engine threads run it.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "trainstream/offload_pipeline.hpp"

namespace trainstream {

// What every call that would touch a released parameter's host state says (release_state).
inline constexpr const char* kReleased =
    "OffloadPipeline: this parameter's host state was given back (it is resident); take_state() first";

// A queued job. Once started, its elements are split into chunks that the engine threads take
// one at a time; every stage of a job is elementwise (the norm keeps one partial a norm block),
// so chunks need no barrier between them, and a thread that finds no chunk left in a started
// job moves on to the next job while others finish theirs.
struct OffloadPipeline::Task {
  std::shared_ptr<HostParam> param;
  GradJob job;
  std::uint64_t seq;       // this parameter's job number (1-based)
  std::uint64_t download;  // runs once this many of the parameter's downloads have landed
  bool landing;            // its own download wrote the landing buffer (land_gradient, landing route)
  bool packed;             // ...through download_bf16_exact
  std::uintptr_t held_term = 0;  // the speculated term this job consumes (HostParam::held_term_)
  std::shared_ptr<const ClipScale> verdict;  // a speculative update: the verdict that decides its fate
  // Set by start():
  std::atomic<bool> skip{false};  // a failure before or during the job: drain it unrun
  const void* grad = nullptr;  // what norm and update read
  DType grad_dtype = DType::float32;
  DType landed = DType::float32;  // what the landing buffer holds
  AdamWBuffers buffers;
  AdamWCoeffs coeffs;
  std::optional<AdamW8bitStep> step8;  // an update of blockwise 8-bit moments (buffers then only for uploads)
  std::size_t chunk = 0, chunks = 0;
  std::size_t next_chunk = 0, chunks_done = 0;  // under the mutex
  std::vector<double> partial;  // squared norm of each norm block (grad_ops.hpp)
};

}  // namespace trainstream
