"""Promotion: profile the first steps, plan (placement.py, pure), and move each parameter to the tier the plan gives it.

A parameter's tier is resident (gradient and AdamW state in VRAM), offloaded (host state, host
updates) or streamed (offloaded, its weights in host memory between uses, trainstream.streaming).
Under placement "auto" the second window is profiled; at the end of its step() the plan is made
and carried out between steps: a wait for the host's last updates, then one copy of each moved
parameter's moments (and bf16 master) to where it now lives. After the first planned window, a
peak over the budget plans once more with the difference added.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Callable

import torch

from trainstream import eight_bit
from trainstream import first_plan as from_shapes
from trainstream import placement as planner
from trainstream import progress
from trainstream.activations import light as light_recompute
from trainstream.clipping import Clipping
from trainstream.errors import HostMemoryError, VramBudgetError
from trainstream.profiler import RECOMPUTE_PER_FORWARD, StepProfiler, block_spans, measure_bandwidths
from trainstream.resident import ResidentAdamW
from trainstream.slots import Engine, Slot, Slots, Window
from trainstream.streaming import WeightStreamer, shared_outside

log = logging.getLogger("trainstream")

PACK_S = 30e-6  # what one call of the saved-tensor hooks costs the host, where it was not measured
# the host engine's seconds per parameter updated (all threads), where the profiled steps updated
# none on the host: 16 Xeon cores with AVX-512, exact AdamW on fp32 state
HOST_S_PER_PARAM = 0.21e-9


def checkpointed(block: torch.nn.Module) -> bool:
    """Whether the model recomputes `block` in backward itself (Hugging Face's gradient
    checkpointing marks each layer it wraps)."""
    return block.training and bool(getattr(block, "gradient_checkpointing", False))


class Promotion:
    """The tiers of one optimizer's parameters and the plan that sets them.

    Called back: `synchronize()` to settle every queued update, `tiers_changed()` when
    parameters start streaming, `planned()` once a plan is in force (the optimizer re-derives
    what depends on it: speculation, gates, staging, packing); `host_held()` says how many host
    bytes TrainStream holds now."""

    def __init__(self, engine: Engine, slots: Slots, window: Window, clipping: Clipping, model: torch.nn.Module,
                 *, pager, placement: str | float, vram_budget: int | None, accumulate_in_vram: bool | None,
                 add_on_host: bool | None, prefetch_depth: int, data_parallel, synchronize: Callable[[], None],
                 tiers_changed: Callable[[], None], planned: Callable[[], None],
                 host_held: Callable[[], int]) -> None:
        self._engine = engine
        self._slots = slots
        self._window = window
        self._clipping = clipping
        self._model = model
        self.pager = pager  # trainstream.activations.ActivationPager or None, attached or not
        self.active_pager = pager  # the same while its hooks are attached (a plan may need none)
        self.placement = placement
        self.vram_budget = vram_budget
        self._vram_sums = accumulate_in_vram  # None: the planner's choice per parameter
        self._add_on_host = add_on_host  # None: the planner's choice (placement.adds_on_host)
        self._depth = prefetch_depth
        self._dp = data_parallel
        self._synchronize = synchronize
        self._tiers_changed = tiers_changed
        self._planned = planned
        self._host_held = host_held
        self.plan: planner.Plan | None = None  # the placement in force, once planned
        self.profile: planner.Profile | None = None
        self.profiler: StepProfiler | None = None
        self.streamer: WeightStreamer | None = None
        self._stats_at_start = None
        self._bandwidths = None  # (d2h, h2d, VRAM) bytes/s, measured when the profiled window starts
        self._checked = False  # the first planned window's peak has been compared with the budget
        self._trim_due = False  # the activation slots the plan does not use go back after its first window
        self.first_plan: from_shapes.FirstPlan | None = None  # made at the first forward (a budget given)
        self._hooks: list = []

    @property
    def state(self) -> str:
        return "planned" if self.plan is not None else "profiling" if self.profiler is not None else "fixed"

    def start_profiling(self) -> None:
        """Under placement "auto": the second window will be profiled."""
        away = self.streamer.weight_bytes - self.streamer.window_bytes if self.streamer is not None else 0
        log.info("trainstream: the second step is profiled in the first plan's placement; the plan follows it")
        self.profiler = StepProfiler(self._model, [s.param for s in self._slots.order], self._engine.device, away)
        self._stats_at_start = self._engine.pipeline.stats()

    def paging_slot_bytes(self) -> int:
        """Host memory the pager's slots already hold (reused for every step's paged activations)."""
        return self.pager.native.stats()["reserved_bytes"] if self.pager is not None else 0

    def paged_host_bytes(self) -> int:
        """Host memory the plan's paged activations need beyond the slots the pager already holds."""
        if self.plan is None or self.profile is None:
            return 0
        return max(0, planner.paged_host_bytes(self.profile, self.plan) - self.paging_slot_bytes())

    def vram_room(self, need: int) -> bool:
        """Whether the placement leaves `need` more bytes of VRAM: within the plan's budget once
        planned; before that only without a budget, and never while profiling."""
        plan = self.plan
        if plan is not None:
            return plan.budget is None or plan.expected_peak + need <= plan.budget - plan.reserve
        return self.placement != "auto" and self.vram_budget is None

    def streamed_count(self) -> int:
        return len(self.streamer.modules) if self.streamer is not None else 0

    # ---------------------------------------------------------------------- the window
    def window_starts(self, args: tuple, kwargs: dict) -> None:
        """At a window's first forward: profile window 2 (window 1 runs cold). The plan follows at
        the end of that window's step(), between steps, where no hook is running."""
        profiler = self.profiler
        if profiler is None:
            return
        if self.plan is None and self._window.count == 1 and not profiler.recording and not profiler.complete:
            self._synchronize()  # the profiled forward computes; it does not wait for uploads
            self._bandwidths = measure_bandwidths(self._engine.device)  # while little is allocated
            if self.active_pager is not None and self.active_pager.deferred:
                self.active_pager.time_next_forward = True  # its block times: the same forward
            profiler.start_forward(args, kwargs)

    def window_ends(self) -> bool:
        """At the end of step(): plan after the profiled window (then True), or check the first
        planned one."""
        if self.profiler is not None and self.plan is None and self.profiler.complete:
            self._promote()
            return True
        if self.plan is not None:
            self._trim_slots()
            if not self._checked:
                self._check_peak()
        return False

    def _trim_slots(self) -> None:
        """Gives back the pager's slots that the first window of a plan did not use (the profiled
        steps page more than most plans do)."""
        if not self._trim_due:
            return
        self._trim_due = False
        freed = self.pager.native.trim()
        if freed:
            log.info("trainstream: %.2f GB of activation slots the plan does not use given back", freed / 1e9)

    # ------------------------------------------------------------------ plan and apply
    def _param_blocks(self, n: int) -> list[int]:
        """Each slot's block among the pager's first `n`: -1 before the blocks, n after them."""
        block_of = {}
        for j, block in enumerate(self.pager.blocks if self.pager is not None else []):
            for p in block.parameters():
                block_of.setdefault(p, j)
        order = self._slots.order
        inside = [s.index for s in order if s.param in block_of]
        return [min(block_of[s.param], n) if s.param in block_of else (-1 if inside and s.index < inside[0] else n)
                for s in order]

    def plan_first(self, args: tuple, kwargs: dict) -> None:
        """Before the first forward with autograd, under a budget: the placement the first steps
        run in, from shapes (trainstream.first_plan). The last parameters wrap() kept resident go
        to host memory, then the last blocks' weights stream, as far as the estimated peak needs.
        Refuses, with the figures, what cannot fit either budget."""
        if self.first_plan is not None or self.profiler is None or self.vram_budget is None:
            return
        order, engine = self._slots.order, self._engine
        blocks = self.pager.blocks if self.pager is not None else []
        tied = shared_outside(blocks, self._model)
        costs = from_shapes.resident_costs([s.weight.numel() for s in order], [s.param.element_size() for s in order],
                                          self._slots.accumulation_steps,
                                          [s.state_format for s in order])
        weights = from_shapes.model_bytes(self._model)
        shapes = from_shapes.read_shapes(
            self._model, blocks, costs, self._param_blocks(len(blocks)), [j not in tied for j in range(len(blocks))],
            # (CPU mode measures no memory but the weights': nor does it estimate the activations)
            self._depth, weights, from_shapes.batch_tokens(args, kwargs) if engine.device.type == "cuda" else 0,
            engine.device)
        resident = sum(1 for s in order if s.resident)
        chosen = from_shapes.plan_first(shapes, self.vram_budget, resident, self.streamed_count())
        self.first_plan = chosen
        log.info("trainstream: %s", chosen.describe())
        if not chosen.fits:
            raise VramBudgetError(
                f"before the first step: the batch's {shapes.tokens} tokens cannot fit a VRAM budget of "
                f"{self.vram_budget / 1e9:.2f} GB. With every parameter's gradient and AdamW state offloaded and "
                f"{chosen.streamed} blocks' weights streamed, the first steps need an estimated "
                f"{chosen.peak / 1e9:.2f} GB: the LM head's logits and the loss's fp32 tensors "
                f"{shapes.head_bytes / 1e9:.2f} GB, {from_shapes.PROFILED_BLOCKS_HELD} blocks' activations "
                f"{from_shapes.PROFILED_BLOCKS_HELD * shapes.block_activation_bytes / 1e9:.2f} GB, the rest "
                f"weights; the budget less the planner's reserve is {chosen.limit / 1e9:.2f} GB. Lower the "
                f"batch or sequence length, raise the budget, or use bf16 weights.")
        demoted = [s for s in order[chosen.resident:] if s.resident and not s.peer]
        need = sum(s.host.state_bytes for s in demoted)
        room = engine.host_room(self._host_held())
        if need > room:
            raise HostMemoryError(
                f"before the first step: the batch's activations leave VRAM for the state of "
                f"{chosen.resident} of {len(order)} parameters; the other {len(demoted)} need "
                f"{need / 2**30:.1f} GiB of host memory for their state, but only {room / 2**30:.1f} GiB is left "
                f"within the host budget. Nothing more was pinned. Raise host_budget or vram_budget, or "
                f"lower the batch or sequence length.")
        for s in demoted:
            self.move(s, False)
        if self._slots.accumulation_steps > 1:  # the profiled steps add micro-batches as the plan will
            self._engine.pipeline.device_accumulate = not planner.adds_on_host_by_default(
                self._add_on_host, chosen.streamed, [s.param.element_size() for s in order[chosen.resident:]])
        if chosen.streamed > self.streamed_count():
            self.stream(blocks[len(blocks) - chosen.streamed:len(blocks) - self.streamed_count()])
        elif demoted:
            self._tiers_changed()
        if self.pager is not None and self.pager.deferred and from_shapes.keeps_every_block(shapes, chosen, self._model):
            self.pager.paged_upto = 0
            log.info("trainstream: the profiled steps keep every block's activations (estimated to fit with "
                     "room to spare): no host memory is pinned for paging them")

    def _promote(self) -> None:
        """Plans from the profile and moves everything where the plan puts it."""
        self._synchronize()
        with progress.stage("planning from the profiled step"):
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
        self.profile = profile
        with progress.stage("moving parameters and activations where the plan puts them"):
            self.apply(plan)

    def _build_profile(self) -> planner.Profile:
        pager = self.active_pager
        deferred = pager is not None and pager.deferred
        if deferred:
            pager.finish_profile()
        times = self.profiler.timings(pager.profiled_marks if deferred else None)
        blocks = []
        figures = pager.last if pager is not None else None
        if deferred and pager.profile is not None:
            prof = pager.profile
            casts = figures.block_cast_bytes or [0] * len(pager.blocks)
            tied = shared_outside(pager.blocks, self._model)
            light = pager.light or [None] * len(pager.blocks)  # (kept bytes, cheap ops, bytes they write, all ops)
            op_host_s = light_recompute.dispatch_seconds(self._engine.device) if pager.light else 0.0
            blocks = [planner.BlockCost(b, i, t, c, weight_bytes=from_shapes.param_bytes(pager.blocks[j]),
                                        streamable=j not in tied, checkpointed=checkpointed(pager.blocks[j]),
                                        light_bytes=None if lt is None else lt[0],
                                        light_s=0.0 if lt is None else light_recompute.seconds(
                                            *lt[1:], self._bandwidths[2], op_host_s))
                      for j, (b, i, t, c, lt) in enumerate(zip(prof.block_bytes,
                                                               prof.block_input_bytes or [0] * len(prof.block_bytes),
                                                               prof.block_seconds, casts, light))]
        order = self._slots.order
        n = len(blocks)
        params = []
        for s, where in zip(order, self._param_blocks(n)):
            params.append(planner.ParamCost(
                # a peer's state and update are another rank's: keeping it costs this rank nothing
                name=self._slots.name(s), numel=0 if s.peer else s.weight.numel(),
                element_size=s.param.element_size(), block=where,
                need_s=times["need_s"][s.index], arrival_s=times["arrival_s"][s.index],
                segment_peak=times["segment_peak"][s.index], moment_bytes=eight_bit.moment_bytes(s.quantized),
                master=not s.stochastic))
        if blocks and times["replayed"]:
            # A recomputed block costs its share of the replayed forward (compute alone), not its
            # time in the profiled step, which the paging there stretched.
            spans = block_spans([p.need_s for p in params], [p.block for p in params], n, times["forward_s"])
            blocks = [b if span is None else replace(b, recompute_s=RECOMPUTE_PER_FORWARD * span)
                      for b, span in zip(blocks, spans)]
        stats, start = self._engine.pipeline.stats(), self._stats_at_start
        updated = stats["updated_elements"] - start["updated_elements"]
        # (with every parameter resident in the profiled steps, the rate the engine was measured at elsewhere)
        host_rate = (stats["busy_seconds"] - start["busy_seconds"]) / updated if updated else HOST_S_PER_PARAM
        added = stats["added_elements"] - start["added_elements"]  # (where the threads added micro-batches)
        add_rate = (stats["adding_seconds"] - start["adding_seconds"]) / added if added else None
        d2h, h2d, vram = self._bandwidths
        hook_s = lean_hook_s = 0.0
        if figures is not None:
            # the hooks' host time as measured, less what paging took in it, and less the kept
            # tensors' bookkeeping where nothing is paged (the device's recasts come on top); an
            # estimate where none was (the profiled step ran without them)
            calls = figures.hook_seconds - figures.paging_seconds if figures.hook_seconds else figures.packs * PACK_S
            recasts = 3 * figures.recast_bytes / vram
            hook_s = calls + recasts
            lean_hook_s = max(0.0, calls - figures.keeping_seconds) + recasts
        return planner.Profile(
            params=params, blocks=blocks, accumulation_steps=self._slots.accumulation_steps,
            clipping=self._clipping.max_grad_norm is not None,
            forward_s=times["forward_s"], backward_s=times["backward_s"],
            forward_peak=self.profiler.forward_peak, tail_peak=self.profiler.tail_peak,
            host_s_per_param=host_rate, d2h_bytes_per_s=d2h, h2d_bytes_per_s=h2d, device_bytes_per_s=vram,
            profiled_paged=pager.paged_upto if pager is not None else 0, profiled_hooks=pager is not None,
            outside_cast_bytes=figures.outside_cast_bytes if figures is not None else 0, hook_s=hook_s,
            lean_hook_s=lean_hook_s,
            weight_bytes=from_shapes.param_bytes(self._model),
            fixed_activations=not deferred, streamed=self.streamed_count() if blocks else 0,
            profiled_resident=sum(1 for s in order if s.resident),
            stream_depth=self._depth, recompute=pager is None or pager.recompute, add_on_host=self._add_on_host,
            host_add_s_per_element=add_rate,
            host_room=None if math.isinf(room := self._engine.host_room(self._host_held()))
            else int(room) + self.paging_slot_bytes())

    def apply(self, plan: planner.Plan) -> None:
        """Moves every parameter to where `plan` puts it (between steps: nothing is in flight)."""
        self._synchronize()
        _ = self._clipping.last_grad_norm  # the window's norm, read where its parts were taken
        pager = self.pager
        streamed = self.streamed_count()
        if plan.streamed > streamed:  # (the profiled steps' streamed blocks stay streamed)
            blocks = pager.blocks
            self.stream(blocks[len(blocks) - plan.streamed:len(blocks) - streamed])
        acc = self._slots.accumulation_steps
        for i, s in enumerate(self._slots.order):
            if s.peer:  # (costs this rank nothing: see _build_profile)
                continue
            resident = i < plan.resident and not s.streamed
            if resident != s.resident:
                self.move(s, resident)
            if self._dp is not None:  # micro-batches are summed where DDP sums them
                s.sum_in_vram = not resident and acc > 1
                continue
            summable = not resident and acc > 1 and s.param.dtype == torch.float32
            wanted = self._vram_sums if self._vram_sums is not None else i < plan.resident + plan.vram_sums
            # (without a host accumulator, the sums can only be in VRAM)
            s.sum_in_vram = summable and (wanted or not s.host.has_accumulator) and not s.streamed
        if acc > 1:
            # Host-summed micro-batches: a kernel that reads the sums back over PCIe adds them, unless
            # bf16 weights stream up the same link (the Llama-3-8B shape under a 24 GB cap at
            # accumulation 8 on an H100: 9.91 s a step added by the kernel, 7.81 s by the threads)
            self._engine.pipeline.device_accumulate = not planner.adds_on_host(self.profile, plan)
        if pager is not None and pager.deferred:
            if plan.hooks or plan.recomputed or plan.light:
                pager.reattach()
                pager.apply(plan.paged if plan.hooks else 0, plan.recomputed, "placement planner", hooks=plan.hooks,
                            light=plan.light, recompute_seconds=planner.recompute_seconds(self.profile, plan))
                self.active_pager = pager
            else:  # (a re-plan may need it again: _check_peak)
                pager.remove()
                self.active_pager = None
            pager.native.mark()  # what the plan's first window pages keeps its slots
            self._trim_due = True
            if self.active_pager is None:
                self._trim_slots()  # nothing will be paged
        self.plan = plan
        self._planned()
        if self._engine.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self._engine.device)

    def move(self, slot: Slot, resident: bool) -> None:
        """Moves one parameter's gradient and AdamW state (and bf16 master) between VRAM and host:
        a parameter made resident gives its host memory back, one offloaded again takes it anew."""
        p, engine = slot.param, self._engine
        if resident:
            # (under DDP, .grad holds the window's sum: no fp32 sum of micro-batches beside it)
            state = ResidentAdamW.new_state(p, self._slots.accumulation_steps if self._dp is None else 1,
                                            slot.quantized, slot.stochastic)
            host = engine.host_state(slot)
            for key, value in host.items():  # the host's state (and bf16 master) carries over
                state[key].copy_(value)
            slot.device_state = state
            slot.state.update(self._slots.shown(slot, state))
            if slot.next_state is not None:
                self._clipping.forget(slot)
            del host  # (views of buffers given back now)
            engine.pipeline.release_state(slot.host)
        else:
            engine.pipeline.take_state(slot.host)
            host = engine.host_state(slot)
            for key, value in host.items():
                value.copy_(slot.device_state[key])
            slot.device_state = None
            slot.state.update(self._slots.shown(slot, host))
            # (the host needs the weights where they are its state: fp32 ones without update terms,
            # and bf16 ones without a master)
            if slot.stochastic or p.dtype == torch.float32 and not engine.pipeline.upload_terms:
                engine.pipeline.load_weights(slot.host, p.data_ptr(), engine.current_stream())
        slot.version = p._version
        slot.resident = resident

    def _check_peak(self) -> None:
        """After the first planned window: if its peak went over the budget, the estimate was
        short; plan again once with the difference added."""
        self._checked = True
        device = self._engine.device
        if device.type != "cuda" or self.vram_budget is None or self.profile is None:
            return
        observed = torch.cuda.max_memory_allocated(device)
        self.plan.observed_peak = observed
        if observed <= self.plan.budget:
            return
        short = observed - self.plan.expected_peak
        plan = planner.plan_placement(self.profile, max(1, self.plan.budget - short))
        log.warning("trainstream: the step peaked at %.2f GB, over the %.2f GB budget (expected %.2f GB); "
                    "re-planning with %.2f GB less", observed / 1e9, self.plan.budget / 1e9,
                    self.plan.expected_peak / 1e9, short / 1e9)
        self.apply(replace(plan, budget=self.plan.budget, observed_peak=observed))

    # --------------------------------------------------------------------- streaming
    def stream(self, modules: list[torch.nn.Module]) -> None:
        """Streams the weights of `modules` (blocks) from now on: their trainable parameters are
        offloaded, and the host engine's buffers hold their weights (trainstream.streaming).
        Between steps."""
        engine, pipeline = self._engine, self._engine.pipeline
        if self.streamer is None:
            self.streamer = WeightStreamer(engine.device, self._depth)
            # A forward without autograd has no backward to end its streaming. (A lambda: see
            # OffloadedAdamW._register.)
            self._hooks.append(self._model.register_forward_hook(
                lambda module, args, output: self._after_forward(), always_call=True))
        self._synchronize()
        stream = engine.current_stream()
        for module in modules:
            hosts = []
            for p in module.parameters():
                s = self._slots.get(p)
                if s is None or s.streamed:
                    continue
                if s.resident:
                    self.move(s, False)
                s.next_state = None  # (its updates wait for the norm from now on)
                if p.device == engine.device:  # (an fp32 master may hold a term)
                    pipeline.load_weights(s.host, p.data_ptr(), stream)
                else:  # still in host memory, where wrap() left it
                    engine.host_tensor(s.host, "master", p).copy_(p.detach().float())
                pipeline.keep_weights_on_host(s.host)  # (bf16: 2 B a parameter more)
                s.streamed = True
                if s.host.has_accumulator:
                    s.sum_in_vram = False
                hosts.append(s.host)
            # forward order: where the model defines the block (its blocks are a ModuleList)
            position = next(k for k, m in enumerate(self._model.modules()) if m is module)
            self.streamer.add(module, position, self._streamed_host,
                              lambda stream, hosts=hosts: self._engine.pipeline.gate(hosts, stream) if hosts else None)
        self._tiers_changed()

    def _after_forward(self) -> None:
        if not torch.is_grad_enabled():
            self.streamer.end_backward()

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

    def refresh_streamed_masters(self) -> None:
        """bf16 weights written behind our back (load_state_dict, an in-place edit) while they
        sat in host memory: the fp32 master follows them, as the gradient hook does for weights on
        the device."""
        for s in self._slots.order:
            if s.streamed and s.param.dtype != torch.float32 and s.param._version != s.version:
                self._engine.pipeline.wait([s.host])
                self._engine.host_tensor(s.host, "master", s.param).copy_(s.param.detach().float())
                s.version = s.param._version

    def remove(self) -> None:
        """Detaches the pager and the streamer (after a final synchronize)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.active_pager is not None:
            self.active_pager.remove()
        if self.streamer is not None and (left := self.streamer.remove()):
            log.warning("trainstream: remove_hooks(): %.2f GB of the streamed blocks' weights do not fit the "
                        "device and stay in host memory (move the model or its blocks where they should "
                        "go, e.g. model.cpu() to save it)", left / 1e9)
