"""The optimizer that wrap() returns: torch.optim.AdamW's interface over a placement of its state.

Each trainable parameter is either *offloaded* or *resident*. An offloaded parameter's gradient
leaves the device from a post-accumulate-grad hook; the native pipeline (trainstream._C.
OffloadPipeline) folds, clips and applies it on host threads and uploads the new weights; module
forward pre-hooks make the compute stream wait for exactly the uploads each module reads. A
resident parameter keeps gradient and AdamW state beside its weights and is updated at step() by
trainstream.resident, with the host engine's arithmetic bit for bit. Which is which comes from
the placement planner (trainstream.placement) after profiling the first steps with everything
offloaded, or from wrap()'s `placement`. This class keeps the Python side of that bargain: when
to update, with which hyperparameters, and torch's optimizer API on top.
"""

from __future__ import annotations

import logging
import math
import weakref
from dataclasses import asdict, dataclass, field, replace

import torch

from trainstream import placement as planner
from trainstream.activations import light as light_recompute
from trainstream.activations.plan import format_size
from trainstream.distributed import local_shard
from trainstream.errors import (GRAD_SCALER_MESSAGE, NativeError, TrainingLoopError, UnsupportedSetupError,
                                VramBudgetError, check_autocast, check_compile_mode, check_single_process,
                                compiled_wrappers)
from trainstream.host_adamw import DTYPE_NAMES
from trainstream.profiler import RECOMPUTE_PER_FORWARD, StepProfiler, block_spans, measure_bandwidths
from trainstream._native import _C
from trainstream.resident import GradientNorms, ResidentAdamW, clip_coefficient
from trainstream.streaming import WeightStreamer, shared_outside

log = logging.getLogger("trainstream")

_CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_
# fp32 update terms cross to VRAM through a staging buffer of at most this many floats (64 MiB),
# a piece at a time for larger parameters.
_STAGING_FLOATS = 16 << 20
_PACK_S = 30e-6  # what one call of the saved-tensor hooks costs the host, where it was not measured
# Host memory that speculation and paged activations leave free: this much, or a tenth of what is
# available if that is more.
_HOST_RESERVE = 4 << 30
# id(parameter) -> (the parameter, its optimizer), both weakly: tensors compare by value, not by
# identity, so they cannot be the keys of a WeakKeyDictionary
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def wrapped_by(param: torch.nn.Parameter):
    """The OffloadedAdamW whose hooks are on `param`, or None."""
    param_ref, owner = _OWNERS.get(id(param), (None, None))
    return owner() if param_ref is not None and param_ref() is param else None


def resident_at_start(placement: str | float, count: int) -> int:
    """How many of `count` trainable parameters (the first in forward order) a placement keeps
    resident from the start: "gpu" all, a share that share, "auto" and "offload" none."""
    if isinstance(placement, float):
        return round(placement * count)
    return count if placement == "gpu" else 0


def _compiled(module: torch.nn.Module) -> bool:
    """Compiled in place (nn.Module.compile()) or a torch.compile wrapper (whose model is its
    `_orig_mod` submodule; looked up directly, as a missing attribute costs an exception)."""
    return getattr(module, "_compiled_call_impl", None) is not None or "_orig_mod" in module._modules


def _weakly(method):
    """`method` through a weak reference to its object. A tensor's hooks are held from C++, where
    the garbage collector cannot see them: a bound method there would keep the optimizer, its
    parameters and every buffer alive after the user drops both model and optimizer."""
    owner, func = weakref.ref(method.__self__), method.__func__

    def call(*args):
        if (obj := owner()) is not None:
            return func(obj, *args)
    return call


def _forget_dead_owners() -> None:
    for key in [k for k, (p, o) in _OWNERS.items() if p() is None or o() is None]:
        del _OWNERS[key]


@dataclass(eq=False)
class _Slot:
    """What the optimizer tracks for one trainable parameter."""

    param: torch.nn.Parameter
    host: object  # trainstream._C.HostParam, or None for a parameter resident from the start
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


class OffloadedAdamW(torch.optim.Optimizer):
    """AdamW whose state lives where the placement puts it, updated on host threads or the GPU.

    Shares ``param_groups`` with the optimizer it was built from, so LR schedulers and code that
    edits ``lr`` keep working. Use it like the original: ``loss.backward(); opt.step();
    opt.zero_grad()``. Build it with :func:`trainstream.wrap`.
    """

    # Lets torch.amp.GradScaler hand itself to step(), where it is refused with a clear message.
    _step_supports_amp_scaling = True

    def __init__(self, source: torch.optim.Optimizer, model: torch.nn.Module, pipeline, *,
                 device: torch.device, max_grad_norm: float | None, accumulation_steps: int,
                 track_grad_norm: bool, streams: tuple | None, activation_pager=None,
                 accumulate_in_vram: bool | None = None, placement: str | float = "offload",
                 vram_budget: int | None = None, threads: int = 0, isa: str | None = None,
                 data_parallel=None, sharded=None, streamed: list[torch.nn.Module] | None = None,
                 prefetch_depth: int = 1, speculative_clipping: bool = True) -> None:
        super().__init__(source.param_groups, source.defaults)
        self.param_groups = source.param_groups  # the very same list: edits show on both sides
        self._pipeline = pipeline
        self._dp = data_parallel  # trainstream.distributed.DataParallel under DDP, else None
        self._shards = sharded  # trainstream.distributed.Sharded under FSDP2, else None
        self._device = device
        self._streams = streams  # (download, upload) torch streams, kept alive here
        self.activation_pager = activation_pager  # trainstream.activations.ActivationPager or None
        self._pager = activation_pager  # the same, also while a plan that needs no hooks has it detached
        self.max_grad_norm = max_grad_norm
        self.accumulation_steps = accumulation_steps
        self._vram_sums = accumulate_in_vram  # None: the planner's choice per parameter
        self._track_norm = track_grad_norm or max_grad_norm is not None
        self._resident = ResidentAdamW(device, threads, isa)
        self._micro = 0  # backward passes finished in this accumulation window
        self._forwards = 0  # forwards (with autograd) in this window
        self._windows = 0  # optimizer steps taken
        self._backward_tasks: set[int] = set()  # autograd graph tasks with our end-callback queued
        self._arrival: list[_Slot] = []  # slots in gradient arrival order, this window
        self._last_grad_norm: float | None = None
        self._norm_slots: list[_Slot] = []  # the window whose norm last_grad_norm reports
        self._norm_pending = False
        self._device_norms: dict[_Slot, float] | tuple = {}  # resident slots' squared norms (or pending)
        self._slots: dict[torch.nn.Parameter, _Slot] = {}
        self._order: list[_Slot] = []  # forward (registration) order
        self._hooks: list = []
        # module -> its offloaded parameters' HostParams, which its forward pre-hook waits for, and their slots
        self._gated: dict[torch.nn.Module, tuple[list, list]] = {}
        self._gates_on = False  # whether the gates wait (an update has been queued since they last settled)
        self._hosts: list = []  # every offloaded parameter's HostParam
        self._uploads_queued = 0  # updates (each ends in an upload) queued so far
        self._gate_always = False  # a benchmark's baseline: gates stay awake and every one waits
        self._pack = True
        self._staging = None
        self._upload_terms = True
        self._model = model
        self._placement = placement
        self.vram_budget = vram_budget
        self.plan: planner.Plan | None = None  # the placement in force, once planned
        self._profile: planner.Profile | None = None
        self._profiler: StepProfiler | None = None
        self._stats_at_start = None
        self._bandwidths = None  # (d2h, h2d, VRAM) bytes/s, measured when the profiled window starts
        self._names = {p: n for n, p in model.named_parameters()}
        self._checked = False  # the first planned window's peak has been compared with the budget
        self._checked_processes = False
        # Clipping: offloaded gradients' squared norms, taken on the device as they arrive, so that
        # the global norm is known when backward ends and host updates may start before it.
        self._grad_norms: GradientNorms | None = None
        self._offload_norms = None  # this window's, pending (trainstream.resident.PendingNorms)
        self._norm_on_device: set = set()  # the slots of the window last_grad_norm reports whose norms they are
        self._speculation_on = speculative_clipping
        self._last_unclipped = True  # the last window's norm did not clip (or there was none): speculate
        self._speculation = {"params": 0, "host_bytes": 0, "hits": 0, "misses": 0, "waited": 0,
                             "vram_term_bytes": 0, "terms_held": 0}
        self._hold_terms = False  # speculated fp32 terms go up at once (see _send)
        self._holding: dict[int, _Slot] = {}  # slots whose held_term is set, by index
        self._verdict = None  # the last window's clip verdict on its way from the device, and what it decides
        self._streamer: WeightStreamer | None = None
        self._prefetch_depth = prefetch_depth
        self._register(model, streamed or [])
        self._sync_packing()
        if self._dp is not None:
            self._dp.attach(self)

    # ----------------------------------------------------------------------------- set-up
    def _register(self, model: torch.nn.Module, streamed: list[torch.nn.Module]) -> None:
        acc = self.accumulation_steps
        _forget_dead_owners()
        trainable, seen = [], set()
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    trainable.append((p, group))
        resident_count = resident_at_start(self._placement, len(trainable))
        # host accumulators: for every parameter that may sum its micro-batches on the host (under
        # DDP, micro-batches are summed where DDP sums them, in VRAM)
        host_sums = acc > 1 and self._vram_sums is not True and self._dp is None
        owners = self._dp.owners if self._dp is not None else None
        away = {id(p) for module in streamed for p in module.parameters()}  # offloaded, whatever the placement
        for i, (p, group) in enumerate(trainable):
            weight = local_shard(p) if self._shards is not None else p
            peer = owners is not None and owners[i] != self._dp.rank or weight.numel() == 0
            resident = i < resident_count and not peer and id(p) not in away
            host = None
            if not resident and not peer:
                # registration order stands in for forward order (embeddings, layers, head)
                host = self._pipeline.add_param(weight.numel(), DTYPE_NAMES[p.dtype], host_sums, i)
                if weight.device == self._device:  # (else a streamed one in host memory: see _stream)
                    self._pipeline.load_weights(host, weight.data_ptr(), self._current_stream())
            slot = _Slot(p, host, group, weight._version, i, peer=peer, sharded=self._shards is not None)
            slot.state = {"step": torch.tensor(0.0)}
            if resident:
                slot.resident = True
                slot.device_state = ResidentAdamW.new_state(p, acc if self._dp is None else 1)
                slot.state.update({k: v for k, v in slot.device_state.items() if k != "accumulator"})
            elif not peer:
                slot.state.update(self._host_state(slot))
                slot.sum_in_vram = acc > 1 and (self._dp is not None or
                                                self._vram_sums is True and p.dtype == torch.float32)
            if not peer:  # a peer's state lives on its owner
                self.state[p] = slot.state
            self._slots[p] = slot
            self._order.append(slot)
            self._hooks.append(p.register_post_accumulate_grad_hook(_weakly(self._on_grad)))
            _OWNERS[id(p)] = (weakref.ref(p), weakref.ref(self))
        self._gate_hooks = None  # laid out below
        self._gate_units: list[torch.nn.Module] = []
        self._compiled_seen: list[int] | None = None  # the compiled modules and wrappers last laid out for
        self._whole_forward_gate = self._shards is not None
        self._layout_gates(wrapped_by_compile=False)
        self._install_gates()
        self._ensure_staging()
        self._pipeline.upload_terms = True
        if streamed:
            self._stream(streamed)
        if self._placement != "auto":
            self._enable_speculation()
        if self._placement == "auto":
            away = self._streamer.weight_bytes - self._streamer.window_bytes if self._streamer is not None else 0
            self._profiler = StepProfiler(model, [s.param for s in self._order], self._device, away)
            self._stats_at_start = self._pipeline.stats()
        # A lambda, not a bound method: copy.deepcopy(model) copies the hooks, and would copy the
        # optimizer behind a bound method with them.
        self._hooks.append(model.register_forward_pre_hook(torch.compiler.disable(
            lambda module, args, kwargs: self._before_forward(args, kwargs)), prepend=True, with_kwargs=True))
        # Reads and writes of the weights outside forward (saving, loading) see settled values.
        self._hooks.append(model.register_state_dict_pre_hook(lambda *_: self.synchronize()))
        self._hooks.append(model.register_load_state_dict_pre_hook(lambda *_: self.synchronize()))

    def _host_state(self, slot: _Slot) -> dict:
        """torch AdamW's state entries as views of the parameter's host buffers."""
        state = {"exp_avg": self._host_tensor(slot.host, "exp_avg", slot.weight),
                 "exp_avg_sq": self._host_tensor(slot.host, "exp_avg_sq", slot.weight)}
        if slot.param.dtype == torch.bfloat16:  # the fp32 master is what bf16 training resumes from
            state["master_param"] = self._host_tensor(slot.host, "master", slot.weight)
        return state

    def _stream(self, modules: list[torch.nn.Module]) -> None:
        """Streams the weights of `modules` (blocks) from now on: their trainable parameters are
        offloaded, and the host engine's buffers hold their weights (trainstream.streaming).
        Between steps."""
        if self._streamer is None:
            self._streamer = WeightStreamer(self._device, self._prefetch_depth)
            # A forward without autograd has no backward to end its streaming. (A lambda: see _register.)
            self._hooks.append(self._model.register_forward_hook(
                lambda module, args, output: self._after_forward(), always_call=True))
        self.synchronize()
        stream = self._current_stream()
        for module in modules:
            hosts = []
            for p in module.parameters():
                s = self._slots.get(p)
                if s is None or s.streamed:
                    continue
                if s.resident:
                    self._move(s, False)
                s.next_state = None  # (its updates wait for the norm from now on)
                if p.device == self._device:  # (an fp32 master may hold a term)
                    self._pipeline.load_weights(s.host, p.data_ptr(), stream)
                else:  # still in host memory, where wrap() left it
                    self._host_tensor(s.host, "master", p).copy_(p.detach().float())
                self._pipeline.keep_weights_on_host(s.host)  # (bf16: 2 B a parameter more)
                s.streamed = True
                if s.host.has_accumulator:
                    s.sum_in_vram = False
                hosts.append(s.host)
            # forward order: where the model defines the block (its blocks are a ModuleList)
            position = next(k for k, m in enumerate(self._model.modules()) if m is module)
            self._streamer.add(module, position, self._streamed_host,
                               lambda stream, hosts=hosts: self._pipeline.gate(hosts, stream) if hosts else None)
        self._speculation["params"] = sum(self._speculates(s) for s in self._order)
        self._build_gates()

    def _streamed_host(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        """The host tensor that holds a streamed parameter's weights: the pipeline's (its fp32
        master, or its bf16 copy, filled here), or None for a frozen one."""
        s = self._slots.get(p)
        if s is None or not s.streamed:
            return None
        host = torch.frombuffer(s.host.view("weights"), dtype=p.dtype).view(p.shape)
        if p.dtype != torch.float32:
            host.copy_(p.detach())
        s.version = p._version
        return host

    def _refresh_streamed_masters(self) -> None:
        """bf16 weights written behind our back (load_state_dict, an in-place edit) while they
        sat in host memory: the fp32 master follows them, as _take does for weights on the device."""
        for s in self._order:
            if s.streamed and s.param.dtype != torch.float32 and s.param._version != s.version:
                self._pipeline.wait([s.host])
                self._host_tensor(s.host, "master", s.param).copy_(s.param.detach().float())
                s.version = s.param._version

    def _after_forward(self) -> None:
        if not torch.is_grad_enabled():
            self._streamer.end_backward()

    def _layout_gates(self, wrapped_by_compile: bool) -> None:
        """Where the forward gates are. A forward pre-hook on each module that owns a trainable
        parameter waits for that module's uploads only, so the next forward starts while later
        layers still update; what changes from step to step is what they wait for, not the hooks.
        Under torch.compile each would be a graph break (they call the native pipeline), cutting the
        compiled code at every module: so a module compiled in place (nn.Module.compile()) or
        wrapped by torch.compile gates once, at its start, for every parameter inside it, and a
        compiled model waits for every upload when its forward starts (_before_forward). So does an
        FSDP2 model, whose all-gathers read a module's weights before that module's hook runs. Run
        at wrap() and at each window's first forward, before dynamo traces the modules: a model
        compiled after wrap() gets its gates moved then (`wrapped_by_compile`: a torch.compile wrapper
        of the model is calling it)."""
        whole = self._whole_forward_gate or _compiled(self._model) or wrapped_by_compile
        units = [] if whole else list(dict.fromkeys(self._units_of(self._model)))  # (a shared module once)
        if self._gate_hooks is not None and (whole, units) == (self._whole_forward_gate, self._gate_units):
            return
        for hook in self._gate_hooks or ():
            hook.remove()
        self._whole_forward_gate, self._gate_units = whole, units
        self._gate_hooks = [unit.register_forward_pre_hook(self._gate_hook(unit)) for unit in units]
        self._build_gates()

    def _units_of(self, module: torch.nn.Module) -> list[torch.nn.Module]:
        """The modules under `module` that gate (see _layout_gates), in module order."""
        if _compiled(module):
            return [module] if any(p in self._slots for p in module.parameters()) else []
        units = [module] if any(p in self._slots for p in module.parameters(recurse=False)) else []
        for child in module.children():
            units += self._units_of(child)
        return units

    def _build_gates(self) -> None:
        """What each gate waits for: the uploads of the offloaded parameters it gates for (resident
        ones are updated on the compute stream itself, before any later kernel reads them)."""
        self._gated = {}
        for unit in self._gate_units:
            inside = unit.parameters() if _compiled(unit) else unit.parameters(recurse=False)
            own = [self._slots[p] for p in inside
                   if p in self._slots and self._slots[p].offloaded and not self._slots[p].streamed]
            if own:
                self._gated[unit] = ([s.host for s in own], own)
        self._hosts = [s.host for s in self._order if s.offloaded and not s.streamed]

    def _speculates(self, slot: _Slot) -> bool:
        """Whether this slot's update may start before the global norm is known: it has next-state
        buffers, and the update reads a gradient the device measured (not a host sum), and
        writes no state without a twin (fp32 masters are state when update terms are off)."""
        return (slot.next_state is not None and slot.offloaded and not slot.streamed and not self._sums_on_host(slot)
                and (slot.param.dtype == torch.bfloat16 or self._pipeline.upload_terms))

    def _enable_speculation(self) -> None:
        """With clipping: next-state buffers for the offloaded parameters, first those whose
        gradients arrive first (they have the most backward to hide behind), as many as host
        memory holds beyond a reserve; the rest wait for the norm."""
        if self.max_grad_norm is None or not self._speculation_on:
            return
        room = self._host_room()
        if self.plan is not None and self._profile is not None:  # the plan's paged activations come first
            room -= max(0, planner.paged_host_bytes(self._profile, self.plan) - self._paging_slot_bytes())
        for s in reversed(self._order):
            if s.next_state is not None or not s.offloaded or s.streamed or self._sums_on_host(s):
                continue
            need = self._pipeline.speculation_bytes(s.weight.numel(), DTYPE_NAMES[s.param.dtype])
            if need > room:
                continue
            try:
                self._speculation["host_bytes"] += self._pipeline.enable_speculation(s.host)
            except NativeError as e:  # (pinned memory can run out before MemAvailable says so)
                log.warning("clipping: no host memory for more second state sets (%s); the updates "
                            "of the parameters without one wait for the global norm", e)
                break
            room -= need
            s.next_state = {"exp_avg": self._host_tensor(s.host, "next_exp_avg", s.weight),
                            "exp_avg_sq": self._host_tensor(s.host, "next_exp_avg_sq", s.weight)}
            if s.param.dtype == torch.bfloat16:
                s.next_state["master_param"] = self._host_tensor(s.host, "next_master", s.weight)
        self._speculation["params"] = sum(self._speculates(s) for s in self._order)
        self._plan_term_holding()

    def _plan_term_holding(self) -> None:
        """Whether speculated fp32 update terms go up at once, each into its gradient's VRAM, kept
        from the gradient's arrival until the module's next forward gate: the commit then applies it
        on the device, and nothing crosses the link after the verdict. It costs up to 4 bytes a
        speculating parameter of VRAM, so under a budget only where the plan leaves that room; not
        while profiling (the profile would count it), nor under DDP or FSDP2, whose gradients are
        theirs."""
        fp32 = [s for s in self._order if self._speculates(s) and s.param.dtype == torch.float32]
        need = sum(4 * s.weight.numel() for s in fp32)
        if not fp32 or not self._pipeline.upload_terms or self._dp is not None or self._shards is not None:
            room = False
        elif self.plan is not None:
            room = self.plan.budget is None or self.plan.expected_peak + need <= self.plan.budget - self.plan.reserve
        else:
            room = self._placement != "auto" and self.vram_budget is None
        self._hold_terms = room
        self._speculation["vram_term_bytes"] = need if room else 0
        if not room:
            self._release_terms()

    @staticmethod
    def _host_room() -> float:
        """Host memory free for pinned activations and speculation, beyond the reserve."""
        available = _C.host_memory_available()
        return max(0, available - max(_HOST_RESERVE, available // 10)) if available else float("inf")

    def _paging_slot_bytes(self) -> int:
        """Host memory the pager's slots already hold (reused for every step's paged activations)."""
        return self._pager._native.stats()["reserved_bytes"] if self._pager is not None else 0

    def _commit(self, slots: list, verdict=None) -> None:
        """Queues the commits of these slots' speculative updates (the engine takes the
        hyperparameters each ran with: the decay the upload applies); the state's views follow the
        swaps. With a `verdict` still on its way, the engine redoes a step into the next-state
        buffers first if it clips."""
        for slot in slots:
            for key, view in slot.next_state.items():
                slot.next_state[key], slot.state[key] = slot.state[key], view
        self._pipeline.commit([s.host for s in slots], [s.weight.data_ptr() for s in slots], verdict)

    def _ensure_staging(self) -> None:
        """The VRAM buffer that offloaded fp32 parameters' update terms cross through, sized for
        the largest of them (none when no fp32 parameter is offloaded)."""
        fp32 = [s.weight.numel() for s in self._order if s.offloaded and s.param.dtype == torch.float32]
        floats = min(max(fp32), _STAGING_FLOATS) if fp32 and self._device.type == "cuda" else 0
        if floats == (self._staging.numel() if self._staging is not None else 0):
            return
        self._pipeline.synchronize()
        self._staging = None  # the allocator waits for the upload stream before reusing it
        self._pipeline.set_upload_staging(0, 0)
        if floats:
            self._staging = torch.empty(floats, dtype=torch.float32, device=self._device)
            self._staging.record_stream(self._streams[1])  # freed only after the uploads using it
            self._pipeline.set_upload_staging(self._staging.data_ptr(), self._staging.nbytes)

    def _set_upload_terms(self, on: bool) -> None:
        if not on and self._pipeline.upload_terms:
            # The host kept no fp32 copy of these weights: take it from the device before the
            # next update reads it.
            self.synchronize()
            for s in self._order:
                if s.offloaded and not s.streamed and s.param.dtype == torch.float32:
                    self._pipeline.load_weights(s.host, s.weight.data_ptr(), self._current_stream())
        self._upload_terms = on
        self._pipeline.upload_terms = on
        self._plan_term_holding()
        if on:
            self._ensure_staging()
        else:
            self._pipeline.set_upload_staging(0, 0)
            self._staging = None

    @staticmethod
    def _host_tensor(host, name: str, like: torch.Tensor) -> torch.Tensor:
        return torch.frombuffer(host.view(name), dtype=torch.float32).view(like.shape)

    def _current_stream(self) -> int:
        if self._device.type == "cuda":
            return torch.cuda.current_stream(self._device).cuda_stream
        return 0

    def _install_gates(self) -> None:
        self._gates_on = bool(self._hosts)

    def _remove_gates(self) -> None:
        self._gates_on = False

    def _check_compiled(self, wrappers: list, compiled: list) -> None:
        for model in wrappers or [self._model]:  # (a wrapper's modules include the model's)
            check_compile_mode(model)
        if self._streamer is not None and compiled:
            raise UnsupportedSetupError(
                "weight streaming runs in eager mode: torch.compile would trace the streamed weights' "
                "device tensors, whose memory comes and goes between blocks. Train this model uncompiled, "
                "or give it a VRAM budget its weights fit (Tuning(streamed_blocks=0) stops streaming)")
        if self._pager is not None and compiled:
            self._pager.light_census = False  # light recompute is offered in eager mode only

    def _before_forward(self, args: tuple, kwargs: dict) -> None:
        check_autocast(self._device.type)
        if self._forwards == 0:  # a model compiled after wrap() is seen at its first forward
            wrappers = compiled_wrappers(self._model)
            compiled = wrappers + [m for m in self._model.modules() if _compiled(m)]
            seen = [id(m) for m in compiled]
            if seen != self._compiled_seen:  # (on the host's critical path: only on a change)
                self._check_compiled(wrappers, compiled)
                self._layout_gates(wrapped_by_compile=bool(wrappers))
                self._compiled_seen = seen
        if torch.is_grad_enabled():
            if self._forwards == 0 and self._profiler is not None:
                self._placement_window_starts(args, kwargs)
            self._forwards += 1
        if self._whole_forward_gate and self._gates_on:
            self._pipeline.gate(self._hosts, self._current_stream())
            self._release_terms()
            self._remove_gates()
        # Once no update is queued and every upload has finished, no module needs to wait for its
        # weights: the gates stand down until the next update is queued (_mark_updated). Within an
        # accumulation window, forwards after the first then make no native call per module.
        self._settle_verdict(wait=False)  # whether the next backward speculates
        if self._gates_on and not self._gate_always and self._pipeline.settled(self._hosts):
            self._release_terms()
            self._remove_gates()
        if self._streamer is not None:
            self._refresh_streamed_masters()
            self._streamer.begin_forward()

    def _gate_hook(self, module: torch.nn.Module):
        # A module that has gated on a stream need not again until another update is queued: its
        # weights' uploads were all waited for. So while the gates stay on (uploads still in
        # flight), later forwards of a window skip the native call and its lock.
        settled = (None, None)  # (uploads queued, stream) at this module's last gate

        @torch.compiler.disable
        def gate(_module, args):
            nonlocal settled
            if not self._gates_on:  # stood down (e.g. by this forward's _before_forward)
                return
            gated = self._gated.get(module)
            if not gated:
                return
            hosts, slots = gated
            now = (self._uploads_queued, self._current_stream())
            if now != settled or self._gate_always:
                self._pipeline.gate(hosts, now[1])
                settled = now
                if self._holding:
                    self._release_terms(slots)
        return gate

    # ------------------------------------------------------------------- during backward
    def _on_grad(self, param: torch.nn.Parameter) -> None:
        grad = param.grad
        if grad is None:
            return
        slot = self._slots[param]
        if grad.is_sparse:
            raise UnsupportedSetupError("sparse gradients are not supported by TrainStream")
        if not self._checked_processes and self._dp is None and self._shards is None:
            # a launcher may have added DDP after wrap()
            check_single_process()
            self._checked_processes = True
        task = torch._C._current_graph_task_id()
        if task not in self._backward_tasks:
            self._backward_tasks.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._on_backward_end(task))
            # whether this backward speculates: the last window's verdict may have landed since forward began
            self._settle_verdict(wait=False)
        if self._micro >= self.accumulation_steps:
            raise TrainingLoopError(
                f"accumulation_steps={self.accumulation_steps} backward passes have run since the "
                f"last optimizer.step(); call optimizer.step() before the next backward"
            )
        if self._profiler is not None and self._profiler.recording:
            self._profiler.gradient(slot.index)
        if self._shards is not None:
            # FSDP2 calls this hook itself, with the reduce-scattered shard (its stream current)
            # after each backward; with set_requires_gradient_sync(False) only after the last
            # micro-batch's, so the window's last is counted by forwards, as under DDP.
            self._take(slot, slot.mine(grad), last=self._forwards >= self.accumulation_steps)
        elif self._dp is None:  # under DDP the gradient is not reduced yet: see _on_reduced
            self._take(slot, grad, last=self._micro == self.accumulation_steps - 1)

    def _on_reduced(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """Under DDP: `param`'s gradient averaged over the ranks (a view of DDP's bucket, which DDP
        copies into .grad when backward ends). The window's last micro-batch is the one whose
        forward was the window's `accumulation_steps`-th."""
        self._take(self._slots[param], grad, last=self._forwards >= self.accumulation_steps)

    def _take(self, slot: _Slot, grad: torch.Tensor, last: bool) -> None:
        """One micro-batch's gradient of `slot`: summed, measured, sent or applied as its
        placement says."""
        param = slot.param
        first = not slot.landed
        if first:
            slot.landed = True
            self._arrival.append(slot)
        if slot.resident:
            if param._version != slot.version and "master_param" in slot.device_state:
                slot.device_state["master_param"].copy_(param.detach())  # bf16 weights written behind our back
                slot.version = param._version
            total = slot.device_state.get("accumulator")
            if total is not None:  # bf16 weights: micro-batches summed in fp32, as on the host
                if first:
                    total.copy_(grad)
                else:
                    total.add_(grad)
                param.grad = None
            return
        if slot.peer:  # another rank updates it; every rank measures it, for the same global norm
            if last and self._track_norm:
                self._measure_on_device(slot, grad, self._current_stream())
            return
        weight = slot.weight
        if weight._version != slot.version and not slot.streamed:  # the weights were changed behind our back
            self._pipeline.load_weights(slot.host, weight.data_ptr(), self._current_stream())
            slot.version = weight._version
        if slot.sum_in_vram and not last:
            return  # autograd adds the next micro-batch into param.grad
        host_sum = self._sums_on_host(slot)
        # With clipping, a gradient the device holds whole is measured there before it leaves, and
        # its update may start now with a clip coefficient of 1, committed at step() if the global
        # norm says so and redone from the untouched state if not.
        device_norm = last and not host_sum and (self.max_grad_norm is not None or
                                                 self._dp is not None and self._track_norm)
        speculate = device_norm and self._speculation_on and self._last_unclipped and self._speculates(slot)
        update_now = last and (self.max_grad_norm is None or speculate)
        job = dict(
            accumulate=host_sum,
            overwrite=host_sum and first,
            from_accumulator=host_sum,
            norm=last and self._track_norm and not device_norm,
        )
        stream = self._current_stream()  # (backward's: the norm and the copy are ordered after it)
        if device_norm:
            self._measure_on_device(slot, grad, stream, job)
        if update_now:
            hyper = self._hyper(slot, grad_scale=1.0)
            job.update(self._update_args(slot, hyper), speculate=speculate)
        self._send(slot, grad, job, stream)
        if speculate:
            slot.speculated = hyper
        elif update_now:
            self._mark_updated(slot)

    def _measure_on_device(self, slot: _Slot, grad: torch.Tensor, stream: int, job: dict | None = None) -> None:
        """Queues the squared norm of `grad` on `stream`; or, given the `job` that is about to send
        a CUDA gradient, has the pipeline take it on its download stream as the gradient leaves,
        off the stream that computes the next gradients (step() orders its stream after them)."""
        if self._grad_norms is None:  # the first clipped window (max_grad_norm may be set later)
            self._grad_norms = GradientNorms(self._device, len(self._order), self._resident)
        if grad.numel() and job is not None and grad.is_cuda:
            job["device_norm"], job["device_norm_scratch"] = self._grad_norms.target(
                slot.index, grad.numel(), self._streams[0])
        elif grad.numel():  # (an empty FSDP2 shard's slot stays 0)
            self._grad_norms.add(slot.index, grad, stream)
        slot.norm_on_device = True
        self._norm_pending = True

    def _sums_on_host(self, slot: _Slot) -> bool:
        return self.accumulation_steps > 1 and not slot.sum_in_vram and slot.offloaded

    def _send(self, slot: _Slot, grad: torch.Tensor, job: dict, stream: int) -> None:
        """Hands a gradient to the pipeline (copy out, after `stream`'s work so far; then `job` on
        the host) and frees it, or lends its memory to a speculated fp32 update term
        (_plan_term_holding)."""
        if not grad.is_contiguous():
            grad = grad.contiguous()
        hold = (job.get("speculate", False) and self._hold_terms and grad.dtype == torch.float32
                and grad.numel() == slot.weight.numel())
        if hold:
            job["device_term"] = grad.data_ptr()
        self._pipeline.land_gradient(slot.host, grad.data_ptr(), stream, **job)
        if grad.is_cuda:  # the download stream reads it: keep its memory from reuse until then
            grad.record_stream(self._streams[0])
            if hold:  # ...and the upload stream writes the term and applies it
                grad.record_stream(self._streams[1])
        if slot.held_term is not None:  # (land_gradient waited for this parameter's earlier jobs: it is applied)
            self._release_terms([slot])
        if hold:
            slot.held_term = grad
            self._holding[slot.index] = slot
            self._speculation["terms_held"] += 1
        if self._dp is None:  # (DDP's bucket is DDP's: step() clears .grad under DDP)
            slot.param.grad = None
        self._norm_pending = self._track_norm

    def _on_backward_end(self, task: int) -> None:
        self._backward_tasks.discard(task)
        # A reentrant checkpoint runs a nested backward inside a node of the outer one; only the
        # end of the outermost backward ends a micro-batch.
        if torch._C._current_autograd_node() is None:
            self._backward_tasks.clear()
            self._micro += 1
            if self._streamer is not None:
                self._streamer.end_backward()
            if self._profiler is not None and self._profiler.recording:
                self._profiler.end_backward()

    def _release_terms(self, slots: list | None = None) -> None:
        """Gives back the VRAM lent to terms of these slots (default: every one holding a term),
        whose jobs have all finished (their applying kernels are queued on the upload stream, which
        the allocator waits for)."""
        for s in list(self._holding.values()) if slots is None else slots:
            s.held_term = None
            self._holding.pop(s.index, None)

    def _hyper(self, slot: _Slot, grad_scale: float) -> dict:
        group = slot.group
        beta1, beta2 = group["betas"]
        return dict(
            lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
            weight_decay=float(group.get("weight_decay", 0.0)), step=slot.step + 1,
            grad_scale=grad_scale, maximize=bool(group.get("maximize", False)),
        )

    def _update_args(self, slot: _Slot, hyper: dict) -> dict:
        # (a streamed parameter's update writes its weights in host memory, where they stay)
        device = 0 if slot.streamed else slot.weight.data_ptr()
        return dict(update=True, device_weight=device, **hyper)

    def _mark_updated(self, *slots: _Slot) -> None:
        for slot in slots:
            if slot.offloaded:
                self._install_gates()
                self._uploads_queued += 1
            slot.updated = True
            slot.step += 1
            slot.state["step"].fill_(slot.step)

    # -------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        """Apply this accumulation window's gradients. Returns the closure's loss, if any.

        Without clipping, offloaded updates have already started during backward; with
        max_grad_norm they wait for the global gradient norm (on the host engine's threads, where
        the norm is on the device), then run in forward order. Resident parameters are updated
        here, on the current stream. Either way the next forward waits for exactly the weights it
        reads.
        """
        if grad_scaler is not None:
            raise UnsupportedSetupError(GRAD_SCALER_MESSAGE)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pending = [s for s in reversed(self._arrival) if not s.updated]  # forward order
        early = self._forwards < self.accumulation_steps  # a step before the window's last micro-batch
        if early and self._track_norm:
            for s in pending:  # a peer's norm is taken with the last micro-batch: not yet
                if s.peer and s.param.grad is not None and not s.norm_on_device:
                    self._measure_on_device(s, s.mine(s.param.grad), self._current_stream())
        if self._arrival:
            self._norm_slots = sorted(self._arrival, key=lambda s: s.index)
            self._device_norms = {}
            self._norm_on_device = {s for s in self._arrival if s.norm_on_device}
            if self._norm_on_device and self._device.type == "cuda":
                self._pipeline.order_after_norms(self._current_stream())  # (measured as they left)
            self._offload_norms = self._grad_norms.collect() if self._norm_on_device else None
        for s in pending:
            if not s.offloaded:
                continue
            # (under DDP, .grad also holds the sums the comm hook has already sent)
            held = s.param.grad
            if held is not None and s.sum_in_vram and (self._dp is None or early):
                # Still summing in VRAM: an early step, or no gradient in the last backward.
                self._send(s, s.mine(held), dict(norm=self._track_norm), self._current_stream())
            elif self._track_norm and (early if self._shards is not None else self._micro < self.accumulation_steps):
                # early step: the norm was not taken during backward
                self._pipeline.submit(s.host, from_accumulator=self._sums_on_host(s), norm=True)
        if self._shards is not None and self._track_norm and self._arrival:
            # The global norm is a collective under FSDP2: every rank takes it here, whatever
            # its shards, rather than wherever someone reads last_grad_norm.
            self._norm_pending = True
            _ = self.last_grad_norm
        if pending:
            resident = [(s, ResidentAdamW.gradient(s.param, s.device_state)) for s in self._norm_slots
                        if s.resident and not s.updated]
            resident = [(s, g) for s, g in resident if g is not None]
            norms = device_scale = None
            if resident and self._track_norm:
                norms = self._resident.norms([g for _, g in resident])
                self._device_norms = ([s for s, _ in resident], norms)
                self._norm_pending = True
            scale, verdict = 1.0, None
            if self.max_grad_norm is not None:
                if norms is not None and all(s.resident for s in self._norm_slots):
                    # every norm is on the device: so is the coefficient, and nothing waits for it
                    device_scale = self._resident.clip_scale(norms, self.max_grad_norm, _CLIP_EPS)
                elif self._verdict_on_device():
                    # so is the coefficient, which the host engine's jobs wait for instead of us
                    coefficient, verdict = self._land_verdict(resident, norms)
                    if isinstance(coefficient, torch.Tensor):
                        device_scale = coefficient
                    else:
                        scale = coefficient  # (CPU mode: already known)
                if device_scale is None and verdict is None:
                    scale = self._clip_coefficient()
            if verdict is None:
                unclipped = scale == 1.0 and math.isfinite(self._last_grad_norm or 0.0)
                self._resolve_speculation(pending, unclipped)
            else:
                self._expect_verdict(pending, verdict)
            # queued at once: the engine's threads take the pipeline's lock for every chunk
            jobs, commits, updated = {}, [], []
            hypers = {}  # built once for each group and step count (and only read)
            for s in pending:
                if s.resident:
                    continue
                updated.append(s)
                if s.peer:
                    continue
                key = (id(s.group), s.step)
                if key not in hypers:
                    hypers[key] = self._hyper(s, grad_scale=1.0)
                # a commit needs the speculation's premises intact: the same lr and update mode, and
                # no clip (known here, or judged by the engine when the verdict lands)
                speculated = s.speculated == hypers[key] and self._speculates(s)
                if speculated and (verdict is not None or unclipped):
                    commits.append(s)
                else:
                    hyper = hypers[key] if scale == 1.0 else self._hyper(s, grad_scale=scale)
                    jobs[s.host] = dict(from_accumulator=self._sums_on_host(s), scale=verdict,
                                        **self._update_args(s, hyper))
            if commits:
                self._commit(commits, verdict)
            if jobs:
                self._pipeline.submit_many(list(jobs), list(jobs.values()))
            self._mark_updated(*updated)
            self._update_resident(resident, scale, device_scale)
        if self._dp is not None and self._arrival:
            self._share_updates(self._arrival)
        for s in self._arrival:
            s.landed = s.updated = s.norm_on_device = False
            s.speculated = None
        self._arrival = []
        self._micro = 0
        self._forwards = 0
        self._windows += 1
        if self._profiler is not None and self.plan is None and self._profiler.complete:
            self._promote()
        elif self.plan is not None and not self._checked:
            self._check_peak()
        return loss

    def _share_updates(self, slots: list) -> None:
        """Under DDP: every rank's weights become their owners'. The broadcasts are queued in
        forward order (the same on every rank), each of an owner's as soon as that parameter's
        upload is (the host updates run in forward order too, so later ones overlap the first
        broadcasts). The reduced gradients DDP left in .grad go: sent, or a peer's."""
        stream = self._current_stream()
        sends = []
        for s in sorted(slots, key=lambda s: s.index):
            if s.offloaded:
                self._pipeline.gate([s.host], stream)
            sends.append(self._dp.broadcast(s.param, self._dp.owners[s.index]))
        for send in sends:
            send.wait()
        for p in self._slots:
            p.grad = None

    def _resolve_speculation(self, pending: list, unclipped: bool) -> None:
        """Counts the window as a hit, a miss or a wait; on a miss drops what is left of the
        speculative updates (the redo reads the state they never wrote). The next window
        speculates if this one's norm did not clip: a run that clips every step then waits, as
        without speculation, rather than doing each update twice."""
        if self.max_grad_norm is None or not any(s.offloaded for s in pending):
            return
        speculated = any(s.speculated for s in pending)
        if speculated and not unclipped:
            self._pipeline.abandon_speculation()
        self._count_window(speculated, any(self._speculates(s) for s in pending), unclipped)

    def _count_window(self, speculated: bool, speculates: bool, unclipped: bool) -> None:
        if speculated:
            self._speculation["hits" if unclipped else "misses"] += 1
        elif speculates:
            self._speculation["waited"] += 1
        self._last_unclipped = unclipped

    def _verdict_on_device(self) -> bool:
        """Whether this window's clip coefficient can be computed where all its norms are, the
        device (resident gradients, and offloaded ones measured before they left), and handed to
        the host engine there, so that no thread waits for it: one process, no host sums."""
        return (self._dp is None and self._shards is None and self._grad_norms is not None
                and all(s.resident or s in self._norm_on_device for s in self._norm_slots))

    def _land_verdict(self, resident: list, norms) -> tuple:
        """Queues the clip coefficient after the window's norms, and its download for the host
        engine; returns the coefficient for the resident update, and the verdict."""
        coefficient, on_device = self._grad_norms.verdict(
            [s.index for s, _ in resident], norms, sorted(s.index for s in self._norm_on_device),
            self.max_grad_norm, _CLIP_EPS)
        verdict = self._pipeline.land_scale(on_device.data_ptr(), self._current_stream())
        if on_device.is_cuda:  # the download stream reads it: keep its memory from reuse until then
            on_device.record_stream(self._streams[0])
        return coefficient, verdict

    def _expect_verdict(self, pending: list, verdict) -> None:
        """The window's speculation is counted once its verdict lands (the pipeline drops what is
        left of a speculation that the verdict redoes)."""
        self._settle_verdict(wait=True)  # the last window's, if it has not been counted yet
        if not any(s.offloaded for s in pending):
            return
        self._verdict = (verdict, any(s.speculated for s in pending), any(self._speculates(s) for s in pending))
        self._settle_verdict(wait=False)

    def _settle_verdict(self, wait: bool) -> None:
        if self._verdict is None:
            return
        verdict, speculated, speculates = self._verdict
        if not verdict.landed:
            if not wait:
                return
            self._pipeline.wait_scale(verdict)
        self._verdict = None
        self._count_window(speculated, speculates, verdict.commits)

    @property
    def speculation(self) -> dict:
        """With clipping: offloaded parameters whose updates may start before the global norm is
        known, host bytes their next-state buffers take, VRAM their fp32 update terms may hold
        while they await the verdict (vram_term_bytes, 0 when the terms wait in host memory) and
        how many terms have done so (terms_held), and windows committed (hits), redone (misses) or
        not speculated because the last norm clipped (waited)."""
        self._settle_verdict(wait=True)
        return self._speculation

    def _update_resident(self, items: list, scale: float, device_scale: torch.Tensor | None) -> None:
        """One launch (or host call) per set of parameters that share their hyperparameters: their
        group's and their step count."""
        batches: dict[tuple, list] = {}
        for s, grad in items:
            batches.setdefault((id(s.group), s.step), []).append((s, grad))
        for batch in batches.values():
            hyper = self._hyper(batch[0][0], scale)
            self._resident.update([(s.param, g, s.device_state) for s, g in batch], hyper, device_scale)
            self._mark_updated(*(s for s, _ in batch))

    @property
    def pack_gradients(self) -> bool:
        """Send fp32 gradients whose values are bf16 (weight gradients under bf16 autocast) as
        bf16, losslessly: half the PCIe and host-memory bytes (default True). Not done while
        blocks are paged or recomputed for a budget (or a share of activations is asked for): the
        pack kernels take SMs from backward, which that makes the longer side of the step
        (activations="auto" with Tuning(placement="offload") pages only what hides behind compute)."""
        return self._pack

    @pack_gradients.setter
    def pack_gradients(self, on: bool) -> None:
        self._pack = bool(on)
        self._sync_packing()

    @property
    def speculative_clipping(self) -> bool:
        """With max_grad_norm: start each offloaded update as its gradient lands, with a clip
        coefficient of 1, into a second set of state buffers; step() commits it when the global
        norm does not clip and redoes it from the untouched state when it does (default True).
        The weights and state are the same bits either way; only when the updates run changes.
        After a window whose norm clipped, the next one waits for the norm instead. Off from
        wrap() (`Tuning(speculative_clipping=False)`), it takes no host memory; turned off later,
        the memory it took stays held."""
        return self._speculation_on

    @speculative_clipping.setter
    def speculative_clipping(self, on: bool) -> None:
        self._speculation_on = bool(on)
        planned = self._placement != "auto" or self.plan is not None  # (else the plan takes them)
        if self._speculation_on and not self._speculation["params"] and planned:
            self._enable_speculation()  # off from wrap(): the second sets are taken now

    @property
    def upload_update_terms(self) -> bool:
        """fp32 weights: the host sends AdamW's update term and the GPU adds it to its decayed
        weights (default True), instead of the host keeping an fp32 copy of the weights current
        and sending that: the host reads 24 bytes a parameter instead of 28, and the weights come
        out bit for bit the same. It stages through a VRAM buffer of at most 64 MiB."""
        return self._pipeline.upload_terms

    @upload_update_terms.setter
    def upload_update_terms(self, on: bool) -> None:
        self._set_upload_terms(bool(on))

    def _sync_packing(self) -> None:
        pager = self.activation_pager
        if self.plan is not None:
            paging = self.plan.hooks and (self.plan.paged > 0 or bool(self.plan.recomputed))
        else:
            paging = pager is not None and (pager.vram_budget is not None or bool(pager.share))
        self._pipeline.pack_gradients = self._pack and not paging

    def _clip_coefficient(self) -> float:
        total = self.last_grad_norm
        return clip_coefficient(total, self.max_grad_norm, _CLIP_EPS)

    @property
    def last_grad_norm(self) -> float | None:
        """Global L2 norm of the last window's gradients (before clipping), for logging.

        Measured when max_grad_norm is set or with Tuning(track_grad_norm=True); None otherwise. The
        parameters' squared norms are added in forward order whatever their placement, so the
        norm (and the clipping) has the same bits for every placement.
        """
        if self._norm_pending:
            on_host = [s.host for s in self._norm_slots if s.offloaded and s not in self._norm_on_device]
            if on_host:
                self._pipeline.wait(on_host)
            if isinstance(self._device_norms, tuple):
                slots, pending = self._device_norms
                self._device_norms = dict(zip(slots, pending.values()))
            offloaded = self._offload_norms.values() if self._norm_on_device else None
            total = 0.0  # added in order, one rounding each, as the device adds them (not sum())
            for s in self._norm_slots:
                if s.resident:
                    total += self._device_norms.get(s, 0.0)
                elif s in self._norm_on_device:
                    total += offloaded[s.index]
                else:
                    total += s.host.squared_norm
            if self._shards is not None:
                total = self._shards.global_squared_norm(total, self._device)
            self._last_grad_norm = math.sqrt(total)
            self._norm_pending = False
        return self._last_grad_norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears gradients left on the device: resident parameters' and any a caller left
        behind, and the unsent sums of micro-batches summed in VRAM (as torch's zero_grad would)."""
        for p in self._slots:
            p.grad = None

    def synchronize(self) -> None:
        """Wait for every queued host update and order the current stream after its upload."""
        self._pipeline.synchronize()
        self._pipeline.gate(self._hosts, self._current_stream())
        self._release_terms()

    # ------------------------------------------------------------------- placement
    def _placement_window_starts(self, args: tuple, kwargs: dict) -> None:
        """At a window's first forward: profile window 2 (window 1 runs cold). The plan follows at
        the end of that window's step(), between steps, where no hook is running."""
        profiler = self._profiler
        if self.plan is None and self._windows == 1 and not profiler.recording and not profiler.complete:
            self.synchronize()  # the profiled forward computes; it does not wait for uploads
            self._bandwidths = measure_bandwidths(self._device)  # while little is allocated
            if self.activation_pager is not None and self.activation_pager.deferred:
                self.activation_pager.time_next_forward = True  # its block times: the same forward
            profiler.start_forward(args, kwargs)

    def _promote(self) -> None:
        """Plans from the profile and moves everything where the plan puts it: a wait for the
        host's last updates, then one copy of the moments (and bf16 masters) into VRAM."""
        self.synchronize()
        profile = self._build_profile()
        budget = self.vram_budget
        plan = planner.plan_placement(profile, budget)
        profiled_peak = max(profile.forward_peak, profile.tail_peak)
        if not plan.fits and profiled_peak <= budget:
            # The estimate (with its reserve) says no, but the profiled steps ran within the budget:
            # take every saving (the plan as it stands) rather than refuse what just worked.
            log.warning("trainstream: the planner's estimate of the leanest placement (%.2f GB with a %.2f GB "
                        "reserve) exceeds the %.2f GB budget, but the profiled steps peaked at %.2f GB; "
                        "training in the leanest placement", plan.expected_peak / 1e9, plan.reserve / 1e9,
                        budget / 1e9, profiled_peak / 1e9)
        elif not plan.fits:
            smallest = planner.smallest_plan(profile)
            floor = planner.peak_bytes(profile, smallest)
            weights = planner.device_weight_bytes(profile, smallest.streamed)
            raise VramBudgetError(
                f"the step cannot fit a VRAM budget of {budget / 1e9:.2f} GB: with every gradient and "
                f"AdamW state offloaded, every block recomputed and paged (as far as host memory holds) and "
                f"{'every' if smallest.streamed == len(profile.blocks) else smallest.streamed} block's "
                f"weights streamed, it still needs "
                f"{floor / 1e9:.2f} GB (weights on the GPU {weights / 1e9:.2f} GB + activations and "
                f"workspace {(floor - weights) / 1e9:.2f} GB) + a reserve of "
                f"{planner.reserve_for(budget) / 1e9:.2f} GB for the estimate. Raise the budget, lower "
                f"the batch or sequence length, or use bf16 weights.")
        self._profile = profile
        self._apply(plan)
        log.info("trainstream %s", self.describe())

    def _build_profile(self) -> planner.Profile:
        pager = self.activation_pager
        deferred = pager is not None and pager.deferred
        if deferred:
            pager.finish_profile()
        times = self._profiler.timings(pager.profiled_marks if deferred else None)
        blocks, block_of = [], {}
        figures = pager.last if pager is not None else None
        if deferred and pager.profile is not None:
            prof = pager.profile
            casts = figures.block_cast_bytes or [0] * len(pager.blocks)
            tied = shared_outside(pager.blocks, self._model)
            light = pager.light or [None] * len(pager.blocks)  # (kept bytes, cheap ops, bytes they write, all ops)
            op_host_s = light_recompute.dispatch_seconds(self._device) if pager.light else 0.0
            blocks = [planner.BlockCost(b, i, t, c, weight_bytes=sum(p.numel() * p.element_size()
                                                                     for p in pager.blocks[j].parameters()),
                                        streamable=j not in tied,
                                        light_bytes=None if lt is None else lt[0],
                                        light_s=0.0 if lt is None else light_recompute.seconds(
                                            *lt[1:], self._bandwidths[2], op_host_s))
                      for j, (b, i, t, c, lt) in enumerate(zip(prof.block_bytes,
                                                               prof.block_input_bytes or [0] * len(prof.block_bytes),
                                                               prof.block_seconds, casts, light))]
        if pager is not None and pager.blocks:
            for j, block in enumerate(pager.blocks):
                for p in block.parameters():
                    block_of.setdefault(p, j)
        inside = [s.index for s in self._order if s.param in block_of]
        n = len(blocks)
        params = []
        for s in self._order:
            j = block_of.get(s.param)
            where = min(j, n) if j is not None else (-1 if inside and s.index < inside[0] else n)
            params.append(planner.ParamCost(
                # a peer's state and update are another rank's: keeping it costs this rank nothing
                name=self._name(s), numel=0 if s.peer else s.weight.numel(), element_size=s.param.element_size(),
                block=where,
                need_s=times["need_s"][s.index], arrival_s=times["arrival_s"][s.index],
                segment_peak=times["segment_peak"][s.index]))
        if blocks and times["replayed"]:
            # A recomputed block costs its share of the replayed forward (compute alone), not its
            # time in the profiled step, which the paging there stretched.
            spans = block_spans([p.need_s for p in params], [p.block for p in params], n, times["forward_s"])
            blocks = [b if span is None else replace(b, recompute_s=RECOMPUTE_PER_FORWARD * span)
                      for b, span in zip(blocks, spans)]
        stats, start = self._pipeline.stats(), self._stats_at_start
        updated = stats["updated_elements"] - start["updated_elements"]
        host_rate = (stats["busy_seconds"] - start["busy_seconds"]) / updated if updated else 0.0
        d2h, h2d, vram = self._bandwidths
        hook_s = lean_hook_s = 0.0
        if figures is not None:
            # the hooks' host time as measured, less what paging took in it, and less the kept
            # tensors' bookkeeping where nothing is paged (the device's recasts come on top); an
            # estimate where none was (the profiled step ran without them)
            calls = figures.hook_seconds - figures.paging_seconds if figures.hook_seconds else figures.packs * _PACK_S
            recasts = 3 * figures.recast_bytes / vram
            hook_s = calls + recasts
            lean_hook_s = max(0.0, calls - figures.keeping_seconds) + recasts
        return planner.Profile(
            params=params, blocks=blocks, accumulation_steps=self.accumulation_steps,
            clipping=self.max_grad_norm is not None, forward_s=times["forward_s"], backward_s=times["backward_s"],
            forward_peak=self._profiler.forward_peak, tail_peak=self._profiler.tail_peak,
            host_s_per_param=host_rate, d2h_bytes_per_s=d2h, h2d_bytes_per_s=h2d, device_bytes_per_s=vram,
            profiled_paged=pager._paged_upto if pager is not None else 0, profiled_hooks=pager is not None,
            outside_cast_bytes=figures.outside_cast_bytes if figures is not None else 0, hook_s=hook_s,
            lean_hook_s=lean_hook_s,
            weight_bytes=sum(p.numel() * p.element_size() for p in self._model.parameters()),
            fixed_activations=not deferred, streamed=self._streamed_count() if blocks else 0,
            stream_depth=self._prefetch_depth, recompute=pager is None or pager.recompute,
            host_room=None if math.isinf(room := self._host_room()) else int(room) + self._paging_slot_bytes())

    def _streamed_count(self) -> int:
        return len(self._streamer.modules) if self._streamer is not None else 0

    def _owner(self, slot: _Slot) -> str:
        return f"rank {self._dp.owners[slot.index]}" if self._dp is not None else "other ranks (empty shard here)"

    def _name(self, slot: _Slot) -> str:
        return self._names.get(slot.param, f"param{slot.index}")

    def _apply(self, plan: planner.Plan) -> None:
        """Moves every parameter to where `plan` puts it (between steps: nothing is in flight)."""
        self.synchronize()
        _ = self.last_grad_norm  # the window's norm, read where its parts were taken
        pager = self._pager
        streamed = self._streamed_count()
        if plan.streamed > streamed:  # (the profiled steps' streamed blocks stay streamed)
            blocks = pager.blocks
            self._stream(blocks[len(blocks) - plan.streamed:len(blocks) - streamed])
        for i, s in enumerate(self._order):
            if s.peer:  # (costs this rank nothing: see _build_profile)
                continue
            resident = i < plan.resident and not s.streamed
            if resident != s.resident:
                self._move(s, resident)
            if self._dp is not None:  # micro-batches are summed where DDP sums them
                s.sum_in_vram = not resident and self.accumulation_steps > 1
                continue
            summable = not resident and self.accumulation_steps > 1 and s.param.dtype == torch.float32
            wanted = self._vram_sums if self._vram_sums is not None else i < plan.resident + plan.vram_sums
            # (without a host accumulator, the sums can only be in VRAM)
            s.sum_in_vram = summable and (wanted or not s.host.has_accumulator) and not s.streamed
        if pager is not None and pager.deferred:
            if plan.hooks or plan.recomputed or plan.light:
                pager.reattach()
                pager.apply(plan.paged if plan.hooks else 0, plan.recomputed, "placement planner", hooks=plan.hooks,
                            light=plan.light, recompute_seconds=planner.recompute_seconds(self._profile, plan))
                self.activation_pager = pager
            else:  # (a re-plan may need it again: _check_peak)
                pager.remove()
                self.activation_pager = None
        self.plan = plan
        self._enable_speculation()
        self._build_gates()
        if self._upload_terms:
            self._ensure_staging()
        self._sync_packing()
        if self._device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self._device)

    def _move(self, slot: _Slot, resident: bool) -> None:
        p = slot.param
        if resident:
            # (under DDP, .grad holds the window's sum: no fp32 sum of micro-batches beside it)
            state = ResidentAdamW.new_state(p, self.accumulation_steps if self._dp is None else 1)
            host = self._host_state(slot)
            for key, value in host.items():  # the host's state (and bf16 master) carries over
                state[key].copy_(value)
            slot.device_state = state
            slot.state.update({k: v for k, v in state.items() if k != "accumulator"})
        else:
            host = self._host_state(slot)
            for key, value in host.items():
                value.copy_(slot.device_state[key])
            slot.device_state = None
            slot.state.update(host)
            if p.dtype == torch.float32 and not self._upload_terms:
                self._pipeline.load_weights(slot.host, p.data_ptr(), self._current_stream())
        slot.version = p._version
        slot.resident = resident

    def _check_peak(self) -> None:
        """After the first planned window: if its peak went over the budget, the estimate was
        short; plan again once with the difference added."""
        self._checked = True
        if self._device.type != "cuda" or self.vram_budget is None or self._profile is None:
            return
        observed = torch.cuda.max_memory_allocated(self._device)
        self.plan.observed_peak = observed
        if observed <= self.plan.budget:
            return
        short = observed - self.plan.expected_peak
        plan = planner.plan_placement(self._profile, max(1, self.plan.budget - short))
        log.warning("trainstream: the step peaked at %.2f GB, over the %.2f GB budget (expected %.2f GB); "
                    "re-planning with %.2f GB less", observed / 1e9, self.plan.budget / 1e9,
                    self.plan.expected_peak / 1e9, short / 1e9)
        self._apply(replace(plan, budget=self.plan.budget, observed_peak=observed))

    def describe(self) -> str:
        """Where everything lives and why, in a few readable lines."""
        lines = []
        if self.plan is not None and self._profile is not None:
            lines.append(planner.describe(self.plan, self._profile))
        else:
            resident = sum(s.resident for s in self._order)
            offloaded = sum(s.offloaded for s in self._order)
            state = "profiling the first steps with everything offloaded" if self._profiler else "fixed"
            lines.append(f"placement ({state}): {resident} of {len(self._order)} parameters keep gradient and "
                         f"AdamW state in VRAM, {offloaded} offloaded to host memory")
        if self._streamer is not None and (self.plan is None or not self.plan.streamed):
            lines.append(f"weights: {len(self._streamer.modules)} blocks' ({self._streamer.weight_bytes / 1e9:.2f} GB) "
                         f"stream from host memory, one block ahead of their use")
        host = self._host_memory_line()
        if host:
            lines.append(host)
        clipping = self._clipping_line()
        if clipping:
            lines.append(clipping)
        share = self._distributed_report()
        if share is not None:
            what = ("parameters; the others' new weights come from their owners" if self._dp is not None else
                    "parameters' shards; FSDP2 all-gathers the weights")
            lines.append(f"{share['engine']}: rank {share['rank']} of {share['world_size']} updates "
                         f"{share['owned_params']} of {len(self._order)} {what} "
                         f"({share['owned_elements'] / 1e6:.1f}M elements of state on this host)")
        if self.activation_pager is not None:
            lines.append(self.activation_pager.describe())
        return "\n".join(lines)

    def _clipping_line(self) -> str:
        """How many offloaded updates start before the global norm is known, what that holds, and
        how the windows went; how many wait for the norm."""
        offloaded = sum(1 for s in self._order if s.offloaded and not s.peer)
        if self.max_grad_norm is None or not offloaded:
            return ""
        spec = self.speculation
        if not spec["params"]:
            off = "" if self._speculation_on else " (speculative_clipping is off)"
            return f"clipping: the updates of all {offloaded} offloaded parameters wait for the global norm{off}"
        held = (f", up to {spec['vram_term_bytes'] / 1e9:.2f} GB of VRAM for fp32 terms awaiting the verdict"
                if spec["vram_term_bytes"] else "")
        rest = offloaded - spec["params"]
        return (f"clipping: {spec['params']} offloaded parameters start their update before the global norm is known "
                f"({spec['host_bytes'] / 1e9:.2f} GB of host memory for it{held})"
                + (f", the other {rest} wait for it" if rest else "")
                + f"; windows committed {spec['hits']}, redone {spec['misses']}, waited after a clip {spec['waited']}")

    def _host_memory_line(self) -> str:
        """Host memory by what it holds, per parameter that has host state ("" if none)."""
        used, paging = self._pipeline.host_used_bytes, self._paging_slot_bytes()
        if not used and not paging:
            return ""
        slots = [s for s in self._order if s.host is not None]
        held = ["fp32 master", "two moments", "a gradient buffer"]
        if any(s.host.has_accumulator for s in slots):
            held.append("an fp32 sum of micro-batches")
        if any(s.streamed and s.param.dtype == torch.bfloat16 for s in slots):
            held.append("streamed bf16 weights")
        numel = sum(s.weight.numel() for s in slots)
        parts = [f"{format_size(used)} {self._pipeline.host_memory_kind} for the offloaded state"
                 + (f" ({used / numel:.1f} B a parameter: {', '.join(held)})" if numel else "")]
        # (the profiled steps offload every parameter; the arena keeps what they took)
        kept = sum(1 for s in slots if s.resident)
        if kept:
            parts[0] += f", still held for the {kept} parameters now resident"
        if paging:
            parts.append(f"{format_size(paging)} of slots for paged activations")
        return "host memory: " + ", ".join(parts)  # (speculation's: on the clipping line)

    # ------------------------------------------------------------------- checkpoints
    def state_dict(self):
        """torch.optim.AdamW's state dict. Under DDP each rank holds the state of the parameters
        it owns, and this gathers all of them: a collective that every rank calls (as with
        torch.distributed.checkpoint), after which every rank holds the whole dict."""
        self.synchronize()
        local = super().state_dict()
        if self._dp is not None:
            return self._dp.gather_state(local)
        if self._shards is not None:
            return self._sharded_state_dict(local)
        return local

    def _sharded_state_dict(self, local: dict) -> dict:
        """Under FSDP2, torch AdamW's format as FSDP2 gives it (and torch.distributed.checkpoint
        saves it): each state tensor a DTensor sharded as its parameter, whose local part is this
        rank's host copy; ranks whose shard of a parameter is empty hold empty parts."""
        index = {id(p): i for group, saved in zip(self.param_groups, local["param_groups"])  # torch's numbering
                 for p, i in zip(group["params"], saved["params"])}
        state = {}
        for slot in self._order:
            i = index[id(slot.param)]
            entry = local["state"].get(i) if not slot.peer else None
            if entry is None:  # an empty shard: what the ranks that hold some of it have, with no elements
                empty = torch.zeros(slot.weight.shape, dtype=torch.float32)
                entry = {"step": torch.tensor(float(slot.step)), "exp_avg": empty, "exp_avg_sq": empty.clone()}
                if slot.param.dtype == torch.bfloat16:
                    entry["master_param"] = empty.clone()
            state[i] = {k: self._shards.as_shard_of(v, slot.param) if k != "step" else v for k, v in entry.items()}
        return {"state": dict(sorted(state.items())), "param_groups": local["param_groups"]}

    def load_state_dict(self, state_dict) -> None:
        """Load a torch.optim.AdamW (or our own) state dict, whatever placement wrote it: tensors
        are copied to where this optimizer keeps them. Under DDP, every rank loads the whole dict
        and keeps what it owns."""
        self.synchronize()
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"state dict has {len(saved_groups)} param groups, optimizer has "
                             f"{len(self.param_groups)}")
        index = {}
        for group, saved in zip(self.param_groups, saved_groups):
            if len(group["params"]) != len(saved["params"]):
                raise ValueError("state dict param group sizes do not match the optimizer's")
            for p, i in zip(group["params"], saved["params"]):
                index[i] = p
            for key, value in saved.items():
                if key != "params":
                    group[key] = value
        for i, state in state_dict["state"].items():
            p = index[i]
            slot = self._slots.get(p)
            if slot is None or slot.peer:
                continue
            weight = slot.weight
            for key in ("exp_avg", "exp_avg_sq"):
                slot.state[key].copy_(self._local_state(state[key], slot))
            slot.step = int(state["step"])
            slot.state["step"].fill_(slot.step)
            if "master_param" in state and "master_param" in slot.state:
                slot.state["master_param"].copy_(self._local_state(state["master_param"], slot))
                with torch.no_grad():
                    weight.copy_(slot.state["master_param"].to(weight.device, weight.dtype))
                slot.version = weight._version
            elif weight._version != slot.version:  # the model's weights were loaded: the master follows them
                if not slot.resident:
                    self._pipeline.load_weights(slot.host, weight.data_ptr(), self._current_stream())
                elif "master_param" in slot.state:
                    slot.state["master_param"].copy_(weight.detach())
                slot.version = weight._version

    def _local_state(self, value: torch.Tensor, slot: _Slot) -> torch.Tensor:
        """A saved state tensor as this process holds it: under FSDP2, this rank's shard of it."""
        value = value.detach()
        if self._shards is not None:
            value = self._shards.local_of(value, slot.param)
        return value.reshape(slot.weight.shape)

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_slots", None) is None:  # during torch's own __init__
            return super().add_param_group(param_group)
        raise UnsupportedSetupError(
            "adding param groups after trainstream.wrap() is not supported; add them to the "
            "optimizer before wrapping")

    # ---------------------------------------------------------------------- figures
    def report(self) -> dict:
        """What TrainStream holds where, and how the host engine runs."""
        numel = sum(s.weight.numel() for s in self._order)
        fp32 = [s for s in self._order if s.param.dtype == torch.float32 and s.offloaded]
        packed = sum(s.weight.numel() for s in fp32 if s.host.last_gradient_as_bf16)
        return {
            "trainable_params": numel,
            "host_memory_kind": self._pipeline.host_memory_kind,
            "host_bytes_reserved": self._pipeline.host_reserved_bytes,
            "host_bytes_used": self._pipeline.host_used_bytes,
            "host_bytes_per_param": self._pipeline.host_used_bytes / max(numel, 1),
            "isa": self._pipeline.isa,
            "threads": self._pipeline.threads,
            "engine_niceness": self._pipeline.niceness,  # how much nicer than the training loop they run
            "accumulation_steps": self.accumulation_steps,
            "max_grad_norm": self.max_grad_norm,
            "last_grad_norm": self.last_grad_norm,
            # share of offloaded fp32 weights whose last gradient was bf16-exact (under bf16
            # autocast, the matmuls') and crossed as bf16; each one is tested, so none is rounded
            "gradients_sent_as_bf16": packed / max(sum(s.weight.numel() for s in fp32), 1),
            # VRAM besides the weights: the buffer fp32 update terms cross through (64 MiB at most)
            "vram_staging_bytes": self._staging.nbytes if self._staging is not None else 0,
            "placement": self._placement_report(),
            "speculation": dict(self.speculation),  # clipping without waiting (see the property)
            "activations": self.activation_pager.report() if self.activation_pager else "off",
            # under DDP or FSDP2: this rank, and the parameters (or shards) whose state and updates are its own
            "distributed": self._distributed_report(),
        }

    def _distributed_report(self) -> dict | None:
        engine = self._dp or self._shards
        if engine is None:
            return None
        return {"engine": "DistributedDataParallel" if self._dp is not None else "FSDP2",
                "rank": engine.rank, "world_size": engine.world,
                "owned_params": sum(not s.peer for s in self._order),
                "owned_elements": sum(s.weight.numel() for s in self._order if not s.peer)}

    def _placement_report(self) -> dict:
        plan = self.plan
        out = {
            "mode": self._placement if isinstance(self._placement, str) else f"share {self._placement:g}",
            "state": "planned" if plan is not None else "profiling" if self._profiler is not None else "fixed",
            "resident_params": sum(s.resident for s in self._order),
            "offloaded_params": sum(s.offloaded for s in self._order),
            "vram_budget_bytes": self.vram_budget,
            "streamed_blocks": len(self._streamer.modules) if self._streamer is not None else 0,
            "streamed_weight_bytes": self._streamer.weight_bytes if self._streamer is not None else 0,
            "params": [{
                "name": self._name(s), "numel": s.param.numel(),
                "weight": "host (streamed)" if s.streamed else "vram",
                "gradient": "vram" if s.resident else "host" if not s.peer else self._owner(s),
                "state": "vram" if s.resident else "host" if not s.peer else self._owner(s),
                "window_sum": None if self.accumulation_steps == 1 else
                "vram" if s.resident or s.sum_in_vram else "host",
            } for s in self._order],
        }
        if plan is not None:
            out.update({
                "blocks": planner.block_kinds(plan, len(self._profile.blocks) if self._profile else 0),
                "recomputed": list(plan.recomputed), "recomputed_lightly": list(plan.light), "saved_tensor_hooks": plan.hooks,
                "expected_peak_bytes": plan.expected_peak, "reserve_bytes": plan.reserve,
                "observed_peak_bytes": plan.observed_peak,
                "expected_step_s": plan.expected_step_s, "step_terms": dict(plan.step_terms),
                "moves": list(plan.moves),
                # what the plan was made from, for a person comparing it with what ran
                "profile": asdict(self._profile) if self._profile is not None else None,
            })
        return out

    def remove_hooks(self) -> None:
        """Detach from the model (after a final synchronize); the optimizer is unusable after."""
        self.synchronize()
        for h in self._hooks + self._gate_hooks:
            h.remove()
        self._hooks = []
        for s in self._order:
            if wrapped_by(s.param) is self:
                del _OWNERS[id(s.param)]
        self._remove_gates()
        if self._dp is not None:  # DDP keeps the communication hook; it goes back to a plain all-reduce
            self._dp.detach()
        if self.activation_pager is not None:
            self.activation_pager.remove()
        if self._streamer is not None and (left := self._streamer.remove()):
            log.warning("trainstream: remove_hooks(): %.2f GB of the streamed blocks' weights do not fit the "
                        "device and stay in host memory (move the model or its blocks where they should "
                        "go, e.g. model.cpu() to save it)", left / 1e9)
