"""The first plan (CPU): the placement the profiled steps run in, from shapes, before any step.
Residents kept from wrap() take no host memory; the first forward's estimate offloads the last of
them, then streams the last blocks, and refuses with the figures what cannot fit either budget;
the planner reads a profile measured with residents as one measured without."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import trainstream
from trainstream import first_plan as fp
from trainstream import placement as planner
from trainstream.errors import HostMemoryError, VramBudgetError
from trainstream.fixtures import TinyLM

from test_placement_cpu import assert_same_bits, batches, made_up_profile, make, train

GB = 10**9


def shapes(*, blocks: int = 4, head: int = 0, activations: int = 0, tied: tuple[int, ...] = ()) -> fp.Shapes:
    """An embedding (1 GB of resident cost), `blocks` blocks of two parameters (0.5 GB each, 1 GB
    of weights a block), a head (1 GB)."""
    costs = [GB] + [GB // 2] * (2 * blocks) + [GB]
    where = [-1] + [j for j in range(blocks) for _ in range(2)] + [blocks]
    return fp.Shapes(resident_bytes=costs, param_blocks=where, weight_bytes=(blocks + 2) * GB,
                     block_weight_bytes=[GB] * blocks, streamable=[j not in tied for j in range(blocks)],
                     stream_depth=1, head_bytes=head, block_activation_bytes=activations, tokens=4096)


def test_what_fits_stays_as_wrap_left_it():
    first = fp.plan_first(shapes(), 100 * GB, resident=10, streamed=0)
    assert first.fits and (first.resident, first.streamed) == (10, 0)
    assert first.peak == 6 * GB + 6 * GB and first.limit == 100 * GB - planner.reserve_for(100 * GB)


def test_the_batch_offloads_the_last_residents_first_then_streams_the_last_blocks():
    budget = 20 * GB
    limit = budget - planner.reserve_for(budget)
    # 6 GB of weights, 6 GB of state: an 8 GB head leaves room for all residents but the last (the head's 1 GB)
    first = fp.plan_first(shapes(head=8 * GB, activations=GB // 4), budget, resident=10, streamed=0)
    assert first.fits and first.streamed == 0 and first.resident == 9 and first.peak <= limit
    # with every resident gone, the last blocks stream (two in flight at depth 1)
    first = fp.plan_first(shapes(head=15 * GB), budget, resident=10, streamed=0)
    assert first.fits and first.resident == 0 and first.streamed == 4 and first.peak <= limit
    assert first.peak == 6 * GB - 4 * GB + 2 * GB + 15 * GB
    # a tied block stops streaming: nothing before it may go
    first = fp.plan_first(shapes(head=15 * GB, tied=(2,)), budget, resident=10, streamed=0)
    assert not first.fits and first.streamed == 1
    # what wrap() already streams stays streamed, and no parameter inside a streamed block is resident
    first = fp.plan_first(shapes(), budget, resident=10, streamed=2)
    assert first.streamed == 2 and first.resident == 5


def test_a_budget_nothing_fits_is_not_fitted():
    first = fp.plan_first(shapes(head=30 * GB), 20 * GB, resident=10, streamed=0)
    assert not first.fits and first.resident == 0 and first.streamed == 4 and first.peak > first.limit


def test_residents_at_wrap_take_half_of_what_the_budget_leaves_beside_the_weights():
    costs = [GB] * 10
    budget = 30 * GB
    room = 0.5 * (budget - planner.reserve_for(budget)) - 6 * GB
    assert fp.start_residents(costs, 6 * GB, budget) == int(room // GB)
    assert fp.start_residents(costs, 6 * GB, 200 * GB) == 10
    assert fp.start_residents(costs, 20 * GB, budget) == 0  # the weights take more than half
    # a resident's cost is the planner's: state and gradient
    assert fp.resident_costs([1000, 1000], [4, 2], 1) == [12_000, 14_000]
    assert fp.resident_costs([1000], [2], 4) == [16_000]


def test_the_batch_and_the_head_are_read_off_the_model_and_its_inputs():
    ids = torch.zeros(4, 64, dtype=torch.long)
    assert fp.batch_tokens((), {"input_ids": ids, "labels": ids}) == 256
    assert fp.batch_tokens((torch.zeros(3, 5), ids[:2]), {}) == 128  # the first integer tensor of 2+ dims
    assert fp.batch_tokens((torch.zeros(3, 5),), {"n": 3}) == 0
    model = TinyLM(vocab=1000, dim=32, layers=2, seq=64)
    costs = [12] * sum(1 for _ in model.parameters())
    read = fp.read_shapes(model, list(model.blocks), costs, [0] * len(costs), [True, True], 1, 0, 256,
                          torch.device("cpu"))
    head = max(m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear) and m not in
               set(model.blocks.modules()))
    assert head == 1000
    assert read.head_bytes == 256 * 1000 * (fp.LOSS_BYTES_PER_LOGIT + 4)  # fp32 logits
    linears = [m for m in model.blocks[0].modules() if isinstance(m, torch.nn.Linear)]
    assert read.block_activation_bytes == 2 * 4 * 256 * sum(m.in_features + m.out_features for m in linears)
    assert read.block_weight_bytes == [sum(p.numel() * 4 for p in b.parameters()) for b in model.blocks]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = fp.read_shapes(model, list(model.blocks), costs, [0] * len(costs), [True, True], 1, 0, 256,
                               torch.device("cpu"))
    assert under.head_bytes == 256 * 1000 * (fp.LOSS_BYTES_PER_LOGIT + 2)


def test_a_profile_measured_with_residents_reads_as_one_measured_without():
    for acc in (1, 4):
        without = made_up_profile(activations=False, acc=acc)
        k = 5
        state = sum(planner.state_bytes(p, acc) for p in without.params[:k])
        grads = [planner.resident_grad_bytes(p, acc) if i < k else 0 for i, p in enumerate(without.params)]
        # the same step measured with the first k resident: their state all along, their gradients from arrival
        order = sorted(range(len(without.params)), key=lambda i: without.params[i].arrival_s)
        arrived, segments = 0, {}
        for i in order:
            segments[i] = without.params[i].segment_peak + state + arrived
            arrived += grads[i]
        with_residents = replace(
            without, profiled_resident=k, forward_peak=without.forward_peak + state,
            tail_peak=without.tail_peak + state + sum(grads),
            params=[replace(p, segment_peak=segments[i]) for i, p in enumerate(without.params)])
        for resident in (0, 3, k, len(without.params)):
            plan = planner.Plan(resident=resident)
            assert planner.peak_bytes(with_residents, plan) == planner.peak_bytes(without, plan), (acc, resident)


def test_a_model_that_fits_never_takes_host_memory_and_trains_the_same_bits():
    data = batches(5, 2)
    model, opt = make()
    model, opt = trainstream.wrap(model, opt, max_grad_norm=1.0, accumulation_steps=2, vram_budget="100GB")
    assert all(s.resident for s in opt.slots.order)
    assert opt.engine.pipeline.host_reserved_bytes == 0 and not any(s.host.holds_state for s in opt.slots.order)
    assert "(profiling the first steps in the first plan's placement): 17 of 17 parameters" in opt.describe()
    norms = train(model, opt, data, 1.0)
    assert opt.plan is not None and opt.plan.resident == len(opt.slots.order)
    assert opt.profile.profiled_resident == len(opt.slots.order)
    assert opt.engine.pipeline.host_reserved_bytes == 0  # never taken, at any step
    assert opt.promotion.pager is not None  # the profiled step paged, the plan pages nothing:
    assert opt.host_memory() == dict.fromkeys(opt.host_memory(), 0)  # its slots went back
    ref, ref_opt = make()
    ref, ref_opt = trainstream.wrap(ref, ref_opt, max_grad_norm=1.0, accumulation_steps=2,
                                    tuning=trainstream.Tuning(placement="offload", track_grad_norm=True))
    assert train(ref, ref_opt, data, 1.0) == norms
    assert_same_bits(model, opt, ref, ref_opt, "resident from wrap() on")


def _with_head(monkeypatch, head_bytes: int) -> None:
    """The first forward's shapes with an LM head of `head_bytes` (CPU mode estimates none)."""
    read = fp.read_shapes
    monkeypatch.setattr(fp, "read_shapes", lambda *a: replace(read(*a), head_bytes=head_bytes))


def test_the_first_forward_offloads_what_its_batch_needs_room_for_and_trains_the_same_bits(monkeypatch):
    data = batches(5, 1)
    model, opt = make()
    weights = sum(p.numel() * 4 for p in model.parameters())
    state = sum(12 * p.numel() for p in model.parameters() if p.requires_grad)
    budget = 4 * (weights + state)
    model, opt = trainstream.wrap(model, opt, max_grad_norm=1.0, vram_budget=budget)
    assert all(s.resident for s in opt.slots.order)
    # a head that leaves room for half the state
    _with_head(monkeypatch, budget - planner.reserve_for(budget) - weights - state // 2)
    # fp32 parameters it offloads send update terms through the VRAM staging buffer: sized for
    # them before their first update (on a GPU, an update without it fails)
    sized = []
    ensure = opt.engine.ensure_staging
    monkeypatch.setattr(opt.engine, "ensure_staging", lambda slots: sized.append(
        (opt.promotion.plan is None, sum(s.offloaded for s in slots.order))) or ensure(slots))
    norms = train(model, opt, data, 1.0)
    first = opt.promotion.first_plan
    assert first is not None and first.fits and 0 < first.resident < len(opt.slots.order)
    assert (True, len(opt.slots.order) - first.resident) in sized
    assert opt.profile.profiled_resident == first.resident  # the profiled steps ran in it
    assert opt.report()["placement"]["first_plan"]["resident"] == first.resident
    ref, ref_opt = make()
    ref, ref_opt = trainstream.wrap(ref, ref_opt, max_grad_norm=1.0,
                                    tuning=trainstream.Tuning(placement="offload", track_grad_norm=True))
    assert train(ref, ref_opt, data, 1.0) == norms
    assert_same_bits(model, opt, ref, ref_opt, "the first plan's placement")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_profiled_steps_add_micro_batches_where_the_plan_will_and_measure_the_threads_rate(monkeypatch, dtype):
    """A first plan that streams bf16 weights has the engine's threads add the micro-batches, as
    the final plan will (placement.adds_on_host), so that the profile measures their rate; fp32
    weights keep the adding kernel."""
    data = batches(4, 2)
    model, opt = make(dtype)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = 8 * weights
    model, opt = trainstream.wrap(model, opt, max_grad_norm=1.0, accumulation_steps=2, vram_budget=budget)
    _with_head(monkeypatch, budget - planner.reserve_for(budget) - weights * 9 // 10)  # some weights must go
    norms = train(model, opt, data, 1.0)
    first = opt.promotion.first_plan
    assert first.fits and first.resident == 0 and first.streamed > 0
    bf16 = dtype == torch.bfloat16
    assert opt.engine.pipeline.device_accumulate != bf16
    assert (opt.profile.host_add_s_per_element is not None) == bf16
    if bf16:
        assert opt.profile.host_add_s_per_element > 0
        assert planner.bound_seconds(opt.profile, opt.plan)["host_adds_s"] > 0
        assert " ns/element (" in opt.describe()  # the rate, and a micro-batch's adds under the plan
    ref, ref_opt = make(dtype)
    ref, ref_opt = trainstream.wrap(ref, ref_opt, max_grad_norm=1.0, accumulation_steps=2,
                                    tuning=trainstream.Tuning(placement="offload", track_grad_norm=True))
    assert train(ref, ref_opt, data, 1.0) == norms
    assert_same_bits(model, opt, ref, ref_opt, "micro-batches added by the threads")


@pytest.mark.parametrize("room", [True, False], ids=["room-to-spare", "tight"])
def test_the_profiled_steps_page_nothing_where_every_block_kept_fits_with_room_to_spare(monkeypatch, room):
    """The first plan's estimate with every block's activations kept: under 80% of the budget less
    the reserve, the profiled steps page none (and pin no slot); above it, every block but the last."""
    torch.manual_seed(0)
    model = TinyLM(dim=512, layers=3, seq=64)  # activations of 2 MiB: worth paging
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    budget = 10 * GB
    model, opt = trainstream.wrap(model, opt, max_grad_norm=1.0, vram_budget=budget)
    limit = budget - planner.reserve_for(budget)  # (the weights and state: a few MB of it)
    per_block = int((0.25 if room else 0.3) * limit)  # 3 blocks kept: 75% or 90% of it
    read = fp.read_shapes  # (CPU mode estimates no activations: made up here)
    monkeypatch.setattr(fp, "read_shapes", lambda *a: replace(read(*a), tokens=1024, block_activation_bytes=per_block))
    monkeypatch.setattr(fp, "attention_saves_no_scores", lambda m: m is model)  # (as a Hugging Face model with SDPA)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):  # the cold step, the profiled one, the first planned one
        model.loss(torch.randint(0, 97, (16, 65), generator=g)).backward()
        opt.step()
        opt.zero_grad()
    first = opt.promotion.first_plan
    assert first.fits and first.resident == len(opt.slots.order) and opt.plan is not None
    paged = opt.promotion.pager.native.stats()["paged_out_bytes"]
    assert (paged == 0) == room
    assert opt.profile.profiled_paged == (0 if room else 2)


def test_only_attention_known_to_save_no_scores_lets_the_profiled_steps_keep_every_block():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4)
    for impl, known in (("sdpa", True), ("eager", False)):
        config._attn_implementation = impl
        assert fp.attention_saves_no_scores(LlamaForCausalLM(config)) == known
    assert not fp.attention_saves_no_scores(TinyLM())  # (no config: the estimate may be short)


def test_a_batch_that_cannot_fit_is_refused_before_the_first_step(monkeypatch):
    model, opt = make()
    before = [p.detach().clone() for p in model.parameters()]
    model, opt = trainstream.wrap(model, opt, max_grad_norm=1.0, vram_budget="1GB")
    _with_head(monkeypatch, 2 * GB)
    with pytest.raises(VramBudgetError, match="before the first step.*LM head's logits and the loss's fp32 tensors 2.00 GB"):
        train(model, opt, batches(1, 1), 1.0)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_the_first_plan_refuses_state_the_host_budget_cannot_take(monkeypatch):
    model, opt = make()
    weights = sum(p.numel() * 4 for p in model.parameters())
    state = sum(12 * p.numel() for p in model.parameters() if p.requires_grad)
    budget = 4 * (weights + state)
    model, opt = trainstream.wrap(model, opt, max_grad_norm=1.0, vram_budget=budget, host_budget=4096)
    assert opt.engine.pipeline.host_reserved_bytes == 0
    _with_head(monkeypatch, budget - planner.reserve_for(budget) - weights - state // 2)
    with pytest.raises(HostMemoryError, match="before the first step.*Nothing more was pinned"):
        train(model, opt, batches(1, 1), 1.0)
    assert opt.engine.pipeline.host_reserved_bytes == 0
