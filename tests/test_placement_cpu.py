"""The placement planner on made-up profiles, and training across placements in CPU mode.

The planner is a pure function: these tests give it profiles of a 1B-like model (an embedding,
blocks of four matrices, a head) and check what it keeps where. The training tests force
placements and compare every weight and moment bit for bit: a resident parameter is updated by
the same arithmetic as an offloaded one, so the placement must never change a bit.
"""

from __future__ import annotations

import copy
import importlib
import io
import json
import logging
from dataclasses import asdict, replace

import pytest
import torch

import trainstream
from trainstream import placement as planner
from trainstream.fixtures import TinyLM, param_groups, warmup_cosine

GB = 10**9


def made_up_profile(*, blocks: int = 8, acc: int = 1, clipping: bool = False, dtype_bytes: int = 4,
                    host_ns: float = 0.25, activations: bool = True) -> planner.Profile:
    """An embedding, `blocks` blocks of four 25M-element matrices, a head: forward 25 ms,
    backward 50 ms, 1 GB of activations a block."""
    sizes = [("embed", 65_000_000, -1)]
    for j in range(blocks):
        sizes += [(f"blocks.{j}.{k}", 25_000_000, j) for k in ("qkv", "out", "up", "down")]
    sizes += [("head", 65_000_000, blocks)]
    n = len(sizes)
    forward, backward = 0.025, 0.050
    weights = sum(s for _, s, _ in sizes) * dtype_bytes
    params = [planner.ParamCost(name, numel, dtype_bytes, block, need_s=forward * i / n,
                                arrival_s=backward * (n - i) / n, segment_peak=weights + 2 * GB)
              for i, (name, numel, block) in enumerate(sizes)]
    block_costs = [planner.BlockCost(GB, GB // 20, forward / blocks, GB // 10) for _ in range(blocks)]
    return planner.Profile(
        params=params, blocks=block_costs if activations else [], accumulation_steps=acc, clipping=clipping,
        forward_s=forward, backward_s=backward, forward_peak=weights + 2 * GB, tail_peak=weights,
        host_s_per_param=host_ns * 1e-9, d2h_bytes_per_s=50e9, h2d_bytes_per_s=50e9, device_bytes_per_s=3e12,
        profiled_paged=blocks - 1 if activations else 0, profiled_hooks=activations,
        outside_cast_bytes=130_000_000 if activations else 0, hook_s=0.001, weight_bytes=weights,
        fixed_activations=not activations)


def test_everything_stays_on_the_gpu_when_it_fits():
    profile = made_up_profile()
    plan = planner.plan_placement(profile, 200 * GB)
    assert plan.fits and plan.resident == len(profile.params)
    assert not plan.hooks and plan.paged == 0 and plan.recomputed == () and plan.moves == []
    assert plan.expected_peak <= 200 * GB - plan.reserve
    assert plan.step_terms["weights_wait_s"] == 0.0


def test_a_budget_nothing_fits_in_reports_it_with_the_smallest_placement():
    profile = made_up_profile()
    plan = planner.plan_placement(profile, profile.weight_bytes)
    assert not plan.fits
    smallest = planner.smallest_plan(profile)
    assert plan.resident == 0
    assert planner.peak_bytes(profile, smallest) <= plan.expected_peak


def test_tighter_budgets_offload_more_and_the_first_parameters_stay_longest():
    profile = made_up_profile()
    everything = planner.peak_bytes(profile, planner.Plan(resident=len(profile.params)))
    last = len(profile.params) + 1
    plans = []
    for budget in [everything * f for f in (1.2, 0.9, 0.8, 0.7, 0.6, 0.5)]:
        plan = planner.plan_placement(profile, int(budget))
        plans.append(plan)
        assert plan.fits, budget
        assert plan.expected_peak <= int(budget) - plan.reserve
        assert plan.resident <= last  # monotone: less VRAM never keeps more resident
        last = plan.resident
    assert plans[0].resident == len(profile.params) and plans[-1].resident < len(profile.params)
    # where the budget binds, the greedy choice is as fast as the best placement that offloads a
    # tail of parameters alone (where it does not, nothing moves: plain PyTorch's placement)
    compared = 0
    for plan in plans[1:]:
        fitting = [planner.step_seconds(profile, planner.Plan(resident=r))[0] for r in range(len(profile.params) + 1)
                   if planner.peak_bytes(profile, planner.Plan(resident=r)) <= plan.budget - plan.reserve]
        if fitting:  # (under the tightest budgets only activation moves as well reach it)
            compared += 1
            assert plan.expected_step_s <= min(fitting) * 1.02 + 1e-4
    assert compared >= 2


def test_offloading_costs_more_with_clipping_and_more_the_earlier_the_parameters():
    params = len(made_up_profile().params)
    for clipping in (False, True):
        profile = made_up_profile(clipping=clipping)
        times = [planner.step_seconds(profile, planner.Plan(resident=r))[0] for r in (params - 1, params // 2, 0)]
        assert times == sorted(times)  # the head's update hides best; the embedding's not at all
    no_clip = planner.step_seconds(made_up_profile(), planner.Plan(resident=0))[0]
    clip = planner.step_seconds(made_up_profile(clipping=True), planner.Plan(resident=0))[0]
    assert clip > no_clip  # every host update waits for the global norm


def test_host_updates_slow_the_threads_that_queue_the_gpu_work_beside_them():
    """The offloaded updates share the CPU with the threads queueing backward, the device update
    and the next forward: with clipping they start when backward ends, without it as each gradient
    lands; either way charged until the next forward ends."""
    profile = made_up_profile(clipping=True, host_ns=0.25)
    params = len(profile.params)
    head = planner.step_seconds(profile, planner.Plan(resident=params - 1))[1]
    # 65M elements at 0.25 ns: 16 ms of updates from the end of backward, all of it before the forward ends
    assert head["host_contention_s"] == pytest.approx(planner.HOST_CONTENTION * 0.01625)
    # without clipping the head's update runs as its gradient lands, early in backward: charged the same
    no_clip = made_up_profile(host_ns=0.25)
    assert planner.step_seconds(no_clip, planner.Plan(resident=params - 1))[1]["host_contention_s"] == \
        pytest.approx(planner.HOST_CONTENTION * 0.01625)
    # no more than the device update (none here) and the forward, however long the updates
    everything = planner.step_seconds(profile, planner.Plan(resident=0))[1]
    assert everything["device_update_s"] == 0
    assert everything["host_contention_s"] == pytest.approx(planner.HOST_CONTENTION * profile.forward_s)
    # without clipping, from the first gradient's landing on
    spread = planner.step_seconds(no_clip, planner.Plan(resident=0))[1]
    assert spread["host_contention_s"] > everything["host_contention_s"]


def test_a_block_recomputed_costs_its_recompute_time_where_measured():
    profile = made_up_profile(clipping=True)
    plan = planner.Plan(resident=len(profile.params), recomputed=(0, 3))
    assert planner.recompute_seconds(profile, plan) == pytest.approx(2 * profile.blocks[0].forward_s)
    profile.blocks[3] = replace(profile.blocks[3], recompute_s=0.0005)
    assert planner.recompute_seconds(profile, plan) == pytest.approx(profile.blocks[0].forward_s + 0.0005)


def test_block_spans_run_from_a_blocks_first_parameter_to_the_next_ones():
    from trainstream.profiler import block_spans

    # an embedding at 0, block 0 from 1.0 (its second parameter at 1.5), block 1 owns nothing,
    # block 2 from 4.0, a head after the blocks at 7.0 and a parameter of the model itself (needed
    # at its start, 0), the forward ending at 9.0
    need = [0.0, 1.0, 1.5, 4.0, 7.0, 0.0]
    where = [-1, 0, 0, 2, 3, 3]
    assert block_spans(need, where, 3, 9.0) == [3.0, None, 3.0]
    assert block_spans(need[:4], where[:4], 3, 9.0) == [3.0, None, 5.0]  # nothing after: the forward's end
    # a compiled model's weights are all needed at its start: no block's span can be told
    assert block_spans([0.0, 0.0, 0.0, 0.0, 7.0], [-1, 0, 1, 2, 3], 3, 9.0) == [None, None, None]


def test_with_accumulation_sums_stay_in_vram_until_the_budget_needs_them_on_the_host():
    profile = made_up_profile(acc=8)
    n = len(profile.params)
    everything = planner.peak_bytes(profile, planner.Plan(resident=n))
    roomy = planner.plan_placement(profile, int(0.8 * everything))
    assert roomy.resident < n and roomy.vram_sums == n - roomy.resident  # offloaded, summed in VRAM
    tight = planner.plan_placement(profile, int(0.35 * everything))
    assert tight.fits and tight.vram_sums < n - tight.resident
    slow = planner.step_seconds(profile, planner.Plan(resident=0, vram_sums=0))[0]
    fast = planner.step_seconds(profile, planner.Plan(resident=0, vram_sums=n))[0]
    assert slow > fast  # host sums cross PCIe every micro-batch


def test_resident_gradients_count_only_once_they_have_arrived():
    profile = made_up_profile(activations=False)
    n = len(profile.params)
    # the embedding's gradient arrives last: keeping only it resident adds its state, and its
    # gradient only to the tail of the step
    embed = profile.params[0]
    grad = planner.resident_grad_bytes(embed, 1)
    base = planner.peak_bytes(profile, planner.Plan(resident=0))
    one = planner.peak_bytes(profile, planner.Plan(resident=1))
    assert one - base == planner.state_bytes(embed, 1)
    acc_profile = made_up_profile(activations=False, acc=4)
    assert (planner.peak_bytes(acc_profile, planner.Plan(resident=1)) - planner.peak_bytes(acc_profile, planner.Plan(resident=0))
            == planner.state_bytes(embed, 4) + grad)  # with accumulation it lives through every forward
    assert planner.peak_bytes(profile, planner.Plan(resident=n)) > one


def test_bf16_weights_count_their_fp32_master_and_sum():
    p = planner.ParamCost("w", 1000, 2, 0, 0.0, 0.0, 0)
    assert planner.state_bytes(p, 1) == 12_000 and planner.state_bytes(p, 4) == 16_000
    assert planner.resident_grad_bytes(p, 1) == 2000 and planner.resident_grad_bytes(p, 4) == 0


def test_activation_moves_are_taken_where_they_cost_least_per_gb():
    # A slow host makes offloading dear: the planner recomputes or pages blocks first.
    profile = made_up_profile(host_ns=20.0, clipping=True)
    n = len(profile.params)
    everything = planner.peak_bytes(profile, planner.Plan(resident=n))
    plan = planner.plan_placement(profile, int(everything - 3 * GB))
    assert plan.fits and plan.hooks and plan.resident == n
    assert plan.recomputed or plan.paged
    # A fast host and no clipping: offloading the last parameters hides behind backward.
    cheap = planner.plan_placement(made_up_profile(host_ns=0.05), int(everything - 1 * GB))
    assert cheap.fits and cheap.resident < n


def test_paged_activations_take_no_more_host_memory_than_there_is():
    # Paging is the cheapest saving here (a slow host, free hooks); with host memory for fewer
    # paged activations than the roomy plan's, the rest of the saving comes from elsewhere, and
    # the leanest plan pages only what fits.
    profile = replace(made_up_profile(host_ns=20.0, clipping=True), hook_s=0.0)
    n = len(profile.params)
    budget = int(planner.peak_bytes(profile, planner.Plan(resident=n)) - 4 * GB)
    roomy = planner.plan_placement(profile, budget)
    paged = planner.paged_host_bytes(profile, roomy)
    assert roomy.fits and paged > 0
    tight = replace(profile, host_room=paged // 2)
    plan = planner.plan_placement(tight, budget)
    assert plan.fits and planner.paged_host_bytes(tight, plan) <= tight.host_room
    assert plan.key() != roomy.key()
    assert "GB for the paged activations (host memory had room for" in planner.describe(plan, tight)
    smallest = planner.smallest_plan(replace(profile, host_room=GB // 4))
    assert smallest.paged == 5 and planner.paged_host_bytes(profile, smallest) == 5 * (GB // 20)  # recomputed inputs
    assert planner.smallest_plan(profile).paged == len(profile.blocks)


def test_fixed_activations_leave_the_blocks_alone_and_ties_are_deterministic():
    profile = made_up_profile(activations=False)
    n = len(profile.params)
    everything = planner.peak_bytes(profile, planner.Plan(resident=n))
    a = planner.plan_placement(profile, int(0.7 * everything))
    b = planner.plan_placement(copy.deepcopy(profile), int(0.7 * everything))
    assert a.key() == b.key() and a.moves == b.moves
    assert not a.hooks and a.paged == 0 and a.recomputed == ()


def test_describe_names_what_lives_where():
    profile = made_up_profile(acc=4)
    plan = planner.plan_placement(profile, 12 * GB)
    text = planner.describe(plan, profile, names=True)
    assert "keep gradient and AdamW state in VRAM" in text and "offloaded" in text
    assert "budget of 12.00 GB" in text and "blocks" in text
    assert "head" in text  # the first parameter to leave


def test_clean_forward_takes_the_waits_between_blocks_out():
    from trainstream.profiler import clean_forward

    # an embedding until 1.0, blocks of 2.0 each with waits of 5.0 before blocks 1 and 2, a head
    blocks = [(1.0, 3.0), (8.0, 10.0), (15.0, 17.0)]
    need = [0.0, 1.5, 9.0, 12.0, 16.0, 17.5]
    cleaned, forward = clean_forward(need, 18.0, blocks)
    assert cleaned == [0.0, 1.5, 4.0, 5.0, 6.0, 7.5]  # 12.0 was a wait: the end of block 1
    assert forward == 8.0
    assert clean_forward(need, 18.0, []) == (need, 18.0)


# ----------------------------------------------------------------------- CPU training
def batches(steps: int, acc: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, 97, (4, 17), generator=g) for _ in range(acc)] for _ in range(steps)]


def make(dtype=torch.float32):
    torch.manual_seed(0)
    model = TinyLM().to(dtype)
    for p in model.blocks[0].parameters():  # frozen parameters stay out of every placement
        p.requires_grad_(False)
    return model, torch.optim.AdamW(param_groups(model), lr=3e-3, betas=(0.9, 0.95))


def train(model, opt, data, clip, autocast=False):
    sched = warmup_cosine(opt, 3, len(data))
    norms = []
    for micro_batches in data:
        for tokens in micro_batches:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = model.loss(tokens) / len(micro_batches)
            loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        norms.append(opt.last_grad_norm)
    opt.synchronize()
    return norms


def assert_same_bits(a, a_opt, b, b_opt, what):
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), (what, n)
        if p.requires_grad:
            for key in ("exp_avg", "exp_avg_sq", "master_param"):
                if key in a_opt.state[p]:
                    assert torch.equal(a_opt.state[p][key].cpu(), b_opt.state[q][key].cpu()), (what, n, key)


def test_placements_keep_the_first_parameters_in_forward_order_whatever_the_groups_order():
    # param_groups puts every norm after every matrix, as the Hugging Face Trainer's groups do: a
    # placement of "the first in forward order" that followed the groups kept the matrices of the
    # last blocks resident and offloaded the norms of the first ones (each gating its block)
    model, opt = make()
    assert [id(p) for g in opt.param_groups for p in g["params"] if p.requires_grad] != \
        [id(p) for p in model.parameters() if p.requires_grad]
    model, opt = trainstream.wrap(model, opt, tuning=trainstream.Tuning(placement=0.5))
    assert [id(s.param) for s in opt.slots.order] == [id(p) for p in model.parameters() if p.requires_grad]
    resident = [s.resident for s in opt.slots.order]
    first_away = resident.index(False)
    assert 0 < first_away and not any(resident[first_away:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("acc,clip,autocast", [(1, None, False), (4, 1.0, False), (1, 1.0, True)],
                         ids=["plain", "clip+acc4", "clip+autocast"])
def test_every_placement_trains_the_same_bits(dtype, acc, clip, autocast):
    # under autocast an offloaded fp32 weight's gradient crosses as bf16: with clipping, the
    # update queued at step() reads it from host memory after its norm has
    data = batches(8, acc)
    runs = {}
    for placement in ("offload", "gpu", 0.5, "auto"):
        model, opt = make(dtype)
        model, opt = trainstream.wrap(model, opt, max_grad_norm=clip, accumulation_steps=acc,
                                      tuning=trainstream.Tuning(placement=placement, track_grad_norm=True))
        norms = train(model, opt, data, clip, autocast)
        runs[placement] = model, opt, norms
    ref, ref_opt, ref_norms = runs["offload"]
    assert ref_opt.report()["placement"]["resident_params"] == 0
    for placement in ("gpu", 0.5, "auto"):
        model, opt, norms = runs[placement]
        assert norms == ref_norms, placement  # the global norm has the same bits too
        assert_same_bits(model, opt, ref, ref_opt, placement)
    half = runs[0.5][1].report()["placement"]
    assert 0 < half["resident_params"] < len(half["params"])
    if clip is not None:
        assert max(ref_norms[:3]) > clip  # clipping was active


def test_auto_placement_under_a_budget_mixes_and_trains_the_same_bits():
    data = batches(6, 2)
    model, opt = make()
    trainable = [p for p in model.parameters() if p.requires_grad]
    weights = sum(p.numel() * 4 for p in model.parameters())
    # room for the weights and the gradient and state (12 bytes) of about half the parameters
    budget = int((weights + 6 * sum(p.numel() for p in trainable)) / 0.9)
    model, opt = trainstream.wrap(model, opt, max_grad_norm=1.0, accumulation_steps=2, vram_budget=budget)
    report = opt.report()["placement"]
    assert report["state"] == "profiling"
    norms = train(model, opt, data, 1.0)
    report = opt.report()["placement"]
    assert report["state"] == "planned"
    assert 0 < report["resident_params"] < len(trainable)
    assert report["expected_peak_bytes"] <= budget - report["reserve_bytes"]
    assert [p["gradient"] for p in report["params"]][:report["resident_params"]] == ["vram"] * report["resident_params"]
    ref, ref_opt = make()
    ref, ref_opt = trainstream.wrap(ref, ref_opt, max_grad_norm=1.0, accumulation_steps=2,
                                    tuning=trainstream.Tuning(placement="offload", track_grad_norm=True))
    assert train(ref, ref_opt, data, 1.0) == norms
    assert_same_bits(model, opt, ref, ref_opt, "auto under a budget")
    text = opt.describe()
    assert "VRAM" in text
    # the resident ones hold no host state (given back, or never taken), the offloaded ones do
    resident = [s for s in opt.slots.order if s.resident]
    offloaded = [s for s in opt.slots.order if s.offloaded]
    assert not any(s.host.holds_state for s in resident) and all(s.host.holds_state for s in offloaded)
    per_param = opt.report()["host_bytes_used"] / sum(s.param.numel() for s in offloaded)
    assert f"({per_param:.1f} B a parameter" in text and per_param < 21  # (accumulation 2: with a sum)


@pytest.mark.parametrize("tuning", [{}, dict(light_recompute=True), dict(recompute=False)],
                         ids=["whole", "light-offered", "page-only"])
def test_a_budget_the_activations_must_meet_pages_or_recomputes_and_trains_the_same_bits(tuning):
    """The planner's activation choices (saved-tensor hooks, paged and recomputed blocks, and
    with them gradients no longer sent as bf16) carried out from the third step, under autocast
    with clipping: the bits of an all-offloaded run with its own paging. Light recompute, when
    offered, is measured in the profiled steps; Tuning(recompute=False) recomputes nothing."""
    light = tuning.get("light_recompute", False)
    g = torch.Generator().manual_seed(1)
    data = [[torch.randint(0, 97, (16, 65), generator=g)] for _ in range(5)]  # activations of 2 MiB

    def big():
        torch.manual_seed(0)
        model = TinyLM(dim=512, layers=3, seq=64)
        return model, torch.optim.AdamW(param_groups(model), lr=3e-3, betas=(0.9, 0.95))

    model, opt = big()
    weights = sum(p.numel() * 4 for p in model.parameters())
    budget = int(weights / 0.88)  # the weights and hardly anything else: activations must go
    model, opt = trainstream.wrap(model, opt, max_grad_norm=1.0, vram_budget=budget,
                                  tuning=trainstream.Tuning(**tuning))
    assert opt.activation_pager is not None and opt.activation_pager.deferred
    norms = train(model, opt, data, 1.0, autocast=True)
    report = opt.report()["placement"]
    print(opt.describe())
    # (whether the hooks are on depends on their measured host time: a loaded machine may find
    # recomputing without them cheaper)
    assert report["state"] == "planned"
    assert {"paged", "recomputed", "recomputed lightly"} & set(report["blocks"])
    if tuning.get("recompute") is False:
        assert not opt.plan.recomputed and not opt.plan.light
    offered = [b.light_bytes is not None for b in opt.profile.blocks]
    assert offered == [light] * 3
    if light:  # each block keeps its matmuls' outputs: less than all its activations, more than none
        assert all(0 < b.light_bytes < b.bytes + b.cast_bytes and b.light_s > 0 for b in opt.profile.blocks)
    assert "paged" not in report["blocks"] or report["saved_tensor_hooks"]
    ref, ref_opt = big()
    ref, ref_opt = trainstream.wrap(ref, ref_opt, max_grad_norm=1.0,
                                    tuning=trainstream.Tuning(placement="offload", track_grad_norm=True))
    assert train(ref, ref_opt, data, 1.0, autocast=True) == norms
    assert_same_bits(model, opt, ref, ref_opt, "planned activations")


def test_the_plan_is_logged_once(caplog):
    model, opt = make()
    model, opt = trainstream.wrap(model, opt)
    with caplog.at_level(logging.INFO, logger="trainstream"):
        train(model, opt, batches(5, 1), None)
    plans = [r for r in caplog.records if "placement:" in r.getMessage()]
    assert len(plans) == 1


@pytest.mark.parametrize("save,load", [("gpu", "offload"), ("offload", 0.5), (0.5, "gpu")])
def test_a_checkpoint_loads_into_another_placement(save, load):
    data = batches(8, 1)
    model, opt = make(torch.bfloat16)
    model, opt = trainstream.wrap(model, opt, tuning=trainstream.Tuning(placement=save))
    train(model, opt, data[:4], None)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    train(model, opt, data[4:], None)
    buf.seek(0)
    ckpt = torch.load(buf)
    resumed, ropt = make(torch.bfloat16)
    resumed, ropt = trainstream.wrap(resumed, ropt, tuning=trainstream.Tuning(placement=load))
    resumed.load_state_dict(ckpt["model"])
    ropt.load_state_dict(ckpt["opt"])
    train(resumed, ropt, data[4:], None)
    assert_same_bits(model, opt, resumed, ropt, f"{save} -> {load}")
    assert set(ropt.state_dict()["state"][0]) >= {"step", "exp_avg", "exp_avg_sq", "master_param"}


def test_a_torch_adamw_checkpoint_loads_into_a_resident_placement():
    data = batches(8, 1)
    ref, ref_opt = make()
    for (tokens,) in data[:4]:
        ref.loss(tokens).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    ckpt = copy.deepcopy({"model": ref.state_dict(), "opt": ref_opt.state_dict()})
    for (tokens,) in data[4:]:
        ref.loss(tokens).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    model, opt = make()
    model, opt = trainstream.wrap(model, opt, tuning=trainstream.Tuning(placement="gpu"))
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    for (tokens,) in data[4:]:
        model.loss(tokens).backward()
        opt.step()
        opt.zero_grad()
    assert max((a - b).abs().max().item() for a, b in zip(ref.parameters(), model.parameters())) <= 3e-7


def test_weights_over_the_budget_are_refused_at_wrap():
    model, opt = make()
    with pytest.raises(trainstream.VramBudgetError, match="weights take .* stay on the GPU"):
        trainstream.wrap(model, opt, vram_budget=1000)


def test_bad_placements_are_refused():
    for bad in ("everywhere", 1.5, -0.1, True):
        model, opt = make()
        with pytest.raises(ValueError, match="placement"):
            trainstream.wrap(model, opt, tuning=trainstream.Tuning(placement=bad))
    for without in (dict(placement="offload"), dict(recompute=False)):  # light recompute is the planner's move
        with pytest.raises(ValueError, match="light_recompute=True .* placement='auto' and recompute=True"):
            trainstream.Tuning(light_recompute=True, **without)


def test_recomputing_needs_no_saved_tensor_hooks_when_they_cost_more():
    profile = made_up_profile()
    costly = replace(profile, hook_s=0.040)  # the hooks' host time, as measured on a 1B model
    full = planner.peak_bytes(costly, planner.Plan(resident=len(costly.params)))
    plan = planner.plan_placement(costly, full - 3 * GB)
    assert plan.fits and not plan.hooks and plan.recomputed
    assert plan.step_terms["hooks_s"] == 0.0 and plan.step_terms["recompute_s"] > 0
    # a recomputed block without hooks drops its autocast copies with its activations
    one = planner.Plan(resident=len(costly.params), recomputed=(3,))
    block = costly.blocks[3]
    assert full - planner.peak_bytes(costly, one) == block.bytes + block.cast_bytes - block.input_bytes
    assert "torch's checkpointing" in planner.describe(plan, costly)
    # cheap hooks are still worth their recast copies
    assert planner.plan_placement(replace(profile, hook_s=0.0005), full - 3 * GB).hooks


def test_the_profile_measures_the_hooks_host_time_less_their_paging():
    model, opt = make()
    weights = sum(p.numel() * 4 for p in model.parameters())
    model, opt = trainstream.wrap(model, opt, max_grad_norm=1.0, vram_budget=10 * weights)
    pager = opt.activation_pager
    pager.min_bytes = 0  # (this model's activations are all smaller than what is worth a copy)
    train(model, opt, batches(3, 1), 1.0)
    figures = pager.last  # the profiled step's (the profile pages every block but the last)
    assert 0 < figures.paging_seconds < figures.hook_seconds
    recasts = opt.profile.hook_s - (figures.hook_seconds - figures.paging_seconds)
    assert 0 <= recasts < 1e-3  # the device's recasts, estimated from their bytes
    # a plan that pages nothing skips the kept tensors' bookkeeping: it is measured, and left out
    assert 0 < figures.keeping_seconds < figures.hook_seconds
    lean = opt.profile.hook_s - figures.keeping_seconds
    assert opt.profile.lean_hook_s == pytest.approx(max(lean, recasts), abs=1e-12)


def test_a_blocks_recompute_is_rated_by_its_share_of_the_replayed_forward(monkeypatch):
    from trainstream import profiler

    model, opt = make()
    weights = sum(p.numel() * 4 for p in model.parameters())
    model, opt = trainstream.wrap(model, opt, max_grad_norm=1.0, vram_budget=10 * weights)
    opt.activation_pager.min_bytes = 0
    train(model, opt, batches(3, 1), 1.0)
    profile = opt.profile
    spans = profiler.block_spans([p.need_s for p in profile.params], [p.block for p in profile.params],
                                 len(profile.blocks), profile.forward_s)
    assert spans[0] is None and all(span > 0 for span in spans[1:])  # (block 0 is frozen)
    assert [b.recompute_s for b in profile.blocks[1:]] == [profiler.RECOMPUTE_PER_FORWARD * span for span in spans[1:]]
    assert profile.blocks[0].recompute_s is None
    # where the forward could not be replayed, its profiled time stands
    monkeypatch.setattr(profiler.StepProfiler, "_replay_seconds", lambda self: None)
    model, opt = make()
    model, opt = trainstream.wrap(model, opt, max_grad_norm=1.0, vram_budget=10 * weights)
    opt.activation_pager.min_bytes = 0
    train(model, opt, batches(3, 1), 1.0)
    assert opt.profile.blocks and all(b.recompute_s is None for b in opt.profile.blocks)


def test_hooks_that_page_nothing_cost_their_lean_time():
    # a slow host: offloading costs more than the hooks' autocast copies save
    profile = replace(made_up_profile(host_ns=20.0, clipping=True), hook_s=0.040, lean_hook_s=0.002)
    n = len(profile.params)
    full = planner.peak_bytes(profile, planner.Plan(resident=n))
    hooked = planner.Plan(resident=n, hooks=True)
    assert planner.step_seconds(profile, hooked)[1]["hooks_s"] == 0.002
    assert planner.step_seconds(profile, replace(hooked, paged=1))[1]["hooks_s"] == 0.040
    # cheap lean hooks are the first saving (the autocast copies), where the paging hooks were not
    saved = full - planner.peak_bytes(profile, hooked)
    budget = int((full - saved // 2) / (1 - planner.RESERVE_FRACTION))
    plan = planner.plan_placement(profile, budget)
    assert plan.hooks and plan.paged == 0 and plan.resident == n and plan.step_terms["hooks_s"] == 0.002
    assert not planner.plan_placement(replace(profile, lean_hook_s=None), budget).hooks


def test_a_re_plan_recomputes_after_a_plan_that_needed_no_hooks():
    """A plan that keeps every block detaches the pager; a later plan (the re-plan after a step
    over its budget) that recomputes must hook the model again, and train the same bits."""
    data = batches(6, 1)
    model, opt = make()
    weights = sum(p.numel() * 4 for p in model.parameters())
    model, opt = trainstream.wrap(model, opt, max_grad_norm=1.0, vram_budget=100 * weights)
    train(model, opt, data[:3], 1.0)
    assert opt.plan is not None and opt.activation_pager is None  # everything kept: no hooks
    opt.promotion.apply(replace(opt.plan, recomputed=(1,)))
    assert opt.report()["placement"]["blocks"] == ["kept", "recomputed", "kept"]
    pager = opt.activation_pager
    assert pager is not None and "forward" in model.blocks[1].__dict__
    calls = []
    inner = next(m for m in model.blocks[1].modules() if isinstance(m, torch.nn.Linear))
    inner.register_forward_hook(lambda *_: calls.append(1))
    norms = train(model, opt, data[3:], 1.0)
    assert len(calls) == 6  # each forward, then its recompute in backward
    ref, ref_opt = make()
    ref, ref_opt = trainstream.wrap(ref, ref_opt, max_grad_norm=1.0,
                                    tuning=trainstream.Tuning(placement="offload", track_grad_norm=True))
    train(ref, ref_opt, data[:3], 1.0)  # (the same two schedules)
    assert train(ref, ref_opt, data[3:], 1.0) == norms
    assert_same_bits(model, opt, ref, ref_opt, "re-planned")


@pytest.mark.parametrize("env,turned_on,on", [({}, True, True),
                                              ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, False, False),
                                              ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:64,expandable_segments:True"},
                                               False, True)])
def test_the_planner_turns_on_expandable_segments_unless_the_user_chose(monkeypatch, env, turned_on, on):
    wrapping = importlib.import_module("trainstream.wrap")  # (the package's `wrap` is the function)
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    calls, deprecated = [], []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", deprecated.append, raising=False)
    assert wrapping.expandable_segments() is on
    assert calls == (["expandable_segments:True"] if turned_on else []) and deprecated == []
    # an older torch has the CUDA setting only
    monkeypatch.delattr(torch._C, "_accelerator_setAllocatorSettings")
    assert wrapping.expandable_segments() is on
    assert deprecated == (["expandable_segments:True"] if turned_on else [])


@pytest.mark.parametrize("usable_gb,expandable,margin_gb", [(24, False, 1.2), (24, True, 0.537), (8, True, 0.537),
                                                           (0.7, True, 0.07), (100, True, 2.0)])
def test_the_default_budget_leaves_a_smaller_margin_with_expandable_segments(usable_gb, expandable, margin_gb):
    wrapping = importlib.import_module("trainstream.wrap")
    margin = wrapping.fragmentation_margin(int(usable_gb * 1e9), expandable)
    assert margin == pytest.approx(margin_gb * 1e9, rel=1e-3)


def lightly(profile: planner.Profile, kept: float = 0.4, seconds: float = 0.0003) -> planner.Profile:
    """`profile` with light recompute offered: each block keeps `kept` of its activations besides
    its inputs and reruns its cheap ops in `seconds`."""
    return replace(profile, blocks=[replace(b, light_bytes=int(kept * b.bytes), light_s=seconds)
                                    for b in profile.blocks])


def test_light_recompute_is_taken_first_where_it_saves_enough_and_blocks_go_whole_after():
    profile = lightly(replace(made_up_profile(host_ns=20.0, clipping=True), hook_s=0.040))
    n = len(profile.params)
    full = planner.peak_bytes(profile, planner.Plan(resident=n))
    one = planner.Plan(resident=n, light=(3,))
    block = profile.blocks[3]
    assert full - planner.peak_bytes(profile, one) == block.bytes + block.cast_bytes - block.light_bytes - block.input_bytes
    assert planner.step_seconds(profile, one)[1]["recompute_s"] == pytest.approx(0.0003)
    # 3 GB: light recompute of a few blocks is enough, and costs far less than whole recomputes
    plan = planner.plan_placement(profile, full - 3 * GB)
    assert plan.fits and plan.light and not plan.recomputed and plan.resident == n
    assert plan.step_terms["recompute_s"] < profile.blocks[0].forward_s
    assert "recomputed lightly" in planner.describe(plan, profile)
    assert planner.block_kinds(plan, profile).count("recomputed lightly") == len(plan.light)
    # a budget light recompute cannot meet (and no host memory to page into): blocks recomputed
    # lightly before are recomputed whole
    tight = planner.plan_placement(replace(profile, host_room=0), full - 8 * GB)
    assert tight.fits and tight.recomputed
    assert not set(tight.recomputed) & set(tight.light)
    # not offered (Tuning(light_recompute=False)): the plan of before
    plain = replace(profile, blocks=[replace(b, light_bytes=None, light_s=0.0) for b in profile.blocks])
    assert planner.plan_placement(plain, full - 3 * GB).light == ()
    # a block is recomputed one way or the other: nested checkpoints would fail in backward
    with pytest.raises(ValueError, match=r"blocks \[2\] are both recomputed and recomputed lightly"):
        replace(one, recomputed=(2,), light=(2, 3))


def test_a_lightly_recomputed_block_in_the_paged_range_pages_only_its_inputs():
    profile = lightly(made_up_profile())
    n = len(profile.params)
    plan = planner.Plan(resident=n, hooks=True, paged=2, light=(1,))
    block = profile.blocks[1]
    assert planner.held_bytes(profile, plan, 1) == block.light_bytes
    assert planner.paged_host_bytes(profile, plan) == profile.blocks[0].bytes + block.input_bytes
    assert planner.held_bytes(profile, replace(plan, paged=1), 1) == block.light_bytes + block.input_bytes


def test_light_recompute_is_not_offered_to_a_compiled_model():
    model, opt = make()
    weights = sum(p.numel() * 4 for p in model.parameters())
    model, opt = trainstream.wrap(model, opt, max_grad_norm=1.0, vram_budget=10 * weights,
                                  tuning=trainstream.Tuning(light_recompute=True))
    block = model.blocks[1]
    block._compiled_call_impl = block._call_impl  # what nn.Module.compile() leaves, without the compiling
    train(model, opt, batches(3, 1), 1.0)
    assert opt.profile.blocks and all(b.light_bytes is None for b in opt.profile.blocks)


def test_blocks_that_must_not_run_twice_are_never_recomputed():
    profile = lightly(replace(made_up_profile(), hook_s=0.040))  # (recomputing is the cheapest move here)
    full = planner.peak_bytes(profile, planner.Plan(resident=len(profile.params)))
    assert planner.plan_placement(profile, full - 3 * GB).light
    plan = planner.plan_placement(replace(profile, recompute=False), full - 3 * GB)  # Tuning(recompute=False)
    assert plan.fits and not plan.recomputed and not plan.light
    assert not planner.smallest_plan(replace(profile, recompute=False)).recomputed


def test_a_recorded_profile_reads_back_and_bounds_a_step():
    profile = lightly(made_up_profile(blocks=4))
    recorded = json.loads(json.dumps(asdict(profile)))  # report()["placement"]["profile"], saved as JSON
    assert planner.profile_from(recorded) == profile
    plan = planner.Plan(resident=0, streamed=2, light=(0,))
    bound = planner.bound_seconds(profile, plan)
    assert bound["gpu_s"] == pytest.approx(0.025 + 0.050 + 0.0003)
    assert bound["host_s"] == pytest.approx(sum(p.numel for p in profile.params) * 0.25e-9)
    # up: the updated weights outside the two streamed blocks (whose made-up costs record no
    # weights to stream); down: every gradient, 2 bytes an element without accumulation
    outside = 65_000_000 + 8 * 25_000_000 + 65_000_000
    assert bound["h2d_s"] == pytest.approx(4 * outside / 50e9)
    assert bound["d2h_s"] == pytest.approx(2 * sum(p.numel for p in profile.params) / 50e9)
    assert bound["copies_s"] == bound["h2d_s"]
    assert bound["bound_s"] == max(bound["gpu_s"], bound["host_s"])
    # with accumulation the host sums cross both ways every micro-batch
    summed = planner.bound_seconds(replace(profile, accumulation_steps=8), plan)
    elements = sum(p.numel for p in profile.params)
    assert summed["d2h_s"] == pytest.approx(8 * 4 * elements / 50e9)
    assert summed["h2d_s"] == pytest.approx((4 * outside + 7 * 4 * elements) / 50e9)
    # where weights stream, the engine's threads add them (Tuning(add_on_host=None)): nothing read back
    # (bf16 weights: an fp32 one's gradients land in its sum)
    threads = replace(profile, accumulation_steps=8, add_on_host=None)
    assert not planner.adds_on_host(threads, plan)
    threads = replace(threads, params=[replace(p, element_size=2) for p in profile.params])
    assert planner.adds_on_host(threads, plan) and not planner.adds_on_host(threads, replace(plan, streamed=0))
    on_host = planner.bound_seconds(threads, plan)
    assert on_host["d2h_s"] == pytest.approx(8 * 2 * elements / 50e9)
    assert on_host["h2d_s"] == pytest.approx(2 * outside / 50e9)
    assert planner.step_seconds(threads, plan)[1]["host_summing_s"] == 0.0
    assert planner.step_seconds(replace(threads, add_on_host=False), plan)[1]["host_summing_s"] > 0


def test_micro_batches_the_threads_cannot_add_in_time_hold_the_step_and_count_in_its_bound():
    """Added on the engine's threads at a measured rate: within a micro-batch they cost nothing,
    past it they hold the next one back; the bound counts them as host work beside the updates."""
    profile = made_up_profile(acc=8, dtype_bytes=2)
    profile = replace(profile, add_on_host=True)
    plan = planner.Plan(resident=0, streamed=2)
    elements = sum(p.numel for p in profile.params)
    unmeasured = planner.bound_seconds(profile, plan)
    assert unmeasured["host_adds_s"] == 0.0 and planner.step_seconds(profile, plan)[1]["host_summing_s"] == 0.0
    hidden = replace(profile, host_add_s_per_element=1e-12)  # 0.4 ms a micro-batch: hidden
    assert planner.step_seconds(hidden, plan)[1]["host_summing_s"] == 0.0
    slow = replace(profile, host_add_s_per_element=1e-9)  # 0.4 s a micro-batch against 75 ms
    micro = profile.forward_s + profile.backward_s + planner.recompute_seconds(profile, plan)
    total, terms = planner.step_seconds(slow, plan)
    assert terms["host_summing_s"] > 7 * (elements * 1e-9 - micro - 0.01)
    assert total > planner.step_seconds(profile, plan)[0] + terms["host_summing_s"] - 1e-9
    bound = planner.bound_seconds(slow, plan)
    assert bound["host_adds_s"] == pytest.approx(7 * elements * 1e-9)
    assert bound["host_s"] == pytest.approx(bound["host_updates_s"] + bound["host_adds_s"])
    assert bound["bound_s"] == bound["host_s"]
    # a kernel adding them (Tuning(add_on_host=False)) leaves the threads nothing to add
    assert planner.bound_seconds(replace(slow, add_on_host=False), plan)["host_adds_s"] == 0.0


def test_blocks_that_write_into_their_matmuls_outputs_are_not_offered_light_recompute():
    class ReluNet(torch.nn.Module):  # an in-place ReLU after each block's first layer
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Sequential(
                torch.nn.Linear(64, 256), torch.nn.ReLU(inplace=True), torch.nn.Linear(256, 64)) for _ in range(3))

        def forward(self, x):
            for block in self.blocks:
                x = x + block(x)
            return x.square().mean()

    torch.manual_seed(0)
    model = ReluNet()
    weights = sum(p.numel() * 4 for p in model.parameters())
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), vram_budget=10 * weights,
                                  tuning=trainstream.Tuning(light_recompute=True))
    for _ in range(3):
        model(torch.randn(8, 64)).backward()
        opt.step()
        opt.zero_grad()
    assert opt.profile.blocks and all(b.light_bytes is None for b in opt.profile.blocks)


def test_blocks_the_model_checkpoints_itself_are_never_recomputed_a_second_time():
    profile = made_up_profile()
    own = replace(profile, blocks=[replace(b, checkpointed=j % 2 == 0) for j, b in enumerate(profile.blocks)])
    full = planner.peak_bytes(own, planner.Plan(resident=len(own.params)))
    plan = planner.plan_placement(own, full - 3 * GB)
    assert plan.fits and plan.recomputed and not any(own.blocks[j].checkpointed for j in plan.recomputed)
    assert not any(own.blocks[j].checkpointed for j in planner.smallest_plan(own).recomputed)
    kinds = planner.block_kinds(plan, own)
    assert [k == "recomputed by the model" for k in kinds] == [
        b.checkpointed and j not in plan.recomputed and not (plan.hooks and j < plan.paged)
        for j, b in enumerate(own.blocks)]
    assert "the model recomputes 4 blocks itself" in planner.describe(plan, own)


def test_hugging_face_gradient_checkpointing_is_detected_and_said():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
                                      use_cache=False)

    def run(tuning, checkpointing=True):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = trainstream.wrap(model, opt, max_grad_norm=1.0, tuning=tuning,
                                      **({"vram_budget": "1GB"} if tuning is None else {}))
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            tokens = torch.randint(0, 256, (2, 16), generator=g)
            model(input_ids=tokens, labels=tokens).loss.backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        return model, opt

    model, opt = run(None)
    assert opt.report()["placement"]["blocks"] == ["recomputed by the model"] * 3
    assert "the model recomputes 3 blocks itself" in opt.describe()
    ref, ref_opt = run(trainstream.Tuning(placement="offload", track_grad_norm=True))
    assert_same_bits(model, opt, ref, ref_opt, "the model's own checkpointing")
    _, plain = run(None, checkpointing=False)
    assert "recomputed by the model" not in plain.report()["placement"]["blocks"]
