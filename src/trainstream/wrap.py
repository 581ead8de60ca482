"""trainstream.wrap(): the one line between a model that runs out of memory and one that trains."""

from __future__ import annotations

import gc
import logging
import os
import re
import time
from dataclasses import replace

import torch

from trainstream import eight_bit
from trainstream._native import _C, require_cuda_build
from trainstream.activations import ActivationPager
from trainstream.activations.plan import find_blocks
from trainstream.distributed import (DataParallel, Sharded, check_ddp, check_fsdp2, data_parallel_of, fsdp2_root,
                                     local_shard, partition)
from trainstream.errors import (HostMemoryError, UnsupportedSetupError, VramBudgetError, check_compile_mode,
                                check_not_distributed, check_optimizer, check_weight_dtype)
from trainstream.first_plan import model_bytes, param_bytes, resident_costs, start_residents
from trainstream.host_adamw import DTYPE_NAMES
from trainstream.host_budget import HostBudget, read_host_budget
from trainstream.optimizer import OffloadedAdamW, held_by_live_optimizers, resident_at_start, weakly, wrapped_by
from trainstream.placement import last_streamable, reserve_for, share_or_floor, weights_on_device
from trainstream.slots import Engine, HeldElsewhere, trainable_in_forward_order
from trainstream.streaming import shared_outside
from trainstream.tuning import Tuning
from trainstream.units import parse_bytes

log = logging.getLogger("trainstream")

_GIB = 1 << 30
# Left out of the default budget for what torch's allocator holds beyond the allocated bytes: a
# share of the usable VRAM with fixed-size segments, whose free pieces may fit nothing; with
# expandable segments a share or a floor, whichever is more, the floor at most a tenth (the 0.95B
# Llama's budget sweep on an H200 reserved at most 0.63 GB above the planner's expected peak, at
# caps from 4.5 to 24 GB)
FRAGMENTATION_MARGIN = 0.05
EXPANDABLE_MARGIN, EXPANDABLE_MARGIN_FLOOR = 0.02, 512 << 20
# Weights above this share of the budget (less the planner's reserve) leave too little room for the
# profiled steps' activations: the last blocks' weights stream from the first step on. (At 0.6 the
# 0.95B Llama at batch 4x1024 under a 6 GB cap ran out of memory in its profiled loss: the LM head's
# fp32 logits alone take 0.5 GB there.)
PROFILE_WEIGHT_SHARE = 0.5


def host_bytes_per_param(dtype: torch.dtype, host_accumulator: bool) -> int:
    """Host bytes one trainable parameter costs, as the native pipeline takes them: fp32 master,
    exp_avg, exp_avg_sq, when micro-batches are summed on the host an fp32 accumulator, and a
    landing buffer in the weight dtype (bf16 weights also go back up from it), except for fp32
    weights with an accumulator, whose gradients land in it."""
    return _C.OffloadPipeline.state_bytes(1, DTYPE_NAMES[dtype], host_accumulator)


def offloaded_state_bytes(p: torch.Tensor, host_accumulator: bool, state_format: str = "fp32") -> int:
    """Host bytes of one offloaded parameter's state, kept as `state_format` says
    (eight_bit.state_format: fp32 moments, or 8-bit codes and block scales over an fp32 master or
    over bf16 weights that are their own)."""
    return _C.OffloadPipeline.state_bytes(p.numel(), DTYPE_NAMES[p.dtype], host_accumulator, state_format)


def wrap(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    max_grad_norm: float | None = None,
    accumulation_steps: int = 1,
    vram_budget: int | str | None = None,
    host_budget: int | str | None = None,
    activations: str | float = "auto",
    blocks: list[torch.nn.Module] | None = None,
    tuning: Tuning | None = None,
    device: str | torch.device | None = None,
) -> tuple[torch.nn.Module, OffloadedAdamW]:
    """Train `model` within a VRAM budget: AdamW state, gradients and activations go where the
    placement planner puts them, and updates match torch.optim.AdamW wherever they run.

    Args:
        model: the model, already on its GPU (or on the CPU, where the same machinery runs with
            plain copies: useful for testing). Weights stay where they are. It may be compiled
            (torch.compile, default mode) before or after wrap(). On several GPUs, the
            DistributedDataParallel model, or the FSDP2 one (fully_shard on the model itself): each
            rank then offloads and updates only its share (trainstream.distributed).
        optimizer: a torch.optim.AdamW (or Adam without weight decay), or torchao's AdamW8bit
            (its update, blockwise 8-bit moments: trainstream.eight_bit), over the model's
            trainable parameters. Its param_groups are shared with the returned optimizer.
        max_grad_norm: clip the global gradient L2 norm to this (as clip_grad_norm_ would).
            Do not call clip_grad_norm_ yourself: gradients may no longer be on the device.
        accumulation_steps: backward passes per optimizer step; the update runs after the last
            one (or at an earlier step()).
        vram_budget: the peak VRAM a step may use, in bytes or as a string like "20GB". None: what
            this process can use on its device at wrap() time (free memory plus what it already
            holds, within torch.cuda.set_per_process_memory_fraction), less 5% for fragmentation.
        host_budget: the host memory TrainStream may take, in bytes or as a string like "64GB".
            None: what this process may use at wrap() time (MemAvailable, or the room under its
            cgroup's memory limit where that is less), less a margin of 10% (at least 4 GiB). The
            offloaded state must fit it, or wrap() refuses before pinning anything; speculation's
            second state sets and paged activations' slots take what is left.
        activations: "auto" (default): the planner keeps, pages or recomputes each block's saved
            activations; "off": no saved-tensor hooks at all; a float in [0, 1]: page that share
            of the blocks. Paging and recomputing are bit-exact.
        blocks: the modules whose activations are paged or recomputed block by block (default:
            the largest ModuleList of same-class modules, i.e. the transformer layers).
        tuning: how TrainStream runs (placement, host threads, ...): trainstream.Tuning, whose
            defaults suit most runs.
        device: the GPU to train on, for a model still in host memory (one whose weights may
            not fit the GPU): wrap() moves it there, except the blocks whose weights the budget
            says to stream, which go straight to pinned host memory. None: where the model is.

    Returns:
        (model, optimizer): the same model with hooks attached, and the optimizer to step.
    """
    started = time.perf_counter()
    target_device = device
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(optimizer, OffloadedAdamW):
        raise UnsupportedSetupError(
            "this optimizer is the one trainstream.wrap() returned: the model is already wrapped. To wrap "
            "it again, call optimizer.remove_hooks() first and wrap a torch.optim.AdamW over its parameters")
    check_optimizer(optimizer)
    compact = eight_bit.is_adamw8bit(optimizer)
    if max_grad_norm is not None and not (max_grad_norm > 0):
        raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")
    if int(accumulation_steps) != accumulation_steps or accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be an integer >= 1, got {accumulation_steps}")
    tuning = Tuning() if tuning is None else tuning
    if not isinstance(tuning, Tuning):
        raise TypeError(f"tuning must be a trainstream.Tuning, got {type(tuning).__name__}")

    trainable = [p for p, _ in trainable_in_forward_order(model, optimizer.param_groups)]
    if not trainable:
        raise ValueError("the optimizer has no trainable parameters (requires_grad=True)")
    check_not_distributed(model, trainable)
    ddp = data_parallel_of(model)
    sharded = _is_sharded(model)
    if compact and (ddp is not None or sharded):
        raise UnsupportedSetupError("torchao's AdamW8bit under DDP or FSDP2 is not supported by TrainStream yet: "
                                    "wrap a torch.optim.AdamW there, or train on one GPU")
    if ddp is not None:  # each rank places and updates the share it owns (trainstream.distributed)
        check_ddp(ddp, tuning)
    elif sharded:  # each rank offloads the shards it holds
        check_fsdp2(model, trainable, tuning, activations, vram_budget)
        tuning, activations = replace(tuning, placement="offload", light_recompute=False), "off"
    check_compile_mode(model)
    if any(wrapped_by(p) is not None for p in list(model.parameters()) + trainable):
        raise UnsupportedSetupError(
            "this model (or some of its parameters) is already wrapped by trainstream: a second wrap would "
            "hook every gradient twice. Call remove_hooks() on the optimizer the first wrap() returned, then "
            "wrap again")
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
    on_host = False  # the model waits in host memory for wrap() to place it on `target`
    if target_device is not None:
        target = torch.device(target_device)
        if device.type == "cpu" and target.type == "cuda":
            if ddp is not None or sharded:
                raise UnsupportedSetupError("under DDP or FSDP2 the model must be on its GPU before wrap()")
            on_host, device = True, target
        elif target.type != device.type or target.index not in (None, device.index):
            raise ValueError(f"device={target} but the model is on {device}: pass device= only for a model "
                             f"in host memory that wrap() should move to a GPU")
    for p in trainable:
        check_weight_dtype(names.get(p, "<not in model>"), p)
        if not p.is_contiguous():
            raise UnsupportedSetupError(f"parameter '{names.get(p)}' is not contiguous; call .contiguous() on it before wrapping")
    if tuning.accumulate_in_vram and any(p.dtype != torch.float32 for p in trainable):
        raise UnsupportedSetupError(
            "accumulate_in_vram needs fp32 weights: autograd would sum bf16 gradients in bf16, "
            "rounding every micro-batch. Leave it off to sum them in fp32 on the host.")
    if device.type not in ("cuda", "cpu"):
        raise UnsupportedSetupError(f"parameters on {device} are not supported (CUDA or CPU only)")
    host_accumulator = accumulation_steps > 1 and tuning.accumulate_in_vram is not True and ddp is None
    elsewhere = left_behind(model, device)  # (before either budget is read)
    host = read_host_budget(host_budget)
    if sharded:
        _check_host_memory([local_shard(p) for p in trainable], host_accumulator, host)
    elif ddp is not None:
        owners = partition([p.numel() for p in trainable], torch.distributed.get_world_size(ddp.process_group))
        rank = torch.distributed.get_rank(ddp.process_group)
        _check_host_memory([p for p, owner in zip(trainable, owners) if owner == rank], host_accumulator, host)
    auto = tuning.placement == "auto"
    budget = None if vram_budget is None else parse_bytes(vram_budget)
    if device.type == "cuda":
        require_cuda_build()
        index = device.index if device.index is not None else torch.cuda.current_device()
        device = torch.device("cuda", index)
        if auto:
            expandable = expandable_segments()
            if budget is None:
                budget = default_vram_budget(device, expandable)
    # under "auto" the budget is the planner's, which decides the activations too
    paging, share, pager_budget = _activation_policy(activations, None if auto else budget, device,
                                                     planned=auto and budget is not None)

    if device.type == "cuda":
        # Highest priority for the download stream: with accumulation its gradient-adding kernel
        # must get SMs while backward keeps the GPU busy.
        streams = (torch.cuda.Stream(device, priority=-100), torch.cuda.Stream(device))
        pipeline = _C.cuda_pipeline(device.index, streams[0].cuda_stream, streams[1].cuda_stream, tuning.threads,
                                    tuning.isa, tuning.max_grad_bytes_in_flight, niceness=tuning.engine_niceness,
                                    device_accumulate=tuning.add_on_host is not True,
                                    register_pinned=tuning.register_pinned)
    else:
        streams = None
        pipeline = _C.host_pipeline(tuning.threads, tuning.isa, tuning.max_grad_bytes_in_flight,
                                    niceness=tuning.engine_niceness, device_accumulate=tuning.add_on_host is not True)

    pager = None
    if paging:
        pager = ActivationPager(model, device=device, share=share, vram_budget=pager_budget, blocks=blocks,
                                prefetch_depth=tuning.prefetch_depth, recompute=tuning.recompute, deferred=auto)
        pager.light_census = tuning.light_recompute  # (the planner's move: placement "auto")
    stream_from = pager.blocks if pager is not None else blocks
    if auto and budget is not None and tuning.streamed_blocks is None:
        streamed = _streamed_to_fit(model, (stream_from or []) if ddp is None else [], budget, tuning.prefetch_depth)
    else:
        streamed = _streamed_blocks(model, tuning.streamed_blocks, stream_from, ddp is not None or sharded)
    residents = resident_at_start(tuning.placement, len(trainable))
    if auto and budget is not None and ddp is None and not sharded:  # the first plan's start: first_plan.py
        residents = _start_residents(model, trainable, streamed, budget, int(accumulation_steps), tuning.prefetch_depth,
                                     optimizer)
    if ddp is None and not sharded:  # (before the optimizer pins any of it)
        _check_host_memory(trainable[residents:], host_accumulator, host, streamed, optimizer)
    if on_host:
        _place(model, device, streamed)
    data_parallel = DataParallel(ddp, owners) if ddp is not None else None
    wrapped = OffloadedAdamW(
        optimizer, model, Engine(pipeline, device, streams, host, elsewhere), tuning=tuning, max_grad_norm=max_grad_norm,
        accumulation_steps=int(accumulation_steps), vram_budget=budget if auto else None, activation_pager=pager,
        data_parallel=data_parallel, sharded=Sharded(trainable) if sharded else None, streamed=streamed,
        residents=residents,
    )
    if pager is not None:
        pager.settle = weakly(wrapped.synchronize)  # (no cycle: see optimizer.weakly)
    for p in trainable:
        p.grad = None
    log.info("trainstream: wrap() done in %.1f s", time.perf_counter() - started)
    return model, wrapped


def left_behind(model: torch.nn.Module, device: torch.device) -> HeldElsewhere:
    """What earlier work in this process still holds, once it had the chance to give memory
    back: models and optimizers dropped in reference cycles are collected (a TrainStream
    optimizer's pinned memory goes with it), and on CUDA the caching allocator's free segments
    are released (the plan's new ones are then expandable). Returns the VRAM that tensors other
    than the model's hold on `device` (inside the VRAM budget, as the profile sees it) and the
    host memory other live TrainStream optimizers hold (outside the host budget), for describe()
    and report()."""
    gc.collect()
    vram = 0
    if device.type == "cuda" and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        tensors = [*model.parameters(), *model.buffers()]
        tensors += [p.grad for p in model.parameters() if p.grad is not None]
        storages = dict(filter(None, (_storage(t) for t in tensors if t.device == device)))
        vram = max(0, torch.cuda.memory_allocated(device) - sum(storages.values()))
    optimizers, host = held_by_live_optimizers()
    return HeldElsewhere(vram_bytes=vram, host_bytes=host, host_optimizers=optimizers)


def _storage(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(address, bytes) of the memory under `tensor`; None where it has none of its own (an FSDP2
    parameter between its all-gathers: its storage is freed)."""
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except RuntimeError:
        return None


def _place(model: torch.nn.Module, device: torch.device, streamed: list[torch.nn.Module]) -> None:
    """Moves a model in host memory to `device`, except the parameters of the blocks that stream
    (the optimizer takes those into pinned memory). One tensor at a time: no second copy of the
    model is ever whole."""
    away = {id(p) for block in streamed for p in block.parameters()}
    with torch.no_grad():
        for module in model.modules():
            for p in module._parameters.values():
                if p is not None and id(p) not in away and p.device != device:
                    p.data = p.data.to(device)
            for name, b in module._buffers.items():
                if b is not None and b.device != device:
                    module._buffers[name] = b.to(device)


def _streamed_blocks(model: torch.nn.Module, count: int | None, blocks: list[torch.nn.Module] | None,
                     distributed: bool) -> list[torch.nn.Module]:
    """The blocks whose weights stream from wrap() on: the last `count` of the model's blocks."""
    if not count:
        return []
    if distributed:
        raise UnsupportedSetupError("weight streaming (Tuning(streamed_blocks=...)) is not supported under DDP or FSDP2")
    if blocks is None:
        _, blocks = find_blocks(model)
    if count > len(blocks):
        raise ValueError(f"Tuning(streamed_blocks={count}): the model has {len(blocks)} blocks to stream")
    chosen = list(range(len(blocks) - count, len(blocks)))
    tied = sorted(shared_outside(blocks, model) & set(chosen))
    if tied:
        raise UnsupportedSetupError(
            f"block(s) {tied} hold weights that modules outside the block also use (tied weights): they cannot "
            f"leave the GPU with their block. Stream fewer blocks (Tuning(streamed_blocks=...)) or untie them")
    return [blocks[k] for k in chosen]


def _is_sharded(model: torch.nn.Module) -> bool:
    """Whether FSDP2 shards this model (fully_shard on it or on some of its modules)."""
    return any(fsdp2_root(m) is not None for m in model.modules())


def expandable_segments() -> bool:
    """Turn on expandable segments in torch's caching allocator, unless the user's allocator
    settings name them: near its budget a plan otherwise fails on fragmentation rather than on
    bytes (a 500 MiB logits buffer that no free block fits, with 600 MiB free in pieces). Segments
    allocated before keep their kind. Returns whether new segments are expandable."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        named = re.search(r"expandable_segments:(\w+)", os.environ.get(name, ""))
        if named:
            return named.group(1) == "True"
    # (the accelerator's setting where torch has it: the CUDA one warns there that it is deprecated)
    setting = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or \
        getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setting is None:  # (a torch without the runtime setting)
        return False
    setting("expandable_segments:True")
    return True


def default_vram_budget(device: torch.device, expandable: bool) -> int:
    """What this process can use on `device` now, less the fragmentation margin: the free memory
    plus what torch's allocator already holds, within the per-process memory fraction."""
    free, total = torch.cuda.mem_get_info(device)
    usable = free + torch.cuda.memory_reserved(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _: 1.0)(device)
    usable = min(usable, int(fraction * total))
    return usable - fragmentation_margin(usable, expandable)


def fragmentation_margin(usable: int, expandable: bool) -> int:
    """What the default budget leaves out of `usable` bytes for the allocator's free pieces."""
    if expandable:  # (the floor is at most a tenth: a small process has small pieces)
        return share_or_floor(usable, EXPANDABLE_MARGIN, EXPANDABLE_MARGIN_FLOOR)
    return int(FRAGMENTATION_MARGIN * usable)


def _streamed_to_fit(model: torch.nn.Module, blocks: list[torch.nn.Module], budget: int,
                     depth: int) -> list[torch.nn.Module]:
    """The blocks whose weights stream from the first step on: none when the weights leave the
    activations room (PROFILE_WEIGHT_SHARE of the budget), else the fewest of the last blocks that
    do (the planner may stream more after profiling, never fewer)."""
    weights = model_bytes(model)
    reserve = reserve_for(budget)
    room = PROFILE_WEIGHT_SHARE * (budget - reserve)
    if weights <= room:
        return []
    tied = shared_outside(blocks, model)
    n = len(blocks)
    can = last_streamable([k not in tied for k in range(n)])
    sizes = [param_bytes(b) for b in blocks]
    on_device = weights
    for k in range(1, can + 1):
        on_device = weights_on_device(weights, sizes, k, depth)
        if on_device <= room:
            return blocks[n - k:]
    if on_device + reserve > budget:
        raise VramBudgetError(
            f"the model's weights take {weights / 1e9:.2f} GB; with every block that can stream streamed from "
            f"host memory, {on_device / 1e9:.2f} GB of them stay on the GPU, and with the planner's reserve of "
            f"{reserve / 1e9:.2f} GB that exceeds the budget of {budget / 1e9:.2f} GB before any activation or "
            f"workspace. Raise the budget, use bf16 weights or a smaller model.")
    return blocks[n - can:]


def _start_residents(model: torch.nn.Module, params: list[torch.nn.Parameter], streamed: list[torch.nn.Module],
                     budget: int, accumulation_steps: int, depth: int, optimizer: torch.optim.Optimizer) -> int:
    """How many of the first trainable parameters keep their state in VRAM from wrap() on, taking
    no host memory (the first plan may offload some at the first forward): those before any
    streamed block's whose state fits a share of the budget beside the weights."""
    away = {id(p) for block in streamed for p in block.parameters()}
    before = next((i for i, p in enumerate(params) if id(p) in away), len(params))
    sizes = [param_bytes(block) for block in streamed]
    weights = model_bytes(model)
    weights = weights_on_device(weights, sizes, len(sizes), depth)
    costs = resident_costs([p.numel() for p in params[:before]], [p.element_size() for p in params[:before]],
                           accumulation_steps, [eight_bit.state_format(optimizer, p) for p in params[:before]])
    return start_residents(costs, weights, budget)


def streamed_host_bytes(modules: list[torch.nn.Module], optimizer: torch.optim.Optimizer | None = None) -> int:
    """Host bytes that streaming `modules` adds to their parameters' offloaded state: a bf16 copy
    of trainable bf16 weights (fp32 ones stream from their master, stochastically rounded bf16
    ones from their state), frozen weights whole."""
    params = {id(p): p for m in modules for p in m.parameters()}.values()
    copied = lambda p: p.dtype == torch.bfloat16 and eight_bit.state_format(optimizer, p) != "8bit-sr"
    return sum(p.numel() * (2 if copied(p) else 0) if p.requires_grad
               else p.numel() * p.element_size() for p in params)


def _check_host_memory(params: list[torch.Tensor], host_accumulator: bool, budget: HostBudget,
                       streamed: list[torch.nn.Module] = (), optimizer: torch.optim.Optimizer | None = None) -> None:
    """Refuses, before anything is pinned, offloaded state that the host budget cannot hold."""
    formats = [eight_bit.state_format(optimizer, p) for p in params]
    needed = sum(offloaded_state_bytes(p, host_accumulator, f) for p, f in zip(params, formats))
    state = ("bf16 weights rounded stochastically (no master) and 8-bit AdamW moments, fp32 master weights and "
             "moments for the rest" if "8bit-sr" in formats else
             "fp32 master weights, two AdamW moments (8-bit where torchao quantizes them)" if "8bit" in formats else
             "fp32 master weights, two AdamW moments")
    weights = streamed_host_bytes(list(streamed), optimizer)
    if budget.limit is not None and needed + weights > budget.limit:
        count = max(sum(p.numel() for p in params), 1)
        origin = (f"what this process may use now ({budget.source}) less a margin of {budget.margin / _GIB:.1f} GiB"
                  if budget.margin else budget.source)
        raise HostMemoryError(
            f"TrainStream needs {(needed + weights) / _GIB:.1f} GiB of host RAM: {needed / _GIB:.1f} GiB for "
            f"{count / 1e9:.2f}B offloaded parameters ({needed / count:.1f} bytes each: {state}, "
            + ("an fp32 accumulator, a landing buffer for bf16 weights' gradients" if host_accumulator
               else "a landing buffer for the gradient") + ")"
            + (f" and {weights / _GIB:.1f} GiB more for the weights of {len(streamed)} streamed blocks (bf16 "
               f"copies of bf16 weights, frozen weights whole)" if weights else "")
            + f", but the host budget is {budget.limit / _GIB:.1f} GiB ({origin}). Nothing was pinned. Raise "
            f"host_budget if the host has the memory, free host memory, keep more parameters on the GPU "
            f"(Tuning(placement=...)), freeze some, or use a machine with more RAM.")


def _activation_policy(activations, budget, device: torch.device,
                       planned: bool = False) -> tuple[bool, float | None, int | None]:
    """(page?, share, budget) for the pager from wrap()'s arguments; share None means "auto". With
    `planned`, a budget's planner decides the activations, on the CPU too (CPU mode's tests)."""
    if isinstance(activations, str) and activations in ("auto", "off"):
        share = None
    elif isinstance(activations, (int, float)) and not isinstance(activations, bool) and 0 <= activations <= 1:
        share = float(activations)
    else:
        raise ValueError(f"activations must be 'auto', 'off' or a share in [0, 1], got {activations!r}")
    if activations == "off":
        if budget is not None:
            raise ValueError("vram_budget needs activation paging: drop activations='off', or use Tuning(placement='auto')")
        return False, None, None
    if device.type != "cuda":
        if budget is not None:
            raise UnsupportedSetupError("vram_budget applies to CUDA models only (or to Tuning(placement='auto'))")
        # nothing to save on the CPU; an explicit share or a planned budget still runs the
        # machinery (tests)
        return share is not None or planned, share, None
    return True, share, budget
