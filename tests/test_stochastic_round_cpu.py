"""torchao's AdamW8bit(bf16_stochastic_round=True) under wrap(), in CPU mode: bf16 weights without
an fp32 master, each update rounded stochastically.

torchao draws its rounding bits from torch.randint; the engine draws them from a counter-based
generator (adamw8bit.hpp: rounding_key, rounding_bits), written out again here in Python. With
torchao's randint made to return those bits, torchao's own eager step is the reference, to the bit:
so everything but the source of randomness is torchao's arithmetic."""

from __future__ import annotations

import io

import pytest
import torch

import trainstream
from trainstream import Tuning, eight_bit
from trainstream.fixtures import TinyLM

optim = pytest.importorskip("torchao.optim")
adam = pytest.importorskip("torchao.optim.adam")
OptimState8bit = pytest.importorskip("torchao.optim.subclass_8bit").OptimState8bit

HYPER = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
M32, M64 = 2**32 - 1, 2**64 - 1


def rounding_key(seed: int, step: int) -> tuple[int, int]:
    z = (seed + 0x9E3779B97F4A7C15 * (step + 1)) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    z ^= z >> 31
    return z & M32, z >> 32


def mix32(x: torch.Tensor) -> torch.Tensor:  # int64 lanes holding uint32 values
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & M32
    return x ^ (x >> 16)


def rounding_bits(seed: int, step: int, numel: int) -> torch.Tensor:
    k0, k1 = rounding_key(seed, step)
    index = torch.arange(numel, dtype=torch.int64)
    return (mix32(mix32((index * 0x9E3779B1 + k0) & M32) ^ k1) >> 16).to(torch.int32)


def quantized(p: torch.Tensor) -> bool:
    return p.numel() >= 4096 and p.numel() % 256 == 0


def make(seed: int = 0):
    """A bf16 TinyLM whose quantized parameters train (the small ones' rounding is torch AdamW's,
    with an fp32 master, where torchao keeps bf16 moments: see trainstream.eight_bit)."""
    torch.manual_seed(seed)
    model = TinyLM(dim=64, seq=16).to(torch.bfloat16)
    for p in model.parameters():
        p.requires_grad_(quantized(p))
    params = [p for p in model.parameters() if p.requires_grad]
    return model, optim.AdamW8bit(params, bf16_stochastic_round=True, **HYPER)


@pytest.fixture
def torchao_with_our_bits(monkeypatch):
    """torchao's optimizer steps eagerly, with a correctly rounded square root, and its stochastic
    rounding reads the engine's bits: parameter k of `order` at its step (set by the caller). A clip
    coefficient in calls["scale"] multiplies the fp32 upcast of each gradient, as the engine
    scales it (clip_grad_norm_ would round a bf16 gradient's product to bf16 first)."""
    monkeypatch.setattr(adam.torch, "compile", lambda fn, **_: fn)
    monkeypatch.setattr(torch.Tensor, "sqrt", lambda self: torch.sqrt(self.double()).to(self.dtype))
    calls = {"seeds": [], "step": 0, "next": 0, "scale": None}
    update = adam.single_param_adam

    def scaled(p, grad, *args):
        return update(p, grad if calls["scale"] is None else grad.float() * calls["scale"], *args)

    monkeypatch.setattr(adam, "single_param_adam", scaled)
    randint = torch.randint

    def ours(low, high, size, **kwargs):
        if (low, high) != (0, 1 << 16):
            return randint(low, high, size, **kwargs)
        seed = calls["seeds"][calls["next"] % len(calls["seeds"])]
        calls["next"] += 1
        step = calls["step"] + (calls["next"] - 1) // len(calls["seeds"])
        return rounding_bits(seed, step, torch.Size(size).numel()).view(size)

    monkeypatch.setattr(torch, "randint", ours)
    return calls


def batches(steps: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (4, 17), generator=g) for _ in range(steps)]


def train(model, opt, data, *, clip=None, wrapped=False, calls=None):
    for tokens in data:
        model.loss(tokens).float().backward()
        if clip is not None and not wrapped:  # the coefficient as the engine computes it (see the fixture)
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            norm = sum(g.double().square().sum() for g in grads).sqrt().item()
            calls["scale"] = torch.tensor(min(1.0, clip / (norm + 1e-6)), dtype=torch.float32)
        opt.step()
        opt.zero_grad()
    if wrapped:
        opt.synchronize()


def seeds_of(opt) -> list[int]:
    return [s.rounding_seed for s in opt.slots.order]


@pytest.mark.parametrize("placement, clip", [("offload", None), ("offload", 0.5), ("offload", 100.0),
                                             ("gpu", None), (0.5, 100.0)])
def test_training_is_torchaos_to_the_bit_given_the_same_random_bits(torchao_with_our_bits, placement, clip):
    """Offloaded (host engine, speculated and redone or committed under clipping), resident (the
    device kernel's path) and split: the weights and 8-bit state torchao's step gives."""
    data = batches(5)
    model, opt = make()
    model, opt = trainstream.wrap(model, opt, tuning=Tuning(placement=placement, threads=2), max_grad_norm=clip)
    assert all(s.stochastic for s in opt.slots.order) and "master_param" not in opt.state[opt.slots.order[0].param]
    if placement == "offload" and clip is not None:
        assert opt.clipping.speculating > 0
    train(model, opt, data, clip=clip, wrapped=True)
    torchao_with_our_bits["seeds"] = seeds_of(opt)
    torchao_with_our_bits["step"] = 1
    ref_model, ref_opt = make()
    train(ref_model, ref_opt, data, clip=clip, calls=torchao_with_our_bits)
    if clip == 0.5 and placement == "offload":
        assert opt.speculation["misses"] > 0
    for (name, ours), theirs in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(ours, theirs), name
        if ours.requires_grad:
            for key in ("exp_avg", "exp_avg_sq"):
                state, ref = opt.state[ours][key], ref_opt.state[theirs][key]
                assert torch.equal(state.codes, ref.codes) and torch.equal(state.scale, ref.scale), (name, key)


def test_the_rounding_is_stochastic_and_follows_torchs_seed():
    """Updates far below bf16's step still move the weights on average (round to nearest would
    leave every one where it is); the same torch seed at wrap() gives the same bits, another seed
    other bits."""
    def run(seed):
        model, opt = make()
        torch.manual_seed(seed)
        for group in opt.param_groups:
            group["lr"] = 1e-5  # far under half a bf16 step of these weights
            group["weight_decay"] = 0.0
        model, opt = trainstream.wrap(model, opt, tuning=Tuning(placement="offload", threads=2))
        start = [p.detach().clone() for p in model.parameters()]
        train(model, opt, batches(3), wrapped=True)
        return model, start

    a, start = run(7)
    b, _ = run(7)
    c, _ = run(8)
    moved = sum((p != s).sum().item() for p, s in zip(a.parameters(), start))
    assert moved > 100  # each update moves some weights by a whole bf16 step
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert any(not torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters()))


def test_host_state_is_six_bytes_a_parameter_and_counted_before_pinning():
    model, opt = make()
    big = [p for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in big)
    needed = sum(trainstream._C.OffloadPipeline.state_bytes(p.numel(), "bfloat16", False, "8bit-sr") for p in big)
    assert needed / numel <= 6.05  # weights 2, codes 2, scales 1/32, gradient 2
    with pytest.raises(trainstream.HostMemoryError, match="rounded stochastically.*Nothing was pinned"):
        trainstream.wrap(model, opt, tuning=Tuning(placement="offload"), host_budget=needed - 1)
    model, opt = trainstream.wrap(model, opt, tuning=Tuning(placement="offload", threads=2), max_grad_norm=1.0)
    train(model, opt, batches(2), wrapped=True)
    per_param = sum(opt.slots[p].host.state_bytes for p in big) / numel
    assert per_param <= 6.05, per_param
    with_master = sum(trainstream._C.OffloadPipeline.state_bytes(p.numel(), "bfloat16", False, "8bit") for p in big)
    assert with_master - per_param * numel == 2 * numel  # the fp32 master's 4 B against the weights' 2
    spec = opt.speculation
    assert spec["params"] == len(big) and spec["host_bytes"] <= 4.1 * numel  # codes and next weights
    report, text = opt.report(), opt.describe()
    assert report["stochastic_params"] == len(big)
    assert f"{len(big)} of them bf16 weights without an fp32 master, rounded stochastically" in text


def test_state_dict_loads_into_torchao_and_into_another_placement(torchao_with_our_bits):
    data = batches(4)
    model, opt = make()
    model, opt = trainstream.wrap(model, opt, tuning=Tuning(placement="offload", threads=2))
    train(model, opt, data[:2], wrapped=True)
    saved = opt.state_dict()
    entry = next(iter(saved["state"].values()))
    assert isinstance(entry["exp_avg"], OptimState8bit) and "master_param" not in entry
    buffer = io.BytesIO()
    torch.save(saved, buffer)

    def loaded():
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)

    torchao_with_our_bits["seeds"] = seeds_of(opt)
    torchao_with_our_bits["step"] = 3
    ref_model, ref_opt = make()
    ref_model.load_state_dict(model.state_dict())
    ref_opt.load_state_dict(loaded())
    train(ref_model, ref_opt, data[2:])
    other_model, other_opt = make()
    other_model, other_opt = trainstream.wrap(other_model, other_opt, tuning=Tuning(placement="gpu", threads=2))
    other_model.load_state_dict(model.state_dict())
    other_opt.load_state_dict(loaded())
    train(other_model, other_opt, data[2:], wrapped=True)
    train(model, opt, data[2:], wrapped=True)
    for a, b, c in zip(model.parameters(), other_model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_auto_placement_moves_the_weights_state_between_host_and_device():
    """The planner promotes offloaded parameters mid-run: their bf16 weights (their own state)
    and codes move with them, and training keeps the bits of an all-offloaded run."""
    data = batches(6)
    model, opt = make()
    # (a budget under which wrap() starts with few resident and the plan keeps them all)
    model, opt = trainstream.wrap(model, opt, tuning=Tuning(placement="auto", threads=2), vram_budget="1MB")
    at_start = sum(s.resident for s in opt.slots.order)
    train(model, opt, data, wrapped=True)
    assert at_start < opt.report()["placement"]["resident_params"]
    ref, ref_opt = make()
    ref, ref_opt = trainstream.wrap(ref, ref_opt, tuning=Tuning(placement="offload", threads=2))
    train(ref, ref_opt, data, wrapped=True)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_fp32_weights_ignore_the_flag_as_torchao_does():
    torch.manual_seed(0)
    model = TinyLM(dim=64, seq=16)
    opt = optim.AdamW8bit(model.parameters(), bf16_stochastic_round=True, **HYPER)
    model, opt = trainstream.wrap(model, opt, tuning=Tuning(placement="offload", threads=2))
    assert not any(s.stochastic for s in opt.slots.order)
    assert eight_bit.state_format(opt, next(model.parameters())) in ("8bit", "fp32")


def test_streamed_blocks_stream_from_their_state_with_the_same_bits():
    """Streamed blocks' bf16 weights wait in host memory between uses: stochastically rounded ones
    wait in their own state (no second copy) and train the bits of an unstreamed run."""
    data = batches(4)
    runs = []
    for streamed in (0, 1):
        model, opt = make()
        model, opt = trainstream.wrap(model, opt, max_grad_norm=1.0,
                                      tuning=Tuning(placement="offload", threads=2, streamed_blocks=streamed))
        train(model, opt, data, wrapped=True)
        runs.append((model, opt))
    (base, base_opt), (model, opt) = runs
    assert opt.report()["placement"]["streamed_blocks"] == 1
    assert opt.engine.pipeline.host_used_bytes == base_opt.engine.pipeline.host_used_bytes  # (no bf16 copies)
    assert "streamed bf16 weights" not in opt.describe()
    for a, b in zip(base.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_accumulated_micro_batches_give_the_same_bits_in_every_placement():
    """With accumulation the window's fp32 sum is what each update reads, on the host or beside the
    weights: every placement ends with the same weights and codes."""
    g = torch.Generator().manual_seed(3)
    data = [[torch.randint(0, 97, (4, 17), generator=g) for _ in range(2)] for _ in range(4)]
    runs = []
    for placement in ("offload", "gpu", 0.5):
        model, opt = make()
        model, opt = trainstream.wrap(model, opt, accumulation_steps=2, max_grad_norm=1.0,
                                      tuning=Tuning(placement=placement, threads=2))
        for micro_batches in data:
            for tokens in micro_batches:
                (model.loss(tokens).float() / 2).backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        runs.append((model, opt))
    (base, base_opt) = runs[0]
    for model, opt in runs[1:]:
        for a, b in zip(base.parameters(), model.parameters()):
            assert torch.equal(a, b)
            if a.requires_grad:
                assert torch.equal(base_opt.state[a]["exp_avg"].codes, opt.state[b]["exp_avg"].codes)
