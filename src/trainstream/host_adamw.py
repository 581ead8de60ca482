"""The host AdamW engine, on torch CPU tensors.

`HostAdamW.step` checks its tensors (device, dtype, layout, sizes) and hands their addresses to
the native engine, which runs torch.optim.AdamW's update on a persistent thread pool with the
fastest kernel the CPU supports (AVX-512, AVX2 or scalar; `TRAINSTREAM_ISA` or `isa=` forces one).
"""

from __future__ import annotations

import torch

from trainstream._native import _C

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}  # as the native core names them


def _check_host(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...], numel: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must live in host memory, but it is on {t.device}")
    if t.dtype not in dtypes:
        allowed = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} must be {allowed}, got {str(t.dtype).removeprefix('torch.')}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {t.stride()})")
    if t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements but the parameter has {numel}")


class HostAdamW:
    """torch.optim.AdamW's update over host tensors, in place.

    Args:
        threads: worker threads including the caller; 0 uses every CPU this process may run on.
        isa: "avx512", "avx2", "scalar", or None for $TRAINSTREAM_ISA or else the best the CPU has.
    """

    def __init__(self, threads: int = 0, isa: str | None = None) -> None:
        if threads < 0:
            raise ValueError(f"threads must be >= 0, got {threads}")
        self._engine = _C.HostAdamW(threads, isa)

    @property
    def isa(self) -> str:
        return self._engine.isa

    @property
    def threads(self) -> int:
        return self._engine.threads

    def step(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        step: int,
        grad_scale: float = 1.0,
        maximize: bool = False,
        param_bf16: torch.Tensor | None = None,
    ) -> None:
        """Update `param`, `exp_avg` and `exp_avg_sq` in place, as torch.optim.AdamW would.

        `step` counts this update (1 for the first). `grad` may be fp32 or bf16 and is multiplied
        by `grad_scale` first. If `param_bf16` is given, the updated weights are also written
        there, rounded to bf16 (nearest even); it may be `grad` itself when `grad` is bf16.
        """
        n = param.numel() if isinstance(param, torch.Tensor) else -1
        _check_host("param", param, (torch.float32,), n)
        if n == 0:
            raise ValueError("param is empty (0 elements): nothing to update")
        _check_host("grad", grad, tuple(DTYPE_NAMES), n)
        _check_host("exp_avg", exp_avg, (torch.float32,), n)
        _check_host("exp_avg_sq", exp_avg_sq, (torch.float32,), n)
        out = 0
        if param_bf16 is not None:
            _check_host("param_bf16", param_bf16, (torch.bfloat16,), n)
            out = param_bf16.data_ptr()
        self._engine.step(
            param.data_ptr(), grad.data_ptr(), DTYPE_NAMES[grad.dtype],
            exp_avg.data_ptr(), exp_avg_sq.data_ptr(), n,
            lr=float(lr), beta1=float(betas[0]), beta2=float(betas[1]), eps=float(eps),
            weight_decay=float(weight_decay), step=int(step), grad_scale=float(grad_scale),
            maximize=bool(maximize), param_bf16=out,
        )


def measure_triad(numel: int = 1 << 26, repeats: int = 5, threads: int = 0, isa: str | None = None) -> dict:
    """STREAM triad bandwidth of host memory (GB/s), over `threads` threads (0: all)."""
    return _C.measure_triad(numel, repeats, threads, isa)
