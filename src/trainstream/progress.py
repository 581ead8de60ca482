"""Progress where a person waits: wrap()'s pinning, the profiled steps, the plan.

Each stage is logged through `logging` (logger "trainstream", INFO) with how long it took; a
stage over many items also shows a tqdm progress bar on stderr when tqdm is installed and stderr
is a terminal (tqdm is not a dependency).
"""

from __future__ import annotations

import logging
import sys
import time
from contextlib import contextmanager

log = logging.getLogger("trainstream")


class _Quiet:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def bar(total: int, what: str, unit: str = "it"):
    """A progress bar of `total` units, or one that shows nothing (no terminal, no tqdm)."""
    if not sys.stderr.isatty():
        return _Quiet()
    try:
        from tqdm import tqdm
    except ImportError:
        return _Quiet()
    return tqdm(total=total, desc=f"trainstream: {what}", unit=unit, unit_scale=True, leave=False)


@contextmanager
def stage(what: str):
    """Logs `what` as it starts and how long it took when it ends."""
    log.info("trainstream: %s ...", what)
    t0 = time.perf_counter()
    yield
    log.info("trainstream: %s: done in %.1f s", what, time.perf_counter() - t0)
