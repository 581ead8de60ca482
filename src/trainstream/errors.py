"""Checks that turn unsupported set-ups into clear errors before anything trains wrongly."""

from __future__ import annotations

import torch

SUPPORTED_WEIGHT_DTYPES = (torch.float32, torch.bfloat16)


class UnsupportedSetupError(ValueError):
    """The model, optimizer or training loop uses something TrainStream does not support."""


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Accept torch.optim.AdamW, and Adam where its semantics equal AdamW's; refuse the rest."""
    is_adamw = isinstance(optimizer, torch.optim.AdamW)
    is_adam = type(optimizer) is torch.optim.Adam
    if not (is_adamw or is_adam):
        raise UnsupportedSetupError(
            f"trainstream.wrap() supports torch.optim.AdamW (and torch.optim.Adam without weight "
            f"decay), got {type(optimizer).__module__}.{type(optimizer).__name__}. Create the "
            f"optimizer as torch.optim.AdamW(model.parameters(), ...) and wrap that."
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
