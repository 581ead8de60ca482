"""`python -m trainstream` (or `trainstream`): what this machine offers, and quick checks.

    trainstream demo      a short training run, stock AdamW beside trainstream.wrap(): losses,
                          step time, where memory lives, and whether the two agree (exit 1 if not)
    trainstream info      versions, CUDA, GPU and PCIe link, measured copy and memory bandwidth,
                          host ISA, threads and RAM
    trainstream verify    where training memory lives, stock AdamW vs TrainStream (PASS/FAIL)
    trainstream bench     host AdamW against torch's fused CPU AdamW, then a short training run
                          with stock AdamW and with TrainStream, side by side
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time

import torch

import trainstream
from trainstream._native import _C
from trainstream.profiler import measure_copy_bandwidth


def _step(message: str) -> None:
    print(f"  .. {message}", file=sys.stderr, flush=True)


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                if key in ("MemTotal", "MemAvailable"):
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def _pcie_link() -> str | None:
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=pcie.link.gen.current,pcie.link.width.current", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0 or not done.stdout.strip():
        return None
    gen, width = (x.strip() for x in done.stdout.splitlines()[0].split(","))
    return f"Gen{gen} x{width}"


def _copy_bandwidth() -> dict[str, float]:
    """Pinned host <-> device copy bandwidth in GB/s: 1 GiB each way, best of 5."""
    d2h, h2d = measure_copy_bandwidth(torch.device("cuda", torch.cuda.current_device()), 1 << 30, repeats=5)
    return {"h2d_GBps": round(h2d / 1e9, 1), "d2h_GBps": round(d2h / 1e9, 1)}


def info(args) -> int:
    cpu = _C.cpu_features()
    mem = _meminfo()
    report = {
        "trainstream": trainstream.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "native_build_has_cuda": bool(_C.has_cuda),
        "host_isa": cpu["best_isa"],
        "host_cpus": cpu["available_cpus"],
        "host_ram_GiB": round(mem.get("MemTotal", 0) / 2**30, 1),
        "host_ram_available_GiB": round(mem.get("MemAvailable", 0) / 2**30, 1),
    }
    if _C.has_cuda:
        cuda = _C.cuda_info()
        report["cuda_runtime"] = cuda["runtime_version"]
        report["cuda_driver"] = cuda["driver_version"]
        if cuda["error"]:
            report["cuda_error"] = cuda["error"]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        report["gpu"] = props.name
        report["gpu_memory_GiB"] = round(props.total_memory / 2**30, 1)
        report["pcie_link"] = _pcie_link()
        if not args.quick:
            _step("measuring pinned copy bandwidth (1 GiB each way)")
            report.update(_copy_bandwidth())
    else:
        report["gpu"] = None
    if not args.quick:
        _step(f"measuring host memory bandwidth (triad, {cpu['available_cpus']} threads)")
        report["host_triad_GBps"] = round(_C.measure_triad(1 << 26, 3, 0, None)["best_GBps"], 1)
    if args.json:
        print(json.dumps(report))
    else:
        width = max(map(len, report))
        for key, value in report.items():
            print(f"{key:<{width}}  {value}")
    return 0


def _train_steps(wrapped: bool, args, device: torch.device) -> dict:
    """A few steps of the verify model, stock or wrapped: seconds per step and peak VRAM."""
    from trainstream.verify import Model

    torch.manual_seed(0)
    model = Model(args.hidden, args.layers).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if wrapped:
        model, opt = trainstream.wrap(model, opt)
    data = torch.randn(args.batch, args.hidden, device=device)
    cuda = device.type == "cuda"

    def settle():
        if wrapped:
            opt.synchronize()
        if cuda:
            torch.cuda.synchronize()

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = model(data)
        loss.backward()
        opt.step()
        opt.zero_grad()

    step()  # warm-up
    settle()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(args.train_steps):
        step()
    settle()
    seconds = (time.perf_counter() - t0) / args.train_steps
    peak = torch.cuda.max_memory_allocated() / 1e9 if cuda else None
    if wrapped:
        opt.remove_hooks()
    return {"step_s": round(seconds, 4), "peak_vram_GB": None if peak is None else round(peak, 3)}


def bench(args) -> int:
    """Host AdamW vs torch's fused CPU AdamW on the same parameters, then a short training run."""
    n = args.params
    _step(f"allocating {n:,} parameters ({n * 16 / 2**30:.1f} GiB per optimizer)")
    torch.manual_seed(0)
    p = torch.randn(n)
    g = torch.randn(n)
    engine = trainstream.HostAdamW()
    m, v = torch.zeros(n), torch.zeros(n)
    ours = []
    for step in range(1, args.steps + 2):
        t0 = time.perf_counter()
        engine.step(p, g, m, v, lr=1e-3, step=step)
        ours.append(time.perf_counter() - t0)
    ref = torch.nn.Parameter(torch.randn(n))
    ref.grad = g
    opt = torch.optim.AdamW([ref], lr=1e-3, fused=True)
    theirs = []
    for _ in range(args.steps + 1):
        t0 = time.perf_counter()
        opt.step()
        theirs.append(time.perf_counter() - t0)
    ours_ns = sorted(ours[1:])[len(ours[1:]) // 2] / n * 1e9
    fused_ns = sorted(theirs[1:])[len(theirs[1:]) // 2] / n * 1e9
    _step("measuring host memory bandwidth (triad)")
    triad = _C.measure_triad(max(n // 2, 1 << 20), 3, 0, None)["best_GBps"]
    result = {"params": n, "isa": engine.isa, "threads": engine.threads,
              "trainstream_ns_per_param": round(ours_ns, 4), "torch_fused_ns_per_param": round(fused_ns, 4),
              "triad_GBps": round(triad, 1), "bandwidth_share": round(28 / ours_ns / triad, 3)}
    del p, g, m, v, ref, opt
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    _step(f"training {args.layers} blocks of hidden {args.hidden} on {device}: stock AdamW, then TrainStream")
    result["train_device"] = str(device)
    result["train_stock"] = _train_steps(False, args, device)
    result["train_trainstream"] = _train_steps(True, args, device)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"host AdamW, {n:,} params, {engine.threads} threads")
        print(f"  trainstream ({engine.isa}): {ours_ns:.3f} ns/param  ({28 / ours_ns:.1f} GB/s, "
              f"{100 * 28 / ours_ns / triad:.0f}% of the {triad:.0f} GB/s triad)")
        print(f"  torch AdamW fused:        {fused_ns:.3f} ns/param")
        print(f"training on {device}, {args.layers} blocks of hidden {args.hidden}, batch {args.batch}:")
        for name in ("stock", "trainstream"):
            r = result[f"train_{name}"]
            vram = f", peak VRAM {r['peak_vram_GB']:.2f} GB" if r["peak_vram_GB"] is not None else ""
            print(f"  {name:<12} {r['step_s']:.4f} s/step{vram}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trainstream", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="versions, hardware and measured bandwidths")
    p_info.add_argument("--json", action="store_true")
    p_info.add_argument("--quick", action="store_true", help="skip the bandwidth measurements")
    sub.add_parser("demo", help="a short training run, stock AdamW beside TrainStream", add_help=False)
    sub.add_parser("verify", help="where training memory lives (needs a GPU)", add_help=False)
    p_bench = sub.add_parser("bench", help="host AdamW against torch's fused CPU AdamW")
    p_bench.add_argument("--params", type=int, default=1 << 26)
    p_bench.add_argument("--steps", type=int, default=5)
    p_bench.add_argument("--hidden", type=int, default=2048, help="training part: model width")
    p_bench.add_argument("--layers", type=int, default=8, help="training part: residual MLP blocks")
    p_bench.add_argument("--batch", type=int, default=64)
    p_bench.add_argument("--train-steps", type=int, default=5)
    p_bench.add_argument("--json", action="store_true")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["verify"]:
        from trainstream.verify import main as verify_main

        return verify_main(argv[1:])
    if argv[:1] == ["demo"]:
        from trainstream.demo import main as demo_main

        return demo_main(argv[1:])
    args = parser.parse_args(argv)
    return {"info": info, "bench": bench}[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
