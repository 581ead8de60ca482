"""The host budget: how much host memory TrainStream may take, and what holds it.

wrap(host_budget=None) takes what this process may still use when wrap() runs, MemAvailable
and, where the process runs in a cgroup with a memory limit, that limit less the cgroup's
working set, whichever is less, minus a margin left to the rest of the process (margin(): a
tenth of it, at least HOST_MARGIN_FLOOR). A number of bytes or a string ("64GB") sets it. The
offloaded state must fit it, or wrap() refuses before anything is pinned; speculation's second
state sets and the paged activations' slots take what is left, as far as it goes.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from trainstream._native import _C
from trainstream.units import format_size, parse_bytes

log = logging.getLogger("trainstream")

HOST_MARGIN_FLOOR = 4 << 30
_NO_LIMIT = 1 << 60  # cgroup v1 writes a page-rounded 2^63 for "no limit"


def margin(available: int) -> int:
    """Host memory left to the rest of the process out of `available`: a tenth of it, at least
    HOST_MARGIN_FLOOR (pinning can fail before MemAvailable reaches 0)."""
    return max(HOST_MARGIN_FLOOR, available // 10)


@dataclass(frozen=True)
class HostBudget:
    """Host bytes TrainStream may hold, and where the figure came from."""

    limit: int | None  # None: unknown (no MemAvailable, no cgroup limit, none given): nothing is refused
    source: str  # "host_budget=..." as given, or what the default was read from
    available: int | None = None  # what the process could take at wrap() (None: unknown)
    margin: int = 0  # left out of `available` for the rest of the process

    def describe(self, held: int) -> str:
        """`held` bytes against the budget, in words."""
        if self.limit is None:
            return f"{format_size(held)} held (no host budget: the host's free memory is unknown)"
        origin = f"{self.source} less a {format_size(self.margin)} margin" if self.margin else self.source
        share = f"{held / self.limit:.0%} of " if self.limit else ""
        return f"{format_size(held)} held, {share}a {format_size(self.limit)} host budget ({origin})"


def cgroup_room(root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup") -> int | None:
    """What this process's cgroup lets it still take, or None without a limit: the limit less the
    working set (usage less the inactive file cache, which the kernel reclaims before it would
    refuse), from cgroup v2's memory.max, memory.current and memory.stat, else v1's
    memory.limit_in_bytes, memory.usage_in_bytes and memory.stat."""
    def read(path: str) -> str | None:
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            return None

    def inactive_file(stat: str | None, key: str) -> int:
        for line in (stat or "").splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
        return 0

    where = ""
    for line in (read(self_cgroup) or "").splitlines():
        if line.startswith("0::"):  # v2's unified hierarchy
            where = line[3:].strip().lstrip("/")
    v1 = os.path.join(root, "memory")
    for folder, limit_name, usage_name, cache_key in ((os.path.join(root, where), "memory.max", "memory.current",
                                                       "inactive_file"),
                                                      (root, "memory.max", "memory.current", "inactive_file"),
                                                      (v1, "memory.limit_in_bytes", "memory.usage_in_bytes",
                                                       "total_inactive_file")):
        limit = read(os.path.join(folder, limit_name))
        if limit is None:
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= _NO_LIMIT:
            return None
        usage = read(os.path.join(folder, usage_name))
        used = int(usage) if usage and usage.isdigit() else 0
        used -= min(used, inactive_file(read(os.path.join(folder, "memory.stat")), cache_key))
        return max(0, int(limit) - used)
    return None


def process_available() -> tuple[int | None, str]:
    """Host memory this process may still take, and what said so."""
    mem = _C.host_memory_available() or None
    cgroup = cgroup_room()
    if cgroup is not None and (mem is None or cgroup < mem):
        return cgroup, f"the cgroup's room of {format_size(cgroup)}"
    if mem is None:
        return None, "unknown"
    return mem, f"MemAvailable {format_size(mem)}"


def read_host_budget(value) -> HostBudget:
    """wrap()'s host_budget: None for the default, or bytes / a size string."""
    available, source = process_available()
    if value is None:
        if available is None:
            return HostBudget(None, source)
        left = margin(available)
        return HostBudget(max(0, available - left), source, available, left)
    limit = parse_bytes(value, "host_budget")
    if available is not None and limit > available:
        log.warning("trainstream: host_budget=%s is more than this process may take now (%s); pinning may fail "
                    "before the budget is reached", format_size(limit), source)
    return HostBudget(limit, f"host_budget={value!r}" if isinstance(value, str) else "host_budget", available)
