"""Clipping: the global gradient norm, updates started before it is known, and the verdict that commits or redoes them.

Offloaded gradients' squared norms are taken on the device as they arrive, so the global norm is
known when backward ends; an offloaded update may then start at once with a clip coefficient of
1, into a second set of state buffers, committed at step() if the norm does not clip and redone
from the untouched state if it does (the same bits as waiting). Where every norm is on the
device, the clip coefficient is computed there too and handed to the host engine as a verdict,
so no thread waits for it. The parameters' squared norms are added in forward order whatever
their placement, so the norm has the same bits for every placement.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import torch

from trainstream.errors import NativeError
from trainstream.host_adamw import DTYPE_NAMES
from trainstream.resident import GradientNorms, ResidentAdamW, clip_coefficient
from trainstream.slots import Engine, Slot, Slots

log = logging.getLogger("trainstream")

CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_


class Clipping:
    """The norms and the speculation of one optimizer.

    `vram_room(nbytes)` says whether the placement leaves `nbytes` of VRAM for held update terms,
    `host_held()` how many host bytes TrainStream holds now; under DDP or FSDP2
    (`data_parallel`, `shards`) the gradients are theirs: their terms are never held, their
    verdicts never computed on the device."""

    def __init__(self, engine: Engine, slots: Slots, resident: ResidentAdamW, *, max_grad_norm: float | None,
                 track_grad_norm: bool, speculative: bool, data_parallel, shards,
                 vram_room: Callable[[int], bool], host_held: Callable[[], int]) -> None:
        self._engine = engine
        self._slots = slots
        self._resident = resident
        self._dp = data_parallel
        self._shards = shards
        self._vram_room = vram_room
        self._host_held = host_held
        self.max_grad_norm = max_grad_norm
        self.track_norm = track_grad_norm or max_grad_norm is not None
        # offloaded gradients' squared norms, taken on the device as they arrive (made at the first
        # clipped window: max_grad_norm may be set later)
        self.grad_norms: GradientNorms | None = None
        self._offload_norms = None  # this window's, pending (trainstream.resident.PendingNorms)
        self._norm_on_device: set = set()  # the slots of the window last_grad_norm reports whose norms they are
        self.norm_slots: list[Slot] = []  # the window whose norm last_grad_norm reports
        self._device_norms: dict[Slot, float] | tuple = {}  # resident slots' squared norms (or pending)
        self._norm_pending = False
        self._last_grad_norm: float | None = None
        self.on = speculative  # speculative_clipping
        self.last_unclipped = True  # the last window's norm did not clip (or there was none): speculate
        self._counts = {"params": 0, "host_bytes": 0, "hits": 0, "misses": 0, "waited": 0,
                        "vram_term_bytes": 0, "terms_held": 0}
        self.hold_terms = False  # speculated fp32 terms go up at once (see plan_term_holding)
        self._holding: dict[int, Slot] = {}  # slots whose held_term is set, by index
        self._verdict = None  # the last window's clip verdict on its way from the device, and what it decides

    # --------------------------------------------------------------------- speculation
    def speculates(self, slot: Slot) -> bool:
        """Whether this slot's update may start before the global norm is known: it has next-state
        buffers, and the update reads a gradient the device measured (not a host sum), and
        writes no state without a twin (fp32 masters are state when update terms are off; under
        8-bit moments the master has its twin)."""
        return (slot.next_state is not None and slot.offloaded and not slot.streamed
                and not self._slots.sums_on_host(slot)
                and (slot.param.dtype == torch.bfloat16 or slot.quantized or self._engine.pipeline.upload_terms))

    def recount(self) -> None:
        self._counts["params"] = sum(self.speculates(s) for s in self._slots.order)

    @property
    def speculating(self) -> int:
        """How many offloaded parameters may update before the global norm is known."""
        return self._counts["params"]

    @property
    def host_bytes(self) -> int:
        """Host memory the second state sets hold."""
        return self._counts["host_bytes"]

    def enable_speculation(self, paged_bytes: int = 0) -> None:
        """With clipping: next-state buffers for the offloaded parameters, first those whose
        gradients arrive first (they have the most backward to hide behind), as many as the host
        budget holds beyond what TrainStream holds already and the plan's `paged_bytes` of
        activations; the rest wait for the norm."""
        if self.max_grad_norm is None or not self.on:
            return
        room = self._engine.host_room(self._host_held()) - paged_bytes
        pipeline, host_tensor = self._engine.pipeline, self._engine.host_tensor
        for s in reversed(self._slots.order):
            if s.next_state is not None or not s.offloaded or s.streamed or self._slots.sums_on_host(s):
                continue
            need = self._speculation_bytes(s)
            if need > room:
                continue
            try:
                self._counts["host_bytes"] += pipeline.enable_speculation(s.host)
            except NativeError as e:  # (pinned memory can run out before MemAvailable says so)
                log.warning("clipping: no host memory for more second state sets (%s); the updates "
                            "of the parameters without one wait for the global norm", e)
                break
            room -= need
            if s.quantized:  # (as the optimizer's state shows it: see Slots.shown)
                s.next_state = self._slots.shown(s, self._engine.host_codes(s.host, "next_"))
            else:
                s.next_state = {"exp_avg": host_tensor(s.host, "next_exp_avg", s.weight),
                                "exp_avg_sq": host_tensor(s.host, "next_exp_avg_sq", s.weight)}
            if s.param.dtype == torch.bfloat16 and not s.stochastic:
                s.next_state["master_param"] = host_tensor(s.host, "next_master", s.weight)
        self.recount()
        self.plan_term_holding()

    def forget(self, slot: Slot) -> None:
        """`slot` became resident: its second state set goes with its host state."""
        self._counts["host_bytes"] -= self._speculation_bytes(slot)
        slot.next_state = None
        self.recount()

    def _speculation_bytes(self, slot: Slot) -> int:
        return self._engine.pipeline.speculation_bytes(slot.weight.numel(), DTYPE_NAMES[slot.param.dtype],
                                                       slot.host.moments)

    def plan_term_holding(self) -> None:
        """Whether speculated fp32 update terms go up at once, each into its gradient's VRAM, kept
        from the gradient's arrival until the module's next forward gate: the commit then applies it
        on the device, and nothing crosses the link after the verdict. It costs up to 4 bytes a
        speculating parameter of VRAM, so under a budget only where the plan leaves that room; not
        while profiling (the profile would count it), nor under DDP or FSDP2, whose gradients are
        theirs."""
        fp32 = [s for s in self._slots.order if self.speculates(s) and s.param.dtype == torch.float32]
        need = sum(4 * s.weight.numel() for s in fp32)
        distributed = self._dp is not None or self._shards is not None
        room = bool(fp32) and self._engine.pipeline.upload_terms and not distributed and self._vram_room(need)
        self.hold_terms = room
        self._counts["vram_term_bytes"] = need if room else 0
        if not room:
            self.release_terms()

    def holds_term(self, slot: Slot, grad: torch.Tensor, job: dict) -> bool:
        """Whether this gradient's VRAM is lent to its speculated fp32 update term."""
        return (job.get("speculate", False) and self.hold_terms and grad.dtype == torch.float32
                and grad.numel() == slot.weight.numel())

    def hold_term(self, slot: Slot, grad: torch.Tensor) -> None:
        slot.held_term = grad
        self._holding[slot.index] = slot
        self._counts["terms_held"] += 1

    def holds_terms(self) -> bool:
        return bool(self._holding)

    def release_terms(self, slots: list | None = None) -> None:
        """Gives back the VRAM lent to terms of these slots (default: every one holding a term),
        whose jobs have all finished (their applying kernels are queued on the upload stream, which
        the allocator waits for)."""
        for s in list(self._holding.values()) if slots is None else slots:
            s.held_term = None
            self._holding.pop(s.index, None)

    def commit(self, slots: list, verdict=None) -> None:
        """Queues the commits of these slots' speculative updates (the engine takes the
        hyperparameters each ran with: the decay the upload applies); the state's views follow the
        swaps. With a `verdict` still on its way, the engine redoes a step into the next-state
        buffers first if it clips."""
        for slot in slots:
            for key, view in slot.next_state.items():
                slot.next_state[key], slot.state[key] = slot.state[key], view
        self._engine.pipeline.commit([s.host for s in slots], [s.weight.data_ptr() for s in slots], verdict)

    @property
    def speculation(self) -> dict:
        """See OffloadedAdamW.speculation."""
        self.settle_verdict(wait=True)
        return self._counts

    # --------------------------------------------------------------------------- norms
    def measure(self, slot: Slot, grad: torch.Tensor, stream: int, job: dict | None = None) -> None:
        """Queues the squared norm of `grad` on `stream`; or, given the `job` that is about to send
        a CUDA gradient, has the pipeline take it on its download stream as the gradient leaves,
        off the stream that computes the next gradients (step() orders its stream after them)."""
        if self.grad_norms is None:  # the first clipped window (max_grad_norm may be set later)
            self.grad_norms = GradientNorms(self._engine.device, len(self._slots.order), self._resident)
        if grad.numel() and job is not None and grad.is_cuda:
            job["device_norm"], job["device_norm_scratch"] = self.grad_norms.target(
                slot.index, grad.numel(), self._engine.streams[0])
        elif grad.numel():  # (an empty FSDP2 shard's slot stays 0)
            self.grad_norms.add(slot.index, grad, stream)
        slot.norm_on_device = True
        self._norm_pending = True

    def gradient_sent(self) -> None:
        """A gradient went to the host: the window's norm must be read again."""
        self._norm_pending = self.track_norm

    def collect(self, arrival: list) -> None:
        """At step(): the window whose norm last_grad_norm reports is this one."""
        self.norm_slots = sorted(arrival, key=lambda s: s.index)
        self._device_norms = {}
        self._norm_on_device = {s for s in arrival if s.norm_on_device}
        if self._norm_on_device and self._engine.device.type == "cuda":
            self._engine.pipeline.order_after_norms(self._engine.current_stream())  # (measured as they left)
        self._offload_norms = self.grad_norms.collect() if self._norm_on_device else None

    def take_norm_now(self) -> None:
        """Under FSDP2 the global norm is a collective: every rank takes it at step(), whatever its
        shards, rather than wherever someone reads last_grad_norm."""
        self._norm_pending = True
        _ = self.last_grad_norm

    @property
    def last_grad_norm(self) -> float | None:
        """See OffloadedAdamW.last_grad_norm."""
        if self._norm_pending:
            on_host = [s.host for s in self.norm_slots if s.offloaded and s not in self._norm_on_device]
            if on_host:
                self._engine.pipeline.wait(on_host)
            if isinstance(self._device_norms, tuple):
                slots, pending = self._device_norms
                self._device_norms = dict(zip(slots, pending.values()))
            offloaded = self._offload_norms.values() if self._norm_on_device else None
            total = 0.0  # added in order, one rounding each, as the device adds them (not sum())
            for s in self.norm_slots:
                if s.resident:
                    total += self._device_norms.get(s, 0.0)
                elif s in self._norm_on_device:
                    total += offloaded[s.index]
                else:
                    total += s.host.squared_norm
            if self._shards is not None:
                total = self._shards.global_squared_norm(total, self._engine.device)
            self._last_grad_norm = math.sqrt(total)
            self._norm_pending = False
        return self._last_grad_norm

    # ------------------------------------------------------------------------ verdicts
    def coefficient(self, resident: list) -> tuple:
        """This window's clip coefficient, after the resident gradients' norms (`resident`: their
        (slot, gradient) pairs) are queued: (scale, device_scale, verdict). `scale` is the
        host's, 1.0 when nothing clips or the verdict decides; `device_scale` a device tensor for
        the resident update where the norms are all on the device; `verdict` the pipeline's handle
        where the host engine's jobs wait for the coefficient instead of this thread."""
        norms = device_scale = verdict = None
        if resident and self.track_norm:
            norms = self._resident.norms([g for _, g in resident])
            self._device_norms = ([s for s, _ in resident], norms)
            self._norm_pending = True
        scale = 1.0
        if self.max_grad_norm is not None:
            if norms is not None and all(s.resident for s in self.norm_slots):
                # every norm is on the device: so is the coefficient, and nothing waits for it
                device_scale = self._resident.clip_scale(norms, self.max_grad_norm, CLIP_EPS)
            elif self.verdict_on_device():
                # so is the coefficient, which the host engine's jobs wait for instead of us
                coefficient, verdict = self.land_verdict(resident, norms)
                if isinstance(coefficient, torch.Tensor):
                    device_scale = coefficient
                else:
                    scale = coefficient  # (CPU mode: already known)
            if device_scale is None and verdict is None:
                scale = clip_coefficient(self.last_grad_norm, self.max_grad_norm, CLIP_EPS)
        return scale, device_scale, verdict

    def verdict_on_device(self) -> bool:
        """Whether this window's clip coefficient can be computed where all its norms are, the
        device (resident gradients, and offloaded ones measured before they left), and handed to
        the host engine there, so that no thread waits for it: one process, no host sums."""
        return (self._dp is None and self._shards is None and self.grad_norms is not None
                and all(s.resident or s in self._norm_on_device for s in self.norm_slots))

    def land_verdict(self, resident: list, norms) -> tuple:
        """Queues the clip coefficient after the window's norms, and its download for the host
        engine; returns the coefficient for the resident update, and the verdict."""
        coefficient, on_device = self.grad_norms.verdict(
            [s.index for s, _ in resident], norms, sorted(s.index for s in self._norm_on_device),
            self.max_grad_norm, CLIP_EPS)
        verdict = self._engine.pipeline.land_scale(on_device.data_ptr(), self._engine.current_stream())
        if on_device.is_cuda:  # the download stream reads it: keep its memory from reuse until then
            on_device.record_stream(self._engine.streams[0])
        return coefficient, verdict

    def resolve(self, pending: list, scale: float, verdict) -> bool:
        """Counts the window (now, or once its verdict lands) and says whether its speculative
        updates may be committed: no clip known here, or a verdict that will judge them."""
        if verdict is not None:
            self._expect_verdict(pending, verdict)
            return True
        unclipped = scale == 1.0 and math.isfinite(self._last_grad_norm or 0.0)
        self._resolve_speculation(pending, unclipped)
        return unclipped

    def _resolve_speculation(self, pending: list, unclipped: bool) -> None:
        """Counts the window as a hit, a miss or a wait; on a miss drops what is left of the
        speculative updates (the redo reads the state they never wrote). The next window
        speculates if this one's norm did not clip: a run that clips every step then waits, as
        without speculation, rather than doing each update twice."""
        if self.max_grad_norm is None or not any(s.offloaded for s in pending):
            return
        speculated = any(s.speculated for s in pending)
        if speculated and not unclipped:
            self._engine.pipeline.abandon_speculation()
        self._count_window(speculated, any(self.speculates(s) for s in pending), unclipped)

    def _count_window(self, speculated: bool, speculates: bool, unclipped: bool) -> None:
        if speculated:
            self._counts["hits" if unclipped else "misses"] += 1
        elif speculates:
            self._counts["waited"] += 1
        self.last_unclipped = unclipped

    def _expect_verdict(self, pending: list, verdict) -> None:
        """The window's speculation is counted once its verdict lands (the pipeline drops what is
        left of a speculation that the verdict redoes)."""
        self.settle_verdict(wait=True)  # the last window's, if it has not been counted yet
        if not any(s.offloaded for s in pending):
            return
        self._verdict = (verdict, any(s.speculated for s in pending), any(self.speculates(s) for s in pending))
        self.settle_verdict(wait=False)

    def settle_verdict(self, wait: bool) -> None:
        """Counts the last window once its verdict has landed (waiting for it with `wait`)."""
        if self._verdict is None:
            return
        verdict, speculated, speculates = self._verdict
        if not verdict.landed:
            if not wait:
                return
            self._engine.pipeline.wait_scale(verdict)
        self._verdict = None
        self._count_window(speculated, speculates, verdict.commits)

    @property
    def verdict_pending(self) -> bool:
        """Whether the last window's verdict has not been counted yet."""
        return self._verdict is not None

    def expect(self, verdict, speculated: bool, speculates: bool) -> None:
        """Treat `verdict` as the last window's, still on its way (tests' seam)."""
        self._verdict = (verdict, speculated, speculates)
