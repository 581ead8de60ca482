"""Step time, peak VRAM and host memory per rank on several GPUs: TrainStream under DDP and FSDP2
against DDP with fused AdamW, FSDP2 with CPUOffloadPolicy and DeepSpeed ZeRO-2 with the optimizer
offloaded.

    python benchmarks/distributed_step.py --gpus 2 --json dist.json \
        --modes ddp-adamw,ddp-trainstream,fsdp2-offload,fsdp2-trainstream,deepspeed

Every mode runs in fresh processes, one per GPU over NCCL, each rank on its own --batch of the
same model (train_step.py's model flags; the 0.95B Llama by default), clipping at --clip. The step
time is rank 0's wall time over --steps steps after --warmup, once every rank (and TrainStream's
host threads) has finished; VRAM and host memory (resident set, pinned memory included) are each
rank's. FSDP2 shards every decoder layer and the model. With --device cpu the same runs on CPU
processes over gloo (no CPUOffloadPolicy, no DeepSpeed): a check that the script works, not a
measurement.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import trainstream
from trainstream.activations import find_blocks
from trainstream.fixtures import causal_lm_loss

from common import about, add_model_arguments, build_model, deepspeed_config, deepspeed_engine, write_json

MODES = ("ddp-adamw", "ddp-trainstream", "fsdp2-offload", "fsdp2-trainstream", "deepspeed")


def host_bytes() -> int:
    """This process's resident set (pinned host memory included, once touched)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def build(mode: str, args, device: torch.device):
    """(model, optimizer, clips itself) for one mode on this rank."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build_model(args, device)
    lr, decay = 1e-4, 0.01
    if mode.startswith("ddp"):
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    elif mode.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        policy = {"offload_policy": CPUOffloadPolicy()} if mode == "fsdp2-offload" else {}
        for layer in find_blocks(model)[1]:
            fully_shard(layer, mesh=mesh, **policy)
        fully_shard(model, mesh=mesh, **policy)
    if mode == "deepspeed":
        return (*deepspeed_engine(model, deepspeed_config(args, 2)), True)
    if mode == "ddp-adamw":
        return model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=decay, fused=device.type == "cuda"), False
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=decay)  # (FSDP2's offload: on the host)
    if mode.endswith("trainstream"):
        model, opt = trainstream.wrap(model, opt, max_grad_norm=args.clip)
        return model, opt, True
    return model, opt, False


def rank_main(rank: int, world: int, port: int, mode: str, args, out) -> None:
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
        if args.vram_cap_gb:
            total = torch.cuda.get_device_properties(rank).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.vram_cap_gb * 1e9 / total))
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, **({"device_id": torch.device("cuda", rank)} if cuda else {}))
    # Stock DDP and FSDP2 ranks too: a process group's thread that frees a Python object while the
    # interpreter finalizes aborts the process, whichever optimizer trained. So at exit this rank
    # lets go of the GIL for a moment first, as trainstream.distributed does for its own ranks.
    atexit.register(time.sleep, 0.05)
    try:
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        torch.manual_seed(0)
        model, opt, clips_itself = build(mode, args, device)
        g = torch.Generator(device=device).manual_seed(1 + rank)  # each rank its own batch
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=device, generator=g)

        def step():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.autocast):
                loss = causal_lm_loss(model, tokens)
            if mode == "deepspeed":
                model.backward(loss)
                model.step()
                return loss
            loss.backward()
            if not clips_itself:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        def settle():
            if hasattr(opt, "synchronize"):
                opt.synchronize()
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()

        for _ in range(args.warmup):
            step()
        settle()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        for _ in range(args.steps):
            loss = step()
        settle()
        seconds = (time.perf_counter() - start) / args.steps
        mine = {"peak_vram_GB": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
                "host_GB": host_bytes() / 1e9, "loss": loss.item()}
        if mode.endswith("trainstream"):
            report = opt.report()
            mine.update(trainstream_host_GB=report["host_bytes_used"] / 1e9,
                        owned_elements=report["distributed"]["owned_elements"])
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            params = sum(p.numel() for p in (model.module if hasattr(model, "module") else model).parameters())
            out.update(mode=mode, world=world, step_s=seconds, ranks=gathered,
                       params=params if not mode.startswith("fsdp2") else None,
                       tokens_per_s=world * args.batch * args.seq / seconds)
        if mode == "deepspeed":
            model.destroy()
    finally:
        dist.destroy_process_group()


def run(mode: str, args, world: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        try:
            mp.spawn(rank_main, args=(world, port, mode, args, out), nprocs=world)
        except Exception as exc:  # one mode's failure (out of memory, a missing package) is its row
            return {"mode": mode, "world": world, "error": str(exc).strip().splitlines()[-1][:300]}
        return dict(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(ap)
    ap.add_argument("--gpus", type=int, default=2, help="ranks, one per GPU (with --device cpu: processes)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--autocast", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--vram-cap-gb", type=float, default=None, help="each rank's VRAM cap")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < args.gpus:
        print(f"distributed_step.py needs {args.gpus} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    rows = []
    for mode in args.modes.split(","):
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")
        row = run(mode, args, args.gpus)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{args.gpus} x {torch.cuda.get_device_name() if args.device == 'cuda' else 'CPU'}  hidden={args.hidden} "
          f"layers={args.layers} batch={args.batch}x{args.seq} per rank, weights={args.weights}, clip={args.clip}")
    print(f"{'mode':<20}{'step s':>9}{'peak VRAM GB (max)':>20}{'host GB (max)':>15}")
    for r in rows:
        if "step_s" not in r:
            print(f"{r['mode']:<20}  {r.get('error')}")
            continue
        vram = max((x["peak_vram_GB"] or 0.0) for x in r["ranks"])
        print(f"{r['mode']:<20}{r['step_s']:>9.3f}{vram:>20.2f}{max(x['host_GB'] for x in r['ranks']):>15.2f}")
    if args.json:
        write_json(args.json, {"about": about(argv), "args": vars(args), "results": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
