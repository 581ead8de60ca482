"""torch.compile before or after wrap(): the gradient hooks and activation paging run eagerly (a
graph break at each hook) while the model's own code is compiled; the forward waits for the
weights' uploads once, at its start, rather than at each module. On the CPU with
the aot_eager backend (quick to compile); on the GPU with the default inductor backend."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import trainstream
from trainstream import placement as planner
from trainstream.errors import UnsupportedSetupError
from trainstream.fixtures import TinyLM, param_groups

STEPS = 4


@pytest.fixture(autouse=True)
def fresh_compiler():
    """Compiled graphs (and the memory they keep) go with each test, not into the next one's figures."""
    yield
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def lm_loss(model, tokens):
    logits = model(tokens[:, :-1])  # model(...), not model.loss(...): a compiled wrapper's __call__
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def train(order: str, device: str, backend=None, size: dict | None = None,
          placement="offload", setup=None, **options):
    """order: 'eager', 'before' (compile, then wrap) or 'after' (wrap, then compile); torch.compile
    wraps the model, or with 'in place' in the order, nn.Module.compile() compiles the model itself
    ('model in place ...') or each block ('blocks in place ...'). `setup(opt)` runs after wrap()."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    size = dict(size or {})
    batch = size.pop("batch", 4)
    model = TinyLM(**size).to(device)
    opt = torch.optim.AdamW(param_groups(model), lr=3e-3, betas=(0.9, 0.95))
    compile_options = {"backend": backend} if backend else {}

    def compile_it(model):
        if order.startswith("model in place"):
            model.compile(**compile_options)
        elif order.startswith("blocks in place"):
            for block in model.blocks:
                block.compile(**compile_options)
        else:
            model = torch.compile(model, **compile_options)
        return model

    if order.endswith("before"):
        model = compile_it(model)
    model, opt = trainstream.wrap(model, opt, max_grad_norm=1.0, tuning=trainstream.Tuning(placement=placement),
                                  **options)
    if setup is not None:
        setup(opt)
    if order.endswith("after"):
        model = compile_it(model)
    g = torch.Generator(device=device).manual_seed(1)
    losses = []
    for _ in range(STEPS):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            tokens = torch.randint(0, size.get("vocab", 97), (batch, size.get("seq", 16) + 1), generator=g, device=device)
            loss = lm_loss(model, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    opt.synchronize()
    return losses, [p.detach().float().clone() for p in model.parameters()], opt, model


@pytest.mark.parametrize("order", ["before", "after", "model in place, before", "blocks in place, before",
                                   "blocks in place, after"])
@pytest.mark.parametrize("placement", ["offload", 0.5])
def test_compiled_model_trains_as_the_eager_one_on_cpu(order, placement):
    eager = train("eager", "cpu", placement=placement)
    compiled = train(order, "cpu", backend="aot_eager", placement=placement)
    # aot_eager runs decomposed ops: the same arithmetic up to summation order
    assert compiled[0] == pytest.approx(eager[0], rel=1e-5)
    assert max((a - b).abs().max().item() for a, b in zip(eager[1], compiled[1])) < 1e-4
    assert compiled[2].last_grad_norm == pytest.approx(eager[2].last_grad_norm, rel=1e-4)
    # no forward hook of ours inside compiled code (each would cut its graph): a compiled model waits
    # for the uploads once, when its forward starts; a compiled block, when it starts
    gated = _gated_modules(compiled[3])
    if order.startswith("blocks"):
        blocks = list(_root(compiled[3]).blocks)
        inside = {id(m) for b in blocks for m in b.modules() if m is not b}
        assert all(b in gated for b in blocks) and not any(id(m) in inside for m in gated)
    else:
        assert gated == []
    assert len(_gated_modules(eager[3])) > len(eager[3].blocks)


def recompute_compiled(order: str, paged: int, device: str, backend: str) -> None:
    """A block the plan recomputes is torch's checkpointing traced into the compiled code (before,
    each ran eagerly: a graph break at the pager's check for backward). With nothing paged the
    blocks carry no hook of ours, so a compiled model is one graph, every recomputed block in it."""
    recomputed = (0, 1)

    def plan(opt):  # blocks 0 and 1 recomputed; with `paged`, block 0's input paged
        opt.activation_pager.apply(paged, recomputed, "test", hooks=bool(paged))

    graphs = []
    compiler = torch._dynamo.lookup_backend(backend)

    def recording(gm, example_inputs):
        graphs.append(gm)
        return compiler(gm, example_inputs)

    # a block's input of 1 MiB (fp32) or more: large enough to page
    size = dict(dim=128, seq=64, batch=32) if device == "cpu" else dict(vocab=1000, dim=512, heads=8, seq=256, batch=8)
    eager = train("eager", device, size=size, activations=1.0, setup=plan)
    torch._dynamo.utils.counters.clear()
    compiled = train(order, device, backend=recording, size=size, activations=1.0, setup=plan)
    if device == "cpu":  # aot_eager runs decomposed ops: the same arithmetic up to summation order
        assert compiled[0] == pytest.approx(eager[0], rel=1e-5)
        assert max((a - b).abs().max().item() for a, b in zip(eager[1], compiled[1])) < 1e-4
    else:  # inductor fuses differently from eager under bf16 autocast
        assert compiled[0] == pytest.approx(eager[0], rel=2e-2)
        assert max((a - b).abs().max().item() for a, b in zip(eager[1], compiled[1])) < 5e-2
    regions = [sum(n.target is torch.ops.higher_order.tag_activation_checkpoint for n in g.graph.nodes)
               for g in graphs]
    breaks = " ".join(torch._dynamo.utils.counters["graph_break"])
    assert "non-Tensor" not in breaks  # (the pager's in_backward() check, traced)
    if paged or order.startswith("blocks"):  # a graph for each block: a recomputed one holds its region
        assert max(regions) == 1
    else:
        assert max(regions) == len(recomputed) and "loop" not in breaks
    pager = compiled[2].activation_pager
    assert pager.compiled and pager._blocks_hooked == bool(paged)
    report = compiled[2].report()["activations"]
    assert report["recomputed_blocks"] == len(recomputed)
    assert (report["paged_bytes_per_step"] > 0) == bool(paged)
    assert ("inside the compiled graph" in pager.describe()) == (not paged)


def test_a_compiled_models_next_plan_that_pages_pages_in_the_compiled_code():
    """A plan that pages after one that did not: the compiled code, traced while the blocks'
    hooks were idle, is traced again (torch.compile does not watch hooks), and the blocks page."""
    size = dict(dim=128, seq=64)  # (a block's input of 1 MiB at a batch of 32: large enough to page)
    _, _, opt, model = train("before", "cpu", backend="aot_eager", size=dict(size, batch=32), activations=1.0,
                             setup=lambda opt: opt.activation_pager.apply(0, (0, 1), "test", hooks=False))
    pager = opt.activation_pager

    def step():
        lm_loss(model, torch.randint(0, 97, (32, size["seq"] + 1))).backward()
        opt.step()
        opt.zero_grad()
        return opt.report()["activations"]["paged_bytes_per_step"]

    assert pager.compiled and not pager._blocks_hooked and step() == 0
    pager.apply(1, (0, 1), "test", hooks=True)
    assert step() > 0 and pager.last.block_bytes[0] > 0
    pager.apply(0, (0, 1), "test", hooks=False)
    assert step() == 0 and not pager._blocks_hooked


@pytest.mark.parametrize("order", ["before", "after", "blocks in place, before"])
@pytest.mark.parametrize("paged", [1, 0], ids=["inputs-paged", "nothing-paged"])
def test_recomputed_blocks_are_recomputed_inside_the_compiled_graph_on_cpu(order, paged):
    recompute_compiled(order, paged, "cpu", "aot_eager")


@pytest.mark.gpu
@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("paged", [1, 0], ids=["inputs-paged", "nothing-paged"])
def test_recomputed_blocks_are_recomputed_inside_the_compiled_graph_on_gpu(order, paged):
    recompute_compiled(order, paged, "cuda", "inductor")


@pytest.mark.gpu
@pytest.mark.parametrize("order", ["before", "after"])
def test_a_compiled_model_under_a_vram_budget_trains_within_it_as_the_eager_one(order):
    """The planner's own choice under a budget the uncapped run does not fit: the compiled model
    trains as the eager one does, within the budget, with nothing the pager traces breaking it."""
    size = dict(vocab=1000, dim=512, heads=8, seq=256, batch=32)
    torch.cuda.reset_peak_memory_stats()
    train("eager", "cuda", size=size, placement="auto")  # (the blocks save about 0.6 GiB under autocast)
    # what it takes uncapped does not fit (at 0.85 of it the first plan's estimate, two blocks'
    # activations in the profiled steps, was refused before the first step on an H100)
    budget = int(0.95 * torch.cuda.max_memory_allocated())
    gc.collect()
    torch.cuda.empty_cache()
    eager = train("eager", "cuda", size=size, placement="auto", vram_budget=budget)
    torch.cuda.reset_peak_memory_stats()
    torch._dynamo.utils.counters.clear()
    compiled = train(order, "cuda", size=size, placement="auto", vram_budget=budget)
    peak = torch.cuda.max_memory_allocated()
    assert compiled[0] == pytest.approx(eager[0], rel=2e-2)
    plan = compiled[2].promotion.plan
    print(f"compiled plan: {len(plan.recomputed)} recomputed, {plan.paged} paged, {plan.resident} resident; "
          f"peak {peak / 2**30:.2f} GiB of a {budget / 2**30:.2f} GiB budget")
    assert plan.fits and peak <= budget
    assert "non-Tensor" not in " ".join(torch._dynamo.utils.counters["graph_break"])


def test_a_compiled_models_blocks_are_rated_by_their_own_forward_under_a_budget():
    """Compiled, the model waits for all its weights when its forward starts, so its marks cannot
    rate each block's recompute by its share of the forward (which made the early blocks' recompute
    look free and the last one's cost the whole forward): each block's own profiled time does."""
    size = dict(dim=64, seq=64, layers=4, batch=64)
    weights = sum(p.numel() * 4 for p in TinyLM(**{k: v for k, v in size.items() if k != "batch"}).parameters())
    _, _, opt, _ = train("before", "cpu", backend="aot_eager", size=size, placement="auto", vram_budget=4 * weights)
    profile = opt.profile
    assert all(b.recompute_s is None and b.forward_s > 0 for b in profile.blocks)
    for j in range(len(profile.blocks)):
        plan = planner.Plan(resident=len(profile.params), recomputed=(j,))
        assert planner.recompute_seconds(profile, plan) == profile.blocks[j].forward_s


def _root(model):
    """The model a torch.compile wrapper wraps, or the model itself."""
    return getattr(model, "_orig_mod", model)


def _gated_modules(model) -> list:
    root = _root(model)
    return [m for m in root.modules() if m is not root and m._forward_pre_hooks]


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
@pytest.mark.parametrize("order", ["before", "after", "block in place, before", "block in place, after"])
def test_cuda_graph_modes_are_refused_with_what_to_use(mode, order):
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters())
    in_place = order.startswith("block in place")
    if order.endswith("before"):
        if in_place:
            model.blocks[1].compile(mode=mode)
        else:
            model = torch.compile(model, mode=mode)
        with pytest.raises(UnsupportedSetupError, match="default mode"):
            trainstream.wrap(model, opt, tuning=trainstream.Tuning(placement="offload"))
        return
    model, opt = trainstream.wrap(model, opt, tuning=trainstream.Tuning(placement="offload"))
    if in_place:
        model.blocks[1].compile(mode=mode)
        compiled = model
    else:
        compiled = torch.compile(model, mode=mode)
    with pytest.raises(UnsupportedSetupError, match="reduce-overhead"):
        lm_loss(compiled, torch.randint(0, 97, (2, 9)))


def test_compiling_after_eager_windows_is_checked_and_moves_the_gates():
    """The first forward of each window checks compilation and lays out the gates again only
    when the compiled modules change: a model compiled after eager windows is still seen."""
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters())
    model, opt = trainstream.wrap(model, opt, max_grad_norm=1.0, tuning=trainstream.Tuning(placement="offload"))
    tokens = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))

    def window(module):
        lm_loss(module, tokens).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(2):
        window(model)
    assert len(_gated_modules(model)) > len(model.blocks)
    compiled = torch.compile(model, backend="aot_eager")
    window(compiled)
    assert _gated_modules(model) == []  # the compiled model now waits once, at its start
    window(compiled)
    model.blocks[1].compile(mode="reduce-overhead")
    with pytest.raises(UnsupportedSetupError, match="reduce-overhead"):
        window(model)


@pytest.mark.gpu
@pytest.mark.parametrize("order", ["before", "after", "blocks in place, before"])
@pytest.mark.parametrize("placement,activations", [("offload", "off"), ("offload", 0.5), (0.5, "off")],
                         ids=["offload", "offload-paged", "half-resident"])
def test_compiled_model_trains_as_the_eager_one_on_gpu(order, placement, activations):
    # activations large enough to page (the pager leaves tensors under 1 MiB where they are)
    size = dict(vocab=1000, dim=512, layers=4, heads=8, seq=256, batch=8)
    eager = train("eager", "cuda", size=size, placement=placement, activations=activations)
    compiled = train(order, "cuda", size=size, placement=placement, activations=activations)
    # inductor fuses differently from eager under bf16 autocast: agreement within bf16 noise
    assert compiled[0] == pytest.approx(eager[0], rel=2e-2)
    assert max((a - b).abs().max().item() for a, b in zip(eager[1], compiled[1])) < 5e-2
    if activations != "off":  # the saved-tensor hooks still page what the compiled graphs save
        paged = [run[2].report()["activations"]["paged_bytes_per_step"] for run in (eager, compiled)]
        print(f"paged bytes a step: eager {paged[0]}, compiled {paged[1]}")
        assert paged[0] > 0 and paged[1] > 0
