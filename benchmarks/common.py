"""What the benchmark scripts share: the model and its flags, how a run is described and written,
the medians of repeated runs, and the figures the scripts and report.py draw.

Scripts run from this folder import it as `common` (a script's folder is first on its path). It
imports no script and runs no training, so report.py uses it too; matplotlib and DeepSpeed, which
only some runs need, are imported where a function needs them.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import json
import os
import shlex
import socket
import statistics
import sys

import torch

import trainstream
from trainstream.fixtures import llama

HERE = os.path.dirname(os.path.abspath(__file__))

# The peers in budget sweeps, as report.py's columns and plot_sweep's legend name them.
PEER_NAMES = {"gpu-adamw": "PyTorch, fused AdamW", "gpu-adamw+ckpt": "PyTorch + gradient checkpointing",
              "torchao": "torchao CPUOffloadOptimizer", "deepspeed": "DeepSpeed ZeRO-2 offload"}
MARKERS = {"gpu-adamw": "s", "gpu-adamw+ckpt": "D", "torchao": "^", "deepspeed": "v"}  # one per peer in PEER_NAMES


# ------------------------------------------------------------------------------ the model
def add_model_arguments(ap: argparse.ArgumentParser) -> None:
    """The model and batch flags (default: the 0.95B Llama at batch 4x1024), --acc and --weights."""
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=None, help="grouped-query attention's key/value heads")
    ap.add_argument("--arch", choices=["llama", "qwen2"], default="llama",
                    help="transformers' LlamaForCausalLM, or Qwen2ForCausalLM (biased q/k/v projections)")
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


def build_model(args, device) -> torch.nn.Module:
    """The model of the flags, built on `device` in the weights' dtype (no fp32 copy of a bf16
    model on the way). In host memory its random values come from `pooled_init`."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if args.weights == "bf16" else torch.float32)
    try:
        with torch.device(device), pooled_init() if device == "cpu" else contextlib.nullcontext():
            return llama(vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads, seq=args.seq,
                         intermediate=args.intermediate, kv_heads=args.kv_heads, arch=args.arch)
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


# ------------------------------------------------------------------------------ DeepSpeed peers
def deepspeed_config(args, stage: int) -> dict:
    """DeepSpeed ZeRO-2 with the optimizer offloaded to the host, or ZeRO-3 with the parameters
    offloaded as well, configured like the other modes (one process on one GPU)."""
    importlib.import_module("deepspeed")  # before the process group: a missing package skips the mode

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


# ------------------------------------------------------------------------------ records
def process_memory() -> dict:
    """This process's host memory now and at its peak (VmRSS, VmHWM), in GB: what a run took
    beside torch's own is the difference from a stock run's in a process of its own."""
    figures = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                figures[{"VmRSS": "host_rss_GB", "VmHWM": "host_peak_rss_GB"}[name]] = int(value.split()[0]) * 1024 / 1e9
    return figures


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


def write_json(path: str, record: dict, indent: int = 1) -> None:
    """A run's record as --json asked for it."""
    with open(path, "w") as f:
        json.dump(record, f, indent=indent)


def medians(results: list[dict]) -> list[dict]:
    """Each mode's timed runs in one file, in the order the modes first ran: how many, and the
    median, fastest and slowest step."""
    steps: dict[str, list[float]] = {}
    for r in results:
        if r.get("step_s") is not None:
            steps.setdefault(r["mode"], []).append(r["step_s"])
    return [{"mode": mode, "runs": len(s), "median_s": statistics.median(s), "min_s": min(s), "max_s": max(s)}
            for mode, s in steps.items()]


# ------------------------------------------------------------------------------ figures
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_runs(runs: list[dict], path: str) -> None:
    """Step time and peak VRAM of train_step.py's modes as two bar charts, first mode on top."""
    plt = _pyplot()
    done = [r for r in runs if r.get("step_s") is not None][::-1]
    names = [r["mode"] for r in done]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 0.45 * len(done) + 1.2), sharey=True)
    a.barh(names, [r["step_s"] for r in done], color="#4472c4")
    a.set_xlabel("seconds per step")
    b.barh(names, [r["peak_vram_GB"] for r in done], color="#ed7d31")
    b.set_xlabel("peak VRAM (GB)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_curves(runs: list[dict], path: str) -> None:
    """convergence.py's training-loss curves, a 50-step mean each, labelled with the held-out loss."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in runs:
        loss = torch.tensor(r["loss"])
        smooth = torch.nn.functional.avg_pool1d(loss[None, None], 50, 1).flatten()
        ax.plot(range(50, 50 + smooth.numel()), smooth, label=f"{r['mode']} ({r['final_held_out_loss']:.3f} held out)")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats a byte, 50-step mean)")
    ax.set_title(f"{runs[0]['params'] / 1e6:.0f}M Llama on the Python standard library, clip 1.0")
    ax.set_ylim(top=min(3.0, ax.get_ylim()[1]))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_sweep(rows: list[dict], accs: list[int], path: str) -> None:
    """budget_sweep.py's step time against the cap, one panel per accumulation: TrainStream as
    lines, each peer as points, and a peer that does not fit under a cap as an x of its colour
    above the highest point."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(accs), figsize=(6 * len(accs), 4.6), squeeze=False)
    for ax, acc in zip(axes[0], accs):
        mine = [r for r in rows if r["acc"] == acc]
        finite = sorted({r["cap_GB"] for r in mine if r["cap_GB"] is not None})
        uncapped_x = (finite[-1] if finite else 24) * 1.25
        x = lambda r: uncapped_x if r["cap_GB"] is None else r["cap_GB"]
        top = max([r["step_s"] for r in mine if "step_s" in r] or [1.0])
        for mode, color in zip(dict.fromkeys(r["mode"] for r in mine if r["mode"].startswith("trainstream")),
                               ("#4472c4", "#70ad47", "#ed7d31")):
            ours = sorted((r for r in mine if r["mode"] == mode and "step_s" in r), key=x)
            label = "TrainStream" + mode.removeprefix("trainstream")
            ax.plot([x(r) for r in ours], [r["step_s"] for r in ours], "o-", color=color, label=label, lw=2)
        for k, (mode, name) in enumerate(PEER_NAMES.items()):
            color, marker = f"C{k + 1}", MARKERS[mode]
            ran = [r for r in mine if r["mode"] == mode and "step_s" in r]
            if ran:
                ax.scatter([x(r) for r in ran], [r["step_s"] for r in ran], marker=marker, s=60, color=color,
                           label=name, zorder=3)
            misses = [x(r) for r in mine if r["mode"] == mode and "step_s" not in r and r["cap_GB"] is not None
                      and not (r.get("error") or "").startswith("not run")]
            if misses:
                ax.scatter(misses, [top * (1.05 + 0.03 * k)] * len(misses), marker="x", color=color, s=40, zorder=3)
        ax.set_xticks(finite + [uncapped_x], [f"{c:g}" for c in finite] + ["none"])
        ax.set_xlabel("VRAM cap (GB); x: out of memory")
        ax.set_ylabel("seconds per step")
        ax.set_title(f"accumulation {acc}")
        ax.set_ylim(0, top * 1.2)
        ax.grid(alpha=0.3)
    legend = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    fig.legend(legend.values(), legend.keys(), loc="lower center", ncol=len(legend), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
