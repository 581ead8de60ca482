"""Steady-state training step time and peak VRAM, side by side in one process.

    python benchmarks/train_step.py --hidden 2048 --layers 16 --batch 4 --seq 1024 \
        --modes gpu-adamw,trainstream --json out.json --plot out.png

Model: a Llama-style decoder (transformers' LlamaForCausalLM built from a config when
transformers is installed, else a small built-in equivalent). Step time is the wall time of
--steps consecutive optimizer steps after --warmup steps, divided by --steps, measured only once
everything (host threads included) has finished. Modes whose package is not installed
(torchao, deepspeed) are reported as skipped.

Peers: torchao's CPUOffloadOptimizer around torch's AdamW, DeepSpeed ZeRO stage 2 with the
optimizer offloaded to the host (its CPU AdamW, fp32 master weights in pinned memory) and, for
models whose weights do not fit, ZeRO stage 3 with the parameters offloaded too ('deepspeed3',
the model built under deepspeed.zero.Init straight into host memory), set up for one process on
one GPU with the same batch, accumulation, clipping and bf16 handling.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import re
import shlex
import socket
import sys
import time
import traceback
import types

import torch

import trainstream
import trainstream._testing as baselines
from trainstream.testing import causal_lm_loss, llama

from report import medians, plot_runs  # (benchmarks/ is on the path: scripts here import each other)


def build_model(args, device) -> torch.nn.Module:
    """The model of the flags, built on `device` in the weights' dtype (no fp32 copy of a bf16
    model on the way). In host memory its random values come from `pooled_init`."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if args.weights == "bf16" else torch.float32)
    try:
        with torch.device(device), pooled_init() if device == "cpu" else contextlib.nullcontext():
            return llama(vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads, seq=args.seq,
                         intermediate=args.intermediate)
    finally:
        torch.set_default_dtype(default)


@contextlib.contextmanager
def pooled_init(pool: int = 1 << 24):
    """Random initialisation at memory speed: torch draws a CPU tensor's random values on one
    thread (over two minutes for a 6B model, twice over with a module's own init and the
    model's), so here each draw copies a pool of `pool` values drawn once, tiled. For timing runs
    of models built in host memory; the values' distribution is the one asked for."""
    normal = torch.randn(pool)
    uniform = torch.rand(pool)
    drawn = {"normal_": torch.Tensor.normal_, "uniform_": torch.Tensor.uniform_}

    def fill(t: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        flat = t.detach().view(-1)
        whole = flat.numel() // pool * pool
        if whole:
            flat[:whole].view(-1, pool).copy_(values.expand(whole // pool, pool))
        flat[whole:].copy_(values[:flat.numel() - whole])
        return t

    def normal_(t, mean=0.0, std=1.0, *, generator=None):
        return fill(t, normal * std + mean) if t.device.type == "cpu" else drawn["normal_"](t, mean, std, generator=generator)

    def uniform_(t, a=0.0, b=1.0, *, generator=None):
        return fill(t, uniform * (b - a) + a) if t.device.type == "cpu" else drawn["uniform_"](t, a, b, generator=generator)

    torch.Tensor.normal_, torch.Tensor.uniform_ = normal_, uniform_
    try:
        yield
    finally:
        torch.Tensor.normal_, torch.Tensor.uniform_ = drawn["normal_"], drawn["uniform_"]


def deepspeed_config(args, stage: int) -> dict:
    """DeepSpeed ZeRO-2 with the optimizer offloaded to the host, or ZeRO-3 with the parameters
    offloaded as well, configured like the other modes (one process on one GPU)."""
    import deepspeed  # noqa: F401  (skipped when missing)

    if not torch.distributed.is_initialized():  # one process on one GPU; kept for later deepspeed modes
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        torch.distributed.init_process_group("nccl", device_id=torch.device("cuda", 0))
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    if stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": args.acc,
        "gradient_clipping": args.clip or 0.0,  # DeepSpeed clips at 1.0 unless told otherwise
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},  # CPU AdamW when offloaded
        "zero_optimization": zero,
        "bf16": {"enabled": args.weights == "bf16"},
        # the engine turns off an outer autocast unless its own config asks for one
        "torch_autocast": {"enabled": args.autocast, "dtype": "bfloat16"},
    }


def deepspeed_engine(model, config: dict):
    import deepspeed

    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, opt


CPUS = sorted(os.sched_getaffinity(0))  # this process's, before any '+pin' mode narrows this thread's


def run_mode(mode: str, args) -> dict:
    torch.manual_seed(0)
    os.sched_setaffinity(0, CPUS)  # (an earlier '+pin' mode kept this thread to one)
    started = time.perf_counter()
    base = mode.split("+")[0]
    if base == "deepspeed3":  # built straight into host memory, partitioned as it is made
        import deepspeed

        config = deepspeed_config(args, 3)
        with deepspeed.zero.Init(config_dict_or_path=config, remote_device="cpu", pin_memory=True):
            model = build_model(args, "cpu")
    else:
        # --host-model: a model whose weights may not fit the GPU waits in host memory for wrap()
        model = build_model(args, "cpu" if args.host_model and base == "trainstream" else "cuda")
    progress = print if args.host_model else lambda *a, **k: None  # large models: minutes, shown as they pass
    progress(f"{mode}: model built in host memory ({time.perf_counter() - started:.0f} s)", flush=True)
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    sync = lambda: None
    saving = contextlib.nullcontext  # how forward keeps its activations
    base, *extras = mode.split("+")
    # 'trainstream' is wrap() with the options users pass (max_grad_norm, accumulation_steps, and
    # --vram-budget if given): the planner places everything. '+offload' offloads every gradient
    # and AdamW state with no saved-tensor hooks, as wrap(placement="offload", activations="off");
    # the variants paged/auto/hostacc/vramacc imply it. Baselines for TrainStream's own choices,
    # added to any trainstream mode: '+fp32grads' sends
    # every gradient as fp32, '+everygate' keeps the forward gates on and every one waiting,
    # '+pageonly' meets a VRAM budget by paging alone (no recomputed blocks), '+t12' runs the host
    # engine on 12 threads instead of every CPU, '+master' keeps fp32 masters on the host and
    # uploads them instead of update terms, '+light' offers the planner light recompute
    # (Tuning(light_recompute=True)), '+pin' starts the host engine's threads on every CPU but the
    # first and keeps this thread, which queues the GPU's work, alone on that one; '+niceN' runs
    # the host engine's threads N nicer than this thread (Tuning(engine_niceness=N); '+nice0' is
    # the baseline for the default, 5).
    # '+waitclip' makes clipped host updates wait for the global norm instead of speculating.
    # '+ckpt' or '+save_on_cpu' may come with one of TrainStream's variants: 'trainstream+ckpt+auto'.
    # On any mode: '+compile' compiles the model (torch.compile, default mode) before the optimizer
    # is built or wrapped, '+compileafter' after wrap(); '+noclip' or '+clipX' (e.g. +clip1e9)
    # replace --clip for that mode. '+streamN' streams the weights of the last N blocks
    # (Tuning(streamed_blocks=N)).
    threads = next((int(e[1:]) for e in extras if re.fullmatch(r"t\d+", e)), 0)
    nice = next((int(e[4:]) for e in extras if re.fullmatch(r"nice\d+", e)), None)
    streams = [int(e[6:]) for e in extras if re.fullmatch(r"stream\d+", e)]
    clips = [e for e in extras if e == "noclip" or re.fullmatch(r"clip[0-9.e+-]+", e)]
    clip = args.clip if not clips else None if clips[0] == "noclip" else float(clips[0][4:])
    compiling = [e for e in extras if e in ("compile", "compileafter")]
    knobs = {e for e in extras if e in ("fp32grads", "everygate", "pageonly", "master", "offload", "waitclip", "light",
                                        "pin", f"t{threads}", f"nice{nice}", *clips, *compiling, *(f"stream{n}" for n in streams))}
    keeping = [e for e in extras if e in ("ckpt", "save_on_cpu")]
    variants = [e for e in extras if e not in knobs and e not in keeping]
    if len(variants) > 1 or len(keeping) > 1:
        raise ValueError(f"unknown mode {mode}: one variant at most besides ckpt/save_on_cpu and the baselines")
    variant = variants[0] if variants else ""
    if keeping == ["ckpt"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif keeping == ["save_on_cpu"]:
        saving = lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)
    if variant not in ("", "paged", "auto", "hostacc", "vramacc"):
        raise ValueError(f"unknown mode {mode}")
    if compiling == ["compile"]:
        model = torch.compile(model)
    torch._dynamo.utils.counters.clear()
    if base == "gpu-adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    elif base == "trainstream":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        t0 = time.perf_counter()
        tuning = dict(recompute="pageonly" not in knobs, threads=threads, pack_gradients="fp32grads" not in knobs,
                      upload_update_terms="master" not in knobs, speculative_clipping="waitclip" not in knobs,
                      streamed_blocks=streams[0] if streams else None, light_recompute="light" in knobs)
        if nice is not None:
            tuning.update(engine_niceness=nice)
        if variant or "offload" in knobs:
            options = paging_options(variant, args)
            tuning.update(placement="offload", accumulate_in_vram=variant == "vramacc",
                          prefetch_depth=args.prefetch_depth)
        else:
            options = dict(vram_budget=args.vram_budget)
        if args.host_model:
            options["device"] = "cuda"
        pin = "pin" in knobs and len(CPUS) > 1
        if pin:  # threads inherit their creator's CPUs: the engine's get all but the first
            os.sched_setaffinity(0, CPUS[1:])
        model, opt = trainstream.wrap(model, opt, accumulation_steps=args.acc, max_grad_norm=clip,
                                      tuning=trainstream.Tuning(**tuning), **options)
        if pin:
            os.sched_setaffinity(0, CPUS[:1])
        setup_s = time.perf_counter() - t0
        sync = opt.synchronize
        if variant == "hostacc":  # the comparison baseline: micro-batches added by host threads
            baselines.add_micro_batches_on_host(opt)
        baselines.gate_every_forward(opt, "everygate" in knobs)
    elif base == "torchao":
        from torchao.optim import CPUOffloadOptimizer  # skipped when missing

        # its fastest documented form: torch's fused CPU AdamW, gradients offloaded as backward
        # produces them (which torchao does not allow with gradient accumulation)
        opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, offload_gradients=args.acc == 1,
                                  fused=True, lr=1e-4, weight_decay=0.01)
    elif base == "deepspeed":
        model, opt = deepspeed_engine(model, deepspeed_config(args, 2))
    elif base == "deepspeed3":
        model, opt = deepspeed_engine(model, config)
    elif base == "no-optimizer":
        # The VRAM floor of an optimizer that keeps nothing but the weights on the GPU: forward and
        # backward, each gradient dropped as soon as autograd has produced it, no update.
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None))
        opt = types.SimpleNamespace(step=lambda: None, zero_grad=lambda set_to_none=True: None)
    else:
        raise ValueError(f"unknown mode {mode}")
    if compiling == ["compileafter"]:
        model = torch.compile(model)

    g = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda", generator=g)
    acc = args.acc

    def one_step():
        for _ in range(acc):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.autocast), saving():
                loss = causal_lm_loss(model, tokens)
            if base.startswith("deepspeed"):  # the engine divides by acc, then steps and clips at the last micro-batch
                model.backward(loss)
                model.step()
            else:
                (loss / acc).backward()
        if not base.startswith("deepspeed"):
            if clip is not None and base not in ("trainstream", "no-optimizer"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss

    progress(f"{mode}: set up in {time.perf_counter() - started:.0f} s", flush=True)
    try:
        for i in range(args.warmup):
            when = f"warm-up step {i + 1}"
            t0 = time.perf_counter()
            loss = one_step()
            if args.host_model:
                sync()
                torch.cuda.synchronize()
            progress(f"{mode}: {when}: {time.perf_counter() - t0:.2f} s", flush=True)
        when = "the timed steps"
        sync()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            loss = one_step()
        sync()
        torch.cuda.synchronize()
    except torch.OutOfMemoryError as exc:  # for the record: when, and the plan that ran out
        exc.when = when
        exc.plan = opt.describe() if base == "trainstream" else None
        raise
    seconds = (time.perf_counter() - t0) / args.steps
    result = {
        "mode": mode, "params": params, "step_s": seconds, "loss": float(loss),
        "peak_vram_GB": torch.cuda.max_memory_allocated() / 1e9, "weights_GB": weight_bytes / 1e9,
        # what a cap limits: the allocator's segments, free blocks inside them included
        "peak_reserved_GB": torch.cuda.max_memory_reserved() / 1e9,
        "tokens_per_s": args.batch * args.seq * acc / seconds, "max_grad_norm": clip,
        # allocations that found no room until the caching allocator gave its free blocks back
        # (each a device synchronization): a sign of a peak too close to a cap
        "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries,
    }
    if compiling:  # how often torch.compile split the model, at which functions, into how many graphs
        counters = torch._dynamo.utils.counters
        reasons = counters["graph_break"]
        result["graph_breaks"] = sum(reasons.values())
        result["graph_break_at"] = sorted({m.group(1).split(".<locals>")[0] for reason in reasons
                                           for m in [re.search(r"<function (\S+) at", reason)] if m})
        result["unique_graphs"] = counters["stats"]["unique_graphs"]
    if base == "trainstream":
        result["setup_s"] = setup_s
        result["report"] = opt.report()
        print(opt.describe(), flush=True)
        opt.remove_hooks()
    if base.startswith("deepspeed"):
        model.destroy()  # hooks, pinned buffers and the CPU AdamW state go with the engine
    return result


def add_model_arguments(ap: argparse.ArgumentParser) -> None:
    """The model and batch flags (default: the 0.95B Llama at batch 4x1024), --acc and --weights."""
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--acc", type=int, default=1)
    ap.add_argument("--weights", choices=["fp32", "bf16"], default="fp32",
                    help="fp32 weights under bf16 autocast, or bf16 weights")


def add_paging_arguments(ap: argparse.ArgumentParser) -> None:
    """How the trainstream+paged and +auto modes page activations (see paging_options)."""
    ap.add_argument("--activations", default="auto",
                    type=lambda text: text if text in ("auto", "off") else float(text),
                    help="for the trainstream+paged mode: 'auto' or a share in [0, 1]")
    ap.add_argument("--vram-budget", default=None, help="for trainstream+paged: e.g. 6GB")
    ap.add_argument("--prefetch-depth", type=int, default=1,
                    help="for trainstream+paged/+auto: blocks prefetched ahead in backward")


def paging_options(variant: str, args) -> dict:
    """wrap()'s activation arguments for a trainstream mode's variant ('paged', 'auto' or other)."""
    if variant == "paged":
        return {"activations": args.activations, "vram_budget": args.vram_budget}
    if variant == "auto":
        return {"activations": "auto"}
    return {"activations": "off"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(ap)
    ap.add_argument("--clip", type=float, default=None)
    ap.add_argument("--autocast", action=argparse.BooleanOptionalAction, default=True,
                    help="bf16 autocast (default on; with fp32 weights it caches a bf16 copy of every weight)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=4,
                    help="steps before timing (TrainStream profiles two, then places everything)")
    ap.add_argument("--vram-cap-gb", type=float, default=None,
                    help="cap this process's VRAM (torch.cuda.set_per_process_memory_fraction)")
    ap.add_argument("--host-model", action="store_true",
                    help="build the model in host memory and let wrap() place it on the GPU (device='cuda'): "
                         "for trainstream modes whose weights may not fit the GPU")
    add_paging_arguments(ap)
    ap.add_argument("--modes", default="gpu-adamw,trainstream,torchao",
                    help="comma list of gpu-adamw, trainstream, torchao, deepspeed, no-optimizer (forward "
                         "and backward only, each gradient dropped at once: weights and activations); a '+ckpt' (gradient "
                         "checkpointing) or '+save_on_cpu' (torch's save_on_cpu) suffix, a '+paged' (our "
                         "activation paging with --activations/--vram-budget) or '+auto' (our "
                         "paging, automatic) suffix, or one of each, changes how activations are kept; "
                         "trainstream+hostacc adds micro-batch gradients on host threads, "
                         "trainstream+vramacc sums them in VRAM (accumulate_in_vram); 'trainstream' alone is "
                         "wrap() with --clip and --vram-budget only (the planner places everything), "
                         "'+offload' offloads every parameter with no saved-tensor hooks; a further "
                         "'+fp32grads' (no bf16 gradient transfer), '+everygate' (forward gates "
                         "never skipped or taken off), '+pageonly' (a VRAM budget met without recomputing "
                         "blocks), '+master' (fp32 masters kept on the host and uploaded, not update "
                         "terms) or '+tN' (N host threads) on a trainstream mode gives a baseline "
                         "for that choice")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the list of modes this many times, one round after another, and print each "
                         "mode's median: runs of one mode in one process spread by several percent")
    ap.add_argument("--alternate", action="store_true",
                    help="with --rounds: every other round runs the modes in reverse order (A B, B A, A B...), "
                         "so that no mode always runs first or always after the same one")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if not torch.cuda.is_available():
        print("train_step.py needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.vram_cap_gb:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.vram_cap_gb * 1e9 / total))
    results = []
    modes = args.modes.split(",")
    for mode in [m for r in range(args.rounds) for m in (modes[::-1] if args.alternate and r % 2 else modes)]:
        try:
            results.append(run_mode(mode, args))
        except ImportError as exc:
            results.append({"mode": mode, "skipped": f"not installed ({exc.name})"})
        except torch.OutOfMemoryError as exc:  # where, and the allocator's figures, for the record
            where = [f for f in traceback.extract_tb(exc.__traceback__) if "trainstream" in f.filename
                     or "train_step" in f.filename or "transformers" in f.filename][-4:]
            results.append({"mode": mode, "error": "out of memory", "when": getattr(exc, "when", "set-up"),
                            "detail": str(exc).split("See documentation")[0].strip(),
                            "at": [f"{f.name} ({os.path.basename(f.filename)}:{f.lineno})" for f in where]})
            if getattr(exc, "plan", None):
                results[-1]["plan"] = exc.plan
                print(f"{mode}: out of memory in {exc.when}, under this plan:\n{exc.plan}", file=sys.stderr)
        gc.collect()  # the mode's model, optimizer and pinned memory go before the next one
        torch.cuda.empty_cache()
        print(json.dumps({k: v for k, v in results[-1].items() if k not in ("report", "plan")}), flush=True)
    if torch.distributed.is_initialized():  # the deepspeed mode's one-process group
        torch.distributed.destroy_process_group()
    first = next((r for r in results if "step_s" in r), None)  # ratios are against the first mode that ran
    base = first["step_s"] if first else None
    print(f"\n{torch.cuda.get_device_name()}  hidden={args.hidden} layers={args.layers} batch={args.batch}x{args.seq} "
          f"acc={args.acc} weights={args.weights} autocast={args.autocast} vram_cap={args.vram_cap_gb}")
    print(f"{'mode':<24}{'params':>10}{'step s':>9}{'vs 1st':>8}{'peak VRAM GB':>14}{'loss':>8}")
    for r in results:
        if "step_s" not in r:
            print(f"{r['mode']:<24}  {r.get('skipped') or r.get('error')}")
            continue
        ratio = f"{r['step_s'] / base:.2f}x" if base else "-"
        print(f"{r['mode']:<24}{r['params'] / 1e9:>9.2f}B{r['step_s']:>9.3f}{ratio:>8}{r['peak_vram_GB']:>14.2f}{r['loss']:>8.3f}")
    summary = medians(results)
    if any(m["runs"] > 1 for m in summary):
        print(f"\n{'mode':<24}{'runs':>5}{'median s':>10}{'fastest':>9}{'slowest':>9}{'vs 1st':>8}")
        for m in summary:
            print(f"{m['mode']:<24}{m['runs']:>5}{m['median_s']:>10.3f}{m['min_s']:>9.3f}{m['max_s']:>9.3f}"
                  f"{m['median_s'] / summary[0]['median_s']:>7.2f}x")
    record = {"about": about(argv), "args": vars(args), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "trainstream": trainstream.__version__, "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    if args.plot:
        plot_runs(results, args.plot)  # the drawing report.py redraws the docs' figures with
    return 0


def about(argv) -> dict:
    """When, on what (the GPU, if any, and the CPU) and by which command a run was made: report.py's
    caption for its table."""
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    script = os.path.relpath(sys.argv[0]) if sys.argv and sys.argv[0].endswith(".py") else "benchmarks/train_step.py"
    return {"date": datetime.date.today().isoformat(),
            "hardware": (f"{torch.cuda.get_device_name()}, " if torch.cuda.is_available() else "")
            + f"{len(os.sched_getaffinity(0))} cores of {cpu}",
            "software": f"torch {torch.__version__}" + (f", CUDA {torch.version.cuda}" if torch.version.cuda else "")
            + f", trainstream {trainstream.__version__}",
            "command": shlex.join(["python", script, *(sys.argv[1:] if argv is None else argv)])}


if __name__ == "__main__":
    raise SystemExit(main())
