"""Host time of wrap()'s hooks and step(), call by call, on the train_step.py model.

The thread that runs backward's gradient hooks and step() also launches the GPU's work; while
the host engine keeps every core busy, what it spends per parameter can show in the step. This
times the optimizer's own methods and every call into the native pipeline and the device norms,
over timed steps after a warm-up, all parameters offloaded. The figures are inclusive: a method's
time holds that of the calls it makes. Prints a table and writes JSON.

    python benchmarks/host_calls.py [--clip 1e9] [--steps 10] [--niceness 5]
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch

import trainstream
from trainstream.testing import causal_lm_loss

from train_step import add_model_arguments, build_model  # (benchmarks/ is on the path)

# the optimizer's methods on the hooks' and step()'s paths (a hook registered at wrap() calls
# _on_grad directly, so it is timed through _take)
METHODS = ("_take", "_measure_on_device", "_send", "_land_verdict", "_expect_verdict", "_settle_verdict",
           "_resolve_speculation", "_update_resident", "_mark_updated", "_commit", "_hyper", "_install_gates")


class Timings:
    def __init__(self) -> None:
        self.seconds: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])

    def add(self, name: str, seconds: float) -> None:
        entry = self.seconds[name]
        entry[0] += seconds
        entry[1] += 1

    def timed(self, name: str, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - t0)
        return call


class TimedCalls:
    """Stands in for an object whose methods are native: every method call is timed."""

    def __init__(self, inner, timings: Timings, prefix: str) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_timings", timings)
        object.__setattr__(self, "_prefix", prefix)

    def __getattr__(self, name):
        value = getattr(self._inner, name)
        return self._timings.timed(self._prefix + name, value) if callable(value) else value

    def __setattr__(self, name, value) -> None:
        setattr(self._inner, name, value)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(ap)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--clip", type=float, default=None, help="max_grad_norm (default: no clipping)")
    ap.add_argument("--niceness", type=int, default=None, help="Tuning(engine_niceness=...); default: Tuning's")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"

    model = build_model(args, args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    tuning = dict(placement="offload", **({} if args.niceness is None else dict(engine_niceness=args.niceness)))
    model, opt = trainstream.wrap(model, opt, accumulation_steps=args.acc, max_grad_norm=args.clip,
                                  tuning=trainstream.Tuning(**tuning))
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=args.device,
                           generator=torch.Generator(device=args.device).manual_seed(1))
    timings = Timings()

    def one_step(timed: bool) -> None:
        backward = 0.0
        for _ in range(args.acc):
            with torch.autocast(args.device, dtype=torch.bfloat16):  # (train_step.py's default, either weights)
                loss = causal_lm_loss(model, tokens)
            t0 = time.perf_counter()
            (loss / args.acc).backward()
            backward += time.perf_counter() - t0
        t0 = time.perf_counter()
        opt.step()
        stepping = time.perf_counter() - t0
        opt.zero_grad(set_to_none=True)
        if timed:
            timings.add("[backward calls]", backward)
            timings.add("[step() call]", stepping)

    def settle() -> None:
        opt.synchronize()
        if cuda:
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        one_step(timed=False)
    settle()
    opt._pipeline = TimedCalls(opt._pipeline, timings, "pipeline.")
    if opt._grad_norms is not None:
        opt._grad_norms = TimedCalls(opt._grad_norms, timings, "norms.")
    for name in METHODS:
        setattr(opt, name, timings.timed(name, getattr(opt, name)))
    t0 = time.perf_counter()
    for _ in range(args.steps):
        one_step(timed=True)
    settle()
    step_s = (time.perf_counter() - t0) / args.steps

    rows = [dict(call=name, ms_per_step=1e3 * s / args.steps, calls_per_step=n / args.steps, us_per_call=1e6 * s / n)
            for name, (s, n) in sorted(timings.seconds.items(), key=lambda item: -item[1][0])]
    print(f"max_grad_norm={args.clip}, engine niceness {opt.report()['engine_niceness']}: "
          f"{1e3 * step_s:.1f} ms a step ({args.steps} steps)")
    print(f"{'call':<28}{'ms/step':>9}{'calls/step':>12}{'us/call':>10}")
    for r in rows:
        print(f"{r['call']:<28}{r['ms_per_step']:>9.2f}{r['calls_per_step']:>12.1f}{r['us_per_call']:>10.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "torch": torch.__version__, "step_s": step_s, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
