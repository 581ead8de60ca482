"""AdamW for the parameters the placement keeps whole on the device: gradient and state in VRAM.

On CUDA the update and the gradient norm run as our own kernels (cuda/kernels/device_adamw.cu)
on the compute stream, with the host engine's arithmetic bit for bit; in CPU mode the host
engine itself runs over the parameters' own tensors. Either way a parameter ends with the bits it
would have had offloaded, which is what lets the planner move it.
"""

from __future__ import annotations

import math

import torch

from trainstream import eight_bit
from trainstream._native import _C
from trainstream.host_adamw import DTYPE_NAMES


def clip_coefficient(norm: float, max_norm: float, eps: float) -> float:
    """torch's clip coefficient, clamped to 1 (a NaN norm gives 1, as min() does): what the host
    hands the engine, and what the GPU's clip_scale kernel computes in the same order."""
    return min(1.0, max_norm / (norm + eps))


class PendingNorms:
    """Squared gradient norms queued on the device; `values()` waits for them."""

    def __init__(self, values=None, host=None, event=None, device=None) -> None:
        self._values, self._host, self._event = values, host, event
        self.device = device  # the squares in VRAM (CUDA)

    def values(self) -> list[float]:
        if self._values is None:
            self._event.synchronize()
            self._values = self._host.tolist()
            self._host = self._event = None
        return self._values


class GradientNorms:
    """Squared norms of offloaded gradients, taken where each gradient is as it arrives (on the
    compute stream, before it leaves for the host), into one slot per parameter. With clipping,
    the global norm is then known when backward ends, without waiting for host jobs: what lets
    host updates start speculatively during backward. Same bits as the host engine's norm."""

    def __init__(self, device: torch.device, count: int, resident: "ResidentAdamW") -> None:
        self._device = device
        self._resident = resident
        self._indices: dict[tuple, torch.Tensor] = {}  # slot lists as device index tensors (placements repeat)
        # each slot's kernel scratch, kept: one allocation per slot rather than one a gradient, and
        # no scratch shared by slots whose norms may run on different streams
        self._scratch: dict[int, tuple[int, torch.Tensor]] = {}
        if device.type == "cuda":
            self._out = torch.zeros(count, dtype=torch.float64, device=device)
            self._host = torch.empty(count, dtype=torch.float64, pin_memory=True)
        else:
            self._values = [0.0] * count

    def add(self, index: int, grad: torch.Tensor, stream: int) -> None:
        """Queues on `stream` (CUDA) or takes (CPU) the squared norm of `grad` into slot `index`."""
        grad = grad.contiguous()  # the kernels read numel elements from data_ptr()
        if self._device.type != "cuda":
            self._values[index] = self._resident.norms([grad]).values()[0]
            return
        out, scratch = self.target(index, grad.numel(), None)
        _C.device_squared_norms(self._device.index, stream, [grad.data_ptr()], [DTYPE_NAMES[grad.dtype]],
                                [grad.numel()], scratch, out)

    def target(self, index: int, numel: int, stream: torch.cuda.Stream | None) -> tuple[int, int]:
        """CUDA: where slot `index`'s squared norm goes, and the kernels' scratch for a gradient of
        `numel` elements, used on `stream` if it is not the current one (for
        OffloadPipeline.land_gradient's device_norm, which measures on the download stream: the
        caller orders the stream that reads the norms after it)."""
        kept = self._scratch.get(index)
        if kept is None or kept[0] != numel:
            doubles = _C.device_norm_scratch([numel])
            kept = self._scratch[index] = (numel, torch.zeros(doubles, dtype=torch.float64, device=self._device))
            if stream is not None:
                kept[1].record_stream(stream)  # (freed, should the size change, after that stream's use)
        return self._out.data_ptr() + index * self._out.element_size(), kept[1].data_ptr()

    def verdict(self, resident: list[int], resident_norms: PendingNorms | None, offloaded: list[int],
                max_norm: float, eps: float) -> tuple[torch.Tensor | float, torch.Tensor]:
        """The clip coefficient of every norm of the window, the resident gradients' (of slots
        `resident`, as ResidentAdamW.norms gave them) and the offloaded ones taken here (slots
        `offloaded`), added in slot order as the host adds them (an absent slot adds an exact 0).
        Returns the coefficient for the resident update (a device float on CUDA, queued; a number in
        CPU mode) and the verdict for OffloadPipeline.land_scale: two doubles, the coefficient and
        the norm."""
        if self._device.type != "cuda":
            squares = [0.0] * len(self._values)
            for i in offloaded:
                squares[i] = self._values[i]
            for i, square in zip(resident, resident_norms.values() if resident else ()):
                squares[i] = square
            total = 0.0
            for square in squares:
                total += square
            norm = math.sqrt(total)
            coefficient = torch.tensor(clip_coefficient(norm, max_norm, eps), dtype=torch.float32).item()
            return coefficient, torch.tensor([coefficient, norm], dtype=torch.float64)
        squares = torch.zeros_like(self._out)
        if offloaded:
            at = self._index(offloaded)
            squares.index_copy_(0, at, self._out.index_select(0, at))
        if resident:
            squares.index_copy_(0, self._index(resident), resident_norms.device)
        scale = torch.empty((), dtype=torch.float32, device=self._device)
        verdict = torch.empty(2, dtype=torch.float64, device=self._device)
        _C.device_clip_scale(self._device.index, torch.cuda.current_stream(self._device).cuda_stream,
                             squares.data_ptr(), squares.numel(), float(max_norm), float(eps), scale.data_ptr(),
                             verdict.data_ptr())
        return scale, verdict

    def _index(self, slots: list[int]) -> torch.Tensor:
        key = tuple(slots)
        if key not in self._indices:
            self._indices[key] = torch.tensor(key, dtype=torch.long).to(self._device)
        return self._indices[key]

    def collect(self) -> PendingNorms:
        """Every slot's last norm, indexed by slot, once the work queued so far has run."""
        if self._device.type != "cuda":
            return PendingNorms(values=list(self._values))
        stream = torch.cuda.current_stream(self._device)
        self._host.copy_(self._out, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
        return PendingNorms(host=self._host, event=event)


class ResidentAdamW:
    """`maps`: torchao's two quantization maps (trainstream.eight_bit.maps()) where some
    parameters keep 8-bit moments."""

    def __init__(self, device: torch.device, threads: int = 0, isa: str | None = None,
                 maps: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._host = None if self._cuda else _C.HostAdamW(threads, isa)
        self._maps = None if maps is None else tuple(m.to(device) for m in maps)

    @staticmethod
    def new_state(param: torch.Tensor, accumulation_steps: int, quantized: bool = False,
                  stochastic: bool = False) -> dict:
        """Zeroed moments beside the weights (8-bit codes and scales where `quantized`); bf16
        weights also get their fp32 master, unless `stochastic` (rounded stochastically, they are
        their own), and with accumulation an fp32 sum of the micro-batches, as the host sums them."""
        if quantized:
            state = eight_bit.zeros(param.numel(), param.device)
        else:
            state = {"exp_avg": torch.zeros(param.shape, dtype=torch.float32, device=param.device),
                     "exp_avg_sq": torch.zeros(param.shape, dtype=torch.float32, device=param.device)}
        if param.dtype == torch.bfloat16:
            if not stochastic:
                state["master_param"] = param.detach().float()
            if accumulation_steps > 1:
                state["accumulator"] = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
        return state

    @staticmethod
    def gradient(param: torch.Tensor, state: dict) -> torch.Tensor | None:
        """What the update reads: the fp32 sum of micro-batches where there is one, else .grad."""
        grad = state.get("accumulator", param.grad)
        return None if grad is None else grad.contiguous()

    def norms(self, grads: list[torch.Tensor]) -> PendingNorms:
        """The squared norm of each gradient, computed exactly as the host engine computes it."""
        if not grads:
            return PendingNorms(values=[])
        names = [DTYPE_NAMES[g.dtype] for g in grads]
        if not self._cuda:
            return PendingNorms(values=[self._host.squared_norm(g.data_ptr(), n, g.numel()) for g, n in zip(grads, names)])
        numels = [g.numel() for g in grads]
        scratch = torch.empty(_C.device_norm_scratch(numels), dtype=torch.float64, device=self.device)
        out = torch.empty(len(grads), dtype=torch.float64, device=self.device)
        stream = torch.cuda.current_stream(self.device)
        _C.device_squared_norms(self.device.index, stream.cuda_stream, [g.data_ptr() for g in grads], names,
                                numels, scratch.data_ptr(), out.data_ptr())
        host = torch.empty(len(grads), dtype=torch.float64, pin_memory=True)
        host.copy_(out, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
        return PendingNorms(host=host, event=event, device=out)

    def clip_scale(self, norms: PendingNorms, max_norm: float, eps: float) -> torch.Tensor | None:
        """The clip coefficient of these norms (all of the window's), computed on the device where
        they are, without waiting for them; None in CPU mode."""
        if not self._cuda or norms.device is None:
            return None
        scale = torch.empty((), dtype=torch.float32, device=self.device)
        _C.device_clip_scale(self.device.index, torch.cuda.current_stream(self.device).cuda_stream,
                             norms.device.data_ptr(), norms.device.numel(), float(max_norm), float(eps),
                             scale.data_ptr())
        return scale

    def update(self, items: list[tuple[torch.Tensor, torch.Tensor, dict, int | None]], hyper: dict,
               device_scale: torch.Tensor | None = None) -> None:
        """AdamW over (param, gradient, state, rounding seed) items that share `hyper` (lr,
        beta1, beta2, eps, weight_decay, step, grad_scale, maximize), in place, on the current
        stream; a `device_scale` (clip_scale()) replaces grad_scale. A seed (not None) marks bf16
        weights with 8-bit moments and no master, rounded stochastically."""
        quantized = [item for item in items if "exp_avg_codes" in item[2]]
        if quantized:
            self._update_8bit(quantized, hyper, device_scale)
            items = [item for item in items if "exp_avg_codes" not in item[2]]
        if not items:
            return
        if not self._cuda:
            for param, grad, state, _ in items:
                bf16 = param.dtype == torch.bfloat16
                weights = state["master_param"] if bf16 else param
                self._host.step(weights.data_ptr(), grad.data_ptr(), DTYPE_NAMES[grad.dtype],
                                state["exp_avg"].data_ptr(), state["exp_avg_sq"].data_ptr(), param.numel(),
                                param_bf16=param.data_ptr() if bf16 else 0, **hyper)
            return
        weights, bf16_out = [], []
        for param, _, state, _ in items:
            bf16 = param.dtype == torch.bfloat16
            weights.append((state["master_param"] if bf16 else param).data_ptr())
            bf16_out.append(param.data_ptr() if bf16 else 0)
        _C.device_adamw_step(
            self.device.index, torch.cuda.current_stream(self.device).cuda_stream, weights,
            [g.data_ptr() for _, g, _, _ in items], [DTYPE_NAMES[g.dtype] for _, g, _, _ in items],
            [s["exp_avg"].data_ptr() for _, _, s, _ in items], [s["exp_avg_sq"].data_ptr() for _, _, s, _ in items],
            bf16_out, [p.numel() for p, _, _, _ in items],
            device_scale=device_scale.data_ptr() if device_scale is not None else 0, **hyper)

    def _update_8bit(self, items: list[tuple[torch.Tensor, torch.Tensor, dict, int | None]], hyper: dict,
                     device_scale: torch.Tensor | None) -> None:
        """torchao's AdamW8bit over update() items with 8-bit moments: the host engine's 8-bit
        kernel in CPU mode, device_adamw8bit.cu on CUDA, the same bits (stochastic rounding's
        included)."""
        hyper = {k: v for k, v in hyper.items() if k != "maximize"}  # (AdamW8bit has none)
        weights, bf16_out = [], []
        for param, _, state, seed in items:
            master = param.dtype == torch.bfloat16 and seed is None
            weights.append((state["master_param"] if master else param).data_ptr())
            bf16_out.append(param.data_ptr() if master else 0)
        signed, unsigned = self._maps
        if not self._cuda:
            for (param, grad, state, seed), weight, out in zip(items, weights, bf16_out):
                self._host.step_8bit(weight, grad.data_ptr(), DTYPE_NAMES[grad.dtype], state["exp_avg_codes"].data_ptr(),
                                     state["exp_avg_scale"].data_ptr(), state["exp_avg_sq_codes"].data_ptr(),
                                     state["exp_avg_sq_scale"].data_ptr(), signed.data_ptr(), unsigned.data_ptr(),
                                     param.numel(), param_bf16=out, stochastic_seed=seed, **hyper)
            return
        _C.device_adamw8bit_step(
            self.device.index, torch.cuda.current_stream(self.device).cuda_stream, weights,
            [g.data_ptr() for _, g, _, _ in items], [DTYPE_NAMES[g.dtype] for _, g, _, _ in items],
            *([s[key].data_ptr() for _, _, s, _ in items] for key in eight_bit.RAW_KEYS), bf16_out,
            [p.numel() for p, _, _, _ in items], signed.data_ptr(), unsigned.data_ptr(),
            device_scale=device_scale.data_ptr() if device_scale is not None else 0,
            seeds=[-1 if seed is None else seed for _, _, _, seed in items], **hyper)
