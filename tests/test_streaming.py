"""Weight streaming: blocks whose weights live in host memory train the same bits as blocks whose
weights stay on the device, and come to the device only around their use.

Every test runs in CPU mode (the same hooks, copies and storage juggling, with host memory standing
in for VRAM); the `cuda` cases run the same checks on a GPU.
"""

from __future__ import annotations

import copy
import gc
from dataclasses import replace

import pytest
import torch
from torch import nn

import trainstream
from trainstream import placement as planner
from trainstream.activations import pager as activation_pager
from trainstream.activations.plan import Plan
from trainstream.errors import UnsupportedSetupError
from trainstream.fixtures import TinyLM, param_groups

GB = 10**9
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def train(base, device, *, streamed, dtype=torch.float32, acc=1, clip=None, steps=3, autocast=False,
          setup=None, tuning=None, wrap_kwargs=None):
    torch.manual_seed(1)
    model = copy.deepcopy(base).to(device=device, dtype=dtype)
    opt = torch.optim.AdamW(param_groups(model), lr=1e-2)
    tuning = tuning or trainstream.Tuning(placement="offload", streamed_blocks=streamed)
    model, opt = trainstream.wrap(model, opt, max_grad_norm=clip, accumulation_steps=acc, tuning=tuning,
                                  **(wrap_kwargs or {}))
    if setup is not None:
        setup(model, opt)
    return model, opt, run_steps(model, opt, device, steps, acc, autocast)


def run_steps(model, opt, device, steps, acc=1, autocast=False) -> list[float]:
    losses = []
    for _ in range(steps):
        for _ in range(acc):
            tokens = torch.randint(0, 97, (2, 17)).to(device)
            with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                loss = model.loss(tokens)
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    return losses


def assert_same_training(a, b):
    (model_a, opt_a, losses_a), (model_b, opt_b, losses_b) = a, b
    assert losses_a == losses_b
    for (name, x), y in zip(model_a.state_dict().items(), model_b.state_dict().values()):
        assert torch.equal(x.cpu(), y.cpu()), name
    for x, y in zip(opt_a.state_dict()["state"].values(), opt_b.state_dict()["state"].values()):
        for key in x:
            assert torch.equal(x[key].cpu(), y[key].cpu()), key


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, autocast", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False)])
@pytest.mark.parametrize("acc, clip", [(1, None), (3, 1.0), (2, 1e-3)])
def test_streamed_blocks_train_the_same_bits(device, dtype, autocast, acc, clip):
    if autocast and device == "cpu" and dtype == torch.float32 and acc == 3:
        pytest.skip("covered on the GPU; slow on CPU")
    torch.manual_seed(0)
    base = TinyLM(layers=4)
    kept = train(base, device, streamed=0, dtype=dtype, acc=acc, clip=clip, autocast=autocast)
    streamed = train(base, device, streamed=3, dtype=dtype, acc=acc, clip=clip, autocast=autocast)
    assert_same_training(kept, streamed)
    _, opt, _ = streamed
    report = opt.report()["placement"]
    assert report["streamed_blocks"] == 3
    assert sum(p["weight"] == "host (streamed)" for p in report["params"]) == 3 * 7  # 7 parameters a block


@pytest.mark.parametrize("placement, in_vram", [("gpu", None), (0.5, None), ("offload", True)])
def test_streaming_under_other_placements_trains_the_same_bits(placement, in_vram):
    torch.manual_seed(0)
    base = TinyLM(layers=4)
    runs = [train(base, "cpu", streamed=None, acc=2, clip=1.0, tuning=trainstream.Tuning(
        placement=placement, accumulate_in_vram=in_vram, streamed_blocks=n)) for n in (0, 3)]
    assert_same_training(*runs)
    assert runs[1][1].report()["placement"]["streamed_blocks"] == 3


def test_an_early_step_and_a_new_wrap_after_remove_hooks():
    torch.manual_seed(0)
    base = TinyLM(layers=4)

    def early(model, opt):  # one micro-batch of two, then step()
        model.loss(torch.randint(0, 97, (2, 17))).backward()
        opt.step()
        opt.zero_grad()

    kept, streamed = (train(base, "cpu", streamed=n, acc=2, clip=1.0, setup=early) for n in (0, 3))
    assert_same_training(kept, streamed)
    model, opt, _ = streamed
    opt.remove_hooks()
    opt = torch.optim.AdamW(param_groups(model), lr=1e-2)
    model, opt = trainstream.wrap(model, opt, tuning=trainstream.Tuning(placement="offload", streamed_blocks=2))
    assert len(run_steps(model, opt, "cpu", 2)) == 2


@pytest.mark.parametrize("device", DEVICES)
def test_only_the_prefetch_window_is_on_the_device(device):
    torch.manual_seed(0)
    base = TinyLM(layers=5)
    seen = []

    def watch(model, opt):
        streamer = opt.promotion.streamer
        block_bytes = streamer.weight_bytes // 4
        for block in model.blocks:
            block.register_forward_pre_hook(lambda *_: seen.append(streamer.resident_bytes() / block_bytes))
        model.blocks[1].register_full_backward_hook(lambda *_: seen.append(streamer.resident_bytes() / block_bytes))

    model, opt, _ = train(base, device, streamed=4, steps=2, setup=watch)
    # at each block's start: it and the next one (prefetch depth 1); in backward: two at most
    assert seen and max(seen) <= 2
    streamer = opt.promotion.streamer
    # between steps every streamed weight is in host memory, and the parameter holds it there
    assert streamer.resident_bytes() == 0
    for block in model.blocks[1:]:
        for p in block.parameters():
            assert p.device.type == "cpu"
    # per micro-batch: 4 blocks forward, 3 again in backward (the last one stays)
    assert streamer.copies == 2 * 7


def test_blocks_streamed_later_join_in_forward_order():
    torch.manual_seed(0)
    base = TinyLM(layers=5)
    seen = []

    def more_later(model, opt):  # as the planner does after profiling: earlier blocks join the streamed ones
        opt.promotion.stream([model.blocks[1], model.blocks[2]])
        streamer = opt.promotion.streamer
        assert streamer.modules == list(model.blocks[1:])
        for block in model.blocks:
            block.register_forward_pre_hook(lambda *_: seen.append(streamer.resident_bytes()))

    kept = train(base, "cpu", streamed=0, steps=2)
    streamed = train(base, "cpu", streamed=2, steps=2, setup=more_later)
    assert_same_training(kept, streamed)
    assert max(seen) <= 2 * block_bytes_of(base) and streamed[1].promotion.streamer.copies == 2 * 7


def block_bytes_of(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())


@pytest.mark.parametrize("how", ["recomputed", "light"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_recomputed_block_uses_one_copy_for_its_recompute_and_backward(device, how):
    torch.manual_seed(0)
    base = TinyLM(layers=4)

    def recompute(model, opt):  # blocks 1 to 3 recomputed in backward (whole, or lightly)
        opt.activation_pager.apply_plan(Plan(0, 4, "test", **{how: (1, 2, 3)}))

    kwargs = dict(wrap_kwargs={"activations": 1.0}, setup=recompute)
    kept = train(base, device, streamed=0, **kwargs)
    streamed = train(base, device, streamed=3, **kwargs)
    assert_same_training(kept, streamed)
    assert streamed[1].promotion.streamer.copies == 3 * (3 + 2)


@pytest.mark.parametrize("device", DEVICES)
def test_frozen_weights_in_a_streamed_block_stream_too(device):
    torch.manual_seed(0)
    base = TinyLM(layers=3)
    for block in base.blocks:
        block.norm1.weight.requires_grad_(False)
        block.attn.out.weight.requires_grad_(False)
    assert_same_training(train(base, device, streamed=0), train(base, device, streamed=2))


@pytest.mark.parametrize("device", DEVICES)
def test_checkpoints_interchange_with_a_resident_run(device):
    torch.manual_seed(0)
    base = TinyLM(layers=3)
    kept_model, kept_opt, _ = train(base, device, streamed=0, dtype=torch.bfloat16, steps=2)
    model_state, opt_state = copy.deepcopy(kept_model.state_dict()), copy.deepcopy(kept_opt.state_dict())

    def resume(model, opt):
        model.load_state_dict(model_state)
        opt.load_state_dict(opt_state)

    continued = train(base, device, streamed=0, dtype=torch.bfloat16, steps=2, setup=resume)
    streamed = train(base, device, streamed=2, dtype=torch.bfloat16, steps=2, setup=resume)
    assert_same_training(continued, streamed)
    # and the other way: a streamed run's checkpoint loads into a resident model
    model, opt, _ = streamed
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    fresh = copy.deepcopy(base).to(device=device, dtype=torch.bfloat16)
    fresh.load_state_dict(saved)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v.cpu(), saved[k].cpu()), k


@pytest.mark.parametrize("device", DEVICES)
def test_forwards_without_backward_and_remove_hooks(device):
    torch.manual_seed(0)
    base = TinyLM(layers=3)
    model, opt, _ = train(base, device, streamed=2, steps=1)
    tokens = torch.randint(0, 97, (2, 17)).to(device)
    with torch.no_grad():
        evaluated = model.loss(tokens)
    assert opt.promotion.streamer.resident_bytes() == 0
    model.loss(tokens)  # with autograd, never backward: the next step still trains
    loss = model.loss(tokens)
    loss.backward()
    opt.step()
    opt.synchronize()
    opt.remove_hooks()
    for p in model.parameters():
        assert p.device.type == device
    with torch.no_grad():
        again = model.loss(tokens)
    assert torch.isfinite(evaluated) and torch.isfinite(again)


def test_streaming_refuses_what_it_cannot_stream():
    class TiedBlocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
            self.head = nn.Linear(8, 8)
            self.head.weight = self.blocks[2].weight

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    model = TiedBlocks()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(UnsupportedSetupError, match="tied"):
        trainstream.wrap(model, opt, tuning=trainstream.Tuning(placement="offload", streamed_blocks=1))
    with pytest.raises(ValueError, match="has 3 blocks"):
        trainstream.wrap(model, opt, tuning=trainstream.Tuning(placement="offload", streamed_blocks=4))
    with pytest.raises(ValueError, match="streamed_blocks"):
        trainstream.Tuning(streamed_blocks=-1)
    with pytest.raises(ValueError, match="pass device= only for a model in host memory"):
        trainstream.wrap(model, opt, device="meta")


def test_a_model_in_host_memory_without_a_gpu_is_refused_clearly(monkeypatch):
    from trainstream import _native
    monkeypatch.setattr(_native._C, "has_cuda", False)
    model = TinyLM(layers=3)
    with pytest.raises(_native.UnsupportedError, match="no CUDA support"):
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()), device="cuda")
    assert all(p.device.type == "cpu" for p in model.parameters())  # left where it was


# ------------------------------------------------------------------------------ planning
def made_up_profile(streamed: int = 0, blocks: int = 8):
    """An embedding, `blocks` blocks of 100M bf16 weights (0.2 GB) with 1 GB of activations each,
    a head; copies at 50 GB/s and 3 ms of forward a block."""
    sizes = [("embed", 65_000_000, -1)]
    for j in range(blocks):
        sizes += [(f"blocks.{j}.{k}", 25_000_000, j) for k in ("qkv", "out", "up", "down")]
    sizes += [("head", 65_000_000, blocks)]
    n = len(sizes)
    weights = sum(s for _, s, _ in sizes) * 2
    block_bytes = 100_000_000 * 2
    on_device = weights - streamed * block_bytes + min(streamed, 2) * block_bytes
    params = [planner.ParamCost(name, numel, 2, block, need_s=0.025 * i / n, arrival_s=0.05 * (n - i) / n,
                                segment_peak=on_device + 2 * GB) for i, (name, numel, block) in enumerate(sizes)]
    costs = [planner.BlockCost(GB, GB // 20, 0.003, 0, weight_bytes=block_bytes) for _ in range(blocks)]
    return planner.Profile(
        params=params, blocks=costs, accumulation_steps=1, clipping=True, forward_s=0.025, backward_s=0.05,
        forward_peak=on_device + 2 * GB, tail_peak=on_device, host_s_per_param=0.25e-9, d2h_bytes_per_s=50e9,
        h2d_bytes_per_s=50e9, device_bytes_per_s=3e12, profiled_paged=blocks - 1, profiled_hooks=True,
        weight_bytes=weights, streamed=streamed)



def test_the_planner_streams_weights_only_when_nothing_else_is_left():
    profile = made_up_profile()
    leanest_unstreamed = planner.peak_bytes(profile, replace(planner.smallest_plan(profile), streamed=0))
    roomy = planner.plan_placement(profile, leanest_unstreamed + GB)
    assert roomy.fits and roomy.streamed == 0
    tight = planner.plan_placement(profile, leanest_unstreamed)  # the reserve must come from streaming
    assert tight.fits and tight.streamed > 0 and tight.resident == 0
    streaming = [m for m in tight.moves if m.startswith("stream")]
    assert streaming[0].startswith("stream 3 more blocks") and tight.moves[-len(streaming):] == streaming
    # each streamed block takes its weights off the device beyond the two in flight
    for k in range(1, 9):
        delta = planner.peak_bytes(profile, replace(tight, streamed=k - 1)) - \
            planner.peak_bytes(profile, replace(tight, streamed=k))
        assert delta == (0 if k <= 2 else 200_000_000)
    assert "stream from host memory" in planner.describe(tight, profile)
    # copies of 4 ms against 3 ms of forward: 1 ms exposed a block in forward, none in backward
    assert tight.step_terms["streaming_exposed_s"] == pytest.approx(tight.streamed * 1e-3)


def test_blocks_streamed_in_the_profile_stay_streamed():
    profile = made_up_profile(streamed=5)
    plan = planner.plan_placement(profile, 200 * GB)
    assert plan.streamed == 5
    # its figures are the profiled ones: the same streaming adds nothing
    assert plan.expected_peak == planner.peak_bytes(profile, plan)
    assert planner.smallest_plan(profile).streamed == 8
    assert planner.smallest_plan(replace(profile, blocks=[replace(b, streamable=j != 5)
                                                                 for j, b in enumerate(profile.blocks)])).streamed == 2


def test_weights_over_the_budget_stream_from_the_first_step():
    torch.manual_seed(0)
    base = TinyLM(layers=6)
    weights = sum(p.numel() * p.element_size() for p in base.parameters())
    tuning = trainstream.Tuning(placement="auto")
    planned = train(base, "cpu", streamed=None, clip=1.0, steps=4, tuning=tuning,
                    wrap_kwargs={"vram_budget": int(1.4 * weights)})
    assert planned[1].report()["placement"]["streamed_blocks"] == 5  # (2 in flight of 5 streamed fit half)
    assert planned[1].plan.streamed == 5
    assert "stream from host memory" in planned[1].describe()
    kept = train(base, "cpu", streamed=None, clip=1.0, steps=4, tuning=tuning,
                 wrap_kwargs={"vram_budget": 10 * weights})
    assert kept[1].report()["placement"]["streamed_blocks"] == 0
    assert_same_training(kept, planned)
    with pytest.raises(trainstream.VramBudgetError, match="stay on the GPU"):
        train(base, "cpu", streamed=None, tuning=tuning, wrap_kwargs={"vram_budget": int(0.3 * weights)})


def test_micro_batches_are_added_on_the_host_where_bf16_weights_stream():
    # a kernel that reads each host sum back over PCIe would compete with the streamed weights
    torch.manual_seed(0)
    base = TinyLM(layers=6)
    weights = sum(p.numel() * 2 for p in base.parameters())

    def run(budget, dtype=torch.bfloat16, **tuning):
        return train(base, "cpu", streamed=None, dtype=dtype, acc=2, clip=1.0,
                     tuning=trainstream.Tuning(placement="auto", **tuning), wrap_kwargs={"vram_budget": int(budget * weights)})

    streamed, by_kernel, kept = run(1.4), run(1.4, add_on_host=False), run(10)
    fp32 = run(2.8, dtype=torch.float32)[1]  # (fp32 weights' gradients land in their sums: no landing buffers)
    assert fp32.plan.streamed and fp32.engine.pipeline.device_accumulate
    # the user's choice holds where no planner runs too
    fixed = train(base, "cpu", streamed=None, dtype=torch.bfloat16, acc=2, steps=1,
                  tuning=trainstream.Tuning(placement="offload", add_on_host=True))[1]
    assert not fixed.engine.pipeline.device_accumulate
    assert streamed[1].plan.streamed and not kept[1].plan.streamed
    assert not streamed[1].engine.pipeline.device_accumulate
    assert by_kernel[1].engine.pipeline.device_accumulate and kept[1].engine.pipeline.device_accumulate
    assert_same_training(streamed, by_kernel)


def test_host_memory_for_streamed_weights_is_planned_before_pinning():
    model = TinyLM(layers=3).to(torch.bfloat16)
    numel = sum(p.numel() for p in model.parameters())
    offloaded = numel * 14  # bf16 weights: fp32 master, two moments, a bf16 gradient buffer
    streamed = 2 * sum(p.numel() for b in model.blocks[1:] for p in b.parameters())  # their bf16 copies
    tuning = trainstream.Tuning(placement="offload", streamed_blocks=2)
    with pytest.raises(trainstream.HostMemoryError, match="2 streamed blocks"):
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()), tuning=tuning,
                         host_budget=offloaded + streamed - 1)
    trainstream.wrap(model, torch.optim.AdamW(model.parameters()), tuning=tuning, host_budget=offloaded + streamed)


def test_a_compiled_model_is_refused_with_streaming():
    model = TinyLM(layers=3)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()),
                                  tuning=trainstream.Tuning(placement="offload", streamed_blocks=1))
    compiled = torch.compile(model)
    with pytest.raises(UnsupportedSetupError, match="eager mode"):
        compiled(torch.randint(0, 97, (2, 16)))


# ------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
def test_a_model_in_host_memory_is_placed_by_wrap():
    torch.manual_seed(0)
    base = TinyLM(layers=4)
    on_gpu = train(base, "cuda", streamed=2)

    def from_host(base_copy):
        torch.manual_seed(1)
        model = copy.deepcopy(base_copy)  # stays in host memory
        opt = torch.optim.AdamW(param_groups(model), lr=1e-2)
        return trainstream.wrap(model, opt, device="cuda",
                                tuning=trainstream.Tuning(placement="offload", streamed_blocks=2))

    model, opt = from_host(base)
    assert all(p.device.type == "cuda" for p in model.blocks[:2].parameters())
    assert all(p.device.type == "cpu" and p.is_pinned() for p in model.blocks[2:].parameters())
    assert_same_training(on_gpu, (model, opt, run_steps(model, opt, "cuda", 3)))


@pytest.mark.gpu
def test_streaming_frees_vram_and_a_long_run_stays_flat():
    torch.manual_seed(0)
    base = TinyLM(dim=512, layers=8, heads=8)
    block_bytes = sum(p.numel() * 4 for p in base.blocks[0].parameters())
    # Bytes asked for, not the allocator's blocks: a block keeps a remainder of up to 1 MiB
    # unsplit, so what memory_allocated() counts for the same tensors depends on earlier frees.
    requested = lambda: torch.cuda.memory_stats()["requested_bytes.all.current"]

    def between_steps(streamed, steps):
        gc.collect()  # (an earlier run's model and optimizer, which hold each other)
        before = requested()
        model, opt, _ = train(base, "cuda", streamed=streamed, steps=2, clip=1.0)
        allocated, host = [], []
        tokens = torch.randint(0, 97, (2, 17)).cuda()
        for _ in range(steps):
            model.loss(tokens).backward()
            opt.step()
            opt.zero_grad()
            opt.synchronize()
            torch.cuda.synchronize()
            # A gradient whose download stream read it stays counted as allocated until the
            # allocator next looks at its streams' events: let it look now.
            torch.cuda.empty_cache()
            allocated.append(requested() - before)
            host.append(opt.report()["host_bytes_used"])
        return allocated, host

    # cuBLAS(Lt) workspaces (32 MiB each on Hopper GPUs) are allocated at a process's first matmuls
    # and stay counted as allocated: before either count, not inside the first
    between_steps(0, 1)
    kept, _ = between_steps(0, 3)
    streamed, host = between_steps(6, 100)
    # between steps, six blocks' weights are in host memory only
    assert kept[-1] - streamed[-1] == 6 * block_bytes
    assert streamed[9] == streamed[-1] and host[9] == host[-1]


@pytest.mark.gpu
def test_weights_over_a_gpu_budget_stream_and_the_peak_holds():
    torch.manual_seed(0)
    base = TinyLM(dim=1024, layers=8, heads=8)
    weights = sum(p.numel() * 4 for p in base.parameters())
    budget = int(0.7 * weights) + (300 << 20)  # (CUDA's workspaces take about 0.2 GB)
    tuning = trainstream.Tuning(placement="auto")
    planned = train(base, "cuda", streamed=None, clip=1.0, steps=5, tuning=tuning, wrap_kwargs={"vram_budget": budget})
    plan = planned[1].plan
    assert plan.streamed > 0 and plan.fits
    assert planned[1].report()["placement"]["observed_peak_bytes"] <= budget
    kept = train(base, "cuda", streamed=0, clip=1.0, steps=5)
    assert_same_training(kept, planned)


def test_the_streamed_window_follows_the_prefetch_depth():
    deeper = replace(made_up_profile(), stream_depth=2)
    assert planner.streamed_weight_bytes(deeper, 8) == 3 * 200_000_000
    plan = planner.plan_placement(deeper, planner.peak_bytes(deeper, replace(planner.smallest_plan(deeper), streamed=0)))
    assert [m for m in plan.moves if m.startswith("stream")][0].startswith("stream 4 more blocks")


def test_remove_hooks_leaves_in_host_memory_what_the_device_cannot_hold(monkeypatch, caplog):
    """A model streamed because its weights do not fit keeps, after remove_hooks(), the blocks
    that still do not fit in host memory, as tensors of their own with the trained weights."""
    torch.manual_seed(0)
    model, opt, _ = train(TinyLM(layers=3), "cpu", streamed=2, steps=2)
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    held = {p.data_ptr() for p in model.parameters()}  # between steps: the host buffers themselves
    resize = torch.UntypedStorage.resize_
    calls = []

    def full_after_one(storage, nbytes):  # the device holds the first streamed weight, then no more
        calls.append(nbytes)
        if len(calls) > 1 and nbytes:
            raise torch.OutOfMemoryError("out of memory")
        return resize(storage, nbytes)

    monkeypatch.setattr(torch.UntypedStorage, "resize_", full_after_one)
    with caplog.at_level("WARNING", logger="trainstream"):
        opt.remove_hooks()
    monkeypatch.undo()
    streamed = [p for block in model.blocks[1:] for p in block.parameters()]
    left = sum(p.numel() * p.element_size() for p in streamed[1:])
    assert f"{left / 1e9:.2f} GB of the streamed blocks' weights" in caplog.text
    for p in streamed[1:]:
        assert p.data_ptr() not in held  # copied out of the optimizer's buffers
    for n, p in model.named_parameters():
        assert torch.equal(p, trained[n]), n
    del opt
    gc.collect()
    for n, p in model.named_parameters():  # its own memory: the optimizer's buffers are gone
        assert torch.equal(p, trained[n]), n


def test_describe_states_host_bytes_per_parameter():
    """14 bytes an offloaded bf16 parameter (fp32 master, two moments, a bf16 gradient buffer), 2
    more for a streamed one's bf16 weights: the figures describe() gives are the ones held."""
    torch.manual_seed(0)
    model = TinyLM(layers=2).to(torch.bfloat16)
    opt = torch.optim.AdamW(param_groups(model), lr=1e-2)
    model, opt = trainstream.wrap(model, opt, tuning=trainstream.Tuning(placement="offload", streamed_blocks=1))
    trainable = sum(p.numel() for p in model.parameters())
    streamed = sum(p.numel() for p in model.blocks[1].parameters())
    line = next(line for line in opt.describe().splitlines() if line.startswith("host memory"))
    assert f"({(14 * trainable + 2 * streamed) / trainable:.1f} B a parameter" in line
    assert "streamed bf16 weights" in line


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paging_leaves_streamed_weights_to_the_streamer(monkeypatch, dtype):
    """A streamed block's weights get a new storage at each upload: the pager must still know them
    for weights (the streamer uploads them again for backward), not page them as activations."""
    monkeypatch.setattr(activation_pager, "MIN_BYTES", 0)  # (this model's tensors are all small)
    torch.manual_seed(0)
    base = TinyLM(layers=4)
    paged = []
    for streamed in (0, 3):
        _, opt, _ = train(base, "cpu", streamed=None, dtype=dtype, wrap_kwargs=dict(activations=1.0),
                          tuning=trainstream.Tuning(placement="offload", streamed_blocks=streamed))
        paged.append(opt.report()["activations"]["paged_bytes_per_step"])
    assert paged[0] > 0
    assert paged[1] == paged[0]
