"""Benchmark baselines and test handles: behaviour no user needs, reached here through the
optimizer's rooms rather than by setting private attributes. Not part of the public API."""

from __future__ import annotations

import os
import time

from trainstream.optimizer import OffloadedAdamW


def gate_every_forward(optimizer: OffloadedAdamW, on: bool = True) -> None:
    """Keep the forward gates awake and make every one call the pipeline, even once the uploads
    have settled: the baseline for letting them stand down."""
    optimizer.gates.always = on


def stage_update_terms(optimizer: OffloadedAdamW, floats: int) -> None:
    """Make fp32 update terms cross to the GPU through a staging buffer of `floats` floats, so that
    parameters larger than it go up in pieces (the default buffer holds the largest parameter up
    to 64 MiB)."""
    optimizer.synchronize()
    optimizer.engine.stage(floats)


def thread_names() -> dict[int, str]:
    """This process's threads by id, with their names (Linux, from /proc; empty elsewhere). The
    host engine's are named ts-engine (the offload pipeline's) and ts-pool."""
    names = {}
    if not os.path.isdir("/proc/self/task"):
        return names
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names[int(task)] = f.read().strip()
        except FileNotFoundError:  # (a thread that ended meanwhile)
            pass
    return names


def engine_threads_since(before: dict[int, str], count: int, timeout: float = 10.0) -> dict[int, str]:
    """The host engine's threads started since `before` (a thread_names()), once `count` of them
    are named ts-engine (a thread names itself when it first runs) or at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        new = {t: n for t, n in thread_names().items() if t not in before and n in ("ts-engine", "ts-pool")}
        if sum(n == "ts-engine" for n in new.values()) >= count or time.monotonic() > deadline:
            return new
        time.sleep(0.01)


def keep_terms_on_host(optimizer: OffloadedAdamW) -> None:
    """Speculated fp32 update terms wait in host memory until their commit, as under a budget
    that leaves no VRAM for them, instead of going up at once."""
    optimizer.clipping.hold_terms = False
