"""Convergence on real text: one optimizer configuration trains a ~100M-parameter Llama on the
Python standard library's own source, byte by byte, and writes its loss curve.

Run each mode in a fresh process, same seed and data order, then plot them together:

    for mode in stock trainstream trainstream-8bit trainstream-8bit-sr torchao-8bit; do
        python benchmarks/convergence.py --mode $mode --json out/convergence_$mode.json
    done
    python benchmarks/convergence.py --plot docs/img/convergence.png out/convergence_*.json

Modes: `stock` is torch's fused AdamW on the GPU with clip_grad_norm_; `trainstream` wraps
torch.optim.AdamW, `trainstream-8bit` torchao's AdamW8bit (clip 1.0 through max_grad_norm, every
parameter offloaded, so the host engine runs each update), `trainstream-8bit-sr` the same with
bf16 weights and bf16_stochastic_round=True (no fp32 master); `torchao-8bit` is torchao's
AdamW8bit on the GPU, as torchao runs it. The others keep fp32 weights under bf16 autocast. The data is every .py file under the standard library (sorted,
joined, bytes as tokens), 1% held out; each step draws the same batches in every mode.
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
import time
from pathlib import Path

import torch

MODES = ("stock", "trainstream", "trainstream-8bit", "trainstream-8bit-sr", "torchao-8bit")


def corpus() -> torch.Tensor:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    data = b"\n".join(p.read_bytes() for p in files)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batches(data: torch.Tensor, steps: int, batch: int, seq: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=g)
        yield torch.stack([data[s:s + seq] for s in starts.tolist()])


def build(args):
    from trainstream.fixtures import llama

    torch.manual_seed(args.seed)
    return llama(vocab=256, hidden=args.hidden, layers=args.layers, heads=args.hidden // 64, seq=args.seq,
                 intermediate=args.intermediate).to(args.device)


def run(args) -> dict:
    import trainstream

    data = corpus()
    held_out = data[-data.numel() // 100:]
    train_data = data[:-data.numel() // 100]
    model = build(args)
    hyper = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    if args.mode == "stock":
        opt = torch.optim.AdamW(model.parameters(), fused=True, **hyper)
    elif args.mode == "trainstream":
        opt = torch.optim.AdamW(model.parameters(), **hyper)
    else:
        from torchao.optim import AdamW8bit

        if args.mode == "trainstream-8bit-sr":  # bf16 weights without a master, rounded stochastically
            model.bfloat16()
        opt = AdamW8bit(model.parameters(), bf16_stochastic_round=args.mode.endswith("-sr"), **hyper)
    wrapped = args.mode.startswith("trainstream")
    if wrapped:
        model, opt = trainstream.wrap(model, opt, max_grad_norm=args.clip,
                                      tuning=trainstream.Tuning(placement="offload"))
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))))

    def loss_of(tokens):
        with torch.autocast(args.device, dtype=torch.bfloat16):
            return model(input_ids=tokens, labels=tokens).loss

    def evaluate() -> float:
        with torch.no_grad():
            losses = [loss_of(t.to(args.device)).item() for t in batches(held_out, 8, args.batch, args.seq, seed=12345)]
        return sum(losses) / len(losses)

    curve, evals, norms = [], [], []

    def figures(done: bool) -> dict:
        out = {"mode": args.mode, "params": sum(p.numel() for p in model.parameters()), "steps": args.steps,
               "steps_done": len(curve), "complete": done, "tokens_per_step": args.batch * args.seq,
               "loss": curve, "held_out": evals, "grad_norms": norms,
               "final_train_loss": sum(curve[-100:]) / len(curve[-100:]), "final_held_out_loss": evals[-1][1],
               "norm_under_clip_share": sum(n is not None and n < args.clip for n in norms) / len(norms),
               "seconds": time.perf_counter() - start,
               "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
        if wrapped:
            out["speculation"] = opt.report()["speculation"]
        return out

    start = time.perf_counter()
    for step, tokens in enumerate(batches(train_data, args.steps, args.batch, args.seq, args.seed)):
        loss = loss_of(tokens.to(args.device, non_blocking=True))
        loss.backward()
        if not wrapped:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if wrapped:
            norms.append(opt.last_grad_norm)
        curve.append(loss.item())
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            evals.append((step + 1, evaluate()))
            print(f"{args.mode}: step {step + 1} train {sum(curve[-50:]) / len(curve[-50:]):.4f} "
                  f"held-out {evals[-1][1]:.4f} ({time.perf_counter() - start:.0f} s)", flush=True)
            if args.json and step + 1 < args.steps:  # a run stopped early still leaves its curve so far
                Path(args.json).write_text(json.dumps(figures(done=False)))
    out = figures(done=True)
    if wrapped:
        out["describe"] = opt.describe()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=MODES)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=14)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: TrainStream's CPU mode, for trying the script on a small model")
    ap.add_argument("--json", help="write the curve and figures here")
    ap.add_argument("--plot", help="with JSON files as arguments: plot their curves into this PNG")
    ap.add_argument("files", nargs="*")
    args = ap.parse_args()
    if args.plot:
        from common import plot_curves

        plot_curves([json.loads(Path(f).read_text()) for f in args.files], args.plot)
        return
    if args.mode is None:
        ap.error("--mode is required to train")
    out = run(args)
    print(json.dumps({k: v for k, v in out.items() if k not in ("loss", "grad_norms", "describe")}))
    if args.json:
        Path(args.json).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
