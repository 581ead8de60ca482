"""The optimizer that wrap() returns: torch.optim.AdamW's interface over host-side state.

Gradients leave the device from per-parameter post-accumulate-grad hooks; the native pipeline
(trainstream._C.OffloadPipeline) folds, clips and applies them on host threads and uploads the
new weights; module forward pre-hooks make the compute stream wait for exactly the uploads each
module reads. This class keeps the Python side of that bargain: when to update, with which
hyperparameters, and torch's optimizer API on top.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from trainstream.errors import GRAD_SCALER_MESSAGE, UnsupportedSetupError, check_autocast
from trainstream.host_adamw import DTYPE_NAMES

_CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_
# fp32 update terms cross to VRAM through a staging buffer of at most this many floats (64 MiB),
# a piece at a time for larger parameters.
_STAGING_FLOATS = 16 << 20


@dataclass(eq=False)
class _Slot:
    """What the optimizer tracks for one trainable parameter."""

    param: torch.nn.Parameter
    host: object  # trainstream._C.HostParam
    group: dict
    version: int  # param._version when host master and device weights last agreed
    step: int = 0
    landed: bool = False  # a gradient arrived in the current accumulation window
    updated: bool = False  # its update for this window has been queued
    state: dict = field(default_factory=dict)


class OffloadedAdamW(torch.optim.Optimizer):
    """AdamW whose state lives in host memory and whose update runs on host threads.

    Shares ``param_groups`` with the optimizer it was built from, so LR schedulers and code that
    edits ``lr`` keep working. Use it like the original: ``loss.backward(); opt.step();
    opt.zero_grad()``. Build it with :func:`trainstream.wrap`.
    """

    # Lets torch.amp.GradScaler hand itself to step(), where it is refused with a clear message.
    _step_supports_amp_scaling = True

    def __init__(self, source: torch.optim.Optimizer, model: torch.nn.Module, pipeline, *,
                 device: torch.device, max_grad_norm: float | None, accumulation_steps: int,
                 track_grad_norm: bool, streams: tuple | None, activation_pager=None,
                 accumulate_in_vram: bool = False) -> None:
        super().__init__(source.param_groups, source.defaults)
        self.param_groups = source.param_groups  # the very same list: edits show on both sides
        self._pipeline = pipeline
        self._device = device
        self._streams = streams  # (download, upload) torch streams, kept alive here
        self.activation_pager = activation_pager  # trainstream.activations.ActivationPager or None
        self.max_grad_norm = max_grad_norm
        self.accumulation_steps = accumulation_steps
        # Micro-batch gradients are summed by autograd in VRAM and sent once per window, rather
        # than sent every micro-batch and summed in a host accumulator.
        self.accumulate_in_vram = accumulate_in_vram and accumulation_steps > 1
        self._host_sum = accumulation_steps > 1 and not self.accumulate_in_vram
        self._track_norm = track_grad_norm or max_grad_norm is not None
        self._micro = 0  # backward passes finished in this accumulation window
        self._backward_tasks: set[int] = set()  # autograd graph tasks with our end-callback queued
        self._arrival: list[_Slot] = []  # slots in gradient arrival order, this window
        self._last_grad_norm: float | None = None
        self._norm_slots: list[_Slot] = []  # the window whose norm last_grad_norm reports
        self._norm_pending = False
        self._slots: dict[torch.nn.Parameter, _Slot] = {}
        self._hooks: list = []
        self._gates: list = []  # (module, forward pre-hook) for each module that owns parameters
        self._gate_handles: list | None = None  # while the gates are installed
        self._hosts: list = []  # every parameter's HostParam
        self._uploads_queued = 0  # updates (each ends in an upload) queued so far
        self._gate_always = False  # a benchmark's baseline: gates stay installed and every one waits
        self._pack = True
        self._register(model)
        self._sync_packing()

    # ----------------------------------------------------------------------------- set-up
    def _register(self, model: torch.nn.Module) -> None:
        accumulate = self._host_sum
        for group in self.param_groups:
            for p in group["params"]:
                if not p.requires_grad or p in self._slots:
                    continue
                # registration order stands in for forward order (embeddings, layers, head)
                host = self._pipeline.add_param(p.numel(), DTYPE_NAMES[p.dtype], accumulate,
                                                len(self._slots))
                self._pipeline.load_weights(host, p.data_ptr(), self._current_stream())
                slot = _Slot(p, host, group, p._version)
                slot.state = {
                    "step": torch.tensor(0.0),
                    "exp_avg": self._host_tensor(host, "exp_avg", p),
                    "exp_avg_sq": self._host_tensor(host, "exp_avg_sq", p),
                }
                if p.dtype == torch.bfloat16:  # the fp32 master is what bf16 training resumes from
                    slot.state["master_param"] = self._host_tensor(host, "master", p)
                self.state[p] = slot.state
                self._slots[p] = slot
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        for module in model.modules():
            own = [self._slots[p].host for p in module.parameters(recurse=False) if p in self._slots]
            if own:
                self._gates.append((module, self._gate_hook(own)))
        self._hosts = [s.host for s in self._slots.values()]
        self._staging = None
        self._set_upload_terms(True)
        self._install_gates()
        # A lambda, not a bound method: copy.deepcopy(model) copies the hooks, and would copy the
        # optimizer behind a bound method with them.
        self._hooks.append(model.register_forward_pre_hook(lambda *_: self._before_forward(), prepend=True))
        # Reads and writes of the weights outside forward (saving, loading) see settled values.
        self._hooks.append(model.register_state_dict_pre_hook(lambda *_: self.synchronize()))
        self._hooks.append(model.register_load_state_dict_pre_hook(lambda *_: self.synchronize()))

    def _set_upload_terms(self, on: bool) -> None:
        fp32 = [s for s in self._slots.values() if s.param.dtype == torch.float32]
        if on and fp32 and self._device.type == "cuda" and self._staging is None:
            floats = min(max(s.param.numel() for s in fp32), _STAGING_FLOATS)
            self._staging = torch.empty(floats, dtype=torch.float32, device=self._device)
            self._staging.record_stream(self._streams[1])  # freed only after the uploads using it
            self._pipeline.set_upload_staging(self._staging.data_ptr(), self._staging.nbytes)
        if not on and self._pipeline.upload_terms:
            # The host kept no fp32 copy of these weights: take it from the device before the
            # next update reads it.
            self.synchronize()
            for s in fp32:
                self._pipeline.load_weights(s.host, s.param.data_ptr(), self._current_stream())
            self._pipeline.set_upload_staging(0, 0)
            self._staging = None  # the allocator waits for the upload stream before reusing it
        self._pipeline.upload_terms = on

    @staticmethod
    def _host_tensor(host, name: str, like: torch.Tensor) -> torch.Tensor:
        return torch.frombuffer(host.view(name), dtype=torch.float32).view(like.shape)

    def _current_stream(self) -> int:
        if self._device.type == "cuda":
            return torch.cuda.current_stream(self._device).cuda_stream
        return 0

    def _install_gates(self) -> None:
        if self._gate_handles is None:
            self._gate_handles = [m.register_forward_pre_hook(hook) for m, hook in self._gates]

    def _remove_gates(self) -> None:
        for h in self._gate_handles or ():
            h.remove()
        self._gate_handles = None

    def _before_forward(self) -> None:
        check_autocast(self._device.type)
        # Once no update is queued and every upload has finished, no module needs to wait for its
        # weights: the gates come off until the next update is queued (_mark_updated). Within an
        # accumulation window, forwards after the first then run without a hook on every module.
        if self._gate_handles is not None and not self._gate_always and self._pipeline.settled(self._hosts):
            self._remove_gates()

    def _gate_hook(self, hosts: list):
        # A module that has gated on a stream need not again until another update is queued: its
        # weights' uploads were all waited for. So while the gates stay on (uploads still in
        # flight), later forwards of a window skip the native call and its lock.
        settled = (None, None)  # (uploads queued, stream) at this module's last gate

        def gate(module, args):
            nonlocal settled
            if self._gate_handles is None:  # taken off by this forward's _before_forward
                return
            now = (self._uploads_queued, self._current_stream())
            if now != settled or self._gate_always:
                self._pipeline.gate(hosts, now[1])
                settled = now
        return gate

    # ------------------------------------------------------------------- during backward
    def _on_grad(self, param: torch.nn.Parameter) -> None:
        grad = param.grad
        if grad is None:
            return
        slot = self._slots[param]
        if grad.is_sparse:
            raise UnsupportedSetupError("sparse gradients are not supported by TrainStream")
        task = torch._C._current_graph_task_id()
        if task not in self._backward_tasks:
            self._backward_tasks.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._on_backward_end(task))
        if self._micro >= self.accumulation_steps:
            raise RuntimeError(
                f"accumulation_steps={self.accumulation_steps} backward passes have run since the "
                f"last optimizer.step(); call optimizer.step() before the next backward"
            )
        if param._version != slot.version:  # the weights were changed behind our back
            self._pipeline.load_weights(slot.host, param.data_ptr(), self._current_stream())
            slot.version = param._version
        last = self._micro == self.accumulation_steps - 1
        first = not slot.landed
        if first:
            slot.landed = True
            self._arrival.append(slot)
        if self.accumulate_in_vram and not last:
            return  # autograd adds the next micro-batch into param.grad
        update_now = last and self.max_grad_norm is None
        job = dict(
            accumulate=self._host_sum,
            overwrite=self._host_sum and first,
            from_accumulator=self._host_sum,
            norm=last and self._track_norm,
        )
        if update_now:
            job.update(self._update_args(slot, grad_scale=1.0))
        self._send(slot, grad, job)
        if update_now:
            self._mark_updated(slot)

    def _send(self, slot: _Slot, grad: torch.Tensor, job: dict) -> None:
        """Hands a gradient to the pipeline (copy out, then `job` on the host) and frees it."""
        if not grad.is_contiguous():
            grad = grad.contiguous()
        self._pipeline.land_gradient(slot.host, grad.data_ptr(), self._current_stream(), **job)
        if grad.is_cuda:  # the download stream reads it: keep its memory from reuse until then
            grad.record_stream(self._streams[0])
        slot.param.grad = None
        self._norm_pending = self._track_norm

    def _on_backward_end(self, task: int) -> None:
        self._backward_tasks.discard(task)
        # A reentrant checkpoint runs a nested backward inside a node of the outer one; only the
        # end of the outermost backward ends a micro-batch.
        if torch._C._current_autograd_node() is None:
            self._backward_tasks.clear()
            self._micro += 1

    def _update_args(self, slot: _Slot, grad_scale: float) -> dict:
        group = slot.group
        lr = group["lr"]
        beta1, beta2 = group["betas"]
        return dict(
            update=True,
            lr=float(lr), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
            weight_decay=float(group.get("weight_decay", 0.0)), step=slot.step + 1,
            grad_scale=grad_scale, maximize=bool(group.get("maximize", False)),
            device_weight=slot.param.data_ptr(),
        )

    def _mark_updated(self, slot: _Slot) -> None:
        self._install_gates()
        self._uploads_queued += 1
        slot.updated = True
        slot.step += 1
        slot.state["step"].fill_(slot.step)

    # -------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        """Apply this accumulation window's gradients. Returns the closure's loss, if any.

        Without clipping, updates have already started during backward and this returns at
        once; with max_grad_norm it waits for the gradient norms, then queues the updates in
        forward order. Either way the next forward waits for exactly the weights it reads.
        """
        if grad_scaler is not None:
            raise UnsupportedSetupError(GRAD_SCALER_MESSAGE)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pending = [s for s in reversed(self._arrival) if not s.updated]  # forward order
        if pending:
            from_acc = self._host_sum
            scale = 1.0
            for s in pending:
                if s.param.grad is not None and self.accumulate_in_vram:
                    # Still summing in VRAM: an early step, or no gradient in the last backward.
                    self._send(s, s.param.grad, dict(norm=self._track_norm))
                elif self._track_norm and self._micro < self.accumulation_steps:
                    # early step: the norm was not taken during backward
                    self._pipeline.submit(s.host, from_accumulator=from_acc, norm=True)
            self._norm_slots = list(self._arrival)
            if self.max_grad_norm is not None:
                scale = self._clip_coefficient()
            for s in pending:
                self._pipeline.submit(s.host, from_accumulator=from_acc,
                                      **self._update_args(s, grad_scale=scale))
                self._mark_updated(s)
        if not pending and self._arrival:
            self._norm_slots = list(self._arrival)
        for s in self._arrival:
            s.landed = s.updated = False
        self._arrival = []
        self._micro = 0
        return loss

    @property
    def pack_gradients(self) -> bool:
        """Send fp32 gradients whose values are bf16 (weight gradients under bf16 autocast) as
        bf16, losslessly: half the PCIe and host-memory bytes (default True). Not done when a
        share of activations or a VRAM budget is asked for: the pack kernels take SMs from
        backward, which that much paging makes the longer side of the step (activations="auto"
        pages only what hides behind compute)."""
        return self._pack

    @pack_gradients.setter
    def pack_gradients(self, on: bool) -> None:
        self._pack = bool(on)
        self._sync_packing()

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
        paging = pager is not None and (pager.vram_budget is not None or bool(pager.share))
        self._pipeline.pack_gradients = self._pack and not paging

    def _clip_coefficient(self) -> float:
        total = self.last_grad_norm
        return min(1.0, self.max_grad_norm / (total + _CLIP_EPS))

    @property
    def last_grad_norm(self) -> float | None:
        """Global L2 norm of the last window's gradients (before clipping), for logging.

        Measured when max_grad_norm is set or wrap(track_grad_norm=True); None otherwise.
        """
        if self._norm_pending:
            self._pipeline.synchronize()
            self._last_grad_norm = math.sqrt(sum(s.host.squared_norm for s in self._norm_slots))
            self._norm_pending = False
        return self._last_grad_norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears gradients left on the device: any a caller left behind, and with
        accumulate_in_vram the window's unsent sums (as torch's zero_grad would)."""
        for p in self._slots:
            p.grad = None

    def synchronize(self) -> None:
        """Wait for every queued host update and order the current stream after its upload."""
        self._pipeline.synchronize()
        self._pipeline.gate(self._hosts, self._current_stream())

    # ------------------------------------------------------------------- checkpoints
    def state_dict(self):
        self.synchronize()
        return super().state_dict()

    def load_state_dict(self, state_dict) -> None:
        """Load a torch.optim.AdamW (or our own) state dict; tensors are copied to host memory."""
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
            if slot is None:
                continue
            for key in ("exp_avg", "exp_avg_sq"):
                slot.state[key].copy_(state[key].detach().reshape(p.shape))
            slot.step = int(state["step"])
            slot.state["step"].fill_(slot.step)
            if "master_param" in state and "master_param" in slot.state:
                slot.state["master_param"].copy_(state["master_param"].reshape(p.shape))
                with torch.no_grad():
                    p.copy_(slot.state["master_param"].to(p.device, p.dtype))
                slot.version = p._version
            elif p._version != slot.version:
                self._pipeline.load_weights(slot.host, p.data_ptr(), self._current_stream())
                slot.version = p._version

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_slots", None) is None:  # during torch's own __init__
            return super().add_param_group(param_group)
        raise UnsupportedSetupError(
            "adding param groups after trainstream.wrap() is not supported; add them to the "
            "optimizer before wrapping")

    # ---------------------------------------------------------------------- figures
    def report(self) -> dict:
        """What TrainStream holds where, and how the host engine runs."""
        numel = sum(s.param.numel() for s in self._slots.values())
        fp32 = [s for s in self._slots.values() if s.param.dtype == torch.float32]
        packed = sum(s.param.numel() for s in fp32 if s.host.last_gradient_as_bf16)
        return {
            "trainable_params": numel,
            "host_memory_kind": self._pipeline.host_memory_kind,
            "host_bytes_reserved": self._pipeline.host_reserved_bytes,
            "host_bytes_used": self._pipeline.host_used_bytes,
            "host_bytes_per_param": self._pipeline.host_used_bytes / max(numel, 1),
            "isa": self._pipeline.isa,
            "threads": self._pipeline.threads,
            "accumulation_steps": self.accumulation_steps,
            "accumulate_in": "vram" if self.accumulate_in_vram else "host",
            "max_grad_norm": self.max_grad_norm,
            "last_grad_norm": self.last_grad_norm,
            # share of fp32 weights whose last gradient was bf16-exact (under bf16 autocast, the
            # matmuls') and crossed as bf16; each one is tested, so none is ever rounded
            "gradients_sent_as_bf16": packed / max(sum(s.param.numel() for s in fp32), 1),
            # VRAM besides the weights: the buffer fp32 update terms cross through (64 MiB at most)
            "vram_staging_bytes": self._staging.nbytes if self._staging is not None else 0,
            "activations": self.activation_pager.report() if self.activation_pager else "off",
        }

    def remove_hooks(self) -> None:
        """Detach from the model (after a final synchronize); the optimizer is unusable after."""
        self.synchronize()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._remove_gates()
        if self.activation_pager is not None:
            self.activation_pager.remove()
