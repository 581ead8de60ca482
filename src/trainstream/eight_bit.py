"""torchao's AdamW8bit under TrainStream: which parameters get blockwise 8-bit moments, and their
state as torchao shows it.

`wrap(model, torchao.optim.AdamW8bit(...))` runs torchao's algorithm wherever a parameter lives:
the host engine's 8-bit kernels for offloaded parameters, cuda/kernels/device_adamw8bit.cu for
resident ones, with the same bits. As in torchao, a parameter of at least MIN_QUANTIZED elements
that is whole blocks of BLOCK_SIZE keeps its moments as uint8 codes and one fp32 scale a block; a
smaller one keeps fp32 moments and is updated as torch.optim.AdamW rounds it (within an ulp or two
a step of torchao's own fp32 arithmetic). bf16 weights keep an fp32 master, as under exact AdamW
(torchao rounds them back to bf16 every step), unless the optimizer was made with
bf16_stochastic_round=True: then a quantized bf16 parameter's weights are its own state, 2 bytes
an element, and each update rounds them stochastically as torchao does, from a counter-based
generator (cpp/include/trainstream/adamw8bit.hpp) that the host and GPU kernels share, seeded
per parameter from torch's seed at wrap() (`rounding_seed`): the same seed, the same bits,
wherever the parameter lives. torchao draws its bits from torch's generator instead, so runs of
the two agree in distribution, not bit for bit.

Inside TrainStream the codes and scales are plain tensors under their own keys (`RAW_KEYS`), so
moving a parameter between host and VRAM copies them like any state; the optimizer's `state`
shows them as torchao's OptimState8bit, which is what `state_dict()` saves and torchao loads.
torchao is imported only here, and only when its optimizer is used.
"""

from __future__ import annotations

import torch

BLOCK_SIZE = 256  # the engine's quantization block (kQuantBlock)
MIN_QUANTIZED = 4096  # torchao (after bitsandbytes) quantizes tensors of at least this many values
RAW_KEYS = ("exp_avg_codes", "exp_avg_scale", "exp_avg_sq_codes", "exp_avg_sq_scale")
SUPPORTED = ("torch.optim.AdamW, torch.optim.Adam (without weight decay) and torchao.optim.AdamW8bit "
             "(block_size=256, bf16_stochastic_round True or False)")


def is_adamw8bit(optimizer: torch.optim.Optimizer) -> bool:
    kind = type(optimizer)
    return kind.__module__ == "torchao.optim.adam" and kind.__qualname__ == "AdamW8bit"


def check_adamw8bit(optimizer: torch.optim.Optimizer) -> str | None:
    """Why TrainStream cannot run this AdamW8bit as torchao would, or None."""
    if getattr(optimizer, "block_size", None) != BLOCK_SIZE:
        return (f"block_size={getattr(optimizer, 'block_size', None)}: the host and GPU kernels quantize blocks "
                f"of {BLOCK_SIZE} (torchao's default)")
    for i, group in enumerate(optimizer.param_groups):
        if group.get("amsgrad", False):
            return f"param group {i}: amsgrad=True is not implemented"
    return None


def quantizes(numel: int) -> bool:
    """Whether a parameter of `numel` elements (this process's part of it) gets 8-bit moments."""
    return numel >= MIN_QUANTIZED and numel % BLOCK_SIZE == 0


def state_format(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> str:
    """How the engine keeps `p`'s state (p: this process's part of the parameter) under
    `optimizer`: 'fp32' (moments, and an fp32 master for bf16 weights), '8bit' (codes and scales
    over that master) or '8bit-sr' (codes and scales; bf16 weights without a master, rounded
    stochastically)."""
    if not is_adamw8bit(optimizer) or not quantizes(p.numel()):
        return "fp32"
    return "8bit-sr" if getattr(optimizer, "bf16_stochastic_round", False) and p.dtype == torch.bfloat16 else "8bit"


def rounding_seed(base: int, index: int) -> int:
    """Parameter `index`'s seed for stochastic rounding (63 bits), from wrap()'s `base`."""
    x = (base * 0x9E3779B97F4A7C15 + index + 1) & (2**64 - 1)
    x = ((x ^ (x >> 31)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    return (x ^ (x >> 29)) >> 1


def moment_bytes(quantized: bool) -> float:
    """Bytes an element of a parameter's two moments: fp32, or codes with a scale a block."""
    return 2 + 8 / BLOCK_SIZE if quantized else 8.0


def maps() -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's signed and unsigned quantization maps (256 fp32 values each, host memory)."""
    from torchao.optim.subclass_8bit import get_qmap_signed, get_qmap_unsigned

    return (torch.tensor(get_qmap_signed(), dtype=torch.float32),
            torch.tensor(get_qmap_unsigned(), dtype=torch.float32))


def zeros(numel: int, device: torch.device) -> dict:
    """Zeroed 8-bit moments of `numel` elements under RAW_KEYS (torchao's zeros)."""
    blocks = numel // BLOCK_SIZE
    return {"exp_avg_codes": torch.zeros(numel, dtype=torch.uint8, device=device),
            "exp_avg_scale": torch.zeros(blocks, dtype=torch.float32, device=device),
            "exp_avg_sq_codes": torch.zeros(numel, dtype=torch.uint8, device=device),
            "exp_avg_sq_scale": torch.zeros(blocks, dtype=torch.float32, device=device)}


class Shown:
    """The optimizer's `state` entries for raw state: torchao's OptimState8bit over our codes and
    scales (views: they show what the engine holds, and writing them writes it). `maps`: maps(),
    or None where no parameter is quantized."""

    def __init__(self, maps: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        self._maps = {}  # device -> (signed, unsigned)
        self._host = maps

    def state(self, raw: dict, like: torch.Tensor) -> dict:
        """`raw` (a slot's host or device state, less any accumulator) as torch's optimizers key
        it, shaped as `like`."""
        raw = {k: v for k, v in raw.items() if k != "accumulator"}
        if "exp_avg_codes" not in raw:
            return raw
        from torchao.optim.subclass_8bit import OptimState8bit

        shown = {k: v for k, v in raw.items() if k not in RAW_KEYS}
        signed, unsigned = self.on(raw["exp_avg_codes"].device)
        for key, qmap, is_signed in (("exp_avg", signed, True), ("exp_avg_sq", unsigned, False)):
            shown[key] = OptimState8bit(raw[f"{key}_codes"].view(like.shape), raw[f"{key}_scale"], qmap, is_signed)
        return shown

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The two maps on `device` (copied there once)."""
        if device.type == "cpu":
            return self._host
        if device not in self._maps:
            self._maps[device] = tuple(m.to(device) for m in self._host)
        return self._maps[device]


def load_moment(ours, saved, name: str, key: str) -> None:
    """Copies a saved moment into ours, both 8-bit (OptimState8bit) or both plain tensors."""
    ours_quantized, saved_quantized = hasattr(ours, "codes"), hasattr(saved, "codes")
    if ours_quantized != saved_quantized:
        have = "8-bit" if ours_quantized else "fp32"
        got = "8-bit (torchao OptimState8bit)" if saved_quantized else "fp32"
        raise ValueError(f"{name}: the state dict's {key} is {got} but this optimizer keeps {have} moments for it; "
                         f"load a checkpoint of the same optimizer (torch.optim.AdamW and torchao's AdamW8bit "
                         f"state dicts do not convert into each other)")
    if not ours_quantized:
        ours.copy_(saved)
        return
    if saved.codes.numel() != ours.codes.numel() or saved.scale.numel() != ours.scale.numel():
        raise ValueError(f"{name}: the state dict's {key} has {saved.codes.numel()} codes in blocks of "
                         f"{saved.codes.numel() // max(saved.scale.numel(), 1)}; this parameter has "
                         f"{ours.codes.numel()} in blocks of {BLOCK_SIZE}")
    if not torch.equal(saved.qmap.cpu(), ours.qmap.cpu()):
        raise ValueError(f"{name}: the state dict's {key} was quantized with another map than torchao's")
    ours.codes.copy_(saved.codes.reshape(ours.codes.shape))
    ours.scale.copy_(saved.scale)
