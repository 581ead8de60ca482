"""During backward: each gradient, as autograd produces it, summed, measured, sent or applied as its placement says.

A post-accumulate-grad hook on every trainable parameter hands its gradient over: a resident one
stays beside its weights (bf16 weights sum micro-batches in an fp32 accumulator); an offloaded one
is copied to host memory by the native pipeline and freed, its update queued at once where no
clipping waits for the global norm (or where the update may start before it: clipping.py).
Under DDP the gradient arrives reduced, from the communication hook (distributed.py); under
FSDP2, as this rank's reduce-scattered shard.
"""

from __future__ import annotations

import torch

from trainstream.clipping import Clipping
from trainstream.errors import TrainingLoopError, UnsupportedSetupError, check_single_process
from trainstream.gates import ForwardGates
from trainstream.slots import Engine, Slot, Slots, Window, hyperparameters, update_args


class GradientHooks:
    """The gradient side of one optimizer. `tiers` is the promotion room, whose profiler records
    the profiled window's arrivals and whose weight streamer (when blocks stream) follows
    backward."""

    def __init__(self, engine: Engine, slots: Slots, window: Window, clipping: Clipping, gates: ForwardGates,
                 tiers, *, data_parallel, shards) -> None:
        self._engine = engine
        self._slots = slots
        self._window = window
        self._clipping = clipping
        self._gates = gates
        self._tiers = tiers
        self._dp = data_parallel
        self._shards = shards
        self._checked_processes = False

    def on_grad(self, param: torch.nn.Parameter) -> None:
        """The post-accumulate-grad hook."""
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
        window, acc = self._window, self._slots.accumulation_steps
        task = torch._C._current_graph_task_id()
        if task not in window.backward_tasks:
            window.backward_tasks.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._on_backward_end(task))
            # whether this backward speculates: the last window's verdict may have landed since forward began
            self._clipping.settle_verdict(wait=False)
        if window.micro >= acc:
            raise TrainingLoopError(
                f"accumulation_steps={acc} backward passes have run since the "
                f"last optimizer.step(); call optimizer.step() before the next backward"
            )
        profiler = self._tiers.profiler
        if profiler is not None and profiler.recording:
            profiler.gradient(slot.index)
        if self._shards is not None:
            # FSDP2 calls this hook itself, with the reduce-scattered shard (its stream current)
            # after each backward; with set_requires_gradient_sync(False) only after the last
            # micro-batch's, so the window's last is counted by forwards, as under DDP.
            self.take(slot, slot.mine(grad), last=window.forwards >= acc)
        elif self._dp is None:  # under DDP the gradient is not reduced yet: see on_reduced
            self.take(slot, grad, last=window.micro == acc - 1)

    def on_reduced(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """Under DDP: `param`'s gradient averaged over the ranks (a view of DDP's bucket, which DDP
        copies into .grad when backward ends). The window's last micro-batch is the one whose
        forward was the window's `accumulation_steps`-th."""
        self.take(self._slots[param], grad, last=self._window.forwards >= self._slots.accumulation_steps)

    def take(self, slot: Slot, grad: torch.Tensor, last: bool) -> None:
        """One micro-batch's gradient of `slot`: summed, measured, sent or applied as its
        placement says."""
        param, clipping = slot.param, self._clipping
        first = not slot.landed
        if first:
            slot.landed = True
            self._window.arrival.append(slot)
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
            if last and clipping.track_norm:
                clipping.measure(slot, grad, self._engine.current_stream())
            return
        weight = slot.weight
        if weight._version != slot.version and not slot.streamed:  # the weights were changed behind our back
            self._engine.pipeline.load_weights(slot.host, weight.data_ptr(), self._engine.current_stream())
            slot.version = weight._version
        if slot.sum_in_vram and not last:
            return  # autograd adds the next micro-batch into param.grad
        host_sum = self._slots.sums_on_host(slot)
        # With clipping, a gradient the device holds whole is measured there before it leaves, and
        # its update may start now with a clip coefficient of 1, committed at step() if the global
        # norm says so and redone from the untouched state if not.
        clip = clipping.max_grad_norm is not None
        device_norm = last and not host_sum and (clip or self._dp is not None and clipping.track_norm)
        speculate = device_norm and clipping.on and clipping.last_unclipped and clipping.speculates(slot)
        update_now = last and (not clip or speculate)
        job = dict(
            accumulate=host_sum,
            overwrite=host_sum and first,
            from_accumulator=host_sum,
            norm=last and clipping.track_norm and not device_norm,
        )
        stream = self._engine.current_stream()  # (backward's: the norm and the copy are ordered after it)
        if device_norm:
            clipping.measure(slot, grad, stream, job)
        if update_now:
            hyper = hyperparameters(slot, grad_scale=1.0)
            job.update(update_args(slot, hyper), speculate=speculate)
        self.send(slot, grad, job, stream)
        if speculate:
            slot.speculated = hyper
        elif update_now:
            self.mark_updated(slot)

    def send(self, slot: Slot, grad: torch.Tensor, job: dict, stream: int) -> None:
        """Hands a gradient to the pipeline (copy out, after `stream`'s work so far; then `job` on
        the host) and frees it, or lends its memory to a speculated fp32 update term
        (Clipping.plan_term_holding)."""
        clipping = self._clipping
        if not grad.is_contiguous():
            grad = grad.contiguous()
        hold = clipping.holds_term(slot, grad, job)
        if hold:
            job["device_term"] = grad.data_ptr()
        self._engine.pipeline.land_gradient(slot.host, grad.data_ptr(), stream, **job)
        if grad.is_cuda:  # the download stream reads it: keep its memory from reuse until then
            grad.record_stream(self._engine.streams[0])
            if hold:  # ...and the upload stream writes the term and applies it
                grad.record_stream(self._engine.streams[1])
        if slot.held_term is not None:  # (land_gradient waited for this parameter's earlier jobs: it is applied)
            clipping.release_terms([slot])
        if hold:
            clipping.hold_term(slot, grad)
        if self._dp is None:  # (DDP's bucket is DDP's: step() clears .grad under DDP)
            slot.param.grad = None
        clipping.gradient_sent()

    def mark_updated(self, *slots: Slot) -> None:
        for slot in slots:
            if slot.offloaded:
                self._gates.update_queued()
            slot.updated = True
            slot.step += 1
            slot.state["step"].fill_(slot.step)

    def _on_backward_end(self, task: int) -> None:
        window = self._window
        window.backward_tasks.discard(task)
        # A reentrant checkpoint runs a nested backward inside a node of the outer one; only the
        # end of the outermost backward ends a micro-batch.
        if torch._C._current_autograd_node() is None:
            window.backward_tasks.clear()
            window.micro += 1
            if self._tiers.streamer is not None:
                self._tiers.streamer.end_backward()
            profiler = self._tiers.profiler
            if profiler is not None and profiler.recording:
                profiler.end_backward()
