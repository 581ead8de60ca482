"""torchao's AdamW8bit on a CUDA GPU: the device kernel gives the host engine's bits (stochastic
rounding's included), so a parameter trains the same kept in VRAM or offloaded. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import trainstream
from trainstream import Tuning, _C
from trainstream.fixtures import TinyLM

pytestmark = pytest.mark.gpu

optim = pytest.importorskip("torchao.optim")
subclass_8bit = pytest.importorskip("torchao.optim.subclass_8bit")


def _state(numel, device):
    zeros = subclass_8bit.OptimState8bit.zeros
    return zeros((numel,), True, 256, device), zeros((numel,), False, 256, device)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_the_device_kernel_gives_the_host_engines_bits(grad_dtype):
    torch.manual_seed(0)
    sizes = [256, 4096, 3 * 65536 + 768]
    engine = _C.HostAdamW(threads=4)
    host = [(torch.randn(n), *_state(n, "cpu")) for n in sizes]
    dev = [(p.cuda(), *_state(n, "cuda")) for (p, _, _), n in zip(host, sizes)]
    signed, unsigned = dev[0][1].qmap, dev[0][2].qmap
    scale = torch.tensor(0.37, device="cuda")
    for step in range(1, 5):
        grads = [(torch.randn(n) * 10.0 ** (step - 2)).to(grad_dtype) for n in sizes]
        hyper = dict(lr=2e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=step)
        for (p, m, v), g in zip(host, grads):
            engine.step_8bit(p.data_ptr(), g.data_ptr(), "bfloat16" if g.dtype == torch.bfloat16 else "float32",
                             m.codes.data_ptr(), m.scale.data_ptr(), v.codes.data_ptr(), v.scale.data_ptr(),
                             m.qmap.data_ptr(), v.qmap.data_ptr(), p.numel(), grad_scale=0.37, **hyper)
        dgrads = [g.cuda() for g in grads]
        _C.device_adamw8bit_step(
            0, torch.cuda.current_stream().cuda_stream, [p.data_ptr() for p, _, _ in dev],
            [g.data_ptr() for g in dgrads], ["bfloat16" if g.dtype == torch.bfloat16 else "float32" for g in dgrads],
            [m.codes.data_ptr() for _, m, _ in dev], [m.scale.data_ptr() for _, m, _ in dev],
            [v.codes.data_ptr() for _, _, v in dev], [v.scale.data_ptr() for _, _, v in dev], [0] * len(dev),
            sizes, signed.data_ptr(), unsigned.data_ptr(), device_scale=scale.data_ptr(), **hyper)
        torch.cuda.synchronize()
        for (p, m, v), (dp, dm, dv) in zip(host, dev):
            assert torch.equal(p, dp.cpu()), f"weights at step {step}"
            for a, b in ((m, dm), (v, dv)):
                assert torch.equal(a.codes, b.codes.cpu()) and torch.equal(a.scale, b.scale.cpu())


def test_the_device_kernel_rounds_bf16_weights_stochastically_with_the_host_engines_bits():
    torch.manual_seed(0)
    sizes = [256, 4096, 3 * 65536 + 768]
    seeds = [3, 2**62 + 5, 11]
    engine = _C.HostAdamW(threads=4)
    host = [(torch.randn(n).bfloat16(), *_state(n, "cpu")) for n in sizes]
    dev = [(p.cuda(), *_state(n, "cuda")) for (p, _, _), n in zip(host, sizes)]
    signed, unsigned = dev[0][1].qmap, dev[0][2].qmap
    start = [p.clone() for p, _, _ in host]
    for step in range(1, 5):
        grads = [(torch.randn(n) * 10.0 ** (step - 2)).bfloat16() for n in sizes]
        hyper = dict(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=step)
        for (p, m, v), g, seed in zip(host, grads, seeds):
            engine.step_8bit(p.data_ptr(), g.data_ptr(), "bfloat16", m.codes.data_ptr(), m.scale.data_ptr(),
                             v.codes.data_ptr(), v.scale.data_ptr(), m.qmap.data_ptr(), v.qmap.data_ptr(),
                             p.numel(), stochastic_seed=seed, **hyper)
        dgrads = [g.cuda() for g in grads]
        _C.device_adamw8bit_step(
            0, torch.cuda.current_stream().cuda_stream, [p.data_ptr() for p, _, _ in dev],
            [g.data_ptr() for g in dgrads], ["bfloat16"] * len(dev),
            [m.codes.data_ptr() for _, m, _ in dev], [m.scale.data_ptr() for _, m, _ in dev],
            [v.codes.data_ptr() for _, _, v in dev], [v.scale.data_ptr() for _, _, v in dev], [0] * len(dev),
            sizes, signed.data_ptr(), unsigned.data_ptr(), seeds=seeds, **hyper)
        torch.cuda.synchronize()
        for (p, m, v), (dp, dm, dv) in zip(host, dev):
            assert torch.equal(p, dp.cpu()), f"weights at step {step}"
            for a, b in ((m, dm), (v, dv)):
                assert torch.equal(a.codes, b.codes.cpu()) and torch.equal(a.scale, b.scale.cpu())
    assert all((p != s).any() for (p, _, _), s in zip(host, start))  # (updates below half a bf16 step moved some)


def test_stochastically_rounded_bf16_weights_train_the_same_in_vram_or_offloaded():
    g = torch.Generator(device="cuda").manual_seed(1)
    data = [torch.randint(0, 97, (8, 17), device="cuda", generator=g) for _ in range(6)]
    runs = []
    for placement in ("gpu", "offload", 0.5):
        torch.manual_seed(0)
        model = TinyLM(dim=64).cuda().bfloat16()
        opt = optim.AdamW8bit(model.parameters(), lr=3e-3, weight_decay=0.1, bf16_stochastic_round=True)
        model, opt = trainstream.wrap(model, opt, max_grad_norm=0.5, tuning=Tuning(placement=placement))
        for tokens in data:
            model.loss(tokens).float().backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        runs.append((model, opt))
    (base, base_opt), others = runs[0], runs[1:]
    assert base_opt.report()["stochastic_params"] > 0
    for model, opt in others:
        assert opt.report()["stochastic_params"] == base_opt.report()["stochastic_params"]
        for a, b in zip(base.parameters(), model.parameters()):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_parameter_trains_the_same_in_vram_or_offloaded(dtype):
    g = torch.Generator(device="cuda").manual_seed(1)
    data = [torch.randint(0, 97, (8, 17), device="cuda", generator=g) for _ in range(8)]
    runs = []
    for placement in ("gpu", "offload", 0.5):
        torch.manual_seed(0)
        model = TinyLM(dim=64).cuda().to(dtype)
        opt = optim.AdamW8bit(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
        model, opt = trainstream.wrap(model, opt, max_grad_norm=0.5, accumulation_steps=2,
                                      tuning=Tuning(placement=placement))
        for i in range(0, len(data), 2):
            for tokens in data[i:i + 2]:
                (model.loss(tokens) / 2).backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        runs.append((model, opt))
    (base, base_opt), others = runs[0], runs[1:]
    assert base_opt.report()["quantized_params"] > 0
    for model, opt in others:
        for a, b in zip(base.parameters(), model.parameters()):
            assert torch.equal(a, b)
            sa, sb = base_opt.state[a], opt.state[b]
            if hasattr(sa["exp_avg"], "codes"):
                assert torch.equal(sa["exp_avg"].codes.cpu(), sb["exp_avg"].codes.cpu())
                assert torch.equal(sa["exp_avg_sq"].scale.cpu(), sb["exp_avg_sq"].scale.cpu())


def test_torchaos_own_gpu_update_and_ours_stay_together():
    """torchao compiles its update (its roundings are the compiler's): the same training with
    both stays within rounding, not an algorithm apart."""
    g = torch.Generator(device="cuda").manual_seed(2)
    data = [torch.randint(0, 97, (8, 17), device="cuda", generator=g) for _ in range(10)]
    losses = []
    for wrapped in (False, True):
        torch.manual_seed(0)
        model = TinyLM(dim=64).cuda()
        opt = optim.AdamW8bit(model.parameters(), lr=3e-3, weight_decay=0.1)
        if wrapped:
            model, opt = trainstream.wrap(model, opt, tuning=Tuning(placement="offload"))
        for tokens in data:
            model.loss(tokens).backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            losses.append(model.loss(data[0]).item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-3)
