"""trainstream's HostAdamW next to torch.optim.AdamW on CPU, in one process, same threads.

    python benchmarks/adamw_vs_torch.py --params N [--tensor-numel M] [--steps K] [--threads T]
                                        [--isa NAME] [--skip-slow] [--json]

The N parameters are split into tensors of M elements (like a model's layers). Each optimizer
(trainstream HostAdamW; torch AdamW for-loop, foreach and fused) starts from the same fp32
weights and gradients, takes one warm-up step, then K timed steps (wall clock, median) with a
learning rate that changes every step. A STREAM triad with the same thread count, measured in
the same run, gives the machine's bandwidth: at 28 B/param (read p, g, m, v; write p, m, v) the
share of it an optimizer reaches is what judges it.

Memory: the gradients (4 B/param) are shared by every run; each run adds its weights and two
moments (12 B/param) and frees them before the next, except the trainstream weights, kept
(4 B/param) to compare with the torch for-loop run: peak about 20 B/param plus torch's foreach
temporaries (about 4 B/param), 6 GiB at 256M params. The triad (three arrays of
max(N/2, 64M) floats) runs first, before any of it is allocated.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import statistics
import sys
import time

import torch

import trainstream
from trainstream import HostAdamW
from trainstream.host_adamw import measure_triad
from trainstream._native import _C

BYTES_PER_PARAM = 28  # fp32: read p, g, m, v; write p, m, v
BASE_LR = 1e-3
BETAS = (0.9, 0.999)
EPS = 1e-8
WEIGHT_DECAY = 1e-2
TORCH_FORMS = {
    "torch_for": {"foreach": False},
    "torch_foreach": {"foreach": True},
    "torch_fused": {"fused": True},
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, required=True, help="total parameters N")
    parser.add_argument("--tensor-numel", type=int, default=8_388_608,
                        help="elements per parameter tensor (default 8388608)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps after a warm-up (default 5)")
    parser.add_argument("--threads", type=int, default=0,
                        help="threads for trainstream, torch and the triad (default: all available)")
    parser.add_argument("--isa", default=None, help="force trainstream's ISA: avx512, avx2 or scalar")
    parser.add_argument("--skip-slow", action="store_true",
                        help="skip torch's for-loop AdamW (slow at huge sizes); max_abs_diff then "
                             "compares with the foreach run")
    parser.add_argument("--json", action="store_true", help="also print one JSON line of results")
    args = parser.parse_args(argv)
    if args.params <= 0 or args.tensor_numel <= 0 or args.steps <= 0 or args.threads < 0:
        parser.error("--params, --tensor-numel and --steps must be positive, --threads >= 0")
    if args.isa is not None:
        try:
            supported = _C.isa_supported(args.isa)
        except ValueError as exc:
            parser.error(str(exc))
        if not supported:
            parser.error(f"this CPU cannot run the {args.isa} kernels")
    if args.threads == 0:
        args.threads = _C.cpu_features()["available_cpus"]
    return args


def tensor_sizes(params: int, tensor_numel: int) -> list[int]:
    full, rest = divmod(params, tensor_numel)
    return [tensor_numel] * full + ([rest] if rest else [])


def learning_rate(step: int, total: int) -> float:
    """Cosine decay over the run: every step has its own learning rate."""
    return BASE_LR * (0.55 + 0.45 * math.cos(math.pi * step / total))


def random_tensors(sizes: list[int], seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    """The same values for the same (sizes, seed) in every run, without keeping a copy."""
    out = []
    for index, n in enumerate(sizes):
        generator = torch.Generator().manual_seed(seed * 100_003 + index)
        t = torch.randn(n, generator=generator)
        out.append(t.mul_(scale) if scale != 1.0 else t)
    return out


def median_ns_per_param(seconds: list[float], params: int) -> float:
    return statistics.median(seconds) * 1e9 / params


def run_trainstream(args, sizes, grads):
    """Times HostAdamW over every tensor; returns (seconds per timed step, final weights, isa)."""
    engine = HostAdamW(threads=args.threads, isa=args.isa)
    params = random_tensors(sizes, seed=1)
    exp_avgs = [torch.zeros(n) for n in sizes]
    exp_avg_sqs = [torch.zeros(n) for n in sizes]
    total = args.steps + 1
    seconds = []
    for step in range(1, total + 1):  # step 1 is the warm-up
        lr = learning_rate(step, total)
        start = time.perf_counter()
        for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
            engine.step(p, g, m, v, lr=lr, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, step=step)
        if step > 1:
            seconds.append(time.perf_counter() - start)
    return seconds, params, engine.isa


def run_torch(args, sizes, grads, **form):
    """Times torch.optim.AdamW in the given form; returns (seconds per timed step, final weights)."""
    params = [torch.nn.Parameter(t) for t in random_tensors(sizes, seed=1)]
    for p, g in zip(params, grads):
        p.grad = g  # shared, never written: AdamW only reads gradients
    optimizer = torch.optim.AdamW(params, lr=BASE_LR, betas=BETAS, eps=EPS,
                                  weight_decay=WEIGHT_DECAY, **form)
    total = args.steps + 1
    seconds = []
    for step in range(1, total + 1):  # step 1 is the warm-up (and allocates the state)
        optimizer.param_groups[0]["lr"] = learning_rate(step, total)
        start = time.perf_counter()
        optimizer.step()
        if step > 1:
            seconds.append(time.perf_counter() - start)
    weights = [p.detach() for p in params]
    for p in params:
        p.grad = None
    del optimizer, params
    return seconds, weights


def max_abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = tensor_sizes(args.params, args.tensor_numel)
    n = args.params

    # The triad first, before the optimizer state exists; always with the best ISA.
    triad_numel = max(n // 2, 64 << 20)
    best_isa = _C.cpu_features()["best_isa"]
    triad = measure_triad(numel=triad_numel, repeats=5, threads=args.threads, isa=best_isa)
    triad_gbps = triad["best_GBps"]

    grads = random_tensors(sizes, seed=2, scale=1e-2)
    results: dict[str, float | None] = {}

    seconds, ts_weights, isa = run_trainstream(args, sizes, grads)
    results["trainstream"] = median_ns_per_param(seconds, n)

    # Compared with the trainstream weights: the for-loop run (the same math), or with
    # --skip-slow the foreach one. The kept weights are freed as soon as they are compared.
    diff_reference = "torch_foreach" if args.skip_slow else "torch_for"
    diff = math.nan
    for key, form in TORCH_FORMS.items():
        if key == "torch_for" and args.skip_slow:
            results[key] = None
            continue
        try:
            seconds, weights = run_torch(args, sizes, grads, **form)
        except (RuntimeError, ValueError) as exc:  # e.g. a torch without the CPU fused kernel
            print(f"{key}: unavailable: {exc}", file=sys.stderr)
            results[key] = None
            continue
        results[key] = median_ns_per_param(seconds, n)
        if key == diff_reference:
            diff = max_abs_diff(ts_weights, weights)
            ts_weights = None
        del weights
        gc.collect()

    def gbps(ns_per_param):
        return BYTES_PER_PARAM / ns_per_param  # bytes per ns = GB/s

    print(f"AdamW over {n:,} fp32 params in {len(sizes)} tensors of <= {args.tensor_numel:,}, "
          f"{args.threads} threads, median of {args.steps} steps after a warm-up")
    print(f"cpu: {cpu_model()}; torch {torch.__version__}; trainstream {trainstream.__version__}")
    print(f"triad: {triad_gbps:.1f} GB/s (best of 5 over {triad_numel:,} floats x 3, {best_isa})\n")
    print(f"{'optimizer':<22} {'ns/param':>9} {'GB/s':>7} {'triad share':>11} {'vs trainstream':>14}")
    labels = {
        "trainstream": f"trainstream ({isa})",
        "torch_for": "torch for-loop",
        "torch_foreach": "torch foreach",
        "torch_fused": "torch fused",
    }
    for key, label in labels.items():
        ns = results[key]
        if ns is None:
            print(f"{label:<22} {'skipped':>9}")
            continue
        print(f"{label:<22} {ns:9.4f} {gbps(ns):7.1f} {gbps(ns) / triad_gbps:10.0%} "
              f"{ns / results['trainstream']:13.2f}x")
    print(f"\nmax |trainstream - {diff_reference.replace('_', ' ')}| over the weights after "
          f"{args.steps + 1} steps: {diff:.3g}")

    if args.json:
        record = {
            "params": n,
            "tensor_numel": args.tensor_numel,
            "tensors": len(sizes),
            "steps": args.steps,
            "isa": isa,
            "threads": args.threads,
            "trainstream_ns_per_param": results["trainstream"],
            "torch_for_ns_per_param": results["torch_for"],
            "torch_foreach_ns_per_param": results["torch_foreach"],
            "torch_fused_ns_per_param": results["torch_fused"],
            "triad_GBps": triad_gbps,
            "triad_median_GBps": triad["median_GBps"],
            "bandwidth_share": gbps(results["trainstream"]) / triad_gbps,
            "max_abs_diff": None if math.isnan(diff) else diff,
            "max_abs_diff_reference": diff_reference,
            "torch_version": torch.__version__,
            "trainstream_version": trainstream.__version__,
            "cpu": cpu_model(),
            "available_cpus": len(os.sched_getaffinity(0)),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
