"""Pinned PCIe copies and the host AdamW engine, each alone and both at once.

    python benchmarks/copy_under_load.py [--params N] [--copy-gb G] [--threads T] [--json FILE]

Activation paging adds copies between VRAM and pinned host memory to a step whose host side
is already busy: the AdamW engine reads and writes about 26 bytes per parameter (fp32 weights
and moments, bf16 gradients). Both go through the same host memory. This measures, in one run:

- host-to-device, device-to-host and both directions at once, alone (CUDA events);
- the same copies while the engine updates N parameters on T threads in a loop;
- the engine's own speed alone and while both copy directions run.

If a copy slows down under the engine's load, a step that pages is bound by host memory
traffic rather than by copy time or compute.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import torch

from trainstream import HostAdamW

ENGINE_BYTES_PER_PARAM = 26  # read p, m, v (fp32) and g (bf16); write p, m, v


def copy_rates(host: torch.Tensor, dev: torch.Tensor, repeats: int, only: str | None = None) -> dict:
    """GB/s for H2D, D2H and both at once (each direction's bytes over the wall time), best of
    `repeats`."""
    half = host.numel() // 2
    up, down = torch.cuda.Stream(), torch.cuda.Stream()
    cases = {
        "h2d": [(up, dev, host)],
        "d2h": [(down, host, dev)],
        "both": [(up, dev[:half], host[:half]), (down, host[half:], dev[half:])],
    }
    rates = {}
    for name, copies in cases.items():
        if only not in (None, name):
            continue
        best = float("inf")
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for stream, dst, src in copies:
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        moved = sum(src.numel() for _, _, src in copies) / len(copies)  # per direction
        rates[name] = moved / best / 1e9
    return rates


class EngineLoop:
    """The AdamW engine updating `n` parameters over and over on a thread of its own."""

    def __init__(self, n: int, threads: int) -> None:
        self.engine = HostAdamW(threads)
        self.p = torch.rand(n)
        self.g = torch.rand(n).bfloat16()
        self.m = torch.zeros(n)
        self.v = torch.zeros(n)
        self.n = n
        self.steps = 0
        self._stop = threading.Event()
        self._thread = None

    def step(self) -> None:
        self.steps += 1
        self.engine.step(self.p, self.g, self.m, self.v, lr=1e-4, step=self.steps)

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.step()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def gbps(self, seconds: float, steps: int) -> float:
        return steps * self.n * ENGINE_BYTES_PER_PARAM / seconds / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=int, default=1 << 28, help="parameters the engine updates")
    ap.add_argument("--copy-gb", type=float, default=2.0, help="bytes per copy case")
    ap.add_argument("--threads", type=int, default=0, help="engine threads (0: every CPU)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("copy_under_load.py needs a CUDA GPU", file=sys.stderr)
        return 2
    nbytes = int(args.copy_gb * 1e9) // 2 * 2
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    loop = EngineLoop(args.params, args.threads)

    alone = copy_rates(host, dev, args.repeats)
    loop.step()  # first touch of its buffers
    t0, s0 = time.perf_counter(), loop.steps
    for _ in range(args.repeats):
        loop.step()
    engine_alone = loop.gbps(time.perf_counter() - t0, loop.steps - s0)

    loop.start()
    time.sleep(0.2)
    loaded = copy_rates(host, dev, args.repeats)
    # the engine's speed while both directions copy without pause
    t0, s0 = time.perf_counter(), loop.steps
    while loop.steps - s0 < args.repeats:
        copy_rates(host, dev, 1, only="both")
    engine_loaded = loop.gbps(time.perf_counter() - t0, loop.steps - s0)
    loop.stop()

    result = {
        "gpu": torch.cuda.get_device_name(),
        "engine_threads": loop.engine.threads,
        "engine_isa": loop.engine.isa,
        "params": args.params,
        "copy_bytes": nbytes,
        "copy_GBps_alone": alone,
        "copy_GBps_with_engine": loaded,
        "engine_GBps_alone": engine_alone,
        "engine_GBps_with_copies": engine_loaded,
    }
    print(f"{result['gpu']}; engine: {loop.engine.threads} threads, {loop.engine.isa}, "
          f"{args.params / 1e6:.0f}M params at {ENGINE_BYTES_PER_PARAM} B/param")
    print(f"{'pinned copies (GB/s each way)':<32}{'alone':>8}{'engine running':>16}")
    for name in alone:
        print(f"{name:<32}{alone[name]:8.1f}{loaded[name]:16.1f}")
    print(f"{'engine (GB/s)':<32}{engine_alone:8.1f}{engine_loaded:16.1f}  (with both directions copying)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
