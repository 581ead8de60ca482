"""wrap() on a CUDA GPU: parity, where the bytes live, and a soak. Skipped without CUDA.

Parity here is open-loop: a hook registered before wrap() hands every gradient our model
produces to a reference torch.optim.AdamW on the same GPU, so both optimizers see the same
gradient sequence and any difference is the update itself (under bf16 autocast, a closed loop
would amplify last-bit differences through bf16 rounding of the weights).
"""

from __future__ import annotations

import copy

import pytest
import torch

import trainstream
from trainstream.baselines import stage_update_terms
from trainstream.fixtures import TinyLM, param_groups, warmup_cosine

pytestmark = pytest.mark.gpu

STEPS = 20


def tokens_for(step: int, batch: int = 8, seq: int = 17) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(100 + step)
    return torch.randint(0, 97, (batch, seq), device="cuda", generator=g)


def setup(dtype, clip, acc, in_vram=False):
    torch.manual_seed(0)
    model = TinyLM(dim=64).cuda().to(dtype)
    for p in model.blocks[0].parameters():
        p.requires_grad_(False)
    ref = copy.deepcopy(model).float()
    ref_params = dict(ref.named_parameters())
    names = {p: n for n, p in model.named_parameters()}

    def hand_over(q):
        r = ref_params[names[q]]
        g = q.grad.float()
        # summed in VRAM, q.grad is already the window's running sum
        r.grad = g.clone() if r.grad is None or in_vram else r.grad + g

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(hand_over)
    opt = torch.optim.AdamW(param_groups(model), lr=3e-3, betas=(0.9, 0.95))
    ref_opt = torch.optim.AdamW(param_groups(ref), lr=3e-3, betas=(0.9, 0.95), foreach=False)
    model, opt = trainstream.wrap(model, opt, max_grad_norm=clip, accumulation_steps=acc,
                                  tuning=trainstream.Tuning(accumulate_in_vram=in_vram, placement="offload"))
    return model, opt, ref, ref_opt


@pytest.mark.parametrize("dtype,clip,acc,in_vram", [
    (torch.float32, None, 1, False), (torch.bfloat16, None, 1, False),
    (torch.float32, 1.0, 4, False), (torch.bfloat16, 1.0, 4, False), (torch.float32, 1.0, 4, True),
], ids=["plain-fp32-weights", "plain-bf16-weights", "clip+acc4-fp32-weights", "clip+acc4-bf16-weights",
        "clip+acc4-in-vram-fp32-weights"])
def test_parity_on_gpu(dtype, clip, acc, in_vram):
    model, opt, ref, ref_opt = setup(dtype, clip, acc, in_vram)
    sched, ref_sched = warmup_cosine(opt, 5, STEPS), warmup_cosine(ref_opt, 5, STEPS)
    for step in range(STEPS):
        for micro in range(acc):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model.loss(tokens_for(step * acc + micro)) / acc
            loss.backward()
        if clip is not None:
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        ref_opt.step()
        if clip is not None:
            assert opt.last_grad_norm == pytest.approx(float(ref_norm), rel=1e-4)
        sched.step()
        ref_sched.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    opt.synchronize()
    if dtype == torch.float32 and acc == 1:  # the Linear weights' gradients crossed as bf16
        assert opt.report()["gradients_sent_as_bf16"] > 0.5
    tol = 3e-7 if clip is None else 1e-6
    for (n, p), r in zip(model.named_parameters(), ref.parameters()):
        if not p.requires_grad:
            continue
        master = opt.state[p]["master_param"] if dtype == torch.bfloat16 else p.detach().float().cpu()
        assert (master - r.detach().cpu()).abs().max().item() <= tol, n
        if dtype == torch.bfloat16:
            assert torch.equal(p.detach().cpu(), master.to(torch.bfloat16)), n


def test_host_memory_pinned_by_registering_trains_the_same_bits():
    # Tuning(register_pinned=True): slabs faulted in on every CPU, then cudaHostRegister'ed,
    # mapped for the kernel that adds micro-batches into the host sums (accumulation 4)
    def train(register: bool):
        torch.manual_seed(0)
        model = TinyLM(dim=64).cuda()
        opt = torch.optim.AdamW(param_groups(model), lr=3e-3)
        model, opt = trainstream.wrap(model, opt, max_grad_norm=1.0, accumulation_steps=4,
                                      tuning=trainstream.Tuning(placement="offload", register_pinned=register))
        for step in range(4):
            for micro in range(4):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    (model.loss(tokens_for(step * 4 + micro)) / 4).backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        p = next(model.parameters())
        assert opt.state[p]["exp_avg"].is_pinned()
        weights = [q.detach().cpu().clone() for q in model.parameters()]
        opt.remove_hooks()
        return weights

    for a, b in zip(train(False), train(True)):
        assert torch.equal(a, b)


def test_forward_gates_come_off_only_once_uploads_have_finished():
    """With no update queued and every upload's event complete, the forward gates come off
    (CudaTransfer::upload_complete); while an upload is still queued on the device they stay on,
    and each queued update puts them back. Training stays exact throughout."""
    acc = 2
    model, opt, ref, ref_opt = setup(torch.float32, None, acc, in_vram=True)
    upload_stream = opt.engine.streams[1]

    def micro_batch(i: int) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model.loss(tokens_for(i)) / acc
        loss.backward()

    micro_batch(0)  # nothing was ever uploaded: settled from the start
    assert not opt.gates.on
    for step in range(3):
        if step == 1:  # hold this window's uploads behind half a second of GPU sleep
            with torch.cuda.stream(upload_stream):
                torch.cuda._sleep(1 << 30)
        micro_batch(2 * step + 1)
        assert opt.gates.on  # the last backward queued the updates
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        opt.engine.pipeline.synchronize()  # host work done, uploads issued
        settled = opt.engine.pipeline.settled(opt.gates.hosts)
        micro_batch(2 * step + 2)
        if step == 1:
            assert not settled and opt.gates.on
        torch.cuda.synchronize()
        assert opt.engine.pipeline.settled(opt.gates.hosts)
    opt.step()
    ref_opt.step()
    opt.synchronize()
    for (n, p), r in zip(model.named_parameters(), ref.parameters()):
        if p.requires_grad:
            assert (p.detach().float().cpu() - r.detach().cpu()).abs().max().item() <= 3e-7, n


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_no_gradient_or_optimizer_state_in_vram():
    # One plain step first, so the cuBLAS workspace and friends are already in `base`.
    warm = TinyLM(vocab=512, dim=256, layers=1, seq=64).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        warm.loss(torch.randint(0, 512, (4, 65), device="cuda")).backward()
    del warm
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    model = TinyLM(vocab=512, dim=256, layers=4, seq=64).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = trainstream.wrap(model, opt, tuning=trainstream.Tuning(placement="offload"))
    weights = torch.cuda.memory_allocated() - base  # and the staging buffer for update terms
    staging = opt.report()["vram_staging_bytes"]
    assert staging == 4 * max(p.numel() for p in model.parameters())  # the largest one's term
    assert weights == pytest.approx(weight_bytes(model) + staging, rel=0.01)
    tokens = torch.randint(0, 512, (4, 65), device="cuda")
    for _ in range(3):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model.loss(tokens).backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    torch.cuda.synchronize()
    # Gradients handed to the download stream are freed once the caching allocator sees their
    # copies completed, which it checks on its next allocation.
    del tokens
    torch.empty(1, device="cuda")
    assert all(p.grad is None for p in model.parameters())
    assert torch.cuda.memory_allocated() - base <= weights + (1 << 20)  # nothing else
    for state in opt.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].device.type == "cpu" and state[key].is_pinned()
    assert opt.report()["host_memory_kind"] == "pinned"


@pytest.mark.parametrize("staging", ["whole", "pieces"])
def test_update_terms_give_the_weights_an_uploaded_master_gives_on_gpu(staging):
    """fp32 weights: the update term added on the GPU (copied through the staging buffer, in
    pieces when a parameter is larger than it) gives the weights an uploaded host master gives,
    bit for bit, under bf16 autocast with clipping."""
    runs = []
    for terms in (True, False):
        model, opt, _, _ = setup(torch.float32, 1.0, 1)
        opt.upload_update_terms = terms
        if terms and staging == "pieces":
            stage_update_terms(opt, 1000)  # fewer floats than the embedding's 6208
        for step in range(5):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model.loss(tokens_for(step))
            loss.backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        torch.cuda.synchronize()
        runs.append((model, opt))
    (model, opt), (ref, ref_opt) = runs
    assert opt.upload_update_terms and not ref_opt.upload_update_terms
    assert ref_opt.report()["vram_staging_bytes"] == 0
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
        if p.requires_grad:
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(opt.state[p][key], ref_opt.state[q][key])


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def test_soak_200_steps_flat_memory():
    torch.manual_seed(0)
    model = TinyLM(vocab=512, dim=256, layers=4, seq=64).cuda()
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-4), max_grad_norm=1.0,
                                  tuning=trainstream.Tuning(placement="offload"))
    tokens = torch.randint(0, 512, (4, 65), device="cuda")
    vram, rss, peaks = [], [], []
    for step in range(200):
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model.loss(tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 20 == 19:
            opt.synchronize()
            torch.cuda.synchronize()
            vram.append(torch.cuda.memory_allocated())
            peaks.append(torch.cuda.max_memory_allocated())
            rss.append(rss_bytes())
    assert len(set(vram)) == 1, vram
    assert max(peaks) - min(peaks) <= (1 << 20), peaks
    assert rss[-1] - rss[1] <= 32 << 20, rss  # host memory flat after warm-up
    assert torch.isfinite(loss).item()


def test_fp16_autocast_is_refused():
    model = TinyLM().cuda()
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(trainstream.UnsupportedSetupError, match="bfloat16"):
        with torch.autocast("cuda", dtype=torch.float16):
            model.loss(tokens_for(0))


def test_grad_scaler_is_refused():
    model = TinyLM().cuda()
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()))
    scaler = torch.amp.GradScaler("cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model.loss(tokens_for(0))
    scaler.scale(loss).backward()
    with pytest.raises(trainstream.UnsupportedSetupError, match="GradScaler"):
        scaler.step(opt)
