"""The activation pager: saved-tensor hooks that page, recompute or keep each block's activations
(the package docstring says how and why)."""

from __future__ import annotations

import contextlib
import time
import warnings
import weakref

import torch
from torch.utils.checkpoint import checkpoint

from trainstream._native import _C
from trainstream.activations import light as light_recompute
from trainstream.activations import report as reporting
from trainstream.activations.plan import Plan, Profile, find_blocks, plan_paging, tensors_in
from trainstream.activations.report import StepFigures
from trainstream.errors import TrainingLoopError, UnsupportedSetupError
from trainstream.profiler import measure_copy_bandwidth
from trainstream.timing import mark, seconds
from trainstream.units import format_size

MIN_BYTES = 1 << 20  # smaller saved tensors stay on the device: not worth a copy


# ------------------------------------------------------------------------------- runtime
class _Layout:
    """Where a saved tensor sits in its storage, so that unpack rebuilds the same view."""

    __slots__ = ("dtype", "size", "stride", "offset")

    def __init__(self, t):
        self.dtype, self.size, self.stride, self.offset = t.dtype, t.size(), t.stride(), t.storage_offset()

    def view_of(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.as_strided(self.size, self.stride, self.offset)


class _Recast(_Layout):
    """A saved autocast copy of a weight: recomputed from the weight in backward."""

    __slots__ = ("param", "version")

    def __init__(self, param, t):
        super().__init__(t)
        self.param, self.version = param, param._version


class _Stored:
    """One device storage paged to host (shared by every saved view of it)."""

    __slots__ = ("paged", "nbytes", "block", "generation", "device", "unpacks_left", "__weakref__")

    def __init__(self, paged, nbytes, block, generation):
        self.paged, self.nbytes, self.block, self.generation = paged, nbytes, block, generation
        self.device = None  # the restored device storage (uint8), once page_in is queued
        self.unpacks_left = 0


class _Packed(_Layout):
    """A saved tensor whose storage was paged (a view of `stored`)."""

    __slots__ = ("stored",)

    def __init__(self, stored, t):
        super().__init__(t)
        self.stored = stored


class _Kept:
    """A tensor left on the device, tagged with its block so that backward can prefetch."""

    __slots__ = ("tensor", "block", "generation")

    def __init__(self, tensor, block, generation):
        self.tensor, self.block, self.generation = tensor, block, generation


def _updates_a_cache(kwargs) -> bool:
    """A block call that adds to a key/value cache (Hugging Face's keyword arguments)."""
    return kwargs.get("use_cache") is True or any(
        kwargs.get(name) is not None for name in ("past_key_values", "past_key_value", "layer_past"))


def _alive(seen: dict, key: int) -> bool:
    """`key` (a storage address) was seen this forward and a tensor holding it is still alive;
    otherwise the address may have been freed and reused."""
    ref = seen.get(key)
    return ref is not None and ref() is not None


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class ActivationPager:
    """Pages the saved activations of ``blocks`` (see the module docstring). Built by wrap()."""

    def __init__(self, model: torch.nn.Module, *, device: torch.device, share: float | None,
                 vram_budget: int | None, blocks: list[torch.nn.Module] | None = None,
                 prefetch_depth: int = 1, min_bytes: int | None = None,
                 keep_last: int = 1, recompute: bool = True, deferred: bool = False) -> None:
        name = ""
        if blocks is None:
            name, blocks = find_blocks(model)
        self.blocks = list(blocks)
        self.blocks_name = name or "blocks"  # what messages call them
        if len(self.blocks) < 2:
            if share is not None or vram_budget is not None:
                raise UnsupportedSetupError(
                    "activation paging needs the model's repeated blocks (e.g. its transformer layers), "
                    "but found no ModuleList of two or more modules of one class; pass "
                    "wrap(..., blocks=[...]) or activations='off'")
            self.blocks = []  # "auto" without blocks: only the weight casts are recomputed
        if prefetch_depth < 1:
            raise ValueError(f"prefetch_depth must be >= 1, got {prefetch_depth}")
        self.device = device
        # the placement planner decides after the profile (apply()); until then, paged as profiled
        self.deferred = deferred and bool(self.blocks) and share is None
        self.time_next_forward = False  # deferred: the planner's profiled forward is timed here too
        self.profiled_marks: list = []
        self.share = share
        self.vram_budget = vram_budget
        self.recompute = recompute
        self.depth = prefetch_depth
        self.min_bytes = MIN_BYTES if min_bytes is None else min_bytes
        self.keep_last = max(0, min(keep_last, len(self.blocks) - 1))
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
            self.native = _C.cuda_activation_pager(device.index, self._streams[0].cuda_stream,
                                                    self._streams[1].cuda_stream)
        else:
            self._streams = None
            self.native = _C.host_activation_pager()
        self._param_ids = {id(p) for p in model.parameters()}
        self._static_storages: set[int] = set()  # taken at each forward's start (_model_pre)
        self._input_storages: set[int] = set()
        # share given: decided now; otherwise the first step profiles with every block paged
        self.plan: Plan | None = None
        self.profile: Profile | None = None
        if not self.blocks:
            self.plan = Plan(0, 0, "no repeated blocks found: only autocast weight copies are recomputed")
        elif share is not None and vram_budget is None:  # nothing to measure for a share
            n = len(self.blocks)
            self.plan = plan_paging(Profile([0] * n, [0.0] * n, 1.0, 1.0), share=share, keep_last=self.keep_last)
        self.paged_upto = self.plan.paged_blocks if self.plan else len(self.blocks) - self.keep_last
        self.profiling = self.plan is None
        self._generation = 0
        self._current: int | None = None
        self._hooks_ctx = None
        self._by_storage: dict[int, tuple] = {}
        self._kept: dict[int, weakref.ref] = {}  # storages left on the device this forward
        self._stored_by_block: list[list[weakref.ref]] = [[] for _ in self.blocks]
        self._prefetched: set[int] = set()
        self._casts: dict[tuple, object] = {}  # an activation's cast -> how it was saved (this forward)
        self._figures = StepFigures()
        self.last = StepFigures()  # figures of the last finished forward
        self._times: list = []  # (block, start mark, end mark) for each block run in the timed forward
        self._host_times: list[float] = []  # per block, the host's time in it (timed forward)
        self._hook_times: list[float] = []  # per block, the part of it the hooks took
        self._input_bytes: list[int] = []  # per block, its tensor inputs in the timed forward
        self._inputs_seen: dict[int, weakref.ref] = {}  # their storages (one shared by blocks counts once)
        self._replaced_forwards: dict[int, object] = {}  # recomputed block -> its own forward attribute
        # Light recompute's census (light.py), taken in the first profiled forward when asked for:
        # per block, (bytes it would keep besides its inputs, its cheap ops, the bytes they write,
        # every op it dispatches), None for a block that writes into its matmuls' outputs in place
        self.light_census = False
        self.light: list[tuple[int, int, int, int] | None] | None = None
        self._census: light_recompute.Census | None = None
        self._census_now = False
        self._block_start = None
        self._block_host_start = 0.0
        self._timed = False  # the timed forward has finished: the next one ends profiling
        self._fresh_plan = False
        self._timing = False  # the latest forward (and its backward) is the profiled one
        self._backward_peak: int | None = None  # peak VRAM read when the profiled backward ended
        self._warned_held = False
        self._warned_cache = False
        self.saved_tensor_hooks = True  # False: only the recomputed blocks' checkpointing (apply())
        self._lean = False  # this forward's kept tensors skip the bookkeeping (see _model_pre)
        # called before the profiled forward (wrap(): wait for the weights), so that its block times
        # are compute, not waits for a host update that the next steps may overlap differently
        self.settle = None
        self._forwards = 0
        # the model runs under torch.compile (the optimizer tells, at a window's first forward):
        # a plan without saved-tensor hooks then leaves the blocks' hooks idle (_blocks_hooked)
        self.compiled = False
        self._handles = []
        self._model = model
        self._register()

    # ----------------------------------------------------------------------- hooks
    def _register(self) -> None:
        """Hooks the model and its blocks (once, until remove())."""
        if self._handles:
            return
        # The hooks run eagerly under torch.compile (a graph break at each): they read CUDA streams,
        # call the native pager and enter the saved-tensor hooks that the compiled graph then meets.
        eager = torch.compiler.disable
        self._handles = [self._model.register_forward_pre_hook(eager(self._model_pre), with_kwargs=True),
                         self._model.register_forward_hook(eager(self._model_post), always_call=True)]
        for i, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(self._gated(eager(self._block_pre(i))),
                                                                 with_kwargs=True))
            self._handles.append(block.register_forward_hook(self._gated(eager(self._block_post)),
                                                             always_call=True))

    def _gated(self, hook):
        """`hook`, called while the blocks' hooks act. torch.compile traces the check, not the
        hook: what the check reads becomes a guard of the compiled code, so a change of it compiles
        the model again (a hook added or removed after compiling goes unseen: torch skips hook
        guards)."""
        def gated(module, args, extra):
            if self._blocks_hooked:
                return hook(module, args, extra)
            return None
        return gated

    @property
    def _blocks_hooked(self) -> bool:
        """The blocks' hooks act unless the model runs compiled with a plan that pages nothing and
        measures nothing: a hook at each block would then only cut the compiled graph there (and,
        in a loop over the blocks, leave the loop to eager mode), and torch.compile's own
        recompute needs none."""
        return not (self.compiled and not self.saved_tensor_hooks and not self.profiling)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._restore_forwards()

    def reattach(self) -> None:
        """Hooks the model again after remove() (a later plan pages or recomputes after all)."""
        self._register()

    def set_compiled(self, compiled: bool) -> None:
        """Whether the model runs compiled now: light recompute is offered in eager mode only, and
        the blocks' hooks follow (a model that runs eagerly again gets them back)."""
        self.compiled = compiled
        if compiled:
            self.light_census = False

    def _compute_stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream if self._cuda else 0

    def _model_pre(self, module, args, kwargs):
        if in_backward() or self._hooks_ctx is not None or not torch.is_grad_enabled():
            return  # nothing is saved for backward under no_grad
        # the caller holds the model's inputs: paging them would free nothing
        self._input_storages = {t.untyped_storage().data_ptr() for t in tensors_in((args, kwargs))}
        # where the buffers are now (wrap() may have moved them). Weights are known by their
        # parameter (_pack), not their storage: a streamed block's storages are freed after its
        # forward, and activations that reuse the addresses must not pass for weights.
        self._static_storages = {b.untyped_storage().data_ptr() for b in self._model.buffers()}
        if self.profiling and self._timed:
            self._finish_profile()
        # the first forward runs cold (allocator, kernels' first launches): time the second, or
        # (deferred) the one the placement profiler records
        self._timing = self.profiling and (self.time_next_forward if self.deferred else self._forwards > 0)
        self._census_now = self.light_census and self.profiling and not self._timing and self.light is None
        if self._census_now:
            self.light = [(0, 0, 0, 0)] * len(self.blocks)
        self.time_next_forward = False
        if self._timing and self.settle is not None:
            self.settle()
        self._forwards += 1
        self._generation += 1
        self._by_storage = {}
        self._kept = {}
        self._stored_by_block = [[] for _ in self.blocks]
        self._prefetched = set()
        self._casts = {}
        self._figures = StepFigures(block_bytes=[0] * len(self.blocks), block_cast_bytes=[0] * len(self.blocks))
        if self._cuda and (self._timing or self._fresh_plan):  # the profile's peak, then the plan's
            torch.cuda.reset_peak_memory_stats(self.device)
        self._fresh_plan = False
        if self._timing:
            self._times = []
            self._host_times = [0.0] * len(self.blocks)
            self._hook_times = [0.0] * len(self.blocks)
            self._input_bytes = [0] * len(self.blocks)
            self._inputs_seen = {}
            self._backward_peak = None
        # Disabled for torch.compile too: autograd calls them from inside compiled code, where each
        # would otherwise be traced as a frame of its own.
        # With no block paged and no step measured, kept tensors go to autograd as they are: the
        # hooks then only recast weight copies and save repeated casts once.
        self._lean = self.paged_upto == 0 and not self._timing
        pack, unpack = self._pack, self._unpack
        if self._timing:  # the profiled step: what the hooks cost the host, for the placement planner
            pack, unpack = self._clocked(pack, self._figures), self._clocked(unpack, self._figures)
        if self.saved_tensor_hooks:
            self._hooks_ctx = torch.autograd.graph.saved_tensors_hooks(torch.compiler.disable(pack),
                                                                       torch.compiler.disable(unpack))
        else:  # recomputed blocks only: the forward is ours (for their checkpointing), the saved tensors not
            self._hooks_ctx = contextlib.nullcontext()
        self._hooks_ctx.__enter__()

    def _clocked(self, hook, figures: StepFigures):
        def timed(x):
            start = time.perf_counter()
            try:
                return hook(x)
            finally:
                spent = time.perf_counter() - start
                figures.hook_seconds += spent
                if self._current is not None:
                    self._hook_times[self._current] += spent
        return timed

    def _model_post(self, module, args, output):
        if self._hooks_ctx is None or in_backward():
            return
        self._hooks_ctx.__exit__(None, None, None)
        self._hooks_ctx = None
        self._current = None
        self._casts = {}
        self._count_held()
        if not self._lean:  # (a lean forward counts no bytes: the last full count stands)
            self.last = self._figures
        self._timed = self._timing

    def _count_held(self) -> None:
        """Paged storages that something besides autograd still holds (a KV cache, hidden states
        kept in the output, a stash) keep their device memory: paging them frees nothing."""
        figures = self._figures
        for tensor, stored in self._by_storage.values():
            stored = stored()
            if stored is not None and tensor() is not None:
                figures.held_bytes += stored.nbytes
                figures.block_bytes[stored.block] -= stored.nbytes
        if figures.held_bytes and not self._warned_held:
            self._warned_held = True
            warnings.warn(
                f"{format_size(figures.held_bytes)} of paged activations are still referenced outside "
                f"autograd after forward (a KV cache, or hidden states kept in the output?): they are "
                f"copied to the host but their VRAM is not freed. For training a Hugging Face model, "
                f"call it with use_cache=False or set model.config.use_cache = False.", stacklevel=2)

    def _block_pre(self, index: int):
        def hook(module, args, kwargs):
            if self._hooks_ctx is None or in_backward():
                return  # outside our forward, or a checkpoint recomputing in backward
            self._current = index
            # bound the bytes still on their way to the host: their device memory cannot be
            # reused before the copy is done, so a forward far ahead of the copies would not
            # lower the peak
            lagging = index - 2
            last = self._stored_by_block[lagging][-1]() if lagging >= 0 and self._stored_by_block[lagging] else None
            if last is not None:
                self.native.wait_paged_out(last.paged)
            if self._timing:  # after the wait: time the block's own work
                self._input_bytes[index] += self._new_input_bytes((args, kwargs))
                self._block_start = mark(self.device)
                self._block_host_start = time.perf_counter()
            if self._census_now:
                self._census = light_recompute.Census()
                self._census.__enter__()
        return hook

    def _is_static(self, key: int) -> bool:
        """The storage at address `key` belongs to a buffer or this forward's model inputs."""
        return key in self._static_storages or key in self._input_storages

    def _new_input_bytes(self, inputs) -> int:
        """Bytes of the device storages in `inputs` not yet counted (parameters and the model's
        inputs excluded): what checkpointing the block would keep."""
        total = 0
        for t in tensors_in(inputs):
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if t.device != self.device or _alive(self._inputs_seen, key) or self._is_static(key):
                continue
            self._inputs_seen[key] = weakref.ref(t)
            total += storage.nbytes()
        return total

    # -------------------------------------------------------------------- recompute
    def _recomputed_forward(self, index: int, forward, light: bool = False):
        """`forward` under non-reentrant checkpointing: in backward, the block's forward runs
        again (same inputs, same RNG state, same autocast state) and starts the prefetch of the
        paged blocks before it. `light`: selective checkpointing (light.py), which reruns only
        the cheap ops."""
        options = {"context_fn": light_recompute.context} if light else {}
        def run(*args, **kwargs):
            # Traced by torch.compile: torch's checkpointing with nothing of ours inside, so that
            # the region is one of the compiled graph's (recomputed in the compiled backward; the
            # paged blocks' prefetch starts from the unpack hook as their tensors come back). What
            # is read on that path becomes a guard: grad mode and the call's keywords, never a
            # value that changes each step.
            compiling = torch.compiler.is_compiling()
            # outside our training forward, or a checkpoint recomputing in backward
            outside = not torch.is_grad_enabled() if compiling else self._hooks_ctx is None or in_backward()
            if outside:
                return forward(*args, **kwargs)
            if _updates_a_cache(kwargs):
                self._warn_cache(index)
                return forward(*args, **kwargs)
            if compiling:
                return checkpoint(forward, *args, use_reentrant=False, **kwargs)
            generation = self._generation

            def body(*inner_args, **inner_kwargs):
                if in_backward():
                    self._start_block_backward(index, generation)
                return forward(*inner_args, **inner_kwargs)
            return checkpoint(body, *args, use_reentrant=False, **options, **kwargs)
        return run

    def _warn_cache(self, index: int) -> None:
        if not self._warned_cache:
            self._warned_cache = True
            warnings.warn(
                f"{self.blocks_name}[{index}] is called with a KV cache (use_cache=True): running its forward "
                f"again in backward would add its keys and values to the cache twice, so it is not "
                f"recomputed and keeps its activations on the device. For training a Hugging Face model, "
                f"call it with use_cache=False or set model.config.use_cache = False.", stacklevel=3)

    def finish_profile(self) -> None:
        """Ends a finished profiling step now rather than at the next forward."""
        if self.profiling and self._timed:
            self._finish_profile()

    def apply(self, paged: int, recomputed: tuple[int, ...], reason: str, hooks: bool = True,
              light: tuple[int, ...] = (), recompute_seconds: float = 0.0) -> None:
        """Pages blocks 0 .. paged-1, recomputes `recomputed` and recomputes `light` lightly from
        now on (the planner's choice, with what it rates their recomputing at). Without `hooks`,
        nothing is paged and no saved tensor passes through a hook of ours: the recomputed blocks
        are torch's checkpointing alone."""
        self.saved_tensor_hooks = hooks
        self.apply_plan(Plan(paged_blocks=paged, pageable_blocks=len(self.blocks), reason=reason,
                              recomputed=tuple(recomputed), recompute_seconds=recompute_seconds, light=tuple(light)))
        self._fresh_plan = True

    def apply_plan(self, plan: Plan) -> None:
        self.plan = plan
        self.paged_upto = plan.paged_blocks
        self._restore_forwards()
        for i in plan.recomputed + plan.light:
            block = self.blocks[i]
            self._replaced_forwards[i] = block.__dict__.get("forward")
            block.forward = self._recomputed_forward(i, block.forward, light=i in plan.light)

    def _restore_forwards(self) -> None:
        for i, own in self._replaced_forwards.items():
            if own is None:
                del self.blocks[i].forward
            else:
                self.blocks[i].forward = own
        self._replaced_forwards = {}

    def _block_post(self, module, args, output):
        if self._hooks_ctx is None or in_backward():
            return
        if self._timing and self._current is not None:
            self._times.append((self._current, self._block_start, mark(self.device)))
            self._host_times[self._current] += time.perf_counter() - self._block_host_start
        if self._census is not None:
            census, self._census = self._census, None
            census.__exit__(None, None, None)
            counted = self.light[self._current]
            if census.mutated or counted is None:  # (not offered: see Census)
                self.light[self._current] = None
            else:
                kept, ops, written, dispatched = counted
                self.light[self._current] = (kept + census.kept_bytes, ops + census.redone_ops,
                                             written + census.redone_bytes, dispatched + census.dispatched_ops)
        self._current = None
        if torch.is_autocast_enabled(self.device.type):
            torch.clear_autocast_cache()  # its casts of this block's weights are recast in backward

    # ---------------------------------------------------------------- pack / unpack
    def _count_cast(self, nbytes: int) -> None:
        if self._current is None:
            self._figures.outside_cast_bytes += nbytes
        else:
            self._figures.block_cast_bytes[self._current] += nbytes

    def _pack(self, t: torch.Tensor):
        if self._census is None:
            return self._pack_one(t)
        with self._census.aside():
            return self._pack_one(t)

    def _pack_one(self, t: torch.Tensor):
        self._figures.packs += 1
        if t.device != self.device or t.is_leaf and t.requires_grad:
            return t
        base = t._base if t._is_view() else t
        fn = base.grad_fn
        cast = None
        if fn is not None and type(fn).__name__ == "ToCopyBackward0":
            source, output = fn.next_functions[0]
            param = getattr(source, "variable", None)
            if param is not None and id(param) in self._param_ids and base.numel() == param.numel():
                self._figures.recast_bytes += base.numel() * base.element_size()
                self._count_cast(base.numel() * base.element_size())
                return _Recast(param, t)
            if source is not None:
                # Autocast casts an activation again for every matmul that reads it (a
                # transformer's q, k and v projections). The same cast of the same autograd output
                # holds the same values: an in-place change would have given that output a new
                # node. So it is saved once.
                cast = (source, output, base.dtype, base.size(), base.stride(), base.storage_offset())
        block = self._current
        if block is None:
            return t
        if self._lean:  # nothing paged, nothing measured: a kept tensor needs no wrapper
            if cast is None:
                return t
            earlier = self._casts.setdefault(cast, t)
            return t if earlier is t else earlier.detach().as_strided(t.size(), t.stride(), t.storage_offset())
        if cast is not None:
            earlier = self._casts.get(cast)
            if earlier is not None:
                self._figures.shared_cast_bytes += t.numel() * t.element_size()
                self._count_cast(t.numel() * t.element_size())
                return self._same_values(earlier, t)
        # A weight, seen by its parameter rather than its storage: a streamed one gets a new
        # storage at each upload, and the streamer uploads it again for backward.
        packed = self._pack_activation(t, block, weight=id(base) in self._param_ids)
        if cast is not None:
            self._casts[cast] = packed
        return packed

    @staticmethod
    def _same_values(earlier, t):
        """Saves `t` as what `earlier` saved: a tensor with the same values in the same layout."""
        if isinstance(earlier, _Packed):
            earlier.stored.unpacks_left += 1
            return _Packed(earlier.stored, t)
        same = earlier.tensor.detach().as_strided(t.size(), t.stride(), t.storage_offset())
        return _Kept(same, earlier.block, earlier.generation)

    def _pack_activation(self, t: torch.Tensor, block: int, weight: bool = False):
        start = time.perf_counter() if self._timing else 0.0
        storage = t.untyped_storage()
        key = storage.data_ptr()
        nbytes = storage.nbytes()
        view_bytes = t.numel() * t.element_size()
        static = weight or self._is_static(key)
        pageable = not (static or view_bytes < self.min_bytes or nbytes > 4 * view_bytes
                        or nbytes % t.element_size())
        if not pageable or block >= self.paged_upto:
            if pageable and not _alive(self._kept, key):  # what paging would free: each storage once
                self._kept[key] = weakref.ref(t)
                self._figures.kept_bytes += nbytes
                self._figures.block_bytes[block] += nbytes
            if self._timing:
                self._figures.keeping_seconds += time.perf_counter() - start
            return _Kept(t, block, self._generation)
        seen = self._by_storage.get(key)
        # the same storage if a tensor that holds it is still alive (else the address was reused)
        stored = seen[1]() if seen is not None and seen[0]() is not None else None
        if stored is None:
            paged = self.native.page_out(key, nbytes, self._compute_stream())
            if self._cuda:  # the offload stream reads it: no reuse before the copy is done
                t.record_stream(self._streams[0])
            stored = _Stored(paged, nbytes, block, self._generation)
            # weak references: a slot goes back to the pool as soon as autograd drops its tensor
            self._by_storage[key] = (weakref.ref(t), weakref.ref(stored))
            self._stored_by_block[block].append(weakref.ref(stored))
            self._figures.paged_bytes += nbytes
            self._figures.block_bytes[block] += nbytes
        stored.unpacks_left += 1
        if self._timing:
            self._figures.paging_seconds += time.perf_counter() - start
        return _Packed(stored, t)

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, _Kept):
            start = time.perf_counter() if self._timing else 0.0
            self._start_block_backward(packed.block, packed.generation)
            if self._timing:
                self.last.keeping_seconds += time.perf_counter() - start
            return packed.tensor
        if isinstance(packed, _Recast):
            if packed.param._version != packed.version:
                raise TrainingLoopError(
                    "a weight was modified in place between forward and backward; TrainStream "
                    "recomputes autocast weight copies in backward and cannot do so now")
            with torch.no_grad():
                return packed.view_of(packed.param.to(packed.dtype))
        stored = packed.stored
        start = time.perf_counter() if self._timing else 0.0
        self._start_block_backward(stored.block, stored.generation)
        if stored.device is None:
            self.last.on_demand += 1
            self._fetch(stored)
        device = stored.device
        self.native.order_after_page_in(stored.paged, self._compute_stream())
        stored.unpacks_left -= 1
        if stored.unpacks_left <= 0:
            stored.device = None  # autograd holds what it still needs
            stored.unpacks_left = 0
        if self._timing:
            self.last.paging_seconds += time.perf_counter() - start
        return packed.view_of(device.view(packed.dtype))

    def _fetch(self, stored: _Stored) -> None:
        device = torch.empty(stored.nbytes, dtype=torch.uint8, device=self.device)
        self.native.page_in(stored.paged, device.data_ptr(), self._compute_stream())
        if self._cuda:  # written on the prefetch stream: no reuse before that copy is done
            device.record_stream(self._streams[1])
        stored.device = device

    def _start_block_backward(self, block: int, generation: int) -> None:
        """Block `block` runs backward: prefetch the blocks that run next."""
        if self._timing and generation == self._generation and self._backward_peak is None and self._cuda:
            # read the profiled step's peak when its backward ends: a caller resetting the peak
            # statistics before the next forward must not hide it
            self._backward_peak = 0  # queued: read when backward ends
            torch.autograd.Variable._execution_engine.queue_callback(self._note_backward_peak)
        if generation != self._generation or block in self._prefetched:
            return
        self._prefetched.add(block)
        for j in range(block - 1, max(-1, block - 1 - self.depth), -1):
            for ref in self._stored_by_block[j]:
                stored = ref()
                if stored is not None and stored.device is None and stored.unpacks_left > 0:
                    self._fetch(stored)

    # -------------------------------------------------------------------- profiling
    def _note_backward_peak(self) -> None:
        self._backward_peak = torch.cuda.max_memory_allocated(self.device)

    def _finish_profile(self) -> None:
        """After the profiled step: turn its events and byte counts into a plan."""
        if self._cuda and self._times:
            self._times[-1][2].synchronize()
        times = [0.0] * len(self.blocks)  # a block that did not run costs nothing (and saved nothing)
        for block, start, end in self._times:
            times[block] += seconds(start, end)
        # A block's forward as it runs again in backward or in a plan without our hooks: its
        # time on the compute stream or on the host, whichever was longer (the device waits for a
        # host that falls behind), less what the hooks took on the host inside it.
        times = [max(t, h) - k for t, h, k in zip(times, self._host_times, self._hook_times)]
        d2h, h2d = measure_copy_bandwidth(self.device)
        peak = self.observed_peak_bytes()
        if peak is not None and self._backward_peak:
            peak = max(peak, self._backward_peak)
        self.profile = Profile(list(self.last.block_bytes), times, d2h, h2d, peak, list(self._input_bytes))
        if not self.deferred:
            self.apply_plan(plan_paging(self.profile, share=self.share, vram_budget=self.vram_budget,
                                         keep_last=self.keep_last, recompute=self.recompute))
        self.profiling = False
        self._fresh_plan = True
        self.profiled_marks = list(self._times)  # (block, start, end) marks, for the placement profile
        self._times = []
        self._timed = False

    def observed_peak_bytes(self) -> int | None:
        if not self._cuda:
            return None
        return torch.cuda.max_memory_allocated(self.device)

    def report(self) -> dict:
        return reporting.report(self)

    def describe(self) -> str:
        return reporting.describe(self)
