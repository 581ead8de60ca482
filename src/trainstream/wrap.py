"""trainstream.wrap(): the one line between a model that runs out of memory and one that trains."""

from __future__ import annotations

import torch

from trainstream._native import _C, require_cuda_build
from trainstream.activations import ActivationPager, parse_bytes
from trainstream.errors import UnsupportedSetupError, check_optimizer, check_weight_dtype
from trainstream.optimizer import OffloadedAdamW

_GIB = 1 << 30


def host_bytes_per_param(dtype: torch.dtype, host_accumulator: bool) -> int:
    """Host bytes one trainable parameter costs: fp32 master, exp_avg, exp_avg_sq, a landing
    buffer in the weight dtype (bf16 weights also go back up from it) and, when micro-batches
    are summed on the host, an fp32 accumulator."""
    landing = 2 if dtype == torch.bfloat16 else 4
    return 12 + landing + (4 if host_accumulator else 0)


def wrap(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    max_grad_norm: float | None = None,
    accumulation_steps: int = 1,
    accumulate_in_vram: bool = False,
    track_grad_norm: bool = False,
    threads: int = 0,
    isa: str | None = None,
    max_grad_bytes_in_flight: int = 512 << 20,
    activations: str | float = "auto",
    vram_budget: int | str | None = None,
    blocks: list[torch.nn.Module] | None = None,
    prefetch_depth: int = 1,
    recompute: bool = True,
) -> tuple[torch.nn.Module, OffloadedAdamW]:
    """Move gradients, AdamW state and the AdamW update of `model` to host memory and threads.

    Args:
        model: the model, already on its GPU (or on the CPU, where the same machinery runs with
            plain copies: useful for testing). Weights stay where they are.
        optimizer: a torch.optim.AdamW (or Adam without weight decay) over the model's
            trainable parameters. Its param_groups are shared with the returned optimizer.
        max_grad_norm: clip the global gradient L2 norm to this (as clip_grad_norm_ would).
            Do not call clip_grad_norm_ yourself: gradients are no longer on the device.
        accumulation_steps: backward passes per optimizer step; micro-batch gradients are summed
            in fp32 host memory, and the update runs after the last one (or at an earlier step()).
        accumulate_in_vram: with accumulation_steps > 1, let autograd sum the micro-batch
            gradients in VRAM, as plain PyTorch does, and send each sum to the host from the
            window's last backward. Costs VRAM for one gradient per weight (4 bytes a parameter)
            and saves PCIe traffic: each gradient crosses once per step instead of once per
            micro-batch. The sums are the same fp32 adds in the same order. fp32 weights only.
        track_grad_norm: measure the global gradient norm even without clipping
            (``optimizer.last_grad_norm``).
        threads: host threads for AdamW (0: every CPU this process may use).
        isa: force "avx512", "avx2" or "scalar" (default: $TRAINSTREAM_ISA, else the best).
        max_grad_bytes_in_flight: gradient bytes that may wait in device memory for their copy to
            the host; backward pauses at a hook beyond that, which caps the VRAM gradients take.
        activations: activation paging. "auto" (default on CUDA): after two profiling steps
            (every block but the last paged, the second one timed), page the saved activations of
            as many leading blocks as can be copied behind the forward compute; a float in [0, 1]:
            page that share of the blocks; "off": no paging (and no saved-tensor hooks at all).
            With paging on, autocast's bf16 copies of the weights are recomputed in backward
            instead of kept. Paging is bit-exact.
        vram_budget: peak VRAM to stay under, in bytes or as a string like "24GB": page the
            blocks whose copies hide behind compute, then recompute (checkpoint) as many of the
            others as that needs; if recomputing is not enough, page more, even if their copies
            cannot all hide.
        blocks: the modules to page block by block (default: the largest ModuleList of
            same-class modules, i.e. the transformer layers).
        prefetch_depth: blocks prefetched ahead of the one running backward.
        recompute: let a vram_budget recompute blocks in backward rather than page them beyond
            what hides. False pages only (for blocks whose forward must not run twice).

    Returns:
        (model, optimizer): the same model with hooks attached, and the optimizer to step.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_optimizer(optimizer)
    if isinstance(optimizer, OffloadedAdamW):
        raise UnsupportedSetupError("this optimizer is already wrapped by trainstream")
    if max_grad_norm is not None and not (max_grad_norm > 0):
        raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")
    if int(accumulation_steps) != accumulation_steps or accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be an integer >= 1, got {accumulation_steps}")

    trainable = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if not trainable:
        raise ValueError("the optimizer has no trainable parameters (requires_grad=True)")
    names = {p: n for n, p in model.named_parameters()}
    in_optimizer = set(trainable)
    missing = [n for p, n in names.items() if p.requires_grad and p not in in_optimizer]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise UnsupportedSetupError(
            f"{len(missing)} trainable parameter(s) of the model are not in the optimizer "
            f"({shown}); TrainStream offloads only what the optimizer trains. Pass all "
            f"trainable parameters to the optimizer or set requires_grad=False on the rest."
        )
    devices = {p.device for p in trainable}
    if len(devices) != 1:
        raise UnsupportedSetupError(f"all trainable parameters must be on one device, found {sorted(map(str, devices))}")
    device = devices.pop()
    for p in trainable:
        check_weight_dtype(names.get(p, "<not in model>"), p)
        if not p.is_contiguous():
            raise UnsupportedSetupError(f"parameter '{names.get(p)}' is not contiguous; call .contiguous() on it before wrapping")
    if accumulate_in_vram and any(p.dtype != torch.float32 for p in trainable):
        raise UnsupportedSetupError(
            "accumulate_in_vram needs fp32 weights: autograd would sum bf16 gradients in bf16, "
            "rounding every micro-batch. Leave it off to sum them in fp32 on the host.")
    host_accumulator = accumulation_steps > 1 and not accumulate_in_vram
    _check_host_memory(trainable, host_accumulator)
    paging, share, budget = _activation_policy(activations, vram_budget, device)
    if not isinstance(recompute, bool):
        raise TypeError(f"recompute must be True or False, got {recompute!r}")

    if device.type == "cuda":
        require_cuda_build()
        index = device.index if device.index is not None else torch.cuda.current_device()
        device = torch.device("cuda", index)
        # Highest priority for the download stream: with accumulation its gradient-adding kernel
        # must get SMs while backward keeps the GPU busy.
        streams = (torch.cuda.Stream(device, priority=-100), torch.cuda.Stream(device))
        pipeline = _C.cuda_pipeline(index, streams[0].cuda_stream, streams[1].cuda_stream, threads, isa,
                                    max_grad_bytes_in_flight)
    elif device.type == "cpu":
        streams = None
        pipeline = _C.host_pipeline(threads, isa, max_grad_bytes_in_flight)
    else:
        raise UnsupportedSetupError(f"parameters on {device} are not supported (CUDA or CPU only)")

    pager = None
    if paging:
        pager = ActivationPager(model, device=device, share=share, vram_budget=budget, blocks=blocks,
                                prefetch_depth=prefetch_depth, recompute=recompute)
    wrapped = OffloadedAdamW(
        optimizer, model, pipeline, device=device, max_grad_norm=max_grad_norm,
        accumulation_steps=int(accumulation_steps), track_grad_norm=track_grad_norm, streams=streams,
        activation_pager=pager, accumulate_in_vram=accumulate_in_vram,
    )
    if pager is not None:
        pager.settle = wrapped.synchronize
    for p in trainable:
        p.grad = None
    return model, wrapped


def _check_host_memory(params: list[torch.Tensor], host_accumulator: bool) -> None:
    needed = sum(p.numel() * host_bytes_per_param(p.dtype, host_accumulator) for p in params)
    available = _C.host_memory_available()
    if available and needed > available:
        count = sum(p.numel() for p in params)
        raise MemoryError(
            f"TrainStream needs {needed / _GIB:.1f} GiB of host RAM for {count / 1e9:.2f}B trainable "
            f"parameters ({needed / count:.0f} bytes each: fp32 master weights, two AdamW moments, "
            f"a gradient buffer{', an fp32 accumulator' if host_accumulator else ''}), but only "
            f"{available / _GIB:.1f} GiB is available. Free host memory, freeze some parameters, "
            f"or use a machine with more RAM."
        )


def _activation_policy(activations, vram_budget, device: torch.device) -> tuple[bool, float | None, int | None]:
    """(page?, share, budget) for the pager from wrap()'s arguments; share None means "auto"."""
    budget = None if vram_budget is None else parse_bytes(vram_budget)
    if isinstance(activations, str) and activations in ("auto", "off"):
        share = None
    elif isinstance(activations, (int, float)) and not isinstance(activations, bool) and 0 <= activations <= 1:
        share = float(activations)
    else:
        raise ValueError(f"activations must be 'auto', 'off' or a share in [0, 1], got {activations!r}")
    if activations == "off":
        if budget is not None:
            raise ValueError("vram_budget needs activation paging: drop activations='off'")
        return False, None, None
    if device.type != "cuda":
        if budget is not None:
            raise UnsupportedSetupError("vram_budget applies to CUDA models only")
        # nothing to save on the CPU; an explicit share still runs the machinery (tests)
        return share is not None, share, None
    return True, share, budget
