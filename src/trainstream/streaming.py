"""Weight streaming: blocks whose weights live in host memory and visit the device around their use.

A streamed block's weights stay in pinned host memory, in the model's dtype. For its trainable
parameters that memory is the offload pipeline's own (trainstream._C.OffloadPipeline.
keep_weights_on_host): the host AdamW writes each update there and nothing is uploaded at
step(). Frozen ones get a pinned copy of their own.

Each parameter keeps a device tensor whose storage is empty while the block is away. In forward,
the block's pre-hook makes the compute stream wait for its weights and starts the copy of the
next `depth` blocks on a copy stream; its post-hook frees them (the last streamed block stays, as
backward starts with it). A hook on the block's outputs fires when backward reaches the block:
it waits for the block's weights, fetches the ones backward needs next and frees those of the
blocks after it, whose backward is done. A block recomputed in backward finds its weights there
already: one copy serves the recompute and the backward. A copy waits, on the host, for the
block's queued updates, then runs after what the compute stream has queued so far, since the
memory it writes came from that stream's pool.

Outside a training forward and its backward the parameters hold their host tensors, so reading
or saving the model (model.state_dict(), load_state_dict()) sees the current weights, and a
stray use of them on the device fails with a device mismatch rather than reading freed memory.
"""

from __future__ import annotations

import torch

from trainstream.activations.pager import in_backward, tensors_in
from trainstream.placement import in_flight_bytes

_AWAY, _COMING, _HERE = 0, 1, 2


def shared_outside(blocks: list[torch.nn.Module], model: torch.nn.Module) -> set[int]:
    """Positions in `blocks` of those holding a parameter that another module of `model` outside
    them also holds (tied weights): those cannot leave the device with their block."""
    owner: dict[int, int] = {}
    for k, block in enumerate(blocks):
        for p in block.parameters():
            owner[id(p)] = k
    shared = set()
    inside = {id(m) for block in blocks for m in block.modules()}
    for module in model.modules():
        if id(module) in inside:
            continue
        for p in module.parameters(recurse=False):
            if id(p) in owner:
                shared.add(owner[id(p)])
    return shared


class _Block:
    __slots__ = ("module", "position", "params", "device", "host", "nbytes", "where", "event", "gate")

    def __init__(self, module, position, params, gate):
        self.module, self.position, self.params, self.gate = module, position, params, gate
        self.device, self.host, self.nbytes = [], [], []
        self.where = _AWAY
        self.event = None


class WeightStreamer:
    """Streams the weights of the blocks add()ed to it. Built by the optimizer, which calls
    begin_forward() and end_backward()."""

    def __init__(self, device: torch.device, depth: int = 1):
        self.device = device
        self.depth = depth
        self._cuda = device.type == "cuda"
        self._copy = torch.cuda.Stream(device) if self._cuda else None
        self._blocks: list[_Block] = []  # in forward order
        self._index: dict[int, int] = {}  # id(module) -> its place in _blocks
        self._handles = []
        self._attached = False  # the parameters hold their device tensors (a forward is running)
        self.copies = 0  # block copies issued, for report()
        self.copied_bytes = 0
        self.pinned_bytes = 0  # host memory of its own: frozen weights (trainable ones are the pipeline's)

    # ----------------------------------------------------------------------- set-up
    def add(self, module: torch.nn.Module, position: int, host_of, gate) -> None:
        """Streams `module`, the model's block number `position`, from now on (between steps: no
        forward or backward is running). `host_of(param)` gives the host tensor that holds a
        parameter's weights (the pipeline's, already filled), or None for one to be made here;
        `gate(stream)` waits for the block's queued updates and orders `stream` after them."""
        if self._attached:
            self.end_backward()
        params = list(dict.fromkeys(module.parameters()))
        block = _Block(module, position, params, gate)
        for p in params:
            host = host_of(p)
            if host is None:
                host = torch.empty(p.shape, dtype=p.dtype, pin_memory=self._cuda)
                host.copy_(p.detach())
                self.pinned_bytes += host.nbytes
            if p.device != self.device:  # a model wrap() is placing from host memory
                device = torch.empty(p.shape, dtype=p.dtype, device=self.device)
            else:
                device = p.data  # (a version counter of its own: refilling it is no in-place edit of p)
                if device.untyped_storage().nbytes() != p.numel() * p.element_size() or not p.is_contiguous():
                    device = device.clone(memory_format=torch.contiguous_format)  # a storage of its own
            block.device.append(device)
            block.host.append(host)
            block.nbytes.append(p.numel() * p.element_size())
            p.data = host
            device.untyped_storage().resize_(0)
        self._blocks = sorted(self._blocks + [block], key=lambda b: b.position)
        self._index = {id(b.module): k for k, b in enumerate(self._blocks)}
        self._handles.append(module.register_forward_pre_hook(lambda m, a: self._before_block(self._index[id(m)])))
        self._handles.append(module.register_forward_hook(
            lambda m, a, out: self._after_block(self._index[id(m)], out)))

    @property
    def modules(self) -> list[torch.nn.Module]:
        return [b.module for b in self._blocks]

    @property
    def weight_bytes(self) -> int:
        return sum(sum(b.nbytes) for b in self._blocks)

    @property
    def window_bytes(self) -> int:
        """The most streamed weight bytes on the device at a time: the block in use and the
        `depth` after it."""
        return in_flight_bytes([sum(b.nbytes) for b in self._blocks], self.depth)

    def resident_bytes(self) -> int:
        """Streamed weights on the device now."""
        return sum(sum(b.nbytes) for b in self._blocks if b.where != _AWAY)

    def remove(self) -> int:
        """Back to the device for good (remove_hooks()): the blocks' weights in VRAM again, in
        forward order as far as they fit. From the first that does not, they stay in host memory
        as tensors of their own (the pinned buffers go with the optimizer). Returns the bytes
        left in host memory."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.end_backward()
        full, left = False, 0
        for block in self._blocks:
            for p, device, host, nbytes in zip(block.params, block.device, block.host, block.nbytes):
                if not full:
                    try:
                        device.untyped_storage().resize_(nbytes)
                    except torch.OutOfMemoryError:
                        full = True
                    else:
                        p.data = device.copy_(host)
                        continue
                p.data = host.clone()
                left += nbytes
        self._blocks = []
        return left

    # ------------------------------------------------------------------------ moves
    def _stream(self):
        return torch.cuda.current_stream(self.device) if self._cuda else None

    def _fetch(self, k: int) -> None:
        """Starts bringing block k to the device (nothing if it is there or on its way)."""
        if not 0 <= k < len(self._blocks) or self._blocks[k].where != _AWAY:
            return
        block = self._blocks[k]
        for device, nbytes in zip(block.device, block.nbytes):
            device.untyped_storage().resize_(nbytes)  # from the compute stream's pool
        if not self._cuda:
            block.gate(0)
            for device, host in zip(block.device, block.host):
                device.copy_(host)
            block.where = _HERE
        else:
            self._copy.wait_stream(self._stream())  # the memory's last users on the compute stream
            block.gate(self._copy.cuda_stream)
            with torch.cuda.stream(self._copy):
                for device, host in zip(block.device, block.host):
                    device.copy_(host, non_blocking=True)
                block.event = torch.cuda.Event()
                block.event.record(self._copy)
            block.where = _COMING
        self.copies += 1
        self.copied_bytes += sum(block.nbytes)

    def _use(self, k: int) -> None:
        """Block k's weights, ready for the compute stream's next kernels."""
        self._fetch(k)
        block = self._blocks[k]
        if block.where == _COMING:
            self._stream().wait_event(block.event)
            block.where = _HERE

    def _release(self, k: int) -> None:
        block = self._blocks[k]
        if block.where == _AWAY:
            return
        if block.where == _COMING:  # fetched, never used: the copy must finish before reuse
            self._stream().wait_event(block.event)
        for device in block.device:
            device.untyped_storage().resize_(0)
        block.where = _AWAY
        block.event = None

    # ------------------------------------------------------------------------ hooks
    def begin_forward(self) -> None:
        """The model's forward starts: the parameters take their device tensors (empty until
        their block is fetched) and the first blocks start coming."""
        if not self._attached:
            for block in self._blocks:
                for p, device in zip(block.params, block.device):
                    p.data = device
            self._attached = True
        for k in range(min(self.depth, len(self._blocks))):
            self._fetch(k)

    def _before_block(self, k: int) -> None:
        if not self._attached:
            self.begin_forward()  # the block is called on its own, outside the model's forward
        self._use(k)
        if not in_backward():  # (in backward: a recompute, whose block backward has fetched)
            for d in range(1, self.depth + 1):
                self._fetch(k + d)

    def _after_block(self, k: int, output) -> None:
        if in_backward():
            return
        if torch.is_grad_enabled():
            outputs = [t for t in tensors_in(output) if t.requires_grad]
            for t in outputs:
                t.register_hook(lambda grad: self._backward_reaches(k))
            if outputs and k == len(self._blocks) - 1:
                return  # backward starts with it
        self._release(k)

    def _backward_reaches(self, k: int) -> None:
        self._use(k)
        for d in range(1, self.depth + 1):
            self._fetch(k - d)
        for j in range(k + 1, len(self._blocks)):  # their backward is done
            self._release(j)

    def end_backward(self) -> None:
        """Backward (or a forward without one) is over: every block leaves the device and the
        parameters take their host tensors again."""
        for k in range(len(self._blocks)):
            self._release(k)
        if self._attached:
            for block in self._blocks:
                for p, host in zip(block.params, block.host):
                    p.data = host
            self._attached = False
