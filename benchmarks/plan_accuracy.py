"""The planner's expectations against what runs: the plan it chose and variations of it, one
after another in one process.

    python benchmarks/plan_accuracy.py --vram-budget 20GB --json plan_accuracy.json

wrap()s the model of train_step.py's flags with max_grad_norm and the budget (no cap: every
variation must be able to run), trains until the plan is made, then applies the chosen plan and
variations of it: every parameter resident, none of its blocks recomputed, only the LM head
offloaded, half the parameters offloaded, half the blocks recomputed, the saved-tensor hooks on
with nothing paged, with --light half and all of the blocks recomputed lightly, the chosen plan
again, and last (streaming cannot be undone) a quarter, half and all of the blocks' weights
streamed. For each: the planner's expected step time and peak (placement.step_seconds and
peak_bytes on the run's profile) against the measured ones, after --warmup steps, over --steps,
and what the step cannot beat (placement.bound_seconds).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

import torch

import trainstream
from trainstream import placement as planner
from trainstream.fixtures import causal_lm_loss

from common import about, add_model_arguments, build_model, write_json


def variations(profile: planner.Profile, chosen: planner.Plan) -> list[tuple[str, planner.Plan]]:
    """The plans to measure, in an order that can be applied one after another."""
    n, blocks = len(profile.params), len(profile.blocks)
    bare = replace(chosen, recomputed=(), light=())  # (a variation recomputes only what it names)
    out = [("chosen", chosen),
           ("chosen, every parameter resident", replace(chosen, resident=n)),
           ("chosen, no block recomputed", bare),
           ("everything resident, nothing recomputed", replace(bare, resident=n)),
           ("only the last parameter in forward order offloaded", replace(bare, resident=n - 1)),
           ("half the parameters offloaded", replace(bare, resident=n // 2))]
    if blocks:
        out.append((f"every parameter resident, {blocks // 2} blocks recomputed",
                    replace(bare, resident=n, recomputed=tuple(range(blocks // 2)))))
        # the saved-tensor hooks with nothing paged: the autocast copies recast in backward
        out.append(("everything resident, hooks on, nothing paged", replace(bare, resident=n, hooks=True, paged=0)))
        out.append(("chosen, hooks on, nothing paged", replace(chosen, hooks=True, paged=0)))
        if all(b.light_bytes is not None for b in profile.blocks):  # (--light)
            for k in (blocks // 2, blocks):
                out.append((f"everything resident, {k} blocks recomputed lightly",
                            replace(bare, resident=n, light=tuple(range(k)))))
    # the first variation runs right after planning: the same plan again, with everything since
    # behind it, tells that apart from the plan's own cost
    out.append(("chosen, again", chosen))
    for k in sorted({max(1, blocks // 4), blocks // 2, blocks} - {0}):
        streamed = replace(chosen, streamed=max(k, chosen.streamed))
        # (a streamed block's parameters are offloaded: the planner counts them so)
        out.append((f"chosen, {streamed.streamed} blocks' weights streamed",
                    replace(streamed, resident=min(chosen.resident, before_streamed(profile, streamed)))))
    return out


def before_streamed(profile: planner.Profile, plan: planner.Plan) -> int:
    """How many parameters, the first in forward order, come before the plan's first streamed block."""
    streamed = planner.streamed_blocks(profile, plan.streamed)
    return min((i for i, p in enumerate(profile.params) if p.block in streamed), default=len(profile.params))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(ap)
    ap.add_argument("--vram-budget", default="20GB")
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a run of the script itself (no peaks)")
    ap.add_argument("--light", action="store_true", help="offer light recompute (Tuning(light_recompute=True))")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        print("plan_accuracy.py needs a CUDA GPU (or --device cpu)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    model = build_model(args, device.type)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    model, opt = trainstream.wrap(model, opt, max_grad_norm=args.clip, accumulation_steps=args.acc,
                                  vram_budget=args.vram_budget, tuning=trainstream.Tuning(light_recompute=args.light))
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)

    def steps(count: int) -> None:
        for _ in range(count):
            for _ in range(args.acc):
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.weights == "fp32"):
                    loss = causal_lm_loss(model, tokens)
                (loss / args.acc).backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        if cuda:
            torch.cuda.synchronize()

    while opt.plan is None:  # the profiled steps, then the plan
        steps(1)
    profile, chosen = opt.profile, opt.plan
    rows = []
    for name, plan in variations(profile, chosen):
        expected, terms = planner.step_seconds(profile, plan)
        opt.promotion.apply(plan)  # (what a re-plan does: between steps)
        steps(args.warmup)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        steps(args.steps)
        measured = (time.perf_counter() - t0) / args.steps
        row = {"variation": name, "resident_params": sum(s.resident for s in opt.slots.order),
               "recomputed_blocks": len(plan.recomputed), "light_blocks": len(plan.light),
               "streamed_blocks": plan.streamed,
               "expected_step_s": expected, "step_s": measured, "step_terms": terms,
               "bound": planner.bound_seconds(profile, plan),
               "expected_peak_GB": planner.peak_bytes(profile, plan) / 1e9,
               "peak_GB": torch.cuda.max_memory_allocated() / 1e9 if cuda else None}
        print(json.dumps({k: v for k, v in row.items() if k != "step_terms"}), flush=True)
        rows.append(row)
    print(f"\n{'variation':<52}{'expected s':>11}{'measured s':>11}{'expected GB':>12}{'peak GB':>9}")
    for r in rows:
        peak = "-" if r["peak_GB"] is None else f"{r['peak_GB']:.2f}"
        print(f"{r['variation']:<52}{r['expected_step_s']:>11.4f}{r['step_s']:>11.4f}{r['expected_peak_GB']:>12.2f}{peak:>9}")
    if args.json:
        profile_figures = {k: v for k, v in vars(profile).items() if k not in ("params", "blocks")}
        write_json(args.json, {"about": about(argv), "args": vars(args),
                               "params": sum(p.numel() for p in model.parameters()), "profile": profile_figures,
                               "results": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
