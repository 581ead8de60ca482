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
import gc
import json
import os
import re
import sys
import time
import traceback
import types

import torch

import trainstream
import trainstream.baselines as baselines
from trainstream.fixtures import causal_lm_loss

from common import (HERE, about, add_model_arguments, add_paging_arguments, build_model, deepspeed_config,
                    deepspeed_engine, medians, paging_options, plot_runs, process_memory, write_json)


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
    # '+gpuadd' adds micro-batches into the host sums by the kernel that reads and writes them over
    # PCIe, even where weights stream (Tuning(add_on_host=False); the planner adds them on the
    # engine's threads there).
    # '+hostalloc' pins host memory by cudaHostAlloc (Tuning(register_pinned=False)) instead of
    # faulting it in from every CPU and registering it.
    # '+ckpt' or '+save_on_cpu' may come with one of TrainStream's variants: 'trainstream+ckpt+auto'.
    # On any mode: '+compile' compiles the model (torch.compile, default mode) before the optimizer
    # is built or wrapped, '+compileafter' after wrap(); '+noclip' or '+clipX' (e.g. +clip1e9)
    # replace --clip for that mode. '+streamN' streams the weights of the last N blocks
    # (Tuning(streamed_blocks=N)). '+8bit' uses torchao's AdamW8bit: on gpu-adamw torchao's own
    # GPU update, on trainstream wrapped as the optimizer to run; '+sr' with it makes it
    # AdamW8bit(bf16_stochastic_round=True) (bf16 weights without an fp32 master).
    threads = next((int(e[1:]) for e in extras if re.fullmatch(r"t\d+", e)), 0)
    nice = next((int(e[4:]) for e in extras if re.fullmatch(r"nice\d+", e)), None)
    streams = [int(e[6:]) for e in extras if re.fullmatch(r"stream\d+", e)]
    clips = [e for e in extras if e == "noclip" or re.fullmatch(r"clip[0-9.e+-]+", e)]
    clip = args.clip if not clips else None if clips[0] == "noclip" else float(clips[0][4:])
    compiling = [e for e in extras if e in ("compile", "compileafter")]
    knobs = {e for e in extras if e in ("fp32grads", "everygate", "pageonly", "master", "offload", "waitclip", "light", "8bit", "sr",
                                        "gpuadd", "hostalloc", "pin", f"t{threads}", f"nice{nice}", *clips, *compiling, *(f"stream{n}" for n in streams))}
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
    if "8bit" in knobs and base not in ("gpu-adamw", "trainstream") or "sr" in knobs and "8bit" not in knobs:
        raise ValueError(f"mode {mode}: +8bit is for gpu-adamw (torchao's AdamW8bit on the GPU) and trainstream, "
                         f"+sr goes with +8bit")
    eight_bit = dict(lr=1e-4, weight_decay=0.01, bf16_stochastic_round="sr" in knobs)
    if base == "gpu-adamw" and "8bit" in knobs:
        from torchao.optim import AdamW8bit

        opt = AdamW8bit(model.parameters(), **eight_bit)
    elif base == "gpu-adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    elif base == "trainstream":
        if "8bit" in knobs:  # torchao's AdamW8bit, run by TrainStream's engines
            from torchao.optim import AdamW8bit

            opt = AdamW8bit(model.parameters(), **eight_bit)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        t0 = time.perf_counter()
        tuning = dict(recompute="pageonly" not in knobs, threads=threads, pack_gradients="fp32grads" not in knobs,
                      upload_update_terms="master" not in knobs, speculative_clipping="waitclip" not in knobs,
                      streamed_blocks=streams[0] if streams else None, light_recompute="light" in knobs,
                      register_pinned="hostalloc" not in knobs,
                      add_on_host=True if variant == "hostacc" else False if "gpuadd" in knobs else None)
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
        engine_at_start = opt.engine.pipeline.stats() if base == "trainstream" else None
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
        **process_memory(),
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
        # the host engine's rate over the timed steps, beside the profiled one the plan used (wall
        # time while some thread ran an update, over the elements it updated)
        stats = opt.engine.pipeline.stats()
        updated = stats["updated_elements"] - engine_at_start["updated_elements"]
        if updated:
            result["host_ns_per_param_timed"] = 1e9 * (stats["busy_seconds"] - engine_at_start["busy_seconds"]) / updated
        # a step's wall time some thread added micro-batches into host sums, and the time its
        # gradients waited to start downloading (the backward's hooks wait so)
        for key in ("adding_seconds", "landing_wait_seconds"):
            result[f"host_{key.removesuffix('_seconds')}_s_per_step"] = (stats[key] - engine_at_start[key]) / args.steps
        added = stats["added_elements"] - engine_at_start["added_elements"]
        if added:
            result["host_ns_per_element_added"] = 1e9 * (stats["adding_seconds"] - engine_at_start["adding_seconds"]) / added
        result["report"] = opt.report()
        print(opt.describe(), flush=True)
        opt.remove_hooks()
    if base.startswith("deepspeed"):
        model.destroy()  # hooks, pinned buffers and the CPU AdamW state go with the engine
    return result


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
                     or os.path.dirname(os.path.abspath(f.filename)) == HERE or "transformers" in f.filename][-4:]
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
        if "host_adding_s_per_step" in r:
            print(f"{'':<24}host a step: {r['host_adding_s_per_step']:.3f} s adding micro-batches, gradients "
                  f"waited {r['host_landing_wait_s_per_step']:.3f} s to download; updates at "
                  f"{r.get('host_ns_per_param_timed', float('nan')):.3f} ns a parameter")
    summary = medians(results)
    if any(m["runs"] > 1 for m in summary):
        print(f"\n{'mode':<24}{'runs':>5}{'median s':>10}{'fastest':>9}{'slowest':>9}{'vs 1st':>8}")
        for m in summary:
            print(f"{m['mode']:<24}{m['runs']:>5}{m['median_s']:>10.3f}{m['min_s']:>9.3f}{m['max_s']:>9.3f}"
                  f"{m['median_s'] / summary[0]['median_s']:>7.2f}x")
    record = {"about": about(argv), "args": vars(args), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "trainstream": trainstream.__version__, "results": results}
    if args.json:
        write_json(args.json, record)
    if args.plot:
        plot_runs(results, args.plot)  # the drawing report.py redraws the docs' figures with
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
