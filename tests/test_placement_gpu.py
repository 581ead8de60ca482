"""Placement on a CUDA GPU: the device AdamW and norm kernels against the host engine, bit for bit;
training across placements; budgets the planner meets in a memory-capped process. Skipped
without CUDA."""

from __future__ import annotations

import contextlib
import gc
import math
from unittest import mock

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import trainstream
from trainstream import _C, first_plan
from trainstream.fixtures import TinyLM, param_groups, warmup_cosine

pytestmark = pytest.mark.gpu

HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=3, grad_scale=0.37)


def sizes() -> list[int]:
    # edges of the kernels' chunks (8192) and norm blocks (4096, 32 lanes), a tensor's partials in
    # whole and partial sets of 32, and more tensors than one launch takes (32)
    fixed = [1, 5, 31, 32, 33, 4095, 4096, 4097, 8191, 8192, 8193, 100_003, (41 << 12) + 7, 1 << 20]
    g = torch.Generator().manual_seed(3)
    return fixed + torch.randint(1, 50_000, (30,), generator=g).tolist()


def tensors(n: int, seed: int, grad_dtype):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g)
    grad = (torch.randn(n, generator=g) * torch.logspace(-6, 2, n)[torch.randperm(n, generator=g)]).to(grad_dtype)
    if n > 8:
        grad[3] = 0.0
        grad[5] = 1e-42  # a denormal
    m = torch.randn(n, generator=g) * 1e-2
    v = torch.rand(n, generator=g) * 1e-4
    return p, grad, m, v


@pytest.mark.parametrize("grad_dtype,bf16_weights", [(torch.float32, False), (torch.bfloat16, False),
                                                     (torch.bfloat16, True)], ids=["fp32", "bf16-grad", "bf16-weights"])
@pytest.mark.parametrize("maximize", [False, True])
def test_device_adamw_gives_the_host_engines_bits(grad_dtype, bf16_weights, maximize, supported_isas):
    host_engine = _C.HostAdamW(4, supported_isas[-1])
    cases = [tensors(n, k, grad_dtype) for k, n in enumerate(sizes())]
    dev = [[t.cuda() for t in case] for case in cases]
    outs = [torch.empty(c[0].numel(), dtype=torch.bfloat16, device="cuda") if bf16_weights else None for c in cases]
    host_outs = [torch.empty(c[0].numel(), dtype=torch.bfloat16) if bf16_weights else None for c in cases]
    for (p, g, m, v), out in zip(cases, host_outs):
        host_engine.step(p.data_ptr(), g.data_ptr(), str(g.dtype).removeprefix("torch."), m.data_ptr(), v.data_ptr(),
                         p.numel(), maximize=maximize, param_bf16=out.data_ptr() if out is not None else 0, **HYPER)
    _C.device_adamw_step(
        0, torch.cuda.current_stream().cuda_stream, [d[0].data_ptr() for d in dev], [d[1].data_ptr() for d in dev],
        [str(d[1].dtype).removeprefix("torch.") for d in dev], [d[2].data_ptr() for d in dev],
        [d[3].data_ptr() for d in dev], [o.data_ptr() if o is not None else 0 for o in outs],
        [d[0].numel() for d in dev], maximize=maximize, **HYPER)
    torch.cuda.synchronize()
    for k, (case, d) in enumerate(zip(cases, dev)):
        for name, host, device in zip(("param", "grad", "exp_avg", "exp_avg_sq"), case, d):
            assert torch.equal(host, device.cpu()), (k, case[0].numel(), name)
        if bf16_weights:
            assert torch.equal(host_outs[k], outs[k].cpu()), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("offset", [0, 1, 3], ids=["aligned", "offset1", "offset3"])
def test_device_norms_give_the_host_engines_bits(dtype, offset):
    host_engine = _C.HostAdamW(3, None)
    grads = [tensors(n + offset, 100 + k, dtype)[1][offset:] for k, n in enumerate(sizes())]
    dev = [torch.empty(g.numel() + offset, dtype=dtype, device="cuda")[offset:].copy_(g) for g in grads]
    names = [str(dtype).removeprefix("torch.")] * len(dev)
    numels = [g.numel() for g in dev]
    scratch = torch.empty(_C.device_norm_scratch(numels), dtype=torch.float64, device="cuda")
    out = torch.empty(len(dev), dtype=torch.float64, device="cuda")
    _C.device_squared_norms(0, torch.cuda.current_stream().cuda_stream, [g.data_ptr() for g in dev], names,
                            numels, scratch.data_ptr(), out.data_ptr())
    device = out.tolist()
    host = [host_engine.squared_norm(g.data_ptr(), names[0], g.numel()) for g in grads]
    assert device == host
    assert device[-1] == pytest.approx(float(grads[-1].double().pow(2).sum()), rel=1e-12)


def test_device_clip_coefficient_gives_the_hosts_bits():
    g = torch.Generator().manual_seed(7)
    for case in range(40):
        n = int(torch.randint(1, 300, (1,), generator=g))
        squares = (torch.rand(n, dtype=torch.float64, generator=g) * 10.0 ** float(torch.randint(-8, 8, (1,), generator=g)))
        if case == 1:
            squares[0] = float("inf")
        if case == 2:
            squares[-1] = float("nan")
        max_norm = [1.0, 0.5, 1e3][case % 3]
        scale = torch.empty((), dtype=torch.float32, device="cuda")
        device = squares.cuda()
        _C.device_clip_scale(0, torch.cuda.current_stream().cuda_stream, device.data_ptr(), n, max_norm, 1e-6,
                             scale.data_ptr())
        total = 0.0
        for x in squares.tolist():
            total += x
        want = torch.tensor(min(1.0, max_norm / (math.sqrt(total) + 1e-6)), dtype=torch.float32)
        assert torch.equal(scale.cpu(), want), case


# ------------------------------------------------------------------------- training
def tokens_for(step: int, vocab: int = 97, batch: int = 8, seq: int = 17) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(100 + step)
    return torch.randint(0, vocab, (batch, seq), device="cuda", generator=g)


def train(model, opt, steps: int, acc: int, vocab: int = 97, batch: int = 8, seq: int = 17):
    sched = warmup_cosine(opt, 5, steps)
    losses, norms = [], []
    with sdpa_kernel(SDPBackend.MATH):  # a deterministic attention backward: the same bits every run
        for step in range(steps):
            for micro in range(acc):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model.loss(tokens_for(step * acc + micro, vocab, batch, seq)) / acc
                loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(loss.detach())
            norms.append(opt.last_grad_norm)
    opt.synchronize()
    torch.cuda.synchronize()
    return torch.stack(losses), norms


def make(dtype, **model_kwargs):
    torch.manual_seed(0)
    model = TinyLM(**model_kwargs).cuda().to(dtype)
    for p in model.blocks[0].parameters():
        p.requires_grad_(False)
    return model, torch.optim.AdamW(param_groups(model), lr=3e-3, betas=(0.9, 0.95))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-weights", "bf16-weights"])
@pytest.mark.parametrize("acc,clip", [(1, None), (4, 1.0)], ids=["plain", "clip+acc4"])
def test_every_placement_trains_the_same_bits_on_gpu(dtype, acc, clip):
    runs = {}
    for placement in ("gpu", 0.5, "offload"):
        model, opt = make(dtype, dim=64)
        model, opt = trainstream.wrap(model, opt, max_grad_norm=clip, accumulation_steps=acc,
                                      tuning=trainstream.Tuning(placement=placement, track_grad_norm=True))
        losses, norms = train(model, opt, 20, acc)
        runs[placement] = model, opt, losses, norms
    ref, ref_opt, ref_losses, ref_norms = runs["offload"]
    for placement in ("gpu", 0.5):
        model, opt, losses, norms = runs[placement]
        assert torch.equal(losses, ref_losses), placement
        assert norms == ref_norms, placement
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p, q), (placement, n)
            if p.requires_grad:
                for key in ("exp_avg", "exp_avg_sq", "master_param"):
                    if key in opt.state[p]:
                        assert torch.equal(opt.state[p][key].cpu(), ref_opt.state[q][key].cpu()), (placement, n, key)
    resident = runs["gpu"][1]
    assert all(s["exp_avg"].is_cuda for s in resident.state.values())
    assert resident.report()["vram_staging_bytes"] == 0
    if clip is not None:
        assert max(ref_norms[:3]) > clip


MID = dict(vocab=8192, dim=512, layers=8, seq=256)


def mid_run(steps: int, acc: int = 1, **wrap_kwargs):
    """A 25M-parameter model, batch 8x256: (optimizer, losses, peak VRAM of the last 3 steps)."""
    model, opt = make(torch.float32, **MID)
    model, opt = trainstream.wrap(model, opt, max_grad_norm=1.0, accumulation_steps=acc, **wrap_kwargs)
    losses, _ = train(model, opt, steps - 3, acc, vocab=MID["vocab"], batch=8, seq=MID["seq"])
    torch.cuda.reset_peak_memory_stats()
    more, _ = train(model, opt, 3, acc, vocab=MID["vocab"], batch=8, seq=MID["seq"])
    return model, opt, torch.cat([losses, more]), torch.cuda.max_memory_allocated()


def collected() -> None:
    """A wrapped model and its optimizer reference each other: free the last run's memory now."""
    gc.collect()
    torch.cuda.empty_cache()


def footprints(acc: int = 1) -> tuple[int, int]:
    """(peak of two profiled steps with every parameter offloaded, peak with everything resident)
    of the mid-size model."""
    collected()
    model, opt = make(torch.float32, **MID)
    with mock.patch.object(first_plan, "START_STATE_SHARE", 0.0):  # nothing resident at wrap()
        model, opt = trainstream.wrap(model, opt, max_grad_norm=1.0, accumulation_steps=acc)
    torch.cuda.reset_peak_memory_stats()
    train(model, opt, 2, acc, vocab=MID["vocab"], batch=8, seq=MID["seq"])
    profiled = torch.cuda.max_memory_allocated()
    train(model, opt, 2, acc, vocab=MID["vocab"], batch=8, seq=MID["seq"])
    torch.cuda.reset_peak_memory_stats()
    train(model, opt, 2, acc, vocab=MID["vocab"], batch=8, seq=MID["seq"])
    resident = torch.cuda.max_memory_allocated()
    assert opt.report()["placement"]["offloaded_params"] == 0  # uncapped: everything resident
    opt.remove_hooks()
    del model, opt
    collected()
    print(f"profiled steps peak {profiled / 1e9:.3f} GB, everything resident {resident / 1e9:.3f} GB")
    return profiled, resident


@contextlib.contextmanager
def vram_cap(nbytes: int):
    total = torch.cuda.get_device_properties(0).total_memory
    collected()  # the last model (footprints()'s, say) must not count against the cap
    torch.cuda.set_per_process_memory_fraction(nbytes / total)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def test_roomy_gpu_keeps_everything_resident_at_stock_peak():
    model, opt = make(torch.float32, **MID)
    stock = torch.optim.AdamW(param_groups(model), lr=3e-3, betas=(0.9, 0.95), fused=True)
    torch.cuda.reset_peak_memory_stats()
    with sdpa_kernel(SDPBackend.MATH):
        for step in range(4):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                model.loss(tokens_for(step, MID["vocab"], 8, MID["seq"])).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            stock.step()
            stock.zero_grad()
    stock_peak = torch.cuda.max_memory_allocated()
    del model, opt, stock
    collected()
    model, opt, losses, peak = mid_run(8)
    report = opt.report()
    placement = report["placement"]
    print(opt.describe())
    print(f"stock peak {stock_peak / 1e9:.3f} GB, TrainStream {peak / 1e9:.3f} GB")
    assert placement["state"] == "planned" and placement["offloaded_params"] == 0
    assert not placement["saved_tensor_hooks"] and report["activations"] == "off"
    assert report["vram_staging_bytes"] == 0
    assert peak <= 1.05 * stock_peak
    assert torch.isfinite(losses).all()
    # resident from wrap() on: no step took host memory for the state
    assert report["host_memory_kind"] == "pinned" and report["host_bytes_reserved"] == 0
    assert not any(s.host.holds_state for s in opt.slots.order)
    assert opt.profile.profiled_resident == len(opt.slots.order)


def test_a_large_vocabulary_under_a_tight_cap_never_runs_out_of_memory():
    """A 152k-token LM head whose logits and loss take more VRAM than the weights, in a process
    capped near the weights plus them: the first plan counts them before the first step (it
    offloads and streams what the batch needs room for), so neither the profiled steps nor the
    planned ones run out of memory, with the model's own loss."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=151936, hidden_size=1024, intermediate_size=8192,
                                      num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=8,
                                      max_position_embeddings=512, tie_word_embeddings=False, use_cache=False)
    cap = 8 * 10**9
    with vram_cap(cap):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).cuda()
        weights = sum(p.numel() * 4 for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, opt = trainstream.wrap(model, opt, max_grad_norm=1.0)
        torch.cuda.reset_peak_memory_stats()
        tokens = torch.randint(0, config.vocab_size, (4, 512), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        losses = []
        for _ in range(5):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        opt.synchronize()
        peak = torch.cuda.max_memory_allocated()
    first = opt.promotion.first_plan
    print(opt.describe())
    print(f"weights {weights / 1e9:.2f} GB, cap {cap / 1e9:.2f} GB, peak {peak / 1e9:.2f} GB; {first}")
    assert first is not None and first.fits and first.streamed > 0
    assert opt.plan is not None and peak <= opt.vram_budget <= cap
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    opt.remove_hooks()


@pytest.mark.parametrize("share", [0.8, 0.5, 0.3])
def test_a_capped_process_trains_within_its_budget_with_no_option(share):
    """set_per_process_memory_fraction caps the process between what the profiled steps need and
    what everything resident needs; wrap() with no budget plans within what the cap leaves, with
    no out-of-memory error in the profiled steps or after, and trains the bits an all-offloaded
    run trains."""
    profiled, full_peak = footprints()
    cap = int(profiled + share * (full_peak - profiled))
    with vram_cap(cap):
        model, opt, losses, peak = mid_run(8)
    placement = opt.report()["placement"]
    print(f"cap {cap / 1e9:.3f} GB (everything resident: {full_peak / 1e9:.3f} GB): peak {peak / 1e9:.3f} GB, "
          f"expected {placement['expected_peak_bytes'] / 1e9:.3f} GB")
    print(opt.describe())
    assert placement["state"] == "planned"
    assert peak <= opt.vram_budget <= cap
    # something was given up: state offloaded, or activations paged or recomputed (torch's
    # checkpointing alone, without saved-tensor hooks, where that is cheaper)
    assert (placement["offloaded_params"] > 0 or placement["saved_tensor_hooks"]
            or "recomputed" in placement["blocks"])
    opt.remove_hooks()
    collected()
    ref, ref_opt, ref_losses, _ = mid_run(8, tuning=trainstream.Tuning(placement="offload"))
    assert torch.equal(losses, ref_losses)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


def test_a_used_process_plans_as_a_fresh_one_and_names_what_others_hold():
    """Under a cap, after a wrapped run (remove_hooks(), then dropped) and stock training of
    another model in the same process (its segments left cached in torch's allocator, model and
    optimizer dropped), wrap() plans what it planned in the clean process: it releases that
    memory itself. A tensor left alive is counted against the budget, and named in describe()."""
    profiled, full_peak = footprints()
    cap = int(profiled + 0.5 * (full_peak - profiled))
    with vram_cap(cap):
        _, fresh, _, fresh_peak = mid_run(8)
        plan = fresh.plan
        fresh.remove_hooks()
        del fresh
        gc.collect()  # (what the stock run below needs room for)
        model, stock = make(torch.float32, **MID)
        stock = torch.optim.AdamW(param_groups(model), lr=3e-3, fused=True)
        for step in range(2):  # (a smaller batch: stock training of everything fits under the cap)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                model.loss(tokens_for(step, MID["vocab"], 2, MID["seq"])).backward()
            stock.step()
        del model, stock
        assert torch.cuda.memory_reserved() > torch.cuda.memory_allocated()  # cached, not given back
        _, used, _, used_peak = mid_run(8)
        print(f"fresh: {plan.resident} resident, peak {fresh_peak / 1e9:.3f} GB; used: {used.plan.resident} "
              f"resident, peak {used_peak / 1e9:.3f} GB (cap {cap / 1e9:.3f} GB)")
        assert used.report()["held_elsewhere_at_wrap"]["vram_bytes"] < 256 << 20
        assert abs(used.plan.resident - plan.resident) <= max(1, len(used.slots.order) // 10)
        assert used.plan.expected_peak == pytest.approx(plan.expected_peak, rel=0.05)
        assert used_peak <= used.vram_budget
        used.remove_hooks()
        del used
    left = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")  # someone else's tensor (uncapped)
    _, named, _, named_peak = mid_run(8)
    held = named.report()["held_elsewhere_at_wrap"]["vram_bytes"]
    print(named.describe())
    assert left.numel() <= held < left.numel() + (128 << 20)  # (and torch's workspaces: 92 MB seen on an H100)
    assert "not this model's" in named.describe()
    named.remove_hooks()


def test_accumulation_under_a_budget_is_met_and_exact():
    profiled, full_peak = footprints(acc=4)
    budget = int(profiled + 0.5 * (full_peak - profiled))
    model, opt, losses, peak = mid_run(8, acc=4, vram_budget=budget)
    placement = opt.report()["placement"]
    print(opt.describe())
    assert placement["state"] == "planned" and peak <= budget
    assert {p["window_sum"] for p in placement["params"]} <= {"vram", "host"}
    opt.remove_hooks()
    collected()
    ref, _, ref_losses, _ = mid_run(8, acc=4, tuning=trainstream.Tuning(placement="offload"))
    assert torch.equal(losses, ref_losses)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


def test_soak_100_steps_after_planning_flat_memory():
    profiled, full_peak = footprints()
    budget = int(profiled + 0.5 * (full_peak - profiled))  # below everything resident
    model, opt = make(torch.float32, **MID)
    model, opt = trainstream.wrap(model, opt, max_grad_norm=1.0, vram_budget=budget)
    vram, peaks = [], []
    for step in range(100):
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model.loss(tokens_for(step, MID["vocab"], 8, MID["seq"]))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step >= 10 and step % 10 == 0:
            opt.synchronize()
            torch.cuda.synchronize()
            vram.append(torch.cuda.memory_allocated())
            peaks.append(torch.cuda.max_memory_allocated())
    print(opt.describe())
    assert opt.report()["placement"]["state"] == "planned"
    assert len(set(vram)) == 1, vram
    assert max(peaks) - min(peaks) <= (1 << 20), peaks
    assert max(peaks) <= budget
    assert torch.isfinite(loss).item()


def test_every_block_is_offered_light_recompute_though_the_profile_pages_it():
    """The census runs in the profiled forward, which pages blocks: the pager's record_stream
    writes (by its schema) into the outputs it pages, which are then freed and their addresses
    reused. Neither is the block writing into what light recompute keeps: each block is offered
    light recompute, and the plan under a budget trains the bits an all-offloaded run trains."""
    profiled, full_peak = footprints()
    budget = int(profiled + 0.5 * (full_peak - profiled))
    model, opt, losses, peak = mid_run(8, vram_budget=budget, tuning=trainstream.Tuning(light_recompute=True))
    placement = opt.report()["placement"]
    print(opt.describe())
    blocks = placement["profile"]["blocks"]
    assert placement["profile"]["profiled_paged"] > 0  # what this test is about
    assert all(b["light_bytes"] is not None and b["light_bytes"] > 0 for b in blocks), blocks
    assert placement["state"] == "planned" and peak <= budget
    opt.remove_hooks()
    collected()
    ref, _, ref_losses, _ = mid_run(8, tuning=trainstream.Tuning(placement="offload"))
    assert torch.equal(losses, ref_losses)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
