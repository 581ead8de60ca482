"""Set-ups wrap() refuses with a message rather than train wrongly: torch.distributed engines it
does not compose with yet (and DDP set-ups it cannot serve), and a model that is already wrapped."""

from __future__ import annotations

import socket

import pytest
import torch.multiprocessing as mp
import torch
import torch.distributed as dist

import trainstream
from trainstream.fixtures import TinyLM


@pytest.fixture
def process_group():
    """A one-process gloo group, as a launcher would set up on each rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_ddp_setups_it_cannot_serve_are_refused(process_group):
    model = torch.nn.parallel.DistributedDataParallel(TinyLM())
    with pytest.raises(trainstream.UnsupportedSetupError, match="DistributedDataParallel"):
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()),
                         tuning=trainstream.Tuning(accumulate_in_vram=False))
    model.register_comm_hook(None, lambda _, bucket: torch.futures.Future())  # someone else's hook
    with pytest.raises(trainstream.UnsupportedSetupError, match="communication hook"):
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()))


@pytest.mark.parametrize("setup", ["blocks only", "CPUOffloadPolicy", "placement gpu", "paging"])
def test_fsdp2_setups_it_cannot_serve_are_refused(process_group, setup):
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    model = TinyLM()
    policy = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if setup == "CPUOffloadPolicy" else {}
    for block in model.blocks:
        fully_shard(block, **policy)
    if setup != "blocks only":
        fully_shard(model, **policy)
    tuning = trainstream.Tuning(placement="gpu") if setup == "placement gpu" else None
    paging = {"activations": 0.5} if setup == "paging" else {}
    with pytest.raises(trainstream.UnsupportedSetupError,
                       match="FSDP2 model: .*(fully_shard|CPUOffloadPolicy|placement|paging)"):
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()), tuning=tuning, **paging)


def test_dtensor_parameters_are_refused(process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    model = torch.nn.Linear(8, 8)
    model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), mesh))
    with pytest.raises(trainstream.UnsupportedSetupError, match="DTensor"):
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = TinyLM()
        try:
            trainstream.wrap(model, torch.optim.AdamW(model.parameters()))
            results[rank] = "wrapped"
        except trainstream.UnsupportedSetupError as exc:
            results[rank] = str(exc)
    finally:
        dist.destroy_process_group()


def test_a_group_of_several_processes_is_refused():
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(_free_port(), results), nprocs=2)
        assert all("one of 2" in results[r] for r in range(2)), dict(results)


def test_wrapping_twice_is_refused_until_the_first_wrap_is_undone():
    model = TinyLM()
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(trainstream.UnsupportedSetupError, match="already wrapped.*remove_hooks"):
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(trainstream.UnsupportedSetupError, match="remove_hooks"):
        trainstream.wrap(model, opt)  # the optimizer wrap() returned
    outer = torch.nn.Sequential(model)
    with pytest.raises(trainstream.UnsupportedSetupError, match="already wrapped"):
        trainstream.wrap(outer, torch.optim.AdamW(outer.parameters()))
    opt.remove_hooks()
    model, again = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    tokens = torch.randint(0, 97, (4, 17))
    before = [p.detach().clone() for p in model.parameters()]
    model.loss(tokens).backward()
    again.step()
    again.synchronize()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))  # the new wrap trains
    assert all(p.grad is None for p in model.parameters())  # one set of hooks, each gradient taken once
