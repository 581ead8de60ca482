"""What the optimizer tracks for each trainable parameter, and the native side its rooms share.

`Slot` is one parameter's record; `Slots` the table of them in forward order; `Window` the
accumulation window in progress; `Engine` the native offload pipeline with the device, the copy
streams and the VRAM buffer that update terms cross through. The optimizer's rooms (gates.py,
backward.py, clipping.py, promotion.py, checkpoint.py, describe.py) are handed these objects
and read them through their public attributes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from trainstream._native import _C
from trainstream.distributed import local_shard
from trainstream.eight_bit import RAW_KEYS, Shown
from trainstream.host_budget import HostBudget, margin

# fp32 update terms cross to VRAM through a staging buffer of at most this many floats (64 MiB),
# a piece at a time for larger parameters.
STAGING_FLOATS = 16 << 20


@dataclass(eq=False)
class Slot:
    """What the optimizer tracks for one trainable parameter."""

    param: torch.nn.Parameter
    host: object  # trainstream._C.HostParam (holding no state while resident), or None: resident for good
    group: dict
    version: int  # weight._version when host master and device weights last agreed
    index: int  # position in forward (registration) order: the order norms are added in
    step: int = 0
    landed: bool = False  # a gradient arrived in the current accumulation window
    updated: bool = False  # its update for this window has been queued
    state: dict = field(default_factory=dict)  # torch AdamW's state: host views or device tensors
    resident: bool = False  # gradient and AdamW state beside the weights, updated at step()
    sum_in_vram: bool = False  # offloaded; autograd sums the window's micro-batches in VRAM
    device_state: dict | None = None  # resident: exp_avg, exp_avg_sq (+ master_param, accumulator)
    norm_on_device: bool = False  # this window's squared norm was taken before the gradient left
    # the hyperparameters of this window's host update, if it started before the global norm was known
    speculated: dict | None = None
    next_state: dict | None = None  # views of the next-state buffers a commit swaps with `state`
    peer: bool = False  # another rank updates it (DDP), or this rank's FSDP2 shard of it is empty
    sharded: bool = False  # an FSDP2 parameter: this rank holds and updates one shard of it
    streamed: bool = False  # offloaded, with its weights in host memory between uses (trainstream.streaming)
    # its last gradient's VRAM, lent to the pipeline for the speculated update term until its commit
    held_term: torch.Tensor | None = None
    quantized: bool = False  # blockwise 8-bit moments (trainstream.eight_bit), wherever it lives
    # bf16 weights without a master, rounded stochastically with this seed (eight_bit.rounding_seed)
    stochastic: bool = False
    rounding_seed: int = 0

    @property
    def state_format(self) -> str:
        """As eight_bit.state_format names it: 'fp32', '8bit' or '8bit-sr'."""
        return "8bit-sr" if self.stochastic else "8bit" if self.quantized else "fp32"

    @property
    def weight(self) -> torch.Tensor:
        """The tensor this process updates: the parameter, or its FSDP2 shard on this rank."""
        return self.mine(self.param)

    def mine(self, t: torch.Tensor) -> torch.Tensor:
        """This process's part of a tensor shaped as the parameter (its gradient, say)."""
        return local_shard(t) if self.sharded else t

    @property
    def offloaded(self) -> bool:
        """Updated by this process's host threads (neither resident nor another rank's)."""
        return self.host is not None and not self.resident


class Slots:
    """The trainable parameters' slots, by parameter and in forward (registration) order."""

    def __init__(self, model: torch.nn.Module, accumulation_steps: int, shown: Shown | None = None) -> None:
        self.by_param: dict[torch.nn.Parameter, Slot] = {}
        self.order: list[Slot] = []
        self.accumulation_steps = accumulation_steps
        self._names = {p: n for n, p in model.named_parameters()}
        self._shown = shown if shown is not None else Shown(None)

    def shown(self, slot: Slot, raw: dict) -> dict:
        """A slot's host or device state as the optimizer's `state` shows it (torchao's 8-bit
        tensors for quantized moments; no accumulator)."""
        return self._shown.state(raw, slot.weight)

    def add(self, slot: Slot) -> None:
        self.by_param[slot.param] = slot
        self.order.append(slot)

    def __getitem__(self, param: torch.nn.Parameter) -> Slot:
        return self.by_param[param]

    def __contains__(self, param) -> bool:
        return param in self.by_param

    def get(self, param) -> Slot | None:
        return self.by_param.get(param)

    def name(self, slot: Slot) -> str:
        return self._names.get(slot.param, f"param{slot.index}")

    def sums_on_host(self, slot: Slot) -> bool:
        """Whether this slot's micro-batches are summed in its host accumulator."""
        return self.accumulation_steps > 1 and not slot.sum_in_vram and slot.offloaded

    def offloaded_hosts(self) -> list:
        """The HostParams of the offloaded parameters whose weights stay on the device."""
        return [s.host for s in self.order if s.offloaded and not s.streamed]


@dataclass
class Window:
    """The accumulation window in progress (counts are reset by step())."""

    micro: int = 0  # backward passes finished in this window
    forwards: int = 0  # forwards (with autograd) in this window
    count: int = 0  # optimizer steps taken
    arrival: list = field(default_factory=list)  # slots in gradient arrival order
    backward_tasks: set = field(default_factory=set)  # autograd graph tasks with our end-callback queued


def trainable_in_forward_order(model: torch.nn.Module, param_groups: list[dict]) -> list[tuple]:
    """The optimizer's trainable parameters, each once with its group, in the order `model`
    registers them: its forward order for the usual models, where the optimizer's groups may not
    be (the Hugging Face Trainer's put every norm weight after all the matrices). The placements
    keep "the first in forward order" resident, and the planner reads blocks off that order.
    Parameters the model does not hold go last, in the groups' order."""
    position = {id(p): k for k, p in enumerate(model.parameters())}
    seen, trainable = set(), []
    for group in param_groups:
        for p in group["params"]:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                trainable.append((p, group))
    return sorted(trainable, key=lambda entry: position.get(id(entry[0]), len(position)))


def hyperparameters(slot: Slot, grad_scale: float) -> dict:
    """The host engine's arguments for this slot's next AdamW update, read from its param group
    now (schedulers change them between steps)."""
    group = slot.group
    beta1, beta2 = group["betas"]
    return dict(
        lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
        weight_decay=float(group.get("weight_decay", 0.0)), step=slot.step + 1,
        grad_scale=grad_scale, maximize=bool(group.get("maximize", False)),
    )


def update_args(slot: Slot, hyper: dict) -> dict:
    # (a streamed parameter's update writes its weights in host memory, where they stay)
    device = 0 if slot.streamed else slot.weight.data_ptr()
    return dict(update=True, device_weight=device, **hyper)


@dataclass(frozen=True)
class HeldElsewhere:
    """What the rest of the process held when wrap() planned (wrap.left_behind): VRAM of tensors
    that are not the model's, and host memory of other live TrainStream optimizers."""
    vram_bytes: int = 0
    host_bytes: int = 0
    host_optimizers: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


class Engine:
    """The native offload pipeline, the device it serves, its (download, upload) copy streams and
    the VRAM buffer that fp32 update terms cross through. `pipeline` is read at every use, so a
    test or a benchmark may put a wrapper in its place (a spy, a timer)."""

    def __init__(self, pipeline, device: torch.device, streams: tuple | None,
                 host_budget: HostBudget | None = None, elsewhere: HeldElsewhere = HeldElsewhere()) -> None:
        self.pipeline = pipeline
        self.device = device
        self.streams = streams  # (download, upload) torch streams, kept alive here; None on the CPU
        self.host_budget = host_budget if host_budget is not None else HostBudget(None, "none given")
        self.elsewhere = elsewhere
        self.staging: torch.Tensor | None = None

    def current_stream(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.current_stream(self.device).cuda_stream
        return 0

    @staticmethod
    def host_tensor(host, name: str, like: torch.Tensor) -> torch.Tensor:
        """A view of one of a HostParam's fp32 buffers, shaped as `like` (the weights themselves,
        bf16, for the master of stochastically rounded ones)."""
        bf16 = name.endswith("master") and host.moments == "8bit-sr"
        return torch.frombuffer(host.view(name), dtype=torch.bfloat16 if bf16 else torch.float32).view(like.shape)

    @staticmethod
    def host_codes(host, prefix: str = "") -> dict:
        """A HostParam's 8-bit moments (RAW_KEYS) as views of its buffers; `prefix` "next_":
        speculation's second set."""
        return {k: torch.frombuffer(host.view(prefix + k), dtype=torch.uint8 if k.endswith("codes") else torch.float32)
                for k in RAW_KEYS}

    def host_state(self, slot: Slot) -> dict:
        """The parameter's state as views of its host buffers: torch AdamW's entries, or for 8-bit
        moments their codes and scales (trainstream.eight_bit.RAW_KEYS)."""
        if slot.quantized:
            state = self.host_codes(slot.host)
        else:
            state = {"exp_avg": self.host_tensor(slot.host, "exp_avg", slot.weight),
                     "exp_avg_sq": self.host_tensor(slot.host, "exp_avg_sq", slot.weight)}
        if slot.param.dtype == torch.bfloat16 and not slot.stochastic:  # what bf16 training resumes from
            state["master_param"] = self.host_tensor(slot.host, "master", slot.weight)
        return state

    def host_room(self, held: int) -> float:
        """Host memory left for pinned activations and speculation: within the host budget, less
        the `held` bytes TrainStream holds already, and within what the host has free now, less the
        budget's margin of it."""
        available = _C.host_memory_available()
        free = max(0, available - margin(available)) if available else float("inf")
        limit = self.host_budget.limit
        return min(free, max(0, limit - held) if limit is not None else float("inf"))

    def ensure_staging(self, slots: Slots) -> None:
        """The staging buffer sized for the largest offloaded fp32 parameter (at most
        STAGING_FLOATS; none when no fp32 parameter is offloaded)."""
        fp32 = [s.weight.numel() for s in slots.order if s.offloaded and s.param.dtype == torch.float32]
        floats = min(max(fp32), STAGING_FLOATS) if fp32 and self.device.type == "cuda" else 0
        if floats != (self.staging.numel() if self.staging is not None else 0):
            self.stage(floats)

    def stage(self, floats: int) -> None:
        """A staging buffer of `floats` floats (0: none): parameters larger than it go up in pieces."""
        self.pipeline.synchronize()
        self.staging = None  # the allocator waits for the upload stream before reusing it
        self.pipeline.set_upload_staging(0, 0)
        if floats:
            self.staging = torch.empty(floats, dtype=torch.float32, device=self.device)
            self.staging.record_stream(self.streams[1])  # freed only after the uploads using it
            self.pipeline.set_upload_staging(self.staging.data_ptr(), self.staging.nbytes)

    def drop_staging(self) -> None:
        self.pipeline.set_upload_staging(0, 0)
        self.staging = None
