"""Host time of wrap()'s hooks and step(), call by call, on the train_step.py model.

The thread that runs backward's gradient hooks and step() also launches the GPU's work; while
the host engine keeps every core busy, what it spends per parameter can show in the step. This
times, over timed steps after a warm-up, all parameters offloaded: the backward and step() calls
as the loop makes them, wrap()'s gradient hook on each parameter (between a hook registered
before wrap() and one registered after it: torch runs a tensor's hooks in that order), and every
call into the native pipeline and the device norms, through the optimizer's seams for them
(`optimizer.engine.pipeline`, `optimizer.clipping.grad_norms`), and the rooms' methods that the
hooks and step() call (ROOM_METHODS, as `room.method`). The figures are inclusive: a call's time
holds that of the calls it makes. Prints a table and writes JSON.

    python benchmarks/host_calls.py [--clip 1e9] [--steps 10] [--niceness 5]
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

import trainstream
from trainstream.fixtures import causal_lm_loss

from common import add_model_arguments, build_model, write_json

# The optimizer's rooms (its attributes) and their methods that the hooks and step() call.
ROOM_METHODS = {"gradient_hooks": ("take", "send", "mark_updated"),
                "clipping": ("measure", "coefficient", "land_verdict", "resolve", "settle_verdict", "commit"),
                "gates": ("update_queued",)}


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


class HookClock:
    """Times another gradient hook of each parameter: `start` registered before it, `stop` after
    it, so the time between is that hook's, on whichever thread autograd runs hooks. Counts only
    while `on`."""

    def __init__(self, timings: Timings, name: str) -> None:
        self.timings, self.name, self.on = timings, name, False
        self.started: dict[int, float] = {}

    def start(self, param) -> None:
        self.started[id(param)] = time.perf_counter()

    def stop(self, param) -> None:
        t0 = self.started.pop(id(param), None)
        if self.on and t0 is not None:
            self.timings.add(self.name, time.perf_counter() - t0)


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
    timings = Timings()
    hooks = HookClock(timings, "[gradient hooks]")
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.register_post_accumulate_grad_hook(hooks.start)
    tuning = dict(placement="offload", **({} if args.niceness is None else dict(engine_niceness=args.niceness)))
    model, opt = trainstream.wrap(model, opt, accumulation_steps=args.acc, max_grad_norm=args.clip,
                                  tuning=trainstream.Tuning(**tuning))
    for p in params:
        p.register_post_accumulate_grad_hook(hooks.stop)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=args.device,
                           generator=torch.Generator(device=args.device).manual_seed(1))

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
    opt.engine.pipeline = TimedCalls(opt.engine.pipeline, timings, "pipeline.")
    if opt.clipping.grad_norms is not None:
        opt.clipping.grad_norms = TimedCalls(opt.clipping.grad_norms, timings, "norms.")
    for room, names in ROOM_METHODS.items():  # (set on the room objects: they call each other through them)
        obj = getattr(opt, room)
        for name in names:
            setattr(obj, name, timings.timed(f"{room}.{name}", getattr(obj, name)))
    hooks.on = True
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
        write_json(args.json, {"args": vars(args), "torch": torch.__version__, "step_s": step_s, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
