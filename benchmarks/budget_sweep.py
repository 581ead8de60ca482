"""Step time against a VRAM cap: TrainStream with no option but clipping, beside the peers.

    python benchmarks/budget_sweep.py --accs 1,8 --caps none,24,20,16,12,8 --json sweep.json --plot sweep.png

Each cap is set with torch.cuda.set_per_process_memory_fraction, and TrainStream is wrapped with
max_grad_norm and accumulation_steps alone: its budget is what the cap leaves. The peers are plain
PyTorch (fused AdamW, with and without gradient checkpointing), torchao's CPUOffloadOptimizer in
its fastest form and DeepSpeed ZeRO-2 with the optimizer offloaded, all clipping at the same norm
where they can. A peer runs first uncapped; under a cap it runs again only if its uncapped peak
fits, and is otherwise reported with the peak it needs (DeepSpeed runs uncapped only). Every run
is train_step.py in a process of its own, with that script's model and batch flags.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

from common import about, add_model_arguments, add_paging_arguments, plot_sweep, write_json

PEERS = ("gpu-adamw", "gpu-adamw+ckpt", "torchao")


def run(mode: str, args, cap_gb: float | None) -> dict:
    """One mode under one cap, in a process of its own: what a mode leaves allocated (DeepSpeed
    does, and a library's reference cycles may) cannot reach the next."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run.json")
        command = [sys.executable, os.path.join(os.path.dirname(__file__), "train_step.py"), "--modes", mode,
                   "--acc", str(args.acc), "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--clip", str(args.clip), "--weights", args.weights, "--hidden", str(args.hidden),
                   "--layers", str(args.layers), "--heads", str(args.heads), "--intermediate", str(args.intermediate),
                   "--vocab", str(args.vocab), "--batch", str(args.batch), "--seq", str(args.seq), "--json", out,
                   "--arch", args.arch]
        if args.kv_heads is not None:
            command += ["--kv-heads", str(args.kv_heads)]
        if cap_gb is not None:
            command += ["--vram-cap-gb", str(cap_gb)]
        if args.host_model:
            command += ["--host-model"]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0 or not os.path.exists(out):
            result = {"mode": mode, "error": f"failed (exit {done.returncode}): {done.stderr[-400:]}"}
        else:
            with open(out) as f:
                result = json.load(f)["results"][0]
    report = result.pop("report", None)
    if report is not None:
        result["placement"] = summary(report["placement"])
        result["speculation"] = report["speculation"]  # with clipping: windows committed, redone, waited
        result["plan"] = {k: report["placement"].get(k) for k in ("expected_step_s", "step_terms", "moves", "profile",
                                                                  "recomputed", "recomputed_lightly",
                                                                  "blocks", "resident_params", "streamed_blocks")}
    result["cap_GB"] = cap_gb
    print(json.dumps({k: v for k, v in result.items() if k != "plan"}), flush=True)
    return result


def summary(placement: dict) -> str:
    """What TrainStream's planner chose, in a few words."""
    blocks = placement.get("blocks") or []
    kinds = ", ".join(f"{blocks.count(k)} {k}" for k in ("paged", "recomputed", "recomputed lightly") if blocks.count(k))
    host_sums = sum(p["window_sum"] == "host" for p in placement["params"])
    streamed = placement.get("streamed_blocks")
    return (f"{placement['resident_params']}/{len(placement['params'])} params resident"
            + (f", {host_sums} summed on host" if host_sums else "") + (f", blocks: {kinds}" if kinds else "")
            + (f", {streamed} blocks' weights streamed" if streamed else "")
            + (f", expected peak {placement['expected_peak_bytes'] / 1e9:.2f} GB" if "expected_peak_bytes" in placement else ""))


def sweep(args, acc: int) -> list[dict]:
    args.acc = acc
    rows, needs = [], {}
    for cap in args.caps:
        for mode in (*args.ours, *args.peers):
            if cap is not None and not mode.startswith("trainstream"):
                need = needs.get(mode)
                if need is None:
                    continue  # it did not run uncapped
                if need > cap:
                    rows.append({"mode": mode, "cap_GB": cap, "error": f"does not fit: needs {need:.2f} GB uncapped"})
                    continue
            result = run(mode, args, cap)
            rows.append(result)
            if cap is None and "peak_vram_GB" in result:
                needs[mode] = result["peak_vram_GB"]
    if args.deepspeed:  # uncapped only: its step takes seconds
        result = run("deepspeed", args, None)
        rows.append(result)
        need = result.get("peak_vram_GB")
        for cap in args.caps[1:]:
            if need is not None:
                fits = "does not fit" if need > cap else "not run under the cap"
                rows.append({"mode": "deepspeed", "cap_GB": cap, "error": f"{fits}: needs {need:.2f} GB uncapped"})
    for r in rows:
        r["acc"] = acc
    return rows


def table(rows: list[dict]) -> str:
    stock = next((r["step_s"] for r in rows if r["mode"] == "gpu-adamw" and r["cap_GB"] is None and "step_s" in r), None)
    lines = [f"{'cap':>6} {'mode':<18}{'step s':>9}{'vs stock':>10}{'peak GB':>9}  notes"]
    for r in rows:
        cap = "none" if r["cap_GB"] is None else f"{r['cap_GB']:g}"
        if "step_s" not in r:
            lines.append(f"{cap:>6} {r['mode']:<18}{'-':>9}{'-':>10}{'-':>9}  {r.get('error') or r.get('skipped')}")
            continue
        ratio = f"{r['step_s'] / stock:.2f}x" if stock else "-"
        note = r.get("placement", "") + (f"; {r['alloc_retries']} allocator retries" if r.get("alloc_retries") else "")
        lines.append(f"{cap:>6} {r['mode']:<18}{r['step_s']:>9.3f}{ratio:>10}{r['peak_vram_GB']:>9.2f}  {note}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(ap)
    add_paging_arguments(ap)
    ap.add_argument("--accs", default="1,8")
    ap.add_argument("--caps", default="none,24,20,16,12,8", help="GB, comma-separated; 'none' is uncapped")
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--ours", default="trainstream", help="TrainStream's modes, e.g. trainstream,trainstream+light")
    ap.add_argument("--deepspeed", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--autocast", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--host-model", action="store_true",
                    help="TrainStream's model is built in host memory and placed by wrap() (caps its weights do not fit)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("budget_sweep.py needs a CUDA GPU", file=sys.stderr)
        return 2
    args.caps = [None if c == "none" else float(c) for c in args.caps.split(",")]
    if args.caps[0] is not None:
        args.caps.insert(0, None)  # the peers' needs come from their uncapped runs
    args.peers = [p for p in args.peers.split(",") if p]
    args.ours = [m for m in args.ours.split(",") if m]
    args.vram_budget = None
    accs = [int(a) for a in args.accs.split(",")]
    rows = []
    for acc in accs:
        rows += sweep(args, acc)
        print(f"\n{torch.cuda.get_device_name()}  hidden={args.hidden} layers={args.layers} batch={args.batch}x{args.seq} "
              f"acc={acc} weights={args.weights} clip={args.clip}")
        print(table([r for r in rows if r["acc"] == acc]), flush=True)
    record = {"about": about(argv), "args": {k: v for k, v in vars(args).items()},
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "results": rows}
    if args.json:
        write_json(args.json, record)
    if args.plot:
        plot_sweep(rows, accs, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
