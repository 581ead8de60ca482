"""Gradient accumulation into pinned host memory: added on the GPU (device_accumulate) against
copied to the host and added there, side by side in one process.

    python benchmarks/device_accumulate.py [--micro 8] [--repeats 2] [--json out.json]

Gradients: one fp32 tensor per parameter of a Llama-shaped ~1.04B model (16 layers of hidden
2048, MLP 8192, 8 KV heads of 64, norms, and a 32000 x 2048 embedding: 147 tensors, 4.2 GB),
made once in VRAM. One accumulation window hands all of them, in backward order, to one
trainstream pipeline --micro times, the way the autograd hooks do (land_gradient with
accumulate; the first micro-batch overwrites), and ends when every gradient has been added into
the host accumulators (pipeline.synchronize()). The gradients come from an idle "producer"
stream, so the landing never waits for compute it did not need.

Measured for each path, best of --repeats windows after a warm-up window:
  window s      the whole window; ms/micro = window / --micro
  grad GB/s     gradient bytes handed over per second (the PCIe D2H bound is ~55 GB/s)
  hook s        time spent inside land_gradient, i.e. what backward would have waited
and once more while a loop of bf16 matmuls, sized to last about as long as that path's window
alone, runs on the default stream: the window's time under contention and how much slower the
matmuls ran than alone ("matmul +%").

The pipeline holds ~20 B/param of pinned host memory (weights, two moments, landing buffer,
accumulator; ~21 GB at the default size), pinned once at the start (this takes a while; it is
timed and printed). --layers shrinks the model if the host has less. Needs a CUDA build of
trainstream and a GPU with ~6 GB free.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from trainstream._native import _C
from trainstream.host_adamw import DTYPE_NAMES
from trainstream.wrap import host_bytes_per_param

DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro", type=int, default=8, help="micro-batches per window (default 8)")
    parser.add_argument("--repeats", type=int, default=2, help="timed windows per path and load (default 2)")
    parser.add_argument("--layers", type=int, default=16, help="decoder layers (default 16: ~1.04B params)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32",
                        help="gradient (= weight) dtype (default float32)")
    parser.add_argument("--matmul-size", type=int, default=16384,
                        help="square bf16 matmul of the contention load (default 16384)")
    parser.add_argument("--no-contention", action="store_true", help="skip the runs beside the matmul loop")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    if args.micro < 2 or args.repeats < 1 or args.layers < 1:
        parser.error("--micro must be >= 2, --repeats and --layers >= 1")
    return args


def llama_sizes(layers: int, hidden=2048, intermediate=8192, kv=512, vocab=32000) -> list[int]:
    """Parameter sizes in forward order, as in a Llama model of that shape."""
    layer = [hidden,                                    # input_layernorm
             hidden * hidden, kv * hidden, kv * hidden,  # q, k, v projections
             hidden * hidden,                           # o projection
             hidden,                                    # post_attention_layernorm
             intermediate * hidden, intermediate * hidden, hidden * intermediate]  # gate, up, down
    return [vocab * hidden] + layer * layers + [hidden]


def fit_layers(args) -> list[int]:
    """The requested model, or fewer layers if the host cannot pin enough memory for it."""
    available = _C.host_memory_available()
    per_param = host_bytes_per_param(DTYPES[args.dtype], host_accumulator=True)
    layers = args.layers
    while layers > 1 and available and sum(llama_sizes(layers)) * per_param > 0.8 * available:
        layers -= 1
    if layers != args.layers:
        print(f"note: {available / 1e9:.0f} GB of host memory available; using {layers} layers "
              f"instead of {args.layers}", file=sys.stderr)
    return llama_sizes(layers)


def time_matmul(a: torch.Tensor, b: torch.Tensor, count: int = 5) -> float:
    """Seconds per matmul on the default stream, alone."""
    torch.matmul(a, b)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(count):
        torch.matmul(a, b)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / count


class Bench:
    def __init__(self, args, sizes):
        self.args = args
        dtype = DTYPES[args.dtype]
        device = torch.cuda.current_device()
        # download (highest priority, as wrap() makes it), upload: kept alive here
        self.streams = (torch.cuda.Stream(priority=-100), torch.cuda.Stream())
        self.producer = torch.cuda.Stream()
        self.pipe = _C.cuda_pipeline(device, self.streams[0].cuda_stream, self.streams[1].cuda_stream)
        start = time.perf_counter()
        self.hosts = [self.pipe.add_param(n, args.dtype, True, i) for i, n in enumerate(sizes)]
        self.pin_s = time.perf_counter() - start
        generator = torch.Generator(device="cuda").manual_seed(0)
        self.grads = [torch.randn(n, device="cuda", generator=generator).to(dtype) for n in sizes]
        torch.cuda.synchronize()  # the gradients exist before any window starts
        self.grad_bytes = sum(g.numel() * g.element_size() for g in self.grads)

    def window(self, device_accumulate: bool) -> tuple[float, float]:
        """One accumulation window; returns (window seconds, seconds inside land_gradient)."""
        pipe = self.pipe
        pipe.device_accumulate = device_accumulate
        stream = self.producer.cuda_stream
        order = list(zip(self.hosts, self.grads))[::-1]  # backward order
        hook = 0.0
        start = time.perf_counter()
        for k in range(self.args.micro):
            for host, grad in order:
                t = time.perf_counter()
                pipe.land_gradient(host, grad.data_ptr(), stream, accumulate=True, overwrite=k == 0,
                                   from_accumulator=True)
                hook += time.perf_counter() - t
        pipe.synchronize()  # every gradient added into its accumulator
        return time.perf_counter() - start, hook

    def accumulators(self, indices) -> list[torch.Tensor]:
        return [torch.frombuffer(self.hosts[i].view("accumulator"), dtype=torch.float32).clone()
                for i in indices]


def row(path: str, load: str, windows: list[tuple[float, float]], bench: Bench, extra=None) -> dict:
    window, hook = min(windows)
    r = {"path": path, "load": load, "window_s": window, "ms_per_micro": 1e3 * window / bench.args.micro,
         "grad_GBps": bench.grad_bytes * bench.args.micro / window / 1e9, "hook_s": hook,
         "windows_s": [w for w, _ in windows]}
    r.update(extra or {})
    return r


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    if not _C.has_cuda:
        print("this trainstream build has no CUDA support; rebuild with CMAKE_ARGS=-DTRAINSTREAM_WITH_CUDA=ON",
              file=sys.stderr)
        return 2
    sizes = fit_layers(args)
    params = sum(sizes)
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} (CUDA {torch.version.cuda}) | "
          f"{params / 1e9:.2f}B {args.dtype} gradients in {len(sizes)} tensors, {args.micro} micro-batches")
    bench = Bench(args, sizes)
    print(f"pinned {bench.pipe.host_reserved_bytes / 1e9:.1f} GB of host memory in {bench.pin_s:.1f} s; "
          f"{bench.grad_bytes / 1e9:.2f} GB of gradients per micro-batch")
    paths = {"host add": False, "device add": True}

    # Warm-up, then a bit-for-bit check on a few tensors (embedding, a k projection, a norm).
    check = [0, 3, len(sizes) - 1]
    bench.window(False)
    reference = bench.accumulators(check)
    bench.window(True)
    identical = all(torch.equal(a.view(torch.int32), b.view(torch.int32))
                    for a, b in zip(reference, bench.accumulators(check)))
    print(f"accumulators bit-identical between the paths: {'yes' if identical else 'NO'}")

    rows = []
    for path, on in paths.items():
        rows.append(row(path, "alone", [bench.window(on) for _ in range(args.repeats)], bench))

    if not args.no_contention:
        n = args.matmul_size
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        matmul_s = time_matmul(a, b)
        print(f"matmul {n}^3 bf16 alone: {matmul_s * 1e3:.2f} ms ({2 * n**3 / matmul_s / 1e12:.0f} TFLOP/s)")
        for path, on in paths.items():
            alone = next(r for r in rows if r["path"] == path)["window_s"]
            count = max(1, math.ceil(alone / matmul_s))
            windows, slowdowns = [], []
            for _ in range(args.repeats):
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(count):
                    torch.matmul(a, b)
                end.record()
                windows.append(bench.window(on))
                end.synchronize()
                slowdowns.append(start.elapsed_time(end) / 1e3 / (count * matmul_s) - 1)
            rows.append(row(path, "+matmul", windows, bench,
                            {"matmuls": count, "matmul_slowdown": min(slowdowns)}))
        del a, b

    print(f"\n{'path':<11} {'load':<8} {'window s':>9} {'ms/micro':>9} {'grad GB/s':>10} {'hook s':>7} "
          f"{'matmul +%':>10}")
    for r in rows:
        slow = f"{100 * r['matmul_slowdown']:.0f}" if "matmul_slowdown" in r else "-"
        print(f"{r['path']:<11} {r['load']:<8} {r['window_s']:>9.3f} {r['ms_per_micro']:>9.1f} "
              f"{r['grad_GBps']:>10.1f} {r['hook_s']:>7.3f} {slow:>10}")
    for load in ("alone", "+matmul"):
        pair = {r["path"]: r["window_s"] for r in rows if r["load"] == load}
        if len(pair) == 2:
            print(f"{load}: device add is {pair['host add'] / pair['device add']:.2f}x the host add's speed")

    if args.json:
        out = {
            "benchmark": "device_accumulate",
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "params": params,
            "tensors": len(sizes),
            "dtype": args.dtype,
            "micro_batches": args.micro,
            "grad_bytes_per_micro": bench.grad_bytes,
            "pinned_bytes": bench.pipe.host_reserved_bytes,
            "pin_s": bench.pin_s,
            "threads": bench.pipe.threads,
            "accumulators_identical": identical,
            "results": rows,
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {args.json}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
