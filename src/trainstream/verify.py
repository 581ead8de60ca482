"""Show where training memory lives with stock AdamW and with TrainStream, and say PASS or FAIL.

    python -m trainstream verify [--hidden 2048] [--layers 8] [--steps 3]
    python examples/verify_ram_offload.py      (the same)

Trains the same model a few steps twice, once with torch.optim.AdamW on the GPU and once wrapped
by trainstream, and tabulates the bytes of weights, gradients and optimizer state by where they
live: VRAM, pinned host memory or pageable host memory. PASS means that with TrainStream the GPU
holds the weights and nothing else between steps, the AdamW state is in pinned host memory, and
both runs lose the same.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

from trainstream.tuning import Tuning
from trainstream.wrap import wrap


class Model(nn.Module):
    """Residual MLP blocks: big enough that the bytes are plain to see, quick to build."""

    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
            for _ in range(layers)
        )
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x).float().pow(2).mean()


def where(t: torch.Tensor) -> str:
    if t.is_cuda:
        return "vram"
    return "pinned" if t.is_pinned() else "pageable"


def tally(tensors) -> dict[str, int]:
    out = {"vram": 0, "pinned": 0, "pageable": 0}
    for t in tensors:
        out[where(t)] += t.numel() * t.element_size()
    return out


def train(model, opt, data, steps: int) -> tuple[list[float], int]:
    losses, peak_grads = [], 0
    for i in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(data[i])
        loss.backward()
        peak_grads = max(peak_grads, sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()
                                         if p.grad is not None))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    if hasattr(opt, "synchronize"):
        opt.synchronize()
    torch.cuda.synchronize()
    return losses, peak_grads


def run(kind: str, args) -> dict:
    torch.manual_seed(0)
    model = Model(args.hidden, args.layers).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if kind == "trainstream":
        model, opt = wrap(model, opt, tuning=Tuning(placement="offload"))  # what this check is about
    g = torch.Generator(device="cuda").manual_seed(1)
    data = [torch.randn(args.batch, args.hidden, device="cuda", generator=g) for _ in range(args.steps)]
    torch.cuda.empty_cache()
    losses, grads_seen = train(model, opt, data, args.steps)
    torch.empty(1, device="cuda")  # lets the allocator release gradients whose copies finished
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.numel() > 1]
    result = {
        "losses": losses,
        "weights": tally(model.parameters()),
        "optimizer_state": tally(state),
        "grads_left_on_gpu": sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None),
        "grads_seen_on_gpu_after_backward": grads_seen,
        "vram_allocated": torch.cuda.memory_allocated() - sum(d.numel() * d.element_size() for d in data),
    }
    if kind == "trainstream":
        result["host"] = opt.report()
        opt.remove_hooks()
    del model, opt, data
    torch.cuda.empty_cache()
    return result


def gib(n: float) -> str:
    return f"{n / 2**30:7.3f} GiB"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="trainstream verify", description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("FAIL: no CUDA GPU is visible to torch (torch.cuda.is_available() is False); "
              "this check needs one.", file=sys.stderr)
        return 2

    stock, ts = run("stock", args), run("trainstream", args)
    print(f"{torch.cuda.get_device_name()}: {args.layers} blocks of hidden {args.hidden}\n")
    print(f"{'bytes':<34}{'stock AdamW':>22}{'TrainStream':>22}")
    for label, key in (("weights", "weights"), ("optimizer state (exp_avg, exp_avg_sq)", "optimizer_state")):
        for place in ("vram", "pinned", "pageable"):
            a, b = stock[key][place], ts[key][place]
            if a or b:
                print(f"{label + ' in ' + place:<34}{gib(a):>22}{gib(b):>22}")
    print(f"{'gradients on GPU after backward':<34}{gib(stock['grads_seen_on_gpu_after_backward']):>22}"
          f"{gib(ts['grads_seen_on_gpu_after_backward']):>22}")
    host = ts["host"]
    print(f"{'update staging buffer in VRAM':<34}{gib(0):>22}{gib(host['vram_staging_bytes']):>22}")
    print(f"{'VRAM allocated between steps':<34}{gib(stock['vram_allocated']):>22}{gib(ts['vram_allocated']):>22}")
    print(f"\nTrainStream host memory: {gib(host['host_bytes_used'])} {host['host_memory_kind']} "
          f"({host['host_bytes_per_param']:.0f} B/param), AdamW on {host['threads']} threads ({host['isa']})")
    print(f"losses stock:       {[round(x, 6) for x in stock['losses']]}")
    print(f"losses TrainStream: {[round(x, 6) for x in ts['losses']]}\n")

    # Both runs also hold the same fixed overhead (cuBLAS workspace and the like): take it from
    # the stock run, where it is whatever VRAM is neither weights nor optimizer state.
    overhead = stock["vram_allocated"] - stock["weights"]["vram"] - stock["optimizer_state"]["vram"]
    checks = {
        "no optimizer state in VRAM": ts["optimizer_state"]["vram"] == 0,
        "optimizer state in pinned host memory": ts["optimizer_state"]["pinned"] > 0
        and ts["optimizer_state"]["pageable"] == 0,
        "no gradient left on the GPU after backward": ts["grads_seen_on_gpu_after_backward"] == 0,
        "VRAM between steps holds only the weights (and the staging buffer)":
            ts["vram_allocated"] - ts["weights"]["vram"] - host["vram_staging_bytes"] <= overhead + (16 << 20),
        "stock AdamW keeps its state in VRAM (sanity)": stock["optimizer_state"]["vram"] > 0,
        "same losses": all(abs(a - b) <= 1e-3 * max(1.0, abs(a)) for a, b in zip(stock["losses"], ts["losses"])),
    }
    for name, ok in checks.items():
        print(f"  [{'ok' if ok else 'FAILED'}] {name}")
    verdict = all(checks.values())
    print(f"\n{'PASS' if verdict else 'FAIL'}")
    return 0 if verdict else 1
