"""TrainStream under torch.distributed: the reduced gradient leaves, each rank updates its share.

Two things make DDP and an offloading optimizer compose:

* The gradient that leaves for the host must be the all-reduced one. A post-accumulate-grad hook
  fires before DDP's all-reduce, so under DDP the optimizer's hooks only count backward passes and
  a communication hook does the rest: it all-reduces each bucket and, once that bucket's all-reduce
  has completed, hands the bucket's gradients to the optimizer while backward goes on.
* Host memory and host work must not grow with the number of ranks on a machine. Every rank holds
  the same averaged gradients, so each parameter's AdamW state and update belong to one rank only
  (its *owner*): ranks own disjoint shares balanced by size and interleaved in forward order, so
  that every rank's gradients arrive throughout backward. Each rank's placement planner places its
  own share (a peer's parameter costs it nothing), so a model that fits keeps every owned state in
  VRAM and updates it there. At step() each owner broadcasts its new weights to the other ranks.

Every rank still measures every gradient's norm on its device, in forward order, so that the global
norm (and so clipping) has the same bits on every rank without another collective.

Under FSDP2 both come with the engine: FSDP2 calls the optimizer's post-accumulate-grad hooks itself
with each rank's reduce-scattered shard, and each rank holds (and so offloads and updates) only its
shards, which FSDP2 all-gathers before the next forward. The global norm is one all-reduce of the
ranks' squared norms.
"""

import atexit
import threading
import time

import torch
import torch.distributed as dist

from trainstream.errors import UnsupportedSetupError


def partition(sizes: list[int], world: int) -> list[int]:
    """The owning rank of each parameter, `sizes` in forward order: each goes to the rank that owns
    the fewest elements so far (the lowest such rank on a tie). Deterministic, so every rank
    computes the same partition."""
    loads = [0] * world
    owners = []
    for size in sizes:
        rank = min(range(world), key=lambda r: (loads[r], r))
        owners.append(rank)
        loads[rank] += size
    return owners


def data_parallel_of(model: torch.nn.Module):
    """The DistributedDataParallel wrapper `model` is, or None."""
    return model if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None


# A process group's threads free Python objects when their work completes: DDP's communication
# hook's callback, FSDP2's collectives' tensors. Freeing one takes the GIL, and a thread that asks
# for the GIL while the interpreter finalizes is ended on the spot; ending a C++ thread that way is
# std::terminate: a run that trained correctly would abort at exit. So, at exit and before
# finalizing, the main thread lets go of the GIL for a moment, long enough for the last step's
# objects to be freed.
_EXIT_GRACE_S = 0.05
_exit_grace_registered = False


def _exit_grace() -> None:
    time.sleep(_EXIT_GRACE_S)


def _register_exit_grace() -> None:
    global _exit_grace_registered
    if not _exit_grace_registered:
        atexit.register(_exit_grace)
        _exit_grace_registered = True


class DataParallel:
    """One rank's side of training a DDP model: who owns what, the communication hook, and the
    collectives step() and state_dict() run."""

    def __init__(self, ddp: torch.nn.parallel.DistributedDataParallel, owners: list[int]) -> None:
        self.group = ddp.process_group
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.owners = owners  # per trainable parameter, in forward order (partition())
        self._take = None  # where reduced gradients go; None after remove_hooks(): the hook only all-reduces
        self._lock = threading.Lock()  # gloo may complete two buckets' futures on two threads
        _register_exit_grace()
        try:
            ddp.register_comm_hook(self, _reduce_then_hand_over)
        except (RuntimeError, ValueError) as e:
            raise UnsupportedSetupError(
                f"this DistributedDataParallel model cannot take TrainStream's communication hook ({e}). "
                f"TrainStream needs its own: wrap the DDP model before registering a communication hook "
                f"and before its first backward, and do not register another one.") from e

    def attach(self, take) -> None:
        """Reduced gradients go to `take(param, grad)` from now on."""
        self._take = take

    def detach(self) -> None:
        self._take = None

    def hand_over(self, params: list, grads: list) -> None:
        take = self._take
        if take is None:
            return
        with self._lock:
            for param, grad in zip(params, grads):
                take(param, grad)

    def broadcast(self, param: torch.Tensor, owner: int):
        """Queues the broadcast of `owner`'s copy of `param` to every rank (every rank queues the same
        broadcasts in the same order); returns the work to wait for. Called under no_grad, on the
        parameter itself: gloo drops a finished work on a thread of its own, and were the work's
        tensor a temporary alias (param.detach()), freeing it there would need the GIL, which a
        finalizing interpreter refuses by ending the thread (std::terminate at exit)."""
        return dist.broadcast(param, src=dist.get_global_rank(self.group, owner), group=self.group, async_op=True)

    def gather_state(self, local: dict) -> dict:
        """A torch AdamW state dict whose "state" holds every rank's entries (indices are global:
        param_groups are the same on every rank). A collective: every rank calls it."""
        shards: list = [None] * self.world
        cpu = {i: {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in s.items()}
               for i, s in local["state"].items()}
        dist.all_gather_object(shards, cpu, group=self.group)
        state = {}
        for shard in shards:
            state.update(shard)
        return {"state": dict(sorted(state.items())), "param_groups": local["param_groups"]}


def _reduce_then_hand_over(state: "DataParallel", bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's communication hook: the average over ranks (as DDP's own all-reduce computes it), then
    the bucket's gradients go to the optimizer as soon as they are reduced."""
    buffer = bucket.buffer()
    buffer.div_(state.world)
    params, grads = bucket.parameters(), bucket.gradients()  # grads: views of `buffer`
    future = dist.all_reduce(buffer, group=state.group, async_op=True).get_future()

    def reduced(fut):
        state.hand_over(params, grads)
        return fut.value()[0]

    return future.then(reduced)


def check_ddp(ddp: torch.nn.parallel.DistributedDataParallel, tuning) -> None:
    """What wrap() refuses under DDP: summing micro-batches on the host (DDP sums them in .grad)."""
    if tuning.accumulate_in_vram is False:
        raise UnsupportedSetupError(
            "under DistributedDataParallel gradients are summed where DDP sums them, in VRAM (use "
            "ddp.no_sync() for the micro-batches before the last); Tuning(accumulate_in_vram=False) "
            "is not supported there")


# ----------------------------------------------------------------------------------- FSDP2
def fsdp2_root(model: torch.nn.Module):
    """`model` if it is an FSDP2 module (fully_shard applied to it), else None."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without distributed support
        return None
    return model if isinstance(model, FSDPModule) else None


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """The part of a DTensor parameter (or gradient) this rank holds: a plain tensor whose memory
    is FSDP2's own (what it all-gathers from, or what its reduce-scatter wrote)."""
    return param._local_tensor


class Sharded:
    """One rank's side of training an FSDP2 model: FSDP2 keeps all-gathering the weights and
    reduce-scattering the gradients; each rank offloads and updates the shard it holds. The
    global gradient norm is the sum over ranks of each rank's squared norm."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.mesh = params[0].device_mesh
        self.group = self.mesh.get_group()
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        _register_exit_grace()

    def global_squared_norm(self, local: float, device: torch.device) -> float:
        """A collective: every rank calls it at the same point of step()."""
        total = torch.tensor([local], dtype=torch.float64, device=device)
        dist.all_reduce(total, group=self.group)
        return float(total.item())

    @staticmethod
    def as_shard_of(local: torch.Tensor, param: torch.Tensor):
        """`local` (this rank's part of some state of `param`, e.g. a host tensor) as a DTensor
        sharded as `param` is, without copying it to the mesh's device: torch AdamW's state
        dict format for an FSDP2 parameter."""
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

        spec = DTensorSpec(param.device_mesh, param.placements,
                           tensor_meta=TensorMeta(param.shape, param.stride(), local.dtype))
        return DTensor(local, spec, requires_grad=False)

    def local_of(self, value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """This rank's part of a state tensor for `param`: a DTensor's local shard, or the
        rank's chunk (as FSDP2 chunks, along dim 0) of a whole tensor from an unsharded run."""
        from torch.distributed.tensor import DTensor

        if isinstance(value, DTensor):
            return value.to_local()
        value = value.reshape(param.shape)
        chunks = torch.chunk(value, self.world, dim=0)
        if self.rank < len(chunks):
            return chunks[self.rank]
        return value.new_zeros((0,) + tuple(param.shape[1:]))


def check_fsdp2(model: torch.nn.Module, params: list[torch.Tensor], tuning, activations, vram_budget) -> None:
    """What wrap() serves of FSDP2: fully_shard on the model itself (it may be applied to blocks
    too), on a one-dimensional mesh, parameters sharded along dim 0 (the default), kept on the
    device (no CPUOffloadPolicy: TrainStream does the offloading), and no activation paging (FSDP2
    frees and re-gathers the unsharded weights that autograd saves, under the pager's feet)."""
    from torch.distributed.tensor import DTensor, Shard

    def refuse(what: str) -> None:
        raise UnsupportedSetupError(f"trainstream.wrap() of an FSDP2 model: {what}")

    if fsdp2_root(model) is None:
        refuse("apply fully_shard to the model itself (the module given to wrap()), as FSDP2 expects, "
               "after applying it to its blocks")
    if not all(isinstance(p, DTensor) for p in params):
        refuse("every trainable parameter must be sharded by fully_shard")
    mesh = params[0].device_mesh
    if any(p.device_mesh != mesh for p in params) or mesh.ndim != 1:
        refuse("one one-dimensional device mesh is supported (not HSDP or several meshes)")
    if any(tuple(p.placements) != (Shard(0),) for p in params):
        refuse("parameters must be sharded along dim 0 (fully_shard's default shard_placement_fn)")
    if _offloads_to_cpu(model):
        refuse("drop CPUOffloadPolicy: TrainStream offloads the gradients and AdamW state itself and "
               "keeps the sharded weights on the device")
    if tuning.placement not in ("auto", "offload"):
        refuse(f"every rank offloads its shards; Tuning(placement={tuning.placement!r}) is not supported there")
    if activations not in ("auto", "off") or vram_budget is not None:
        refuse("activation paging (activations=<share>, vram_budget) is not supported under FSDP2 yet; "
               "use activation checkpointing on the blocks, as with FSDP2 alone")


def _offloads_to_cpu(model: torch.nn.Module) -> bool:
    """Whether fully_shard was given a CPUOffloadPolicy anywhere in `model` (torch 2.11 keeps one
    parameter group per module, later versions a list)."""
    for module in model.modules():
        if fsdp2_root(module) is None:
            continue
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = getattr(state, "_fsdp_param_group", None)
            groups = [group] if group is not None else []
        if any(getattr(p, "offload_to_cpu", False) for group in groups for p in group.fsdp_params):
            return True
    return False
