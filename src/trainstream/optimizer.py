"""The optimizer that wrap() returns: torch.optim.AdamW's interface over a placement of its state.

Each trainable parameter is either *offloaded* or *resident*. An offloaded parameter's gradient
leaves the device from a post-accumulate-grad hook (backward.py); the native pipeline
(trainstream._C.OffloadPipeline) folds, clips and applies it on host threads and uploads the new
weights; forward gates (gates.py) make the compute stream wait for exactly the uploads each module
reads. A resident parameter keeps gradient and AdamW state beside its weights and is updated at
step() by trainstream.resident, with the host engine's arithmetic bit for bit. Which is which comes
from the placement planner after profiling the first steps (promotion.py), or from wrap()'s
`placement`. Clipping (clipping.py) takes the global norm and lets updates start before it is
known; checkpoint.py gives torch's state-dict format, describe.py the figures.

This class tells the step's story and keeps torch's optimizer API on top; each of those rooms gets
what it needs from here, explicitly.
"""

from __future__ import annotations

import logging
import weakref

import torch

from trainstream import eight_bit
from trainstream import placement as planner
from trainstream import progress
from trainstream.backward import GradientHooks
from trainstream.checkpoint import Checkpoint
from trainstream.clipping import Clipping
from trainstream.describe import Reporter
from trainstream.distributed import local_shard
from trainstream.errors import GRAD_SCALER_MESSAGE, UnsupportedSetupError, check_autocast, check_compile_mode
from trainstream.gates import ForwardGates
from trainstream.host_adamw import DTYPE_NAMES
from trainstream.promotion import Promotion
from trainstream.resident import ResidentAdamW
from trainstream.slots import Engine, Slot, Slots, Window, hyperparameters, trainable_in_forward_order, update_args
from trainstream.tuning import Tuning

log = logging.getLogger("trainstream")

# id(parameter) -> (the parameter, its optimizer), both weakly: tensors compare by value, not by
# identity, so they cannot be the keys of a WeakKeyDictionary
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}
_LIVE: weakref.WeakSet = weakref.WeakSet()  # every OffloadedAdamW not yet collected


def held_by_live_optimizers() -> tuple[int, int]:
    """How many TrainStream optimizers of this process are alive, and the host bytes they hold."""
    live = list(_LIVE)
    return len(live), sum(o._host_held() for o in live)


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


def weakly(method):
    """`method` through a weak reference to its object. A tensor's hooks are held from C++, where
    the garbage collector cannot see them: a bound method there would keep the optimizer, its
    parameters and every buffer alive after the user drops both model and optimizer. Its parts'
    callbacks go the same way, so that no cycle waits for the collector: the last reference
    dropped gives the pinned memory back at once."""
    owner, func = weakref.ref(method.__self__), method.__func__

    def call(*args):
        if (obj := owner()) is not None:
            return func(obj, *args)
    return call


def _forget_dead_owners() -> None:
    for key in [k for k, (p, o) in _OWNERS.items() if p() is None or o() is None]:
        del _OWNERS[key]


class OffloadedAdamW(torch.optim.Optimizer):
    """AdamW whose state lives where the placement puts it, updated on host threads or the GPU.

    Shares ``param_groups`` with the optimizer it was built from, so LR schedulers and code that
    edits ``lr`` keep working. Use it like the original: ``loss.backward(); opt.step();
    opt.zero_grad()``. Build it with :func:`trainstream.wrap`.

    Its rooms are attributes, for tools and tests (not a stable API): ``engine`` (the native
    pipeline and streams), ``slots`` (the parameters), ``window``, ``gates``, ``gradient_hooks``,
    ``clipping``, ``promotion``.
    """

    # Lets torch.amp.GradScaler hand itself to step(), where it is refused with a clear message.
    _step_supports_amp_scaling = True

    def __init__(self, source: torch.optim.Optimizer, model: torch.nn.Module, engine: Engine, *,
                 tuning: Tuning, max_grad_norm: float | None, accumulation_steps: int,
                 vram_budget: int | None = None, activation_pager=None, data_parallel=None, sharded=None,
                 streamed: list[torch.nn.Module] | None = None, residents: int | None = None) -> None:
        super().__init__(source.param_groups, source.defaults)
        self.param_groups = source.param_groups  # the very same list: edits show on both sides
        self._model = model
        self._dp = data_parallel  # trainstream.distributed.DataParallel under DDP, else None
        self._shards = sharded  # trainstream.distributed.Sharded under FSDP2, else None
        self._vram_sums = tuning.accumulate_in_vram  # None: the planner's choice per parameter
        self.eight_bit = eight_bit.is_adamw8bit(source)  # torchao's AdamW8bit: trainstream.eight_bit
        self._source = source  # (read for its kind and flags: eight_bit.state_format)
        self._rounding_base = torch.initial_seed()  # torch.manual_seed() before wrap() fixes the rounding
        maps = eight_bit.maps() if self.eight_bit else None
        if maps is not None:
            engine.pipeline.set_quantization_maps(maps[0].data_ptr(), maps[1].data_ptr())
        self._resident = ResidentAdamW(engine.device, tuning.threads, tuning.isa, maps=maps)
        self._pack = True
        self.engine = engine
        self.slots = Slots(model, accumulation_steps, eight_bit.Shown(maps))
        self.window = Window()
        self.clipping = Clipping(engine, self.slots, self._resident, max_grad_norm=max_grad_norm,
                                 track_grad_norm=tuning.track_grad_norm, speculative=tuning.speculative_clipping,
                                 data_parallel=data_parallel, shards=sharded,
                                 vram_room=weakly(self._vram_room), host_held=weakly(self._host_held))
        self.gates = ForwardGates(engine, self.slots, model, whole_forward=sharded is not None,
                                  release_terms=self.clipping.release_terms, holds_terms=self.clipping.holds_terms)
        self.promotion = Promotion(engine, self.slots, self.window, self.clipping, model, pager=activation_pager,
                                   placement=tuning.placement, vram_budget=vram_budget,
                                   accumulate_in_vram=tuning.accumulate_in_vram, add_on_host=tuning.add_on_host,
                                   prefetch_depth=tuning.prefetch_depth,
                                   data_parallel=data_parallel, synchronize=weakly(self.synchronize),
                                   tiers_changed=weakly(self._tiers_changed), planned=weakly(self._planned),
                                   host_held=weakly(self._host_held))
        self.gradient_hooks = GradientHooks(engine, self.slots, self.window, self.clipping, self.gates,
                                            self.promotion, data_parallel=data_parallel, shards=sharded)
        self._checkpoint = Checkpoint(engine, self.slots, self.param_groups, data_parallel=data_parallel,
                                      shards=sharded)
        self._reporter = Reporter(engine, self.slots, self.clipping, self.promotion, host_memory=weakly(self.host_memory),
                                  data_parallel=data_parallel, shards=sharded, eight_bit=self.eight_bit)
        self._hooks: list = []
        self._register(model, streamed or [], residents)
        self.pack_gradients = tuning.pack_gradients
        if not tuning.upload_update_terms:
            self.upload_update_terms = False
        if data_parallel is not None:
            data_parallel.attach(self.gradient_hooks.on_reduced)
        _LIVE.add(self)

    # ----------------------------------------------------------------------------- set-up
    def _register(self, model: torch.nn.Module, streamed: list[torch.nn.Module], residents: int | None) -> None:
        acc, engine, pipeline = self.slots.accumulation_steps, self.engine, self.engine.pipeline
        placement = self.promotion.placement
        _forget_dead_owners()
        trainable = trainable_in_forward_order(model, self.param_groups)  # (as wrap() orders them)
        # (under placement "auto", the first plan's start: wrap() says how many)
        resident_count = resident_at_start(placement, len(trainable)) if residents is None else residents
        # host accumulators: for every parameter that may sum its micro-batches on the host (under
        # DDP, micro-batches are summed where DDP sums them, in VRAM)
        host_sums = acc > 1 and self._vram_sums is not True and self._dp is None
        owners = self._dp.owners if self._dp is not None else None
        away = {id(p) for module in streamed for p in module.parameters()}  # offloaded, whatever the placement
        on_grad = weakly(self.gradient_hooks.on_grad)
        offloaded = sum(p.numel() for i, (p, _) in enumerate(trainable) if i >= resident_count or id(p) in away)
        with progress.stage(f"host memory for {offloaded / 1e9:.2f}B offloaded parameters"):
            shown = progress.bar(offloaded, "host memory for the offloaded state", unit="param")
            for i, (p, group) in enumerate(trainable):
                slot = self._new_slot(i, p, group, resident=i < resident_count and id(p) not in away,
                                      host_sums=host_sums, owner=None if owners is None else owners[i])
                if not slot.peer:  # a peer's state lives on its owner
                    self.state[p] = slot.state
                self.slots.add(slot)
                self._hooks.append(p.register_post_accumulate_grad_hook(on_grad))
                _OWNERS[id(p)] = (weakref.ref(p), weakref.ref(self))
                shown.update(0 if slot.resident else p.numel())
            shown.close()
        self.gates.layout()
        self.gates.on = bool(self.gates.hosts)
        engine.ensure_staging(self.slots)
        pipeline.upload_terms = True
        if streamed:
            self.promotion.stream(streamed)
        if placement == "auto":
            self.promotion.start_profiling()
        else:
            self.clipping.enable_speculation()
        # A lambda, not a bound method: copy.deepcopy(model) copies the hooks, and would copy the
        # optimizer behind a bound method with them.
        self._hooks.append(model.register_forward_pre_hook(torch.compiler.disable(
            lambda module, args, kwargs: self._before_forward(args, kwargs)), prepend=True, with_kwargs=True))
        # Reads and writes of the weights outside forward (saving, loading) see settled values.
        self._hooks.append(model.register_state_dict_pre_hook(lambda *_: self.synchronize()))
        self._hooks.append(model.register_load_state_dict_pre_hook(lambda *_: self.synchronize()))

    def _new_slot(self, i: int, p: torch.nn.Parameter, group: dict, *, resident: bool, host_sums: bool,
                  owner: int | None) -> Slot:
        """Trainable parameter `i`'s slot: its host state (taken here) or its device state; none
        for another rank's (`owner`) or an empty FSDP2 shard."""
        acc, engine, pipeline = self.slots.accumulation_steps, self.engine, self.engine.pipeline
        weight = local_shard(p) if self._shards is not None else p
        peer = owner is not None and owner != self._dp.rank or weight.numel() == 0
        resident = resident and not peer
        state_format = eight_bit.state_format(self._source, weight)
        quantized, stochastic = state_format != "fp32", state_format == "8bit-sr"
        seed = eight_bit.rounding_seed(self._rounding_base, i) if stochastic else 0
        host = None
        if not peer and (not resident or self.promotion.placement == "auto"):
            # registration order stands in for forward order (embeddings, layers, head); a resident
            # one under "auto" takes its host state only if a plan offloads it
            host = pipeline.add_param(weight.numel(), DTYPE_NAMES[p.dtype], host_sums, i, with_state=not resident,
                                      moments=state_format, rounding_seed=seed)
            if not resident and weight.device == engine.device:  # (else a streamed one in host memory: see
                pipeline.load_weights(host, weight.data_ptr(), engine.current_stream())  # Promotion.stream)
        slot = Slot(p, host, group, weight._version, i, peer=peer, sharded=self._shards is not None,
                    quantized=quantized, stochastic=stochastic, rounding_seed=seed)
        slot.state = {"step": torch.tensor(0.0)}
        if resident:
            slot.resident = True
            slot.device_state = ResidentAdamW.new_state(p, acc if self._dp is None else 1, quantized, stochastic)
            slot.state.update(self.slots.shown(slot, slot.device_state))
        elif not peer:
            slot.state.update(self.slots.shown(slot, engine.host_state(slot)))
            slot.sum_in_vram = acc > 1 and (self._dp is not None or self._vram_sums is True and p.dtype == torch.float32)
        return slot

    def _tiers_changed(self) -> None:
        """Parameters went to host memory (the first plan's) or started streaming: fewer
        speculate, their uploads are not the gates', and fp32 ones' update terms need the staging
        buffer."""
        self.clipping.recount()
        self.gates.build()
        if self.engine.pipeline.upload_terms:
            self.engine.ensure_staging(self.slots)

    def _planned(self) -> None:
        """A plan is in force: what depends on where everything lives follows it."""
        self.clipping.enable_speculation(self.promotion.paged_host_bytes())
        self.gates.build()
        if self.engine.pipeline.upload_terms:
            self.engine.ensure_staging(self.slots)
        self._sync_packing()

    def _check_compiled(self, wrappers: list, compiled: list) -> None:
        for model in wrappers or [self._model]:  # (a wrapper's modules include the model's)
            check_compile_mode(model)
        if self.promotion.streamer is not None and compiled:
            raise UnsupportedSetupError(
                "weight streaming runs in eager mode: torch.compile would trace the streamed weights' "
                "device tensors, whose memory comes and goes between blocks. Train this model uncompiled, "
                "or give it a VRAM budget its weights fit (Tuning(streamed_blocks=0) stops streaming)")
        if self.promotion.pager is not None:
            self.promotion.pager.set_compiled(bool(compiled))

    # --------------------------------------------------------------------------- forward
    def _before_forward(self, args: tuple, kwargs: dict) -> None:
        check_autocast(self.engine.device.type)
        window = self.window
        if window.forwards == 0 and torch.is_grad_enabled():
            self.promotion.plan_first(args, kwargs)  # (once, before window 1: the batch is known now)
        if window.forwards == 0:  # a model compiled after wrap() is seen at its first forward
            self.gates.follow_compile(self._check_compiled)
        if torch.is_grad_enabled():
            if window.forwards == 0:
                self.promotion.window_starts(args, kwargs)
            window.forwards += 1
        self.clipping.settle_verdict(wait=False)  # whether the next backward speculates
        self.gates.before_forward()
        if self.promotion.streamer is not None:
            self.promotion.refresh_streamed_masters()
            self.promotion.streamer.begin_forward()

    # -------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        """Apply this accumulation window's gradients. Returns the closure's loss, if any.

        Without clipping, offloaded updates have already started during backward; with
        max_grad_norm they wait for the global gradient norm (on the host engine's threads, where
        the norm is on the device), unless they could start before it and it does not clip, then
        run in forward order. Resident parameters are updated here, on the current stream. Either
        way the next forward waits for exactly the weights it reads.
        """
        if grad_scaler is not None:
            raise UnsupportedSetupError(GRAD_SCALER_MESSAGE)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        window, clipping, engine = self.window, self.clipping, self.engine
        acc = self.slots.accumulation_steps
        pending = [s for s in reversed(window.arrival) if not s.updated]  # forward order
        early = window.forwards < acc  # a step before the window's last micro-batch
        if early and clipping.track_norm:
            for s in pending:  # a peer's norm is taken with the last micro-batch: not yet
                if s.peer and s.param.grad is not None and not s.norm_on_device:
                    clipping.measure(s, s.mine(s.param.grad), engine.current_stream())
        if window.arrival:
            clipping.collect(window.arrival)
        self._send_leftovers(pending, early)
        if self._shards is not None and clipping.track_norm and window.arrival:
            clipping.take_norm_now()
        if pending:
            self._update(pending)
        if self._dp is not None and window.arrival:
            self._share_updates(window.arrival)
        for s in window.arrival:
            s.landed = s.updated = s.norm_on_device = False
            s.speculated = None
        window.arrival = []
        window.micro = window.forwards = 0
        window.count += 1
        if self.promotion.window_ends():
            log.info("trainstream %s", self.describe())
        return loss

    def _send_leftovers(self, pending: list, early: bool) -> None:
        """Gradients still on the device or norms not taken: sums of micro-batches kept in VRAM,
        and an early step's."""
        clipping, acc = self.clipping, self.slots.accumulation_steps
        for s in pending:
            if not s.offloaded:
                continue
            # (under DDP, .grad also holds the sums the comm hook has already sent)
            held = s.param.grad
            if held is not None and s.sum_in_vram and (self._dp is None or early):
                # Still summing in VRAM: an early step, or no gradient in the last backward.
                self.gradient_hooks.send(s, s.mine(held), dict(norm=clipping.track_norm), self.engine.current_stream())
            elif clipping.track_norm and (early if self._shards is not None else self.window.micro < acc):
                # early step: the norm was not taken during backward
                self.engine.pipeline.submit(s.host, from_accumulator=self.slots.sums_on_host(s), norm=True)

    def _update(self, pending: list) -> None:
        """Queues the window's updates: the offloaded ones' jobs and commits at once (the engine's
        threads take the pipeline's lock for every chunk), the resident ones on the current stream."""
        clipping = self.clipping
        resident = [(s, ResidentAdamW.gradient(s.param, s.device_state)) for s in clipping.norm_slots
                    if s.resident and not s.updated]
        resident = [(s, g) for s, g in resident if g is not None]
        scale, device_scale, verdict = clipping.coefficient(resident)
        committable = clipping.resolve(pending, scale, verdict)
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
                hypers[key] = hyperparameters(s, grad_scale=1.0)
            # a commit needs the speculation's premises intact: the same lr and update mode, and
            # no clip (known here, or judged by the engine when the verdict lands)
            if committable and s.speculated == hypers[key] and clipping.speculates(s):
                commits.append(s)
            else:
                hyper = hypers[key] if scale == 1.0 else hyperparameters(s, grad_scale=scale)
                jobs[s.host] = dict(from_accumulator=self.slots.sums_on_host(s), scale=verdict,
                                    **update_args(s, hyper))
        if commits:
            clipping.commit(commits, verdict)
        if jobs:
            self.engine.pipeline.submit_many(list(jobs), list(jobs.values()))
        self.gradient_hooks.mark_updated(*updated)
        self._update_resident(resident, scale, device_scale)

    def _update_resident(self, items: list, scale: float, device_scale: torch.Tensor | None) -> None:
        """One launch (or host call) per set of parameters that share their hyperparameters: their
        group's and their step count."""
        batches: dict[tuple, list] = {}
        for s, grad in items:
            batches.setdefault((id(s.group), s.step), []).append((s, grad))
        for batch in batches.values():
            hyper = hyperparameters(batch[0][0], scale)
            self._resident.update([(s.param, g, s.device_state, s.rounding_seed if s.stochastic else None)
                                   for s, g in batch], hyper, device_scale)
            self.gradient_hooks.mark_updated(*(s for s, _ in batch))

    def _share_updates(self, slots: list) -> None:
        """Under DDP: every rank's weights become their owners'. The broadcasts are queued in
        forward order (the same on every rank), each of an owner's as soon as that parameter's
        upload is (the host updates run in forward order too, so later ones overlap the first
        broadcasts). The reduced gradients DDP left in .grad go: sent, or a peer's."""
        stream = self.engine.current_stream()
        sends = []
        for s in sorted(slots, key=lambda s: s.index):
            if s.offloaded:
                self.engine.pipeline.gate([s.host], stream)
            sends.append(self._dp.broadcast(s.param, self._dp.owners[s.index]))
        for send in sends:
            send.wait()
        for p in self.slots.by_param:
            p.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears gradients left on the device: resident parameters' and any a caller left
        behind, and the unsent sums of micro-batches summed in VRAM (as torch's zero_grad would)."""
        for p in self.slots.by_param:
            p.grad = None

    def synchronize(self) -> None:
        """Wait for every queued host update and order the current stream after its upload."""
        self.engine.pipeline.synchronize()
        self.gates.wait_all()

    # ------------------------------------------------------------------------ settings
    @property
    def max_grad_norm(self) -> float | None:
        """Clip the global gradient norm to this (None: no clipping); may change between steps."""
        return self.clipping.max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float | None) -> None:
        self.clipping.max_grad_norm = value

    @property
    def accumulation_steps(self) -> int:
        return self.slots.accumulation_steps

    @property
    def vram_budget(self) -> int | None:
        """The planner's VRAM budget in bytes (placement "auto"), else None."""
        return self.promotion.vram_budget

    @property
    def plan(self) -> planner.Plan | None:
        """The placement in force, once planned."""
        return self.promotion.plan

    @property
    def profile(self) -> planner.Profile | None:
        """What the plan was made from (the profiled window's figures), once planned."""
        return self.promotion.profile

    @property
    def activation_pager(self):
        """The activation pager (trainstream.activations.ActivationPager) while its hooks are
        attached, else None."""
        return self.promotion.active_pager

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

    def _sync_packing(self) -> None:
        pager, plan = self.activation_pager, self.plan
        if plan is not None:
            paging = plan.hooks and (plan.paged > 0 or bool(plan.recomputed))
        else:
            paging = pager is not None and (pager.vram_budget is not None or bool(pager.share))
        self.engine.pipeline.pack_gradients = self._pack and not paging

    @property
    def speculative_clipping(self) -> bool:
        """With max_grad_norm: start each offloaded update as its gradient lands, with a clip
        coefficient of 1, into a second set of state buffers; step() commits it when the global
        norm does not clip and redoes it from the untouched state when it does (default True).
        The weights and state are the same bits either way; only when the updates run changes.
        After a window whose norm clipped, the next one waits for the norm instead. Off from
        wrap() (`Tuning(speculative_clipping=False)`), it takes no host memory; turned off later,
        the memory it took stays held."""
        return self.clipping.on

    @speculative_clipping.setter
    def speculative_clipping(self, on: bool) -> None:
        self.clipping.on = bool(on)
        planned = self.promotion.placement != "auto" or self.plan is not None  # (else the plan takes them)
        if self.clipping.on and not self.clipping.speculating and planned:
            self.clipping.enable_speculation(self.promotion.paged_host_bytes())  # off from wrap(): taken now

    @property
    def upload_update_terms(self) -> bool:
        """fp32 weights: the host sends AdamW's update term and the GPU adds it to its decayed
        weights (default True), instead of the host keeping an fp32 copy of the weights current
        and sending that: the host reads 24 bytes a parameter instead of 28, and the weights come
        out bit for bit the same. It stages through a VRAM buffer of at most 64 MiB."""
        return self.engine.pipeline.upload_terms

    @upload_update_terms.setter
    def upload_update_terms(self, on: bool) -> None:
        on, engine = bool(on), self.engine
        if not on and engine.pipeline.upload_terms:
            # The host kept no fp32 copy of these weights: take it from the device before the
            # next update reads it.
            self.synchronize()
            for s in self.slots.order:
                if s.offloaded and not s.streamed and s.param.dtype == torch.float32:
                    engine.pipeline.load_weights(s.host, s.weight.data_ptr(), engine.current_stream())
        engine.pipeline.upload_terms = on
        self.clipping.plan_term_holding()
        if on:
            engine.ensure_staging(self.slots)
        else:
            engine.drop_staging()

    # ------------------------------------------------------------------------- figures
    @property
    def last_grad_norm(self) -> float | None:
        """Global L2 norm of the last window's gradients (before clipping), for logging.

        Measured when max_grad_norm is set or with Tuning(track_grad_norm=True); None otherwise. The
        parameters' squared norms are added in forward order whatever their placement, so the
        norm (and the clipping) has the same bits for every placement.
        """
        return self.clipping.last_grad_norm

    @property
    def speculation(self) -> dict:
        """With clipping: offloaded parameters whose updates may start before the global norm is
        known, host bytes their next-state buffers take, VRAM their fp32 update terms may hold
        while they await the verdict (vram_term_bytes, 0 when the terms wait in host memory) and
        how many terms have done so (terms_held), and windows committed (hits), redone (misses) or
        not speculated because the last norm clipped (waited)."""
        return self.clipping.speculation

    def host_memory(self) -> dict:
        """Host bytes TrainStream holds now, by what they hold: the offloaded parameters' state
        (fp32 masters, moments, landing buffers, sums of micro-batches, streamed bf16 weights),
        speculation's second state sets, the paged activations' slots, and streamed frozen
        weights. All of it counts against the host budget (`report()["host_budget"]`)."""
        streamer = self.promotion.streamer
        return {"state": self.engine.pipeline.host_reserved_bytes, "speculation": self.clipping.host_bytes,
                "activation_slots": self.promotion.paging_slot_bytes(),
                "streamed_frozen_weights": streamer.pinned_bytes if streamer is not None else 0}

    def _host_held(self) -> int:
        return sum(self.host_memory().values())

    def _vram_room(self, need: int) -> bool:
        return self.promotion.vram_room(need)

    def describe(self) -> str:
        """Where everything lives and why, in a few readable lines."""
        return self._reporter.describe()

    def report(self) -> dict:
        """What TrainStream holds where, and how the host engine runs."""
        return self._reporter.report()

    # ----------------------------------------------------------------------- checkpoints
    def state_dict(self):
        """torch.optim.AdamW's state dict. Under DDP each rank holds the state of the parameters
        it owns, and this gathers all of them: a collective that every rank calls (as with
        torch.distributed.checkpoint), after which every rank holds the whole dict. Under FSDP2
        each state tensor is a DTensor sharded as its parameter."""
        self.synchronize()
        return self._checkpoint.state_dict(super().state_dict())

    def load_state_dict(self, state_dict) -> None:
        """Load a torch.optim.AdamW (or our own) state dict, whatever placement wrote it: tensors
        are copied to where this optimizer keeps them. Under DDP, every rank loads the whole dict
        and keeps what it owns."""
        self.synchronize()
        self._checkpoint.load(state_dict)

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "slots", None) is None:  # during torch's own __init__
            return super().add_param_group(param_group)
        raise UnsupportedSetupError(
            "adding param groups after trainstream.wrap() is not supported; add them to the "
            "optimizer before wrapping")

    def remove_hooks(self) -> None:
        """Detach from the model (after a final synchronize); the optimizer is unusable after, and
        dropping it gives its host memory (and its VRAM state) back at once."""
        self.synchronize()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.gates.remove()
        for s in self.slots.order:
            if wrapped_by(s.param) is self:
                del _OWNERS[id(s.param)]
        if self._dp is not None:  # DDP keeps the communication hook; it goes back to a plain all-reduce
            self._dp.detach()
        self.promotion.remove()
