"""Forward gates: the next forward waits for exactly the uploads of the weights it reads, compiled or not.

A forward pre-hook on each module that owns a trainable parameter waits for that module's
uploads only, so the next forward starts while later layers still update; what changes from step
to step is what they wait for, not the hooks. Under torch.compile each hook would be a graph
break (it calls the native pipeline), cutting the compiled code at every module: so a module
compiled in place (nn.Module.compile()) or wrapped by torch.compile gates once, at its start, for
every parameter inside it, and a compiled model waits for every upload when its forward starts.
So does an FSDP2 model, whose all-gathers read a module's weights before that module's hook runs.
"""

from __future__ import annotations

from typing import Callable

import torch

from trainstream.errors import compiled_wrappers
from trainstream.slots import Engine, Slots


def compiled(module: torch.nn.Module) -> bool:
    """Compiled in place (nn.Module.compile()) or a torch.compile wrapper (whose model is its
    `_orig_mod` submodule; looked up directly, as a missing attribute costs an exception)."""
    return getattr(module, "_compiled_call_impl", None) is not None or "_orig_mod" in module._modules


class ForwardGates:
    """The gates of one model. `release_terms(slots)` is called once a gate has waited for these
    slots' uploads (None: every slot's), `holds_terms()` says whether any term is held at all.

    While no update is queued and every upload has finished, no module needs to wait: the gates
    stand down (`on` False) until the next update is queued (`update_queued`). `always` keeps them
    awake and calling the pipeline: a benchmark's baseline (trainstream.baselines)."""

    def __init__(self, engine: Engine, slots: Slots, model: torch.nn.Module, *, whole_forward: bool,
                 release_terms: Callable[[list | None], None], holds_terms: Callable[[], bool]) -> None:
        self._engine = engine
        self._slots = slots
        self._model = model
        self._release_terms = release_terms
        self._holds_terms = holds_terms
        self.on = False  # whether the gates wait (an update has been queued since they last settled)
        self.always = False
        self.uploads_queued = 0  # updates (each ends in an upload) queued so far
        self.hosts: list = []  # every gated parameter's HostParam
        # module -> its offloaded parameters' HostParams, which its forward pre-hook waits for, and their slots
        self._gated: dict[torch.nn.Module, tuple[list, list]] = {}
        self._hooks: list | None = None  # laid out by layout()
        self._units: list[torch.nn.Module] = []
        self._whole = whole_forward
        self._compiled_seen: list[int] | None = None  # the compiled modules and wrappers last laid out for

    # ------------------------------------------------------------------------- layout
    def layout(self, wrapped_by_compile: bool = False) -> None:
        """Where the gates are. Run at wrap() and at each window's first forward, before dynamo
        traces the modules: a model compiled after wrap() gets its gates moved then
        (`wrapped_by_compile`: a torch.compile wrapper of the model is calling it)."""
        whole = self._whole or compiled(self._model) or wrapped_by_compile
        units = [] if whole else list(dict.fromkeys(self._units_of(self._model)))  # (a shared module once)
        if self._hooks is not None and (whole, units) == (self._whole, self._units):
            return
        for hook in self._hooks or ():
            hook.remove()
        self._whole, self._units = whole, units
        self._hooks = [unit.register_forward_pre_hook(self._hook(unit)) for unit in units]
        self.build()

    def follow_compile(self, check: Callable[[list, list], None]) -> None:
        """At a window's first forward: if the model's compiled modules or wrappers changed since
        the gates were laid out, `check(wrappers, compiled)` them and lay the gates out anew (on the
        host's critical path: only on a change)."""
        wrappers = compiled_wrappers(self._model)
        found = wrappers + [m for m in self._model.modules() if compiled(m)]
        seen = [id(m) for m in found]
        if seen != self._compiled_seen:
            check(wrappers, found)
            self.layout(wrapped_by_compile=bool(wrappers))
            self._compiled_seen = seen

    def _units_of(self, module: torch.nn.Module) -> list[torch.nn.Module]:
        """The modules under `module` that gate, in module order."""
        if compiled(module):
            return [module] if any(p in self._slots for p in module.parameters()) else []
        units = [module] if any(p in self._slots for p in module.parameters(recurse=False)) else []
        for child in module.children():
            units += self._units_of(child)
        return units

    def build(self) -> None:
        """What each gate waits for: the uploads of the offloaded parameters it gates for (resident
        ones are updated on the compute stream itself, before any later kernel reads them; streamed
        ones are the weight streamer's)."""
        self._gated = {}
        for unit in self._units:
            inside = unit.parameters() if compiled(unit) else unit.parameters(recurse=False)
            own = [self._slots[p] for p in inside
                   if p in self._slots and self._slots[p].offloaded and not self._slots[p].streamed]
            if own:
                self._gated[unit] = ([s.host for s in own], own)
        self.hosts = self._slots.offloaded_hosts()

    # ------------------------------------------------------------------------ waiting
    def update_queued(self) -> None:
        """An offloaded update was queued: its upload is one the next forward may wait for."""
        self.on = bool(self.hosts)
        self.uploads_queued += 1

    def stand_down(self) -> None:
        self.on = False

    def before_forward(self) -> None:
        """A whole-forward gate waits for every upload here; otherwise, once every upload has
        finished, the gates stand down (forwards after a window's first then make no native call
        per module)."""
        if not self.on:
            return
        pipeline = self._engine.pipeline
        if self._whole:
            pipeline.gate(self.hosts, self._engine.current_stream())
        elif self.always or not pipeline.settled(self.hosts):
            return
        self._release_terms(None)
        self.stand_down()

    def wait_all(self) -> None:
        """Order the current stream after every upload queued so far."""
        self._engine.pipeline.gate(self.hosts, self._engine.current_stream())
        self._release_terms(None)

    def _hook(self, module: torch.nn.Module):
        # A module that has gated on a stream need not again until another update is queued: its
        # weights' uploads were all waited for. So while the gates stay on (uploads still in
        # flight), later forwards of a window skip the native call and its lock.
        settled = (None, None)  # (uploads queued, stream) at this module's last gate

        @torch.compiler.disable
        def gate(_module, args):
            nonlocal settled
            if not self.on:  # stood down (e.g. by this forward's before_forward)
                return
            gated = self._gated.get(module)
            if not gated:
                return
            hosts, slots = gated
            now = (self.uploads_queued, self._engine.current_stream())
            if now != settled or self.always:
                self._engine.pipeline.gate(hosts, now[1])
                settled = now
                if self._holds_terms():
                    self._release_terms(slots)
        return gate

    def remove(self) -> None:
        for hook in self._hooks or ():
            hook.remove()
        self._hooks = []
        self.stand_down()
