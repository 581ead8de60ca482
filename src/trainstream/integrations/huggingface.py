"""Hugging Face Trainer integration: `TrainStreamTrainer` is a drop-in `transformers.Trainer`.

    from trainstream.integrations.huggingface import TrainStreamTrainer
    trainer = TrainStreamTrainer(model=model, args=TrainingArguments(..., bf16=True), train_dataset=ds)
    trainer.train()

It builds the optimizer the Trainer would (AdamW with the usual decay / no-decay groups and the
lr, betas, eps and weight_decay of TrainingArguments), wraps it with trainstream.wrap() using
`gradient_accumulation_steps` and `max_grad_norm`, and does the clipping itself on the host. The
logged `grad_norm` is TrainStream's pre-clip global norm.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from types import MethodType
from typing import Any

try:
    from transformers import Trainer
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "trainstream.integrations.huggingface needs transformers: pip install 'trainstream[hf]'"
    ) from exc

import trainstream
from trainstream.errors import UnsupportedSetupError
from trainstream.optimizer import OffloadedAdamW


def _unwrap(optimizer: Any) -> Any:
    """accelerate wraps the optimizer in an AcceleratedOptimizer; ours is inside."""
    while optimizer is not None and not isinstance(optimizer, OffloadedAdamW) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


@contextlib.contextmanager
def _outputs_left_in_autocast_dtype(model: Any):
    """Lets `model` (prepared by accelerate for mixed precision) return its outputs as autocast
    made them: accelerate's wrapper copies every bf16 output to fp32 after the forward, the
    logits included, at the step's peak (0.5 GB for a 4x1024 batch over a 32k vocabulary) and for
    nothing when only the loss, fp32 already, is read. Where the forward is not wrapped so, as
    under torch.compile, nothing changes."""
    try:
        from accelerate.utils.operations import ConvertOutputsToFp32
    except ImportError:  # pragma: no cover - accelerate comes with transformers' Trainer
        yield
        return
    forward = vars(model).get("forward")
    conversion = getattr(getattr(forward, "__func__", forward), "__wrapped__", None)
    if not isinstance(conversion, ConvertOutputsToFp32):
        yield
        return
    inner = conversion.model_forward
    model.forward = MethodType(inner, model) if isinstance(forward, MethodType) else inner
    try:
        yield
    finally:
        model.forward = forward


class TrainStreamTrainer(Trainer):
    """A `transformers.Trainer` whose optimizer state, gradients and update live in host memory.

    Extra keyword: `trainstream_options`, a dict of trainstream.wrap()'s keywords (e.g.
    ``{"vram_budget": "20GB", "tuning": trainstream.Tuning(threads=12)}``); the norm is always
    tracked, for the Trainer's `grad_norm` log.
    """

    def __init__(self, *args: Any, trainstream_options: dict | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.args.fp16:
            raise UnsupportedSetupError(
                "TrainStreamTrainer does not support fp16=True: fp16 needs loss scaling, which "
                "TrainStream does not implement. Use bf16=True (or full fp32)."
            )
        self._ts_options = dict(trainstream_options or {})
        norm = self.args.max_grad_norm
        self._ts_max_grad_norm = norm if norm is not None and norm > 0 else None
        # Clipping happens inside the offloaded step; the Trainer's own pass would find no
        # gradients on the device.
        self.args.max_grad_norm = 0.0

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # accelerate "places" an optimizer by copying its state dict to the device and loading it
        # back. TrainStream's state is already where its plan keeps it: the copy would put every
        # offloaded byte on the GPU at once (out of memory under a cap) and cross PCIe twice.
        prepare = self.accelerator.prepare_optimizer

        def prepare_optimizer(optimizer, device_placement=None):
            ours = isinstance(_unwrap(optimizer), OffloadedAdamW)
            return prepare(optimizer, device_placement=False if ours else device_placement)

        self.accelerator.prepare_optimizer = prepare_optimizer

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model) if model is not None else super().create_optimizer()
        if not isinstance(_unwrap(optimizer), OffloadedAdamW):
            target = self.model if model is None else model
            options = dict(self._ts_options)
            tuning = replace(options.pop("tuning", None) or trainstream.Tuning(), track_grad_norm=True)
            _, self.optimizer = trainstream.wrap(
                target, optimizer,
                max_grad_norm=self._ts_max_grad_norm,
                accumulation_steps=self.args.gradient_accumulation_steps,
                tuning=tuning,
                **options,
            )
        return self.optimizer

    def compute_loss(self, model, inputs, return_outputs: bool = False, *args: Any, **kwargs: Any):
        # A training step that reads only the model's own loss leaves its logits in bf16: the
        # fp32 copy would take VRAM the plan could keep state in, where a cap binds.
        own_loss = (model.training and not return_outputs and self.compute_loss_func is None
                    and self.label_smoother is None)
        with _outputs_left_in_autocast_dtype(model) if own_loss else contextlib.nullcontext():
            return super().compute_loss(model, inputs, return_outputs, *args, **kwargs)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        optimizer = _unwrap(self.optimizer)
        if isinstance(optimizer, OffloadedAdamW) and "loss" in logs:
            norm = optimizer.last_grad_norm
            if norm is not None:
                logs["grad_norm"] = norm
            pipeline = optimizer.engine.pipeline  # (the two figures logged, not the whole report())
            logs["trainstream_host_GB"] = round(pipeline.host_used_bytes / 1e9, 3)
            logs["trainstream_isa"] = pipeline.isa
        super().log(logs, *args, **kwargs)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        optimizer = _unwrap(self.optimizer)
        if isinstance(optimizer, OffloadedAdamW):
            optimizer.synchronize()
        super()._save_optimizer_and_scheduler(output_dir)
