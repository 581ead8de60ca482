"""Host time that wrap() adds to forward, backward and step() of a model with many small parameters.

The host thread that runs backward's hooks and step() also queues the GPU's work, and on a machine
whose every core runs the host engine it is short of CPU: what it spends per parameter shows in
the step. Here the parameters are tiny, so the figures are the hooks' and step()'s own costs:
no clipping, a norm that never clips (speculated updates, committed at step()), and the same
waiting for the norm (`speculative_clipping=False`). Prints the medians and writes JSON.

    python benchmarks/host_overhead.py [--device cpu|cuda] [--layers 73] [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import trainstream

MODES = {"no clipping": dict(max_grad_norm=None), "never clipping": dict(max_grad_norm=1e9),
         "never clipping, waiting": dict(max_grad_norm=1e9, speculative=False)}


def stack(layers: int, width: int) -> torch.nn.Module:
    blocks = [m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(width, 1))


def measure(mode: dict, args) -> dict:
    torch.manual_seed(0)
    model = stack(args.layers, args.width).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tuning = trainstream.Tuning(placement="offload", speculative_clipping=mode.get("speculative", True))
    model, opt = trainstream.wrap(model, opt, max_grad_norm=mode["max_grad_norm"], tuning=tuning)
    x = torch.randn(8, args.width, device=args.device)
    times = {"forward": [], "backward": [], "step": []}
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        loss = model(x).sum()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        opt.zero_grad()
        opt.synchronize()  # (the engine's own work is not timed)
        if i >= args.warmup:
            for phase, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                times[phase].append(seconds)
    params = sum(1 for _ in model.parameters())
    spec = opt.report()["speculation"]
    opt.remove_hooks()
    return {"params": params, **{f"{k}_ms": 1e3 * statistics.median(v) for k, v in times.items()},
            "hits": spec["hits"], "waited": spec["waited"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=73, help="Linear layers (two parameters each, and a head)")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    print(f"{'mode':<26}{'params':>7}{'forward ms':>12}{'backward ms':>13}{'step() ms':>11}")
    for name, mode in MODES.items():
        row = {"mode": name, **measure(mode, args)}
        rows.append(row)
        print(f"{name:<26}{row['params']:>7}{row['forward_ms']:>12.2f}{row['backward_ms']:>13.2f}{row['step_ms']:>11.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
