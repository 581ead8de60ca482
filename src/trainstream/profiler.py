"""Measures one micro-batch for the placement planner (trainstream.placement).

In the profiled forward it notes when each module that owns parameters starts; in the backward,
the peak VRAM before each parameter's gradient is complete. On CUDA the times are events on the
compute stream (GPU time, read once the step is over) and the peaks come from the caching
allocator, whose counts follow the stream order the GPU runs in; on the CPU the times are the host
clock and no memory is measured.

The profiled step is not a timing of the steps to come: it pages every block but the last (unless
the first plan has room to spare), and
its copies stretch forward and backward several times over. So the times are taken apart:
each block's own compute (the pager marks it after the block's waits) with the gaps between blocks
left out gives the forward as compute alone (clean_forward), and backward is estimated from it:
twice the forward's work (two matrix products for each one), reaching each module in reverse.
"""

from __future__ import annotations

import torch

from trainstream.first_plan import model_bytes
from trainstream.timing import mark, seconds


class StepProfiler:
    """Records one forward and its backward. `params` are the trainable parameters in forward
    (registration) order; `owners` maps each module to the indices of the parameters it owns."""

    def __init__(self, model: torch.nn.Module, params: list[torch.nn.Parameter], device: torch.device,
                 streamed_away: int = 0) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._model = model
        index = {p: i for i, p in enumerate(params)}
        self._owners = [(m, [index[p] for p in m.parameters(recurse=False) if p in index]) for m in model.modules()]
        self._owners = [(m, own) for m, own in self._owners if own]
        self._count = len(params)
        self.recording = False  # between the profiled forward's start and its backward's end
        self.complete = False
        self._handles: list = []
        self._need: list = [None] * self._count  # mark when each parameter's module first ran
        self._seen: list[bool] = [False] * self._count  # a gradient arrived in the profiled backward
        self._start = self._forward_end = self._backward_end = None
        self._inputs = None
        # CPU mode measures no memory: every figure is the weights alone (less those streamed from
        # host memory, `streamed_away`), so that a budget still means weights plus what the placement adds
        self._floor = model_bytes(model)
        self._floor -= streamed_away
        self.forward_peak = self.tail_peak = 0
        self._segment = [self._floor] * self._count

    # ------------------------------------------------------------------ recording
    def _peak(self) -> int:
        """Peak VRAM since the last call (the weights' bytes on the CPU)."""
        if not self._cuda:
            return self._floor
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return peak

    def start_forward(self, args: tuple = (), kwargs: dict | None = None) -> None:
        """Called from the model's first forward pre-hook of the profiled micro-batch, with the
        model's inputs (kept until timings() replays the forward)."""
        device = self.device.type
        autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        self._inputs = (args, dict(kwargs or {}), autocast)
        self.recording = True
        self._peak()
        self._start = mark(self.device)
        eager = torch.compiler.disable  # as the optimizer's own hooks: they read CUDA events
        for module, own in self._owners:
            self._handles.append(module.register_forward_pre_hook(eager(self._module_started(own))))
        self._handles.append(self._model.register_forward_hook(eager(self._forward_ended), always_call=True))

    def _module_started(self, own: list[int]):
        def hook(module, args):
            if any(self._need[i] is None for i in own):
                now = mark(self.device)
                for i in own:
                    if self._need[i] is None:
                        self._need[i] = now
        return hook

    def _forward_ended(self, module, args, output) -> None:
        if self._forward_end is not None:
            return
        self._forward_end = mark(self.device)
        self.forward_peak = self._peak()
        for h in self._handles:
            h.remove()
        self._handles = []

    def gradient(self, index: int) -> None:
        """Called from parameter `index`'s gradient hook in the profiled backward."""
        if not self._seen[index]:
            self._segment[index] = self._peak()
            self._seen[index] = True

    def end_backward(self) -> None:
        self._backward_end = mark(self.device)
        self.tail_peak = self._peak()
        self.recording = False
        self.complete = True

    def _replay_seconds(self) -> float | None:
        """The profiled forward run again on its inputs, without autograd, hooks or dropout (eval
        mode): its length is the forward's compute alone. Every module's mode and the random
        number generators are restored after, so training goes on with the same bits."""
        if self._inputs is None:
            return None
        args, kwargs, (autocast, dtype) = self._inputs
        self._inputs = None
        modes = [(m, m.training) for m in self._model.modules()]
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state(self.device) if self._cuda else None
        try:
            self._model.eval()
            for _ in range(2):  # the first no_grad forward is cold (kernel choices: 0.66 s against 28 ms)
                with torch.no_grad(), torch.autocast(self.device.type, dtype=dtype, enabled=autocast):
                    start = mark(self.device)
                    self._model(*args, **kwargs)
                    end = mark(self.device)
                if self._cuda:
                    end.synchronize()
            return self._seconds(start, end)
        except Exception:  # a model that cannot run twice keeps the profiled times
            return None
        finally:
            for m, training in modes:
                m.training = training
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng, self.device)

    # ------------------------------------------------------------------ results
    @staticmethod
    def _seconds(start, end) -> float:
        return 0.0 if start is None or end is None else seconds(start, end)

    def timings(self, block_marks: list | None = None) -> dict:
        """The step's times in seconds, as compute alone: the forward's length, and per parameter
        when forward needs it (clean_forward over the pager's `block_marks` of this forward),
        then the estimated backward and when it completes each gradient."""
        if self._cuda:
            self._backward_end.synchronize()
        forward_end = self._forward_end or self._backward_end
        need = [self._seconds(self._start, m) if m is not None else 0.0 for m in self._need]
        forward = self._seconds(self._start, forward_end)
        blocks = [(self._seconds(self._start, a), self._seconds(self._start, b)) for _, a, b in block_marks or ()]
        need, forward = clean_forward(need, forward, blocks)
        compute = self._replay_seconds()
        replayed = compute is not None and 0 < compute < forward
        if replayed:  # the hooks' own time left out as well
            need, forward = [t * compute / forward for t in need], compute
        return {
            "replayed": replayed,  # need_s is then the forward's compute alone, hooks and waits left out
            "forward_s": forward,
            "backward_s": BACKWARD_PER_FORWARD * forward,
            "need_s": need,
            "arrival_s": [BACKWARD_PER_FORWARD * (forward - t) for t in need],
            "segment_peak": list(self._segment),
        }


BACKWARD_PER_FORWARD = 2.0
# A block's forward run again in backward (torch's checkpointing: autograd on, its saved tensors
# made again) against the same forward's compute in the replay. Measured on the H200, 0.95B Llama:
# 8 blocks recomputed added 2.05-2.3 ms each, where replays put a block's forward at 1.7 ms.
RECOMPUTE_PER_FORWARD = 1.25


def block_spans(need: list[float], block_of: list[int], count: int, forward: float) -> list[float | None]:
    """Each of `count` blocks' share of a forward: from when its first parameter is needed to when
    a parameter of a later block (or after the blocks) first is after that, else the forward's end;
    `block_of[i]` is parameter i's block (-1 before the blocks, `count` after). None for a block
    that owns no trainable parameter, and for every block where the blocks' first needs do not
    follow one another (a compiled model waits for all its weights at its start: its marks say
    nothing of when each block ran)."""
    starts = [min((t for t, k in zip(need, block_of) if k == j), default=None) for j in range(count)]
    known = [t for t in starts if t is not None]
    if any(a >= b for a, b in zip(known, known[1:])):
        return [None] * count
    spans: list[float | None] = []
    for j, start in enumerate(starts):
        if start is None:
            spans.append(None)
            continue
        later = [t for t, k in zip(need, block_of) if k > j and t >= start]
        spans.append(min(later, default=forward) - start)
    return spans


def clean_forward(need: list[float], forward: float, blocks: list[tuple[float, float]]) -> tuple[list[float], float]:
    """Times in a forward with the gaps between consecutive blocks taken out: `blocks` are the
    (start, end) of each block's own compute, in order; a time inside block j keeps its offset
    from the block's start, one in a gap moves to the end of the block before it. Returns the
    cleaned `need` times and forward length."""
    if not blocks:
        return list(need), forward
    starts, ends = [blocks[0][0]], []
    for j, (a, b) in enumerate(blocks):  # clean start of block j = clean end of block j - 1
        if j:
            starts.append(ends[-1])
        ends.append(starts[-1] + (b - a))

    def clean(t: float) -> float:
        if t < blocks[0][0]:
            return t
        for j, (a, b) in enumerate(blocks):
            if t <= b:
                return starts[j] + max(0.0, t - a)
            if j + 1 < len(blocks) and t < blocks[j + 1][0]:
                return ends[j]  # between blocks: a wait, not compute
        return ends[-1] + (t - blocks[-1][1])
    return [clean(t) for t in need], clean(forward)


def measure_bandwidths(device: torch.device) -> tuple[float, float, float]:
    """(device->host, host->device, VRAM) bandwidth in bytes/s; infinite on the CPU. Small
    buffers: it runs inside a training step, within the budget."""
    if device.type != "cuda":
        return float("inf"), float("inf"), float("inf")
    d2h, h2d = measure_copy_bandwidth(device, nbytes=32 << 20)
    nbytes = 64 << 20
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    with torch.cuda.device(device):
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
    return d2h, h2d, 2 * nbytes / best  # a copy reads and writes


def measure_copy_bandwidth(device: torch.device, nbytes: int = 64 << 20, repeats: int = 3) -> tuple[float, float]:
    """Pinned device->host and host->device bandwidth in bytes/s, best of `repeats` (CUDA events)."""
    if device.type != "cuda":
        return float("inf"), float("inf")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rates = []
    with torch.cuda.device(device):
        for dst, src in ((host, dev), (dev, host)):
            best = float("inf")
            for _ in range(repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src, non_blocking=True)
                end.record()
                end.synchronize()
                best = min(best, start.elapsed_time(end) / 1e3)
            rates.append(nbytes / best)
    return rates[0], rates[1]
