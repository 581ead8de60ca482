"""Points in time on the compute stream, for the profiles that paging and placement are planned from."""

from __future__ import annotations

import time

import torch


def mark(device: torch.device):
    """A point in time: a CUDA event on `device`'s current stream, or the host clock on the CPU."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


def seconds(start, end) -> float:
    """Seconds between two marks (CUDA events must have completed)."""
    if isinstance(start, float):
        return end - start
    return start.elapsed_time(end) / 1e3
