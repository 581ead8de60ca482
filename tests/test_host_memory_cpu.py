"""Host memory (CPU mode): the host budget's default from the machine, offloaded state refused
before anything is pinned when it does not fit, speculation trading its coverage against what is
left, every byte held listed against the budget, a resident parameter's host memory given back
and taken again when it is offloaded, what a used process still holds given back or named, and wrap()
saying what it is doing."""

from __future__ import annotations

import gc
import importlib
import os
import weakref
from dataclasses import replace

import pytest
import torch

import trainstream
from trainstream import host_budget as hb
from trainstream._native import _C
from trainstream.fixtures import TinyLM, param_groups
from trainstream.optimizer import wrapped_by

GIB = 1 << 30


def _cgroup(tmp_path, lines: str, files: dict) -> tuple[str, str]:
    root = tmp_path / "cgroup"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    own = tmp_path / "self_cgroup"
    own.write_text(lines)
    return str(root), str(own)


def test_cgroup_room_reads_v2_and_v1_limits_and_knows_no_limit(tmp_path):
    root, own = _cgroup(tmp_path / "v2", "0::/job/a\n", {"job/a/memory.max": "8589934592\n",
                                                         "job/a/memory.current": "1073741824\n"})
    assert hb.cgroup_room(root, own) == 7 * GIB
    # the inactive file cache is reclaimed before the limit refuses anything: not counted as used
    root, own = _cgroup(tmp_path / "v2cache", "0::/job\n", {"job/memory.max": str(8 * GIB),
                                                            "job/memory.current": str(5 * GIB),
                                                            "job/memory.stat": f"anon 1\ninactive_file {3 * GIB}\n"})
    assert hb.cgroup_room(root, own) == 6 * GIB
    root, own = _cgroup(tmp_path / "v2max", "0::/job\n", {"job/memory.max": "max\n", "job/memory.current": "5\n"})
    assert hb.cgroup_room(root, own) is None
    root, own = _cgroup(tmp_path / "v1", "4:memory:/x\n", {"memory/memory.limit_in_bytes": str(4 * GIB),
                                                           "memory/memory.usage_in_bytes": str(2 * GIB),
                                                           "memory/memory.stat": f"total_inactive_file {GIB}\n"})
    assert hb.cgroup_room(root, own) == 3 * GIB
    root, own = _cgroup(tmp_path / "v1none", "4:memory:/x\n", {"memory/memory.limit_in_bytes": str(1 << 63),
                                                               "memory/memory.usage_in_bytes": "0"})
    assert hb.cgroup_room(root, own) is None
    assert hb.cgroup_room(str(tmp_path / "nowhere"), str(tmp_path / "nothing")) is None


@pytest.mark.parametrize("available, margin", [(100 * GIB, 10 * GIB), (20 * GIB, 4 * GIB), (2 * GIB, 4 * GIB)])
def test_the_default_budget_is_what_the_process_may_take_less_a_stated_margin(monkeypatch, available, margin):
    monkeypatch.setattr(_C, "host_memory_available", lambda: available)
    monkeypatch.setattr(hb, "cgroup_room", lambda: None)
    budget = hb.read_host_budget(None)
    assert (budget.limit, budget.margin, budget.available) == (max(0, available - margin), margin, available)
    assert "MemAvailable" in budget.source and "margin" in budget.describe(0)


def test_a_cgroup_limit_below_memavailable_sets_the_default(monkeypatch):
    monkeypatch.setattr(_C, "host_memory_available", lambda: 100 * GIB)
    monkeypatch.setattr(hb, "cgroup_room", lambda: 50 * GIB)
    budget = hb.read_host_budget(None)
    assert budget.available == 50 * GIB and budget.limit == 45 * GIB and "cgroup" in budget.source


def test_a_given_budget_is_read_as_a_size_and_bad_ones_are_refused():
    assert hb.read_host_budget("2GiB").limit == 2 * GIB
    assert hb.read_host_budget(123456).limit == 123456
    for bad, error in (("lots", ValueError), (-1, ValueError), (True, TypeError)):
        with pytest.raises(error, match="host_budget|size"):
            hb.read_host_budget(bad)


def test_state_that_does_not_fit_the_budget_is_refused_before_anything_is_pinned(monkeypatch):
    made = []
    host_pipeline = _C.host_pipeline
    monkeypatch.setattr(_C, "host_pipeline", lambda *a, **k: made.append(host_pipeline(*a, **k)) or made[-1])
    model = TinyLM()
    numel = sum(p.numel() for p in model.parameters())
    with pytest.raises(trainstream.HostMemoryError, match="the host budget is") as caught:
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()), tuning=trainstream.Tuning(placement="offload"),
                         host_budget=16 * numel - 1)  # fp32: master, two moments, a landing buffer
    assert "Nothing was pinned" in str(caught.value) and "host_budget" in str(caught.value)
    assert made and made[-1].host_reserved_bytes == 0
    assert all(wrapped_by(p) is None for p in model.parameters())
    # what stays on the GPU from the start needs none: the same budget holds a half-resident model
    _, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), tuning=trainstream.Tuning(placement=0.5),
                              host_budget=16 * numel - 1)
    assert opt.report()["placement"]["resident_params"] > 0


def _clipped(host_budget, steps: int = 0):
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(param_groups(model), lr=1e-3)
    model, opt = trainstream.wrap(model, opt, max_grad_norm=1e9, tuning=trainstream.Tuning(placement="offload"),
                                  host_budget=host_budget)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model.loss(torch.randint(0, 97, (4, 17), generator=g)).backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    return model, opt


def test_speculation_takes_what_the_budget_leaves_and_every_held_byte_is_listed():
    _, roomy = _clipped(None)
    held = roomy.host_memory()
    total = len(roomy.slots.order)
    assert roomy.speculation["params"] == total and held["speculation"] == roomy.speculation["host_bytes"] > 0
    assert held["state"] == roomy.report()["host_bytes_reserved"]
    report = roomy.report()["host_budget"]
    assert report["held_bytes"] == held and sum(held.values()) <= report["limit_bytes"]
    assert "held," in roomy.describe() and "host budget" in roomy.describe()

    # A budget that holds the state and a part of the second sets: the first gradients to arrive
    # speculate, the others wait for the norm, and nothing goes over the budget.
    budget = held["state"] + held["speculation"] // 3
    model, tight = _clipped(budget, steps=3)
    spec = tight.speculation
    assert 0 < spec["params"] < total and spec["host_bytes"] <= held["speculation"] // 3
    assert sum(tight.host_memory().values()) <= budget
    assert f"the other {total - spec['params']} wait for it" in tight.describe()
    assert spec["hits"] == 3
    # the bits are the roomy run's: only when the updates ran changed
    model_roomy, roomy = _clipped(None, steps=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model_roomy.parameters()))

    # no room beyond the state: every update waits for the norm
    _, bare = _clipped(held["state"])
    assert bare.speculation["params"] == 0
    assert "wait for the global norm" in bare.describe()


def test_wrap_says_what_it_is_doing_and_how_long_it_took(caplog):
    model = TinyLM()
    with caplog.at_level("INFO", logger="trainstream"):
        _, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), max_grad_norm=1.0)
    text = caplog.text
    assert "host memory for 0.00B offloaded parameters: done in" in text
    assert "the second step is profiled" in text and "wrap() done in" in text
    g = torch.Generator().manual_seed(1)
    with caplog.at_level("INFO", logger="trainstream"):
        for _ in range(2):
            model.loss(torch.randint(0, 97, (4, 17), generator=g)).backward()
            opt.step()
            opt.zero_grad()
    assert "planning from the profiled step: done in" in caplog.text and opt.plan is not None


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _steps(model, opt, g, n: int) -> None:
    for _ in range(n):
        model.loss(torch.randint(0, model.head.out_features, (4, 17), generator=g)).backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the process's RSS from /proc")
def test_a_parameter_made_resident_gives_its_host_memory_back_and_takes_it_again_when_offloaded():
    torch.manual_seed(0)
    model = TinyLM(vocab=4096, dim=256, layers=4)
    numel = sum(p.numel() for p in model.parameters())
    model, opt = trainstream.wrap(model, torch.optim.AdamW(param_groups(model), lr=1e-3), max_grad_norm=1.0)
    g = torch.Generator().manual_seed(1)
    _steps(model, opt, g, 1)  # profiling: every parameter offloaded
    profiled, rss = opt.report()["host_bytes_reserved"], _rss()
    assert profiled >= 16 * numel
    _steps(model, opt, g, 1)  # the plan: everything fits, everything resident
    assert opt.plan is not None and all(s.resident for s in opt.slots.order)
    assert opt.report()["host_bytes_reserved"] == 0 and opt.host_memory()["state"] == 0
    assert not any(s.host.holds_state for s in opt.slots.order)
    # the slabs went back to the OS (here in CPU mode the resident moments take host memory too)
    assert rss - _rss() >= 4 * numel
    with pytest.raises(ValueError, match="given back"):
        opt.slots.order[0].host.view("exp_avg")
    _steps(model, opt, g, 1)  # a resident step

    # offloaded again (as a re-plan may): fresh host state, the resident one copied in, and the
    # training goes on with the bits of a run that stayed offloaded all along
    opt.promotion.apply(replace(opt.plan, resident=0))
    assert all(s.offloaded and s.host.holds_state for s in opt.slots.order)
    assert opt.report()["host_bytes_reserved"] >= 16 * numel
    _steps(model, opt, g, 2)
    torch.manual_seed(0)
    ref = TinyLM(vocab=4096, dim=256, layers=4)
    ref, ref_opt = trainstream.wrap(ref, torch.optim.AdamW(param_groups(ref), lr=1e-3), max_grad_norm=1.0,
                                    tuning=trainstream.Tuning(placement="offload"))
    _steps(ref, ref_opt, torch.Generator().manual_seed(1), 5)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    for s, r in zip(opt.slots.order, ref_opt.slots.order):
        assert torch.equal(s.state["exp_avg_sq"], r.state["exp_avg_sq"])


@pytest.mark.parametrize("roomy", [True, False], ids=["pages-nothing", "pages-as-profiled"])
def test_the_activation_slots_the_plan_does_not_page_into_go_back_after_its_first_step(roomy):
    """The profiled step pages every block but the last; a plan that pages nothing gives those
    slots back, one that pages the same blocks keeps them and takes no more."""
    torch.manual_seed(0)
    model = TinyLM(dim=512, layers=3, seq=64)  # activations of 2 MiB: worth paging
    weights = sum(p.numel() * 4 for p in model.parameters())
    model, opt = trainstream.wrap(model, torch.optim.AdamW(param_groups(model), lr=1e-3), max_grad_norm=1.0,
                                  vram_budget="100GB" if roomy else int(weights / 0.88))
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 97, (16, 65), generator=g) for _ in range(4)]

    def step(batch):
        model.loss(batch).backward()
        opt.step()
        opt.zero_grad()

    step(data[0])
    profiled, slots = opt.host_memory()["activation_slots"], opt.promotion.pager.native.stats()["slots"]
    assert opt.promotion.state == "profiling" and profiled > 0
    for batch in data[1:]:
        step(batch)
    native = opt.promotion.pager.native.stats()
    if roomy:
        assert opt.plan.paged == 0 and opt.host_memory()["activation_slots"] == 0 and native["slots"] == 0
        assert "slots for paged activations" not in opt.describe()
    else:
        assert opt.plan.paged > 0 and opt.host_memory()["activation_slots"] == profiled
        assert native["slots"] == slots and native["paged_in_bytes"] == native["paged_out_bytes"] > 0


@pytest.mark.parametrize("dtype, acc, per_param", [(torch.float32, 1, 16), (torch.float32, 4, 16),
                                                   (torch.bfloat16, 1, 14), (torch.bfloat16, 4, 18)])
def test_each_configuration_takes_the_bytes_it_states(dtype, acc, per_param):
    """Master, two moments, an accumulator with accumulation, and a landing buffer in the weight
    dtype, except for fp32 weights summing micro-batches, whose gradients land in the accumulator:
    what wrap() plans is what the pipeline takes, training as it goes."""
    torch.manual_seed(0)
    model = TinyLM(vocab=4096, dim=256, layers=2).to(dtype)
    numel = sum(p.numel() for p in model.parameters())
    assert importlib.import_module("trainstream.wrap").host_bytes_per_param(dtype, acc > 1) == per_param
    model, opt = trainstream.wrap(model, torch.optim.AdamW(param_groups(model), lr=1e-3), accumulation_steps=acc,
                                  tuning=trainstream.Tuning(placement="offload"))
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        for _ in range(acc):
            model.loss(torch.randint(0, 4096, (4, 17), generator=g)).backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    assert opt.engine.pipeline.host_used_bytes == pytest.approx(per_param * numel, rel=0.01)
    assert all(s.host.has_accumulator == (acc > 1) for s in opt.slots.order)
    landing = not (acc > 1 and dtype == torch.float32)
    assert all(s.host.has_landing_buffer == landing for s in opt.slots.order)
    assert ("a gradient buffer" in opt.describe()) == landing


def test_a_used_process_gives_back_what_it_no_longer_uses_and_names_what_it_still_holds():
    """remove_hooks() then dropping the optimizer gives its host memory back at once, without the
    garbage collector; a model and optimizer dropped still hooked together (a reference cycle) go
    when the next wrap() runs; one still alive is named in describe() and report()."""
    gc.collect()
    gc.disable()  # only what TrainStream does may collect them
    try:
        model, opt = _clipped(None, steps=2)
        pipeline = weakref.ref(opt.engine.pipeline)
        opt.remove_hooks()
        del opt
        assert pipeline() is None

        model, opt = _clipped(None, steps=2)
        pipeline = weakref.ref(opt.engine.pipeline)
        del model, opt
        assert pipeline() is not None  # (a cycle: the model's hooks hold the optimizer)
        _, fresh = _clipped(None)
        assert pipeline() is None  # wrap() collected it before it read the host budget
        assert fresh.report()["held_elsewhere_at_wrap"] == {"vram_bytes": 0, "host_bytes": 0, "host_optimizers": 0}
        assert "elsewhere in this process" not in fresh.describe()

        _, third = _clipped(None)  # `fresh` is still alive and holds its state
        held = third.report()["held_elsewhere_at_wrap"]
        assert held["host_optimizers"] == 1 and held["host_bytes"] == sum(fresh.host_memory().values()) > 0
        assert "held by 1 other TrainStream optimizer(s) still alive" in third.describe()
    finally:
        gc.enable()
