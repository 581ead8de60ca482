"""Micro-batch gradients added on the GPU into pinned host memory (device_accumulate=True) against
the host path (False): the same accumulators, norms and updates, bit for bit. Skipped without CUDA.

Drives trainstream._C.cuda_pipeline directly, the way optimizer.py does: add_param and
load_weights, then per micro-batch land_gradient from the stream that produced the gradient and
record_stream on the download stream, and at the end synchronize and gate.

    python -m pytest tests/test_device_accumulate_gpu.py -v
"""

from __future__ import annotations

import pytest
import torch

from trainstream._native import _C

pytestmark = pytest.mark.gpu

MICRO = 4    # micro-batches per accumulation window
WINDOWS = 2  # the second window overwrites the accumulator that the first one's update read
SIZES = [1, 17, 4099, (1 << 22) + 3]
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


@pytest.fixture(scope="module")
def pipelines():
    """One pipeline per path, each with its own download and upload streams, kept alive here."""
    device = torch.cuda.current_device()
    made = {}
    for on in (True, False):
        streams = (torch.cuda.Stream(), torch.cuda.Stream())
        pipe = _C.cuda_pipeline(device, streams[0].cuda_stream, streams[1].cuda_stream, threads=4,
                                device_accumulate=on)
        assert pipe.device_accumulate is on and pipe.on_device
        made[on] = (pipe, streams)
    yield made
    for pipe, _ in made.values():
        pipe.synchronize()
    torch.cuda.synchronize()


def gradients(dtype: torch.dtype, n: int) -> torch.Tensor:
    """WINDOWS x MICRO gradients spread over many binades, so that any other order of the fp32
    sums, a fused multiply-add or a flushed denormal would change some bits."""
    g = torch.Generator(device="cuda").manual_seed(n)
    base = torch.randn(WINDOWS, MICRO, n, device="cuda", generator=g)
    exponent = torch.randint(-20, 21, (WINDOWS, MICRO, n), device="cuda", generator=g)
    exponent[..., ::7] -= 125  # every 7th element tiny, many of them denormal
    return (base * torch.exp2(exponent.float())).to(dtype)


def host_tensor(host, name: str) -> torch.Tensor:
    return torch.frombuffer(host.view(name), dtype=torch.float32).clone()


def run(pipe, download_stream, dtype, grads, misaligned: bool) -> dict:
    """Lands WINDOWS windows of MICRO gradients; the last micro-batch of each also takes the norm
    and runs AdamW, uploading the weights. Returns everything the pipeline produced."""
    n = grads.shape[-1]
    torch.manual_seed(1)
    weight = torch.randn(n, device="cuda").to(dtype)
    stream = torch.cuda.current_stream()
    host = pipe.add_param(n, DTYPES[dtype], True)
    pipe.load_weights(host, weight.data_ptr(), stream.cuda_stream)
    for window in range(WINDOWS):
        for k in range(MICRO):
            last = k == MICRO - 1
            job = dict(accumulate=True, overwrite=k == 0, from_accumulator=True, norm=last)
            if last:
                job.update(update=True, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                           step=window + 1, grad_scale=1.0 / MICRO, device_weight=weight.data_ptr())
            # A fresh buffer each time (the caching allocator hands the same memory back as soon as
            # it may), filled on the current stream behind a GPU sleep: a transfer that did not
            # wait for its producer would read it before the copy.
            buf = torch.empty(n + 1, dtype=dtype, device="cuda")
            grad = buf[1 : n + 1] if misaligned else buf[:n]
            torch.cuda._sleep(200_000)
            grad.copy_(grads[window, k])
            pipe.land_gradient(host, grad.data_ptr(), stream.cuda_stream, **job)
            buf.record_stream(download_stream)
            del buf, grad
            if pipe.device_accumulate and 0 < k < MICRO - 1:
                # The device path leaves no host job behind a plain micro-batch, so the next hook
                # never waits for this one. (The previous window's update is done: k=0 waited.)
                assert pipe.pending == 0
    pipe.synchronize()
    pipe.gate([host], stream.cuda_stream)
    torch.cuda.synchronize()
    out = {name: host_tensor(host, name) for name in ("accumulator", "master", "exp_avg", "exp_avg_sq")}
    out["weight"] = weight.cpu()
    out["squared_norm"] = host.squared_norm
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@pytest.mark.parametrize("misaligned", [False, True], ids=["aligned", "offset-by-one"])
@pytest.mark.parametrize("n", SIZES, ids=[f"n{n}" for n in SIZES])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES.values()))
def test_device_accumulate_is_bit_identical_to_the_host_path(pipelines, dtype, n, misaligned):
    grads = gradients(dtype, n)
    got = {on: run(pipe, streams[0], dtype, grads, misaligned) for on, (pipe, streams) in pipelines.items()}
    on, off = got[True], got[False]
    for name in ("accumulator", "master", "exp_avg", "exp_avg_sq", "weight"):
        same = torch.equal(bits(on[name]), bits(off[name]))
        differ = (bits(on[name]) != bits(off[name])).sum().item()
        assert same, f"{name}: {differ} of {n} elements differ between device and host accumulation"
    assert on["squared_norm"] == off["squared_norm"]
    # Both are the plain sequential fp32 sum of the last window (torch's CPU add rounds the same).
    expect = grads[-1, 0].float().cpu()
    for k in range(1, MICRO):
        expect = expect + grads[-1, k].float().cpu()
    assert torch.equal(bits(on["accumulator"]), bits(expect))
    assert on["squared_norm"] == pytest.approx(float(expect.double().pow(2).sum()), rel=1e-9)
