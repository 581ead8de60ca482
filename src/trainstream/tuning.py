"""trainstream.Tuning: how TrainStream runs, for the runs that need something other than the defaults.

wrap() takes what a user decides about the training itself: clipping, accumulation, the VRAM
budget, the activation policy and the blocks. Everything else is here, documented once, with a
default that suits most runs:

    model, optimizer = trainstream.wrap(model, optimizer, tuning=trainstream.Tuning(threads=12))

The last three fields are also properties of the optimizer of the same names, settable while it
trains.
"""

from __future__ import annotations

from dataclasses import dataclass



@dataclass(frozen=True)
class Tuning:
    # Where gradients and AdamW state live. "auto": profile the first two steps with everything
    # offloaded, then keep in VRAM as many parameters as the budget allows (the first in forward
    # order first); "offload": every parameter offloaded, always; "gpu": every parameter's state
    # in VRAM; a share in [0, 1]: that share of the parameters, the first in forward order, in VRAM.
    placement: str | float = "auto"
    # With accumulation, sum an offloaded parameter's micro-batches in VRAM (True, fp32 weights
    # only) or in host memory (False). None: the planner's choice per parameter under "auto",
    # else host memory.
    accumulate_in_vram: bool | None = None
    # With accumulation on a GPU, how micro-batches are added into the host sums: False, by a kernel
    # that reads and writes each sum over PCIe; True, copied down and added by the engine's threads.
    # None: on the threads where the plan streams bf16 weights (the read-back then competes with
    # them for the link), else by the kernel.
    add_on_host: bool | None = None
    # Measure the global gradient norm without clipping (optimizer.last_grad_norm).
    track_grad_norm: bool = False
    # Host threads for AdamW: 0 is every CPU this process may use.
    threads: int = 0
    # How much nicer (Linux nice values, 0 to 19) the host engine's threads run than the thread
    # that calls wrap(): when they keep every core busy, the thread that launches the GPU's work
    # and runs the gradient hooks still gets one as soon as it wakes. 0 runs them alike.
    engine_niceness: int = 5
    # Force the host kernel: "avx512", "avx2" or "scalar" (default: $TRAINSTREAM_ISA, else the best).
    isa: str | None = None
    # Gradient bytes that may wait in VRAM for their copy to the host; a gradient hook beyond that
    # waits, which caps the VRAM gradients take.
    max_grad_bytes_in_flight: int = 512 << 20
    # Blocks whose paged activations are fetched ahead of the one running backward.
    prefetch_depth: int = 1
    # Let activation plans recompute blocks in backward rather than page beyond what hides. False
    # pages only, for blocks whose forward must not run twice.
    recompute: bool = True
    # Let the placement planner also recompute blocks lightly: torch's selective checkpointing,
    # which keeps what the matmuls and attention computed and reruns only the cheap ops.
    light_recompute: bool = False
    # With clipping, start offloaded updates before the global norm is known and redo them when it
    # clips (the same bits as waiting); False waits for the norm and takes no host memory for it.
    speculative_clipping: bool = True
    # Send fp32 gradients that are bf16 values (weight gradients under bf16 autocast) as bf16.
    pack_gradients: bool = True
    # fp32 weights: upload AdamW's update term for the GPU to apply, rather than a host master.
    upload_update_terms: bool = True
    # Blocks whose weights live in host memory and come to the GPU only around their use (the last
    # ones in forward order). None: as many as the VRAM budget needs, none when the weights fit
    # (under placement "auto"; none otherwise); an integer: that many, from wrap() on.
    streamed_blocks: int | None = None
    # CUDA: pin host memory by allocating it, faulting it in from every CPU and registering it with
    # cudaHostRegister, rather than by cudaHostAlloc, which faults and pins each page on one
    # thread: wrap() of the Llama-3-8B shape (67.7 GB pinned) took 14.5 s this way and 31.8 s by
    # cudaHostAlloc on an H100's 16-core host.
    register_pinned: bool = True

    def __post_init__(self) -> None:
        placement = self.placement
        if isinstance(placement, (int, float)) and not isinstance(placement, bool) and 0 <= placement <= 1:
            object.__setattr__(self, "placement", float(placement))
        elif not (isinstance(placement, str) and placement in ("auto", "offload", "gpu")):
            raise ValueError(f"placement must be 'auto', 'offload', 'gpu' or a share in [0, 1], got {placement!r}")
        for name in ("accumulate_in_vram", "add_on_host"):
            if getattr(self, name) not in (None, True, False):
                raise TypeError(f"{name} must be True, False or None, got {getattr(self, name)!r}")
        if self.streamed_blocks is not None and (isinstance(self.streamed_blocks, bool)
                                                 or not isinstance(self.streamed_blocks, int) or self.streamed_blocks < 0):
            raise ValueError(f"streamed_blocks must be None or an integer >= 0, got {self.streamed_blocks!r}")
        if isinstance(self.engine_niceness, bool) or not isinstance(self.engine_niceness, int) \
                or not 0 <= self.engine_niceness <= 19:
            raise ValueError(f"engine_niceness must be an integer from 0 to 19, got {self.engine_niceness!r}")
        for name in ("threads", "max_grad_bytes_in_flight", "prefetch_depth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "prefetch_depth" else 0):
                raise ValueError(f"{name} must be an integer >= {1 if name == 'prefetch_depth' else 0}, got {value!r}")
        for name in ("track_grad_norm", "recompute", "light_recompute", "speculative_clipping", "pack_gradients",
                     "upload_update_terms", "register_pinned"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.light_recompute and (self.placement != "auto" or not self.recompute):
            raise ValueError("light_recompute=True is a choice offered to the placement planner: it needs "
                             "placement='auto' and recompute=True")
