"""Light recompute: a block checkpointed with torch's selective checkpointing, so that backward
reruns only its cheap ops (norms, activations, rotary embeddings, casts, residual adds) and
reuses what its matmuls and attention computed in forward. Its activations shrink to its inputs
and those outputs for a small fraction of the block's forward time. Recomputed ops see the same
inputs and run the same kernels, so training keeps its bits.

The census measures, in one forward, what light recompute of each block would keep and redo.
Selective checkpointing decides each op's fate in Python, in forward and again in backward:
that host time is measured too (`dispatch_seconds`), and on a fast GPU it is most of the cost."""

from __future__ import annotations

import contextlib
import functools
import time

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from trainstream.activations.plan import tensors_in

# ops whose outputs are kept: the expensive ones (their time is the block's)
_SAVED_NAMES = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "convolution", "_scaled_dot_product_flash_attention",
                "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_fused_attention_overrideable",
                "_flash_attention_forward", "_efficient_attention_forward")
SAVED_OPS = frozenset(getattr(torch.ops.aten, name).default for name in _SAVED_NAMES
                      if hasattr(torch.ops.aten, name) and hasattr(getattr(torch.ops.aten, name), "default"))
OP_SECONDS = 4e-6  # what one recomputed elementwise kernel costs beyond its bytes (a launch)


def kept(func) -> bool:
    """Whether light recompute keeps `func`'s output: a matmul or attention. Random ops run again,
    all of them, from the random state checkpointing restores: they draw the same values."""
    return func in SAVED_OPS


def _policy(ctx, func, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if kept(func) else CheckpointPolicy.PREFER_RECOMPUTE


context = functools.partial(create_selective_checkpoint_contexts, _policy)


class Census(TorchDispatchMode):
    """Inside one block's forward: the bytes of the outputs light recompute keeps, the ops it
    would run again with the bytes they write (views write nothing), and every op dispatched.
    Every kept op's output is a storage of its own, alive until backward: summed, not told apart
    by address (a freed one's address is reused). `mutated`: an op wrote into a kept output in
    place (an in-place ReLU after a linear layer, say), which selective checkpointing refuses in
    backward: such a block is not offered light recompute. Kept outputs are known by their storage, held weakly: when
    the forward pages one out and frees it, a new tensor at its address is not mistaken for it.
    Ops run `aside()` are not the block's and are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.kept_bytes = 0
        self.redone_ops = 0
        self.redone_bytes = 0
        self.dispatched_ops = 0
        self.mutated = False
        self._kept: set[StorageWeakRef] = set()
        self._aside = False

    @contextlib.contextmanager
    def aside(self):
        """Ops that are not the block's: a saved-tensor hook's (the pager's record_stream writes
        into a kept output, by its schema)."""
        self._aside = True
        try:
            yield
        finally:
            self._aside = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._aside:
            return func(*args, **(kwargs or {}))
        self.dispatched_ops += 1
        if func._schema.is_mutable:
            written = [a for a, spec in zip(args, func._schema.arguments) if spec.alias_info and spec.alias_info.is_write]
            written += [v for k, v in (kwargs or {}).items() if k == "out"]
            self.mutated |= any(StorageWeakRef(t.untyped_storage()) in self._kept for t in tensors_in(written))
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tensors_in((args, kwargs or {}))}
        storages = [t.untyped_storage() for t in tensors_in(out)]
        fresh = {st.data_ptr(): st.nbytes() for st in storages}
        written = sum(n for key, n in fresh.items() if key not in inputs)
        if kept(func):
            self.kept_bytes += written
            self._kept.update(StorageWeakRef(st) for st in storages)
        elif written:
            self.redone_ops += 1
            self.redone_bytes += written
        return out


def seconds(ops: int, written: int, dispatched: int, device_bytes_per_s: float, op_host_s: float) -> float:
    """What light recompute adds to a block: its cheap ops run again, each reading about twice
    what it writes, at the device's bandwidth, plus a launch each; and every op it dispatches
    passes selective checkpointing's Python twice (forward, then the rerun in backward), which
    the GPU waits for when it outpaces the host."""
    return 3 * written / device_bytes_per_s + OP_SECONDS * ops + 2 * dispatched * op_host_s


@functools.cache
def dispatch_seconds(device: torch.device, ops: int = 256) -> float:
    """What selective checkpointing adds to one op on the host, measured: small additions on
    `device` run inside its forward context and without it (best of three; a first pass warms
    both up)."""
    x = torch.zeros(8, device=device)

    def run() -> float:
        start = time.perf_counter()
        y = x
        for _ in range(ops):
            y = y + 1
        return time.perf_counter() - start

    def under_policy() -> float:
        with context()[0]:
            return run()

    run(), under_policy()
    plain = min(run() for _ in range(3))
    return max(0.0, min(under_policy() for _ in range(3)) - plain) / ops
