"""TrainStream's exceptions, and the checks that turn unsupported set-ups into clear errors
before anything trains wrongly.

Every exception TrainStream raises as its own derives from TrainStreamError, and each also
derives from the built-in exception it stands for, so ``except ValueError`` or ``except
RuntimeError`` still catches it::

    TrainStreamError
    ├── UnsupportedSetupError (ValueError)  the model, optimizer or loop uses what is not supported
    ├── VramBudgetError (RuntimeError)      no placement fits the VRAM budget
    ├── TrainingLoopError (RuntimeError)    the loop did something TrainStream cannot follow
    ├── HostMemoryError (MemoryError)       host RAM cannot hold what the placement needs there
    └── NativeError (RuntimeError)          the native core failed (host memory, a CUDA call)
        ├── UnsupportedError                this build or this CPU cannot do what was asked
        └── CudaError                       a CUDA runtime call failed: .code, .name, .call, .location

TrainStreamError and the native ones are made by the compiled core (trainstream._C imports without
torch) and raised from C++; they are re-exported here. Bad argument values are plain ValueError
and TypeError, as Python and pybind11 raise them.
"""

from __future__ import annotations

import sys

import torch

from trainstream import eight_bit
from trainstream._native import CudaError, NativeError, TrainStreamError, UnsupportedError

SUPPORTED_WEIGHT_DTYPES = (torch.float32, torch.bfloat16)

__all__ = ["CudaError", "HostMemoryError", "NativeError", "TrainStreamError", "TrainingLoopError",
           "UnsupportedError", "UnsupportedSetupError", "VramBudgetError"]


class UnsupportedSetupError(TrainStreamError, ValueError):
    """The model, optimizer or training loop uses something TrainStream does not support."""


class VramBudgetError(TrainStreamError, RuntimeError):
    """The training step cannot fit the VRAM budget in any placement; the message has the figures."""


class TrainingLoopError(TrainStreamError, RuntimeError):
    """The training loop did something TrainStream cannot follow, such as changing a weight between
    a forward and its backward."""


class HostMemoryError(TrainStreamError, MemoryError):
    """Host RAM cannot hold what the placement keeps there; the message has the figures."""


# Optimizers users reach for that the engine does not run: named in the refusal
LOW_BIT = ("8bit", "4bit", "fp8", "paged")


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Accept torch.optim.AdamW, Adam where its semantics equal AdamW's, and torchao's AdamW8bit
    as the engine implements it (trainstream.eight_bit); refuse the rest, subclasses included
    (their step() may be anything: running another algorithm would train something else without
    a word)."""
    kind = type(optimizer)
    name = f"{kind.__module__}.{kind.__qualname__}"
    if eight_bit.is_adamw8bit(optimizer):
        why = eight_bit.check_adamw8bit(optimizer)
        if why is not None:
            raise UnsupportedSetupError(f"torchao AdamW8bit: {why}. TrainStream runs {eight_bit.SUPPORTED}.")
        return
    is_adamw = kind is torch.optim.AdamW
    is_adam = kind is torch.optim.Adam
    if not (is_adamw or is_adam):
        why = ""
        if any(tag in name.lower() for tag in LOW_BIT) or kind.__module__.startswith(("torchao", "bitsandbytes")):
            why = (" TrainStream's engine implements no other low-bit or paged optimizer (torchao's AdamW4bit, "
                   "AdamWFp8, Adam8bit, _AdamW, CPUOffloadOptimizer, bitsandbytes' optimizers): it would run a "
                   "different algorithm.")
        elif isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam)):
            why = " A subclass of torch's AdamW or Adam may change its step, which TrainStream would not run."
        raise UnsupportedSetupError(
            f"trainstream.wrap() supports {eight_bit.SUPPORTED}, got {name}.{why} Create one of those over "
            f"model.parameters() and wrap that."
        )
    for i, group in enumerate(optimizer.param_groups):
        if group.get("amsgrad", False):
            raise UnsupportedSetupError(
                f"param group {i}: amsgrad=True is not supported by TrainStream's host AdamW; "
                f"use amsgrad=False"
            )
        if group.get("differentiable", False):
            raise UnsupportedSetupError(f"param group {i}: differentiable=True is not supported")
        decoupled = is_adamw or group.get("decoupled_weight_decay", False)
        if not decoupled and group.get("weight_decay", 0) != 0:
            raise UnsupportedSetupError(
                f"param group {i}: torch.optim.Adam with weight_decay adds L2 decay to the "
                f"gradient, which TrainStream does not implement. Use torch.optim.AdamW "
                f"(decoupled decay) or weight_decay=0."
            )


def check_not_distributed(model: torch.nn.Module, params: list[torch.Tensor]) -> None:
    """Refuse the torch.distributed engines TrainStream does not compose with yet: each would
    train silently wrong (our hooks would see gradients before the engine reduces them) or crash
    (sharded parameters). DistributedDataParallel and FSDP2, as the model wrap() is given, are
    supported (trainstream.distributed checks the details)."""
    engine = None
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return
    if type(model).__module__.startswith("deepspeed"):
        engine = f"a DeepSpeed engine ({type(model).__name__})"
    else:
        kinds = {_fsdp_kind(module) for module in model.modules()} - {None}
        if "FullyShardedDataParallel (FSDP1)" in kinds:
            engine = "FullyShardedDataParallel (FSDP1); use FSDP2's fully_shard"
        elif kinds:
            return  # FSDP2
    if engine is None and any(_is_dtensor(p) for p in params):
        engine = "DTensor parameters outside FSDP2 (tensor parallelism)"
    if engine is None:
        check_single_process()
        return
    raise UnsupportedSetupError(
        f"trainstream.wrap() does not support {engine} yet: the gradients it would offload are not "
        f"the reduced ones, or the parameters are shards, so training would be wrong. For several GPUs, "
        f"wrap a DistributedDataParallel or FSDP2 model; or train this model with its engine's own optimizer.")


def check_single_process() -> None:
    """Refuse training in a torch.distributed group of several processes: a DDP wrapper added
    after wrap() (as the Hugging Face Trainer adds one on several GPUs) all-reduces gradients our
    hooks have already sent, and each rank would update from its own."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
        if world > 1:
            raise UnsupportedSetupError(
                f"TrainStream trains on one GPU in one process, but this process is one of {world} in a "
                f"torch.distributed group: its hooks would take each rank's gradients before they are "
                f"reduced, and the ranks would drift apart. For several GPUs, wrap the DistributedDataParallel "
                f"model itself: trainstream.wrap(DistributedDataParallel(model), optimizer).")


def _fsdp_kind(module: torch.nn.Module) -> str | None:
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # a torch without distributed support
        return None
    if isinstance(module, FullyShardedDataParallel):
        return "FullyShardedDataParallel (FSDP1)"
    if isinstance(module, FSDPModule):
        return "FSDP2 (fully_shard)"
    return None


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(t, DTensor) or isinstance(getattr(t, "data", None), DTensor)


def check_weight_dtype(name: str, param: torch.Tensor) -> None:
    if param.dtype == torch.float16:
        raise UnsupportedSetupError(
            f"parameter '{name}' is float16. fp16 training needs loss scaling, which TrainStream "
            f"does not support; keep the weights in bf16 or fp32 (with bf16 autocast)."
        )
    if param.dtype not in SUPPORTED_WEIGHT_DTYPES:
        raise UnsupportedSetupError(
            f"parameter '{name}' has dtype {param.dtype}; TrainStream trains float32 and "
            f"bfloat16 weights"
        )


def check_autocast(device_type: str) -> None:
    """fp16 autocast implies fp16 loss scaling: refuse it at the first forward."""
    if device_type != "cuda" or not torch.is_autocast_enabled("cuda"):
        return
    if torch.get_autocast_dtype("cuda") == torch.float16:
        raise UnsupportedSetupError(
            "autocast to float16 is not supported: fp16 training needs loss scaling (GradScaler), "
            "which TrainStream does not implement. Use torch.autocast('cuda', dtype=torch.bfloat16)."
        )


GRAD_SCALER_MESSAGE = (
    "fp16 loss scaling (torch.amp.GradScaler) is not supported by TrainStream: gradients leave the "
    "GPU as they are produced, before a scaler could unscale or skip them. Train in bf16 "
    "(torch.autocast('cuda', dtype=torch.bfloat16), or bf16=True in Hugging Face) without a scaler."
)


def check_compile_mode(model: torch.nn.Module) -> None:
    """torch.compile's CUDA-graph modes ("reduce-overhead", "max-autotune") are refused, for a
    torch.compile wrapper or any module compiled in place (nn.Module.compile()): a replayed graph
    writes its outputs, gradients included, to memory of its own that the next replay reuses, which
    TrainStream's copies and in-VRAM sums cannot be ordered with."""
    compiled = [model] + [getattr(m, "_compiled_call_impl", None) for m in model.modules()]
    if any((getattr(c, "get_compiler_config", lambda: None)() or {}).get("triton.cudagraphs") for c in compiled):
        raise UnsupportedSetupError(
            "torch.compile with CUDA graphs (mode='reduce-overhead' or 'max-autotune') is not supported: "
            "a replayed graph reuses its output memory, including gradients that TrainStream is still "
            "copying to the host or summing in VRAM. Compile in the default mode (torch.compile(model)) "
            "or with mode='max-autotune-no-cudagraphs'.")


def compiled_wrappers(model: torch.nn.Module, depth: int = 40) -> list[torch.nn.Module]:
    """The torch.compile wrappers (OptimizedModule) of `model` among the callers of this call:
    how a hook of `model` sees that it was compiled after wrap()."""
    found, frame = [], sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if getattr(owner, "_orig_mod", None) is model and owner not in found:
            found.append(owner)
        frame = frame.f_back
    return found
