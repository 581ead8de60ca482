"""wrap() over torchao's AdamW8bit, in CPU mode: torchao's update wherever a parameter lives, its
state dict format, its host bytes, and the refusals of what the engine does not run.

The reference is torchao's own optimizer stepping eagerly (its update is torch.compile'd; eager
is the arithmetic the engine follows) with a correctly rounded square root, as in
test_host_adamw8bit.py. Parameters torchao quantizes match it to the bit; the small ones (fp32
moments) follow torch.optim.AdamW's rounding, within a few ulp of torchao's fp32 arithmetic."""

from __future__ import annotations

import io

import pytest
import torch

import trainstream
from trainstream import Tuning
from trainstream.fixtures import TinyLM

optim = pytest.importorskip("torchao.optim")
adam = pytest.importorskip("torchao.optim.adam")
OptimState8bit = pytest.importorskip("torchao.optim.subclass_8bit").OptimState8bit

HYPER = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)


def batches(steps: int, acc: int = 1, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, 97, (4, 17), generator=g) for _ in range(acc)] for _ in range(steps)]


@pytest.fixture
def eager_torchao(monkeypatch):
    """torchao's optimizer steps eagerly, with a correctly rounded square root."""
    monkeypatch.setattr(adam.torch, "compile", lambda fn, **_: fn)
    monkeypatch.setattr(torch.Tensor, "sqrt", lambda self: torch.sqrt(self.double()).to(self.dtype))


def train(model, opt, data, *, clip=None, wrapped=False):
    acc = len(data[0])
    for micro_batches in data:
        for tokens in micro_batches:
            (model.loss(tokens) / acc).backward()
        if clip is not None and not wrapped:  # clip_grad_norm_, with the norm taken in double as the engine does
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            norm = sum(g.double().square().sum() for g in grads).sqrt().item()
            coefficient = torch.tensor(min(1.0, clip / (norm + 1e-6)), dtype=torch.float32)
            for g in grads:
                g.mul_(coefficient)
        opt.step()
        opt.zero_grad()
    if wrapped:
        opt.synchronize()


def wrapped(placement="offload", dtype=torch.float32, only_quantized=False, **kwargs):
    model, opt = make(dtype, only_quantized=only_quantized)
    return trainstream.wrap(model, opt, tuning=Tuning(placement=placement, threads=2), **kwargs)


def quantized(p: torch.nn.Parameter) -> bool:
    return p.numel() >= 4096 and p.numel() % 256 == 0


def make(dtype=torch.float32, seed=0, only_quantized=False):
    torch.manual_seed(seed)
    model = TinyLM(dim=64, seq=16).to(dtype)
    if only_quantized:  # the small parameters' rounding differs from torchao's (see the module docstring)
        for p in model.parameters():
            p.requires_grad_(quantized(p))
    return model, optim.AdamW8bit([p for p in model.parameters() if p.requires_grad], **HYPER)


@pytest.mark.parametrize("clip", [None, 0.5, 100.0])  # (0.5 clips: speculation redone; 100 never: committed)
def test_offloaded_8bit_training_is_torchaos_to_the_bit(eager_torchao, clip):
    ref_model, ref_opt = make(only_quantized=True)
    data = batches(6)
    train(ref_model, ref_opt, data, clip=clip)
    model, opt = make(only_quantized=True)
    model, opt = trainstream.wrap(model, opt, tuning=Tuning(placement="offload", threads=2), max_grad_norm=clip)
    train(model, opt, data, clip=clip, wrapped=True)
    if clip is not None:
        spec = opt.speculation
        assert opt.clipping.speculating > 0 and spec["hits" if clip > 1 else "misses"] > 0, spec
    for (name, ours), theirs in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(ours, theirs), name
        if ours.requires_grad:
            state, ref = opt.state[ours], ref_opt.state[theirs]
            for key in ("exp_avg", "exp_avg_sq"):
                assert isinstance(state[key], OptimState8bit)
                assert torch.equal(state[key].codes, ref[key].codes), (name, key)
                assert torch.equal(state[key].scale, ref[key].scale), (name, key)


def test_small_parameters_keep_fp32_moments_within_rounding_of_torchao(eager_torchao):
    """One step from the same weights: the quantized parameters to the bit, the small ones within
    a thousandth of a step (torch AdamW's rounding against torchao's); over more steps the two
    runs stay as close as any two roundings of one training do."""
    data = batches(6)
    ref_model, ref_opt = make()
    model, opt = wrapped("offload")
    train(ref_model, ref_opt, data[:1])
    train(model, opt, data[:1], wrapped=True)
    small = [p for p in model.parameters() if not quantized(p)]
    assert small and len(small) < len(list(model.parameters()))
    assert all(not isinstance(opt.state[p]["exp_avg"], OptimState8bit) for p in small)
    for (name, ours), theirs in zip(model.named_parameters(), ref_model.parameters()):
        if quantized(ours):
            assert torch.equal(ours, theirs), name
        else:
            assert (ours - theirs).abs().max().item() <= 1e-3 * HYPER["lr"], name
    train(ref_model, ref_opt, data[1:])
    train(model, opt, data[1:], wrapped=True)
    tokens = batches(1, seed=9)[0][0]
    with torch.no_grad():
        assert model.loss(tokens).item() == pytest.approx(ref_model.loss(tokens).item(), rel=1e-4)


def test_every_placement_gives_the_same_bits(eager_torchao):
    data = batches(5, acc=2)
    runs = []
    for placement in ("offload", "gpu", 0.5):
        model, opt = wrapped(placement, accumulation_steps=2, max_grad_norm=1.0)
        train(model, opt, data, clip=1.0, wrapped=True)
        runs.append((model, opt))
    (base, base_opt) = runs[0]
    for model, opt in runs[1:]:
        for a, b in zip(base.parameters(), model.parameters()):
            assert torch.equal(a, b)
            for key in ("exp_avg", "exp_avg_sq"):
                sa, sb = base_opt.state[a][key], opt.state[b][key]
                assert torch.equal(sa.codes, sb.codes) if quantized(a) else torch.equal(sa, sb)


def test_bf16_weights_keep_an_fp32_master_and_take_under_8_5_bytes_a_parameter():
    model, opt = wrapped("offload", dtype=torch.bfloat16)
    train(model, opt, batches(2), wrapped=True)
    big = [p for p in model.parameters() if quantized(p)]
    assert all(opt.state[p]["master_param"].dtype == torch.float32 for p in big)
    assert all(torch.equal(opt.state[p]["master_param"].bfloat16(), p.detach()) for p in big)
    numel = sum(p.numel() for p in big)
    per_param = sum(opt.slots[p].host.state_bytes for p in big) / numel
    assert per_param <= 8.5, per_param  # master 4, codes 2, scales 1/32, landing buffer 2
    exact = trainstream._C.OffloadPipeline.state_bytes(numel, "bfloat16", False) / numel
    assert exact - per_param >= 5.9


def test_state_dict_is_torchaos_and_loads_both_ways(eager_torchao):
    data = batches(4)
    model, opt = wrapped("offload", only_quantized=True)
    train(model, opt, data[:2], wrapped=True)
    saved = opt.state_dict()
    first = next(i for i, p in enumerate(model.parameters()) if quantized(p))
    entry = saved["state"][first]
    assert isinstance(entry["exp_avg"], OptimState8bit) and entry["exp_avg"].codes.dtype == torch.uint8
    buffer = io.BytesIO()
    torch.save(saved, buffer)

    def loaded():  # a fresh copy each time: torch's load_state_dict keeps the dict's tensors
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)

    # into torchao's own optimizer, over a copy of the weights: it then trains as we do
    ref_model, ref_opt = make(only_quantized=True)
    ref_model.load_state_dict(model.state_dict())
    ref_opt.load_state_dict(loaded())
    train(ref_model, ref_opt, data[2:])
    # ... and into another placement of ours
    other_model, other_opt = wrapped("gpu", only_quantized=True)
    other_model.load_state_dict(model.state_dict())
    other_opt.load_state_dict(loaded())
    train(other_model, other_opt, data[2:], wrapped=True)
    train(model, opt, data[2:], wrapped=True)
    for a, b, c in zip(model.parameters(), other_model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b) and torch.equal(a, c)

    exact_model = TinyLM(dim=64, seq=16)
    for p, ours in zip(exact_model.parameters(), model.parameters()):
        p.requires_grad_(ours.requires_grad)
    exact = torch.optim.AdamW([p for p in exact_model.parameters() if p.requires_grad], **HYPER)
    train(exact_model, exact, data[:1])
    with pytest.raises(ValueError, match="fp32 but this optimizer keeps 8-bit"):
        opt.load_state_dict(exact.state_dict())


@pytest.mark.parametrize("build, match", [
    (lambda ps: optim.AdamW8bit(ps, block_size=128), "block_size=128"),
    (lambda ps: optim.AdamW8bit(ps, amsgrad=True), "amsgrad"),
    (lambda ps: optim.AdamW4bit(ps), "AdamW4bit.*implements no other low-bit"),
    (lambda ps: optim.AdamWFp8(ps), "AdamWFp8.*implements no other low-bit"),
    (lambda ps: optim.Adam8bit(ps), "Adam8bit.*implements no other low-bit"),
    (lambda ps: optim._AdamW(ps, bf16_stochastic_round=True), "_AdamW.*implements no other low-bit"),
])
def test_what_the_engine_does_not_run_is_refused_naming_what_it_does(build, match):
    model = TinyLM(dim=64, seq=16)
    with pytest.raises(trainstream.UnsupportedSetupError, match=match) as refused:
        trainstream.wrap(model, build(model.parameters()))
    assert "torchao.optim.AdamW8bit" in str(refused.value)


def test_8bit_state_is_counted_before_anything_is_pinned():
    model, opt = make()
    state_bytes = trainstream._C.OffloadPipeline.state_bytes
    needed = sum(state_bytes(p.numel(), "float32", False, "8bit" if quantized(p) else "fp32")
                 for p in model.parameters())
    numel = sum(p.numel() for p in model.parameters())
    assert needed < 11 * numel  # 10 B for each quantized parameter, 16 for the small ones
    with pytest.raises(trainstream.HostMemoryError, match=r"8-bit where torchao quantizes them.*Nothing was pinned"):
        trainstream.wrap(model, opt, tuning=Tuning(placement="offload"), host_budget=needed - 1)
    _, wrapped_opt = trainstream.wrap(model, opt, tuning=Tuning(placement="offload"), host_budget=needed + 4096)
    used = wrapped_opt.engine.pipeline.host_used_bytes
    assert needed <= used <= needed + 64 * 6 * len(list(model.parameters()))  # (buffers start 64 B aligned)


def test_describe_and_report_say_which_moments_are_8bit():
    model, opt = wrapped("offload", max_grad_norm=1.0)
    train(model, opt, batches(2), wrapped=True)
    count = sum(quantized(p) for p in model.parameters())
    report = opt.report()
    assert report["optimizer"] == "torchao.optim.AdamW8bit" and report["quantized_params"] == count
    text = opt.describe()
    assert f"torchao AdamW8bit: {count} parameters" in text and "8-bit or fp32 moments" in text
    assert "start their update before the global norm is known" in text


def test_auto_placement_moves_8bit_state_between_host_and_device_with_its_bits(eager_torchao):
    """CPU mode's planner under a budget: a plan that keeps some parameters resident copies their
    codes and scales off the host (and gives the host memory back), and the run keeps torchao's bits."""
    ref_model, ref_opt = make(only_quantized=True)
    data = batches(6)
    train(ref_model, ref_opt, data)
    model, opt = make(only_quantized=True)
    model, opt = trainstream.wrap(model, opt, tuning=Tuning(placement="auto", threads=2), vram_budget="2MB")
    at_start = sum(s.resident for s in opt.slots.order)
    held = opt.engine.pipeline.host_used_bytes
    train(model, opt, data, wrapped=True)
    assert at_start < opt.report()["placement"]["resident_params"]  # (the plan promoted some)
    assert opt.engine.pipeline.host_used_bytes < held
    for ours, theirs in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(ours, theirs)
