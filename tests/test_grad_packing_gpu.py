"""fp32 gradients sent as bf16 when that loses nothing (cuda/kernels/pack_bf16.cu), against the
same pipeline sending fp32: the same norms, moments and weights, bit for bit, whether every
gradient is bf16-exact or one element of one is not, with the norm taken on the host or on the
device as the gradient leaves (in the packing's own pass, when packed). Skipped without CUDA.

Drives trainstream._C.cuda_pipeline directly, the way optimizer.py does (see
test_device_accumulate_gpu.py), at accumulation 1: one gradient, one update per step.

    python -m pytest tests/test_grad_packing_gpu.py -v
"""

from __future__ import annotations

import pytest
import torch

from trainstream._native import _C

pytestmark = pytest.mark.gpu

STEPS = 3
SIZES = [1, 17, 4099, (1 << 22) + 3]


@pytest.fixture(scope="module")
def pipelines():
    device = torch.cuda.current_device()
    made = {}
    for pack in (True, False):
        streams = (torch.cuda.Stream(), torch.cuda.Stream())
        pipe = _C.cuda_pipeline(device, streams[0].cuda_stream, streams[1].cuda_stream, threads=4)
        pipe.pack_gradients = pack
        made[pack] = (pipe, streams)
    yield made
    for pipe, _ in made.values():
        pipe.synchronize()
    torch.cuda.synchronize()


def bf16_valued(n: int) -> torch.Tensor:
    """STEPS gradients of bf16 values in fp32, over many binades, every 7th element denormal."""
    g = torch.Generator(device="cuda").manual_seed(n)
    base = torch.randn(STEPS, n, device="cuda", generator=g)
    exponent = torch.randint(-20, 21, (STEPS, n), device="cuda", generator=g)
    exponent[..., ::7] -= 125
    return (base * torch.exp2(exponent.float())).bfloat16().float()


def high_halves(g: torch.Tensor) -> torch.Tensor:
    return (g.view(torch.int32) >> 16).to(torch.int16).cpu()


def run(pipe, download_stream, grads: torch.Tensor, misaligned: bool, measured: bool) -> dict:
    n = grads.shape[-1]
    # a device norm's output and scratch, kept across the steps as the optimizer keeps them
    norm = torch.zeros(1, dtype=torch.float64, device="cuda")
    scratch = torch.zeros(_C.device_norm_scratch([n]), dtype=torch.float64, device="cuda")
    measure = dict(device_norm=norm.data_ptr(), device_norm_scratch=scratch.data_ptr()) if measured else dict(norm=True)
    torch.manual_seed(1)
    weight = torch.randn(n, device="cuda")
    stream = torch.cuda.current_stream()
    host = pipe.add_param(n, "float32", False)
    pipe.load_weights(host, weight.data_ptr(), stream.cuda_stream)
    out = {"landed": [], "as_bf16": [], "device_norms": []}
    for step in range(STEPS):
        # a fresh buffer filled behind a GPU sleep: a transfer that did not wait for its producer
        # would read it before the copy
        buf = torch.empty(n + 1, device="cuda")
        grad = buf[1 : n + 1] if misaligned else buf[:n]
        torch.cuda._sleep(200_000)
        grad.copy_(grads[step])
        pipe.land_gradient(host, grad.data_ptr(), stream.cuda_stream, **measure, update=True, lr=1e-2,
                           beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=step + 1,
                           device_weight=weight.data_ptr())
        buf.record_stream(download_stream)
        del buf, grad
        pipe.synchronize()
        out["landed"].append(torch.frombuffer(host.view("grad"), dtype=torch.int16)[:n].clone())
        out["as_bf16"].append(host.last_gradient_as_bf16)
        if measured:
            pipe.order_after_norms(stream.cuda_stream)
            out["device_norms"].append(norm.item())
    pipe.gate([host], stream.cuda_stream)
    torch.cuda.synchronize()
    for name in ("master", "exp_avg", "exp_avg_sq"):
        out[name] = torch.frombuffer(host.view(name), dtype=torch.float32).clone()
    out["weight"] = weight.cpu()
    out["squared_norm"] = host.squared_norm if not measured else None
    return out


def squared_norms(grads: torch.Tensor) -> list[float]:
    """Each gradient's squared norm by the device norm kernels (device_adamw.cu) on its own."""
    n = grads.shape[-1]
    out = torch.zeros(1, dtype=torch.float64, device="cuda")
    scratch = torch.zeros(_C.device_norm_scratch([n]), dtype=torch.float64, device="cuda")
    norms = []
    for g in grads:
        _C.device_squared_norms(torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream,
                                [g.data_ptr()], ["float32"], [n], scratch.data_ptr(), out.data_ptr())
        norms.append(out.item())
    return norms


@pytest.mark.parametrize("measured", [False, True], ids=["host-norm", "device-norm"])
@pytest.mark.parametrize("inexact_at", [None, "first", "middle", "last"])
@pytest.mark.parametrize("misaligned", [False, True], ids=["aligned", "offset-by-one"])
@pytest.mark.parametrize("n", SIZES, ids=[f"n{n}" for n in SIZES])
def test_bf16_exact_gradients_update_bit_identically(pipelines, n, misaligned, inexact_at, measured):
    grads = bf16_valued(n)
    if inexact_at is not None:  # one low bit in one element of the second gradient
        k = {"first": 0, "middle": n // 2, "last": n - 1}[inexact_at]
        grads.view(torch.int32)[1, k] |= 1
    got = {pack: run(pipe, streams[0], grads, misaligned, measured) for pack, (pipe, streams) in pipelines.items()}
    packed, plain = got[True], got[False]
    for name in ("master", "exp_avg", "exp_avg_sq", "weight"):
        differ = (packed[name].view(torch.int32) != plain[name].view(torch.int32)).sum().item()
        assert differ == 0, f"{name}: {differ} of {n} elements differ with bf16 transfer"
    assert packed["squared_norm"] == plain["squared_norm"]
    if measured:  # the packing's pass measures with the norm kernels' bits, step after step
        assert packed["device_norms"] == plain["device_norms"] == squared_norms(grads)
    assert plain["as_bf16"] == [False] * STEPS
    if inexact_at is None:
        assert packed["as_bf16"] == [True] * STEPS
        for step in range(STEPS):  # what crossed: exactly the high halves
            assert torch.equal(packed["landed"][step], high_halves(grads[step]))
    else:  # the inexact one crossed whole, and from then on every gradient of the parameter
        assert packed["as_bf16"] == [True, False, False]
        assert torch.equal(packed["landed"][0], high_halves(grads[0]))
