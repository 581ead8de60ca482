"""Where a training step's time goes: each micro-batch's forward and backward, GPU and host side.

    python benchmarks/step_timeline.py --mode trainstream+vramacc --acc 8 --steps 2
    python benchmarks/step_timeline.py --mode trainstream+paged --vram-budget 6GB --weights bf16
    python benchmarks/step_timeline.py --mode trainstream --clip 1e9   # speculated clipping, never clipping
    python benchmarks/step_timeline.py --mode trainstream+planned --vram-budget 20GB --clip 1.0 --warmup 5

Same model and modes as train_step.py. For each timed step it prints how long every forward and
backward took on the GPU (CUDA events on the compute stream) and on the host (Python's clock,
from the call to its return), then the step: from its first forward to the next step's first
forward, or for the last step to the moment everything, host threads included, has finished,
and when each repeated block (transformer layer) started in the step's first forward, after the
waits of its forward pre-hooks (weights, activation copies). With TrainStream the host update
shows up in two places: the window's last backward (gradients leave at PCIe speed while the host
updates) and the next step's first forward (each module waits for the uploads of the weights it
reads). Without CUDA the model runs on the CPU and only host times are shown.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import trainstream
from trainstream.activations import find_blocks
from trainstream.fixtures import causal_lm_loss

from common import add_model_arguments, add_paging_arguments, build_model, paging_options, write_json

MODES = ("gpu-adamw", "trainstream", "trainstream+vramacc", "trainstream+paged", "trainstream+planned")


class Marks:
    """Named points in time: host clock always, CUDA events on the current stream when on a GPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.names: list[str] = []
        self.host: list[float] = []
        self.events: list = []

    def __call__(self, name: str) -> None:
        self.names.append(name)
        self.host.append(time.perf_counter())
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)

    def span(self, i: int, j: int) -> tuple[float | None, float]:
        """(GPU ms, host ms) from mark i to mark j; call after the GPU has finished."""
        gpu = self.events[i].elapsed_time(self.events[j]) if self.cuda else None
        return gpu, 1e3 * (self.host[j] - self.host[i])


def run(args) -> dict:
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = build_model(args, device)
    base, _, variant = args.mode.partition("+")
    fused = device.type == "cuda" and base == "gpu-adamw"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=fused)
    settle = lambda: None
    if variant == "planned":  # what wrap() does with no option: the planner places everything
        model, opt = trainstream.wrap(model, opt, accumulation_steps=args.acc, max_grad_norm=args.clip,
                                      vram_budget=args.vram_budget,
                                      tuning=trainstream.Tuning(threads=args.threads))
        settle = opt.synchronize
    elif base == "trainstream":
        tuning = trainstream.Tuning(placement="offload", accumulate_in_vram=variant == "vramacc",
                                    threads=args.threads, prefetch_depth=args.prefetch_depth)
        model, opt = trainstream.wrap(model, opt, accumulation_steps=args.acc, tuning=tuning,
                                      max_grad_norm=args.clip, **paging_options(variant, args))
        settle = opt.synchronize
    g = torch.Generator(device=device).manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=device, generator=g)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    marks = Marks(device.type == "cuda")
    # When each repeated block (transformer layer) starts in the first forward of a timed step,
    # after the waits of its forward pre-hooks (weights, paging): where that forward is held up.
    block_marks = Marks(device.type == "cuda")
    timed_forward = False

    def block_starts(k: int):
        def hook(module, args) -> None:
            if timed_forward:
                block_marks(f"block {k}")
        return hook

    for k, block in enumerate(find_blocks(model)[1]):
        block.register_forward_pre_hook(block_starts(k))

    def step(mark) -> None:
        nonlocal timed_forward
        for i in range(args.acc):
            mark(f"forward {i}")
            timed_forward = i == 0 and mark is marks
            if timed_forward:
                block_marks("forward 0")
            with autocast:
                loss = causal_lm_loss(model, tokens)
            timed_forward = False
            mark(f"backward {i}")
            (loss / args.acc).backward()
        mark("optimizer.step")
        if args.clip is not None and base == "gpu-adamw":
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def finish() -> None:
        settle()
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        step(lambda name: None)
    finish()
    engine = opt.engine.pipeline.stats() if base == "trainstream" else None
    for _ in range(args.steps):
        step(marks)
    finish()
    marks("end")  # once everything, host threads included, has finished
    finish()

    steps = []
    per_step = 2 * args.acc + 1  # a forward and a backward mark per micro-batch, then optimizer.step
    for s in range(args.steps):
        first = s * per_step
        phases = []
        for k in range(per_step):
            name = marks.names[first + k]
            gpu, host = marks.span(first + k, first + k + 1)
            phases.append({"phase": name, "gpu_ms": gpu, "host_ms": host})
        gpu, host = marks.span(first, first + per_step)
        per_fwd = len(block_marks.names) // args.steps
        starts = [block_marks.span(s * per_fwd, s * per_fwd + k) for k in range(1, per_fwd)]
        steps.append({"phases": phases, "step_gpu_ms": gpu, "step_host_ms": host,
                      "block_starts_gpu_ms": [g for g, _ in starts],
                      "block_starts_host_ms": [h for _, h in starts]})
    result = {"mode": args.mode, "device": str(device), "acc": args.acc, "max_grad_norm": args.clip, "steps": steps}
    if base == "trainstream":
        result["speculation"] = opt.report()["speculation"]
        if opt.plan is not None:
            result["placement"] = opt.describe()
        # the host engine's busy time a timed step: what speculation adds to the host's work shows here
        now = opt.engine.pipeline.stats()
        busy, updated = now["busy_seconds"] - engine["busy_seconds"], now["updated_elements"] - engine["updated_elements"]
        result["host_engine"] = {"busy_ms_per_step": 1e3 * busy / args.steps, "elements_per_step": updated / args.steps,
                                 "ns_per_element": 1e9 * busy / updated if updated else None}
    return result


def print_timeline(result: dict) -> None:
    cuda = result["device"].startswith("cuda")
    clip = "" if result["max_grad_norm"] is None else f", max_grad_norm={result['max_grad_norm']:g}"
    print(f"{result['mode']} on {result['device']}, accumulation {result['acc']}{clip}")
    print(f"{'step':>4}  {'phase':<16}{'GPU ms' if cuda else '':>9}{'host ms':>10}")
    for s, step in enumerate(result["steps"]):
        for p in step["phases"]:
            gpu = f"{p['gpu_ms']:9.1f}" if cuda else " " * 9
            print(f"{s:>4}  {p['phase']:<16}{gpu}{p['host_ms']:10.1f}")
        gpu = f"{step['step_gpu_ms']:9.1f}" if cuda else " " * 9
        print(f"{s:>4}  {'whole step':<16}{gpu}{step['step_host_ms']:10.1f}")
        for side in ("gpu", "host") if cuda else ("host",):
            starts = " ".join(f"{t:.0f}" for t in step[f"block_starts_{side}_ms"])
            print(f"{s:>4}  blocks start, {side} ms after forward 0: {starts}")
    if "placement" in result:
        print(result["placement"])
    if "host_engine" in result:
        e = result["host_engine"]
        print(f"host engine: busy {e['busy_ms_per_step']:.1f} ms a step, {e['elements_per_step'] / 1e6:.0f}M elements"
              + (f", {e['ns_per_element']:.3f} ns each" if e["ns_per_element"] else ""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=MODES, default="trainstream",
                    help="gpu-adamw: torch.optim.AdamW on the model's device (fused on CUDA)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_model_arguments(ap)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3,
                    help="untimed steps first (trainstream+paged profiles in its second)")
    add_paging_arguments(ap)
    ap.add_argument("--threads", type=int, default=0, help="host AdamW threads for trainstream (0: every CPU)")
    ap.add_argument("--clip", type=float, default=None,
                    help="max_grad_norm (gpu-adamw: clip_grad_norm_ before step); 1e9 never clips, so "
                         "TrainStream's speculated updates commit")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("--device cuda needs a CUDA GPU; use --device cpu", file=sys.stderr)
        return 2
    result = run(args)
    print_timeline(result)
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
