"""Clipping without waiting (CPU mode, and on the GPU where marked): offloaded updates start speculatively during backward
with a clip coefficient of 1 and are committed, or redone from the untouched state, once step()
knows the global norm. Every branch must give the waiting path's bits."""

from __future__ import annotations

import pytest
import torch

import trainstream
from trainstream.baselines import keep_terms_on_host
from trainstream.fixtures import TinyLM, param_groups
from trainstream.slots import Engine

# max_grad_norm per step: hits, a mispredicted clip (miss), a wait after it, hits again
THRESHOLDS = [1e9, 1e9, 1e-3, 1e-3, 1e9, 1e9, 1e9]


def run(*, speculate: bool, acc: int = 1, dtype=torch.float32, placement="offload", in_vram=None,
        thresholds=THRESHOLDS, device="cpu", engine_waits=True, hold_terms=True):
    """Trains a few steps with max_grad_norm changed per step; returns losses, norms, weights,
    optimizer state and the optimizer. On CUDA under bf16 autocast (fp32 weights' gradients then
    cross as bf16). `engine_waits=False` has step() read the clip coefficient on the host even
    where every norm is on the device (as it does under DDP); the optimizer's `verdicts` counts the
    windows whose coefficient the host engine waited for instead. `hold_terms=False` keeps speculated
    fp32 terms in host memory until the commit, as a budget without room for them does."""
    torch.manual_seed(0)
    model = TinyLM().to(device, dtype)
    opt = torch.optim.AdamW(param_groups(model), lr=3e-3, betas=(0.9, 0.95))
    model, opt = trainstream.wrap(model, opt, max_grad_norm=thresholds[0], accumulation_steps=acc,
                                  tuning=trainstream.Tuning(placement=placement, accumulate_in_vram=in_vram))
    opt.speculative_clipping = speculate
    if not hold_terms:
        keep_terms_on_host(opt)
    opt.verdicts = []
    if engine_waits:
        land = opt.clipping.land_verdict
        opt.clipping.land_verdict = lambda *args: opt.verdicts.append(1) or land(*args)
    else:
        opt.clipping.verdict_on_device = lambda: False
    g = torch.Generator(device=device).manual_seed(1)
    losses, norms = [], []
    for threshold in thresholds:
        opt.max_grad_norm = threshold
        for _ in range(acc):
            with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
                loss = model.loss(torch.randint(0, 97, (4, 17), generator=g, device=device)) / acc
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
        norms.append(opt.last_grad_norm)
    opt.synchronize()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters() if p in opt.state]
    return losses, norms, state, moments, opt


def assert_same_bits(a, b):
    assert a[0] == b[0]  # losses
    assert a[1] == b[1]  # norms
    for k in a[2]:
        assert torch.equal(a[2][k], b[2][k]), k
    assert len(a[3]) == len(b[3])
    for x, y in zip(a[3], b[3]):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k


@pytest.mark.parametrize("acc,dtype,in_vram,placement,hold", [
    (1, torch.float32, None, "offload", True),
    (1, torch.float32, None, "offload", False),
    (4, torch.float32, True, "offload", True),
    (1, torch.bfloat16, None, "offload", True),
    (4, torch.bfloat16, None, "offload", True),  # bf16: host sums, which wait for the norm
    (1, torch.float32, None, 0.5, True),  # one global norm over resident and offloaded parts
], ids=["fp32", "fp32-terms-in-host", "fp32-acc4-vram-sums", "bf16", "bf16-acc4-host-sums", "fp32-half-resident"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_speculation_gives_the_waiting_paths_bits(acc, dtype, in_vram, placement, hold, device):
    waiting = run(speculate=False, acc=acc, dtype=dtype, placement=placement, in_vram=in_vram, device=device)
    speculating = run(speculate=True, acc=acc, dtype=dtype, placement=placement, in_vram=in_vram, device=device,
                      hold_terms=hold)
    assert_same_bits(waiting, speculating)
    spec = speculating[4].report()["speculation"]
    if acc > 1 and dtype == torch.bfloat16:
        assert spec["params"] == 0 and spec["hits"] == 0  # host-summed: nothing to speculate on
        return
    assert spec["params"] > 0 and spec["host_bytes"] > 0
    # fp32 terms await the verdict in their gradients' memory, unless told otherwise
    assert (spec["terms_held"] > 0) == (dtype == torch.float32 and hold)
    assert not speculating[4].clipping.holds_terms()  # (synchronize() gave that memory back)
    # steps 1-2 hit, 3 misses (predicted no clip), 4 waits (3 clipped), 5 waits (4 clipped), 6-7 hit
    assert (spec["hits"], spec["misses"], spec["waited"]) == (4, 1, 2)
    assert waiting[4].report()["speculation"]["hits"] == 0


@pytest.mark.parametrize("speculate", [False, True], ids=["waiting", "speculating"])
@pytest.mark.parametrize("acc,in_vram,placement", [(1, None, "offload"), (1, None, 0.5), (4, True, 0.5)],
                         ids=["offloaded", "half-resident", "acc4-vram-sums-half-resident"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_engine_waiting_for_the_coefficient_gives_the_bits_of_reading_it_on_the_host(
        speculate, acc, in_vram, placement, device):
    """Where every norm is on the device, the clip coefficient is computed there and the host engine
    waits for it, committing or redoing speculated steps itself, so that no thread waits at step()."""
    here = run(speculate=speculate, acc=acc, in_vram=in_vram, placement=placement, device=device, engine_waits=False)
    engine = run(speculate=speculate, acc=acc, in_vram=in_vram, placement=placement, device=device)
    assert_same_bits(here, engine)
    assert len(engine[4].verdicts) == len(THRESHOLDS) and not here[4].verdicts
    assert here[4].report()["speculation"] == engine[4].report()["speculation"]
    if speculate:
        assert engine[4].report()["speculation"]["misses"] == 1


def test_state_dict_after_commits_holds_the_committed_state_and_resumes_identically():
    """The state's views follow each commit's swap: state_dict() reads the committed moments, and
    a checkpoint loaded into a freshly wrapped model continues with the waiting path's bits."""
    waiting, speculating = run(speculate=False), run(speculate=True)
    saved = speculating[4].state_dict()
    for i, entry in waiting[4].state_dict()["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, saved["state"][i][key]), key

    def resume(state, opt_state, speculate):
        torch.manual_seed(5)  # other initial weights: the checkpoint must overwrite them
        model = TinyLM()
        opt = torch.optim.AdamW(param_groups(model), lr=3e-3, betas=(0.9, 0.95))
        model, opt = trainstream.wrap(model, opt, max_grad_norm=1e9, tuning=trainstream.Tuning(placement="offload"))
        opt.speculative_clipping = speculate
        model.load_state_dict(state)
        opt.load_state_dict(opt_state)
        g = torch.Generator().manual_seed(3)
        for _ in range(3):
            model.loss(torch.randint(0, 97, (4, 17), generator=g)).backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        assert opt.report()["speculation"]["hits"] == (3 if speculate else 0)
        return [p.clone() for p in model.parameters()]

    for a, b in zip(resume(waiting[2], waiting[4].state_dict(), False), resume(speculating[2], saved, True)):
        assert torch.equal(a, b)


def test_speculation_off_from_wrap_takes_no_host_memory_until_turned_on():
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(param_groups(model), lr=3e-3)
    model, opt = trainstream.wrap(model, opt, max_grad_norm=1e9, tuning=trainstream.Tuning(
        placement="offload", speculative_clipping=False))
    g = torch.Generator().manual_seed(2)

    def steps(n):
        for _ in range(n):
            model.loss(torch.randint(0, 97, (4, 17), generator=g)).backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        return opt.report()["speculation"]

    spec = steps(2)
    assert (spec["params"], spec["host_bytes"], spec["hits"], spec["waited"]) == (0, 0, 0, 0)
    assert "wait for the global norm (speculative_clipping is off)" in opt.describe()
    opt.speculative_clipping = True
    spec = steps(2)
    assert spec["params"] == len(list(model.parameters())) and spec["host_bytes"] > 0
    assert spec["hits"] == 2


def test_with_host_memory_for_some_second_sets_those_speculate_and_the_rest_wait(monkeypatch):
    """The first gradients to arrive (the last layers) get second state sets while host memory
    lasts; the others wait for the norm, describe() says how many, and the bits are the waiting
    path's."""
    model = TinyLM()
    last = list(model.parameters())[-3:]  # the first three gradients to arrive
    room = sum(p.numel() * 8 for p in last)  # fp32 weights: two moments
    monkeypatch.setattr(Engine, "host_room", lambda self, held: room)
    speculating = run(speculate=True)
    spec = speculating[4].report()["speculation"]
    total = len(list(model.parameters()))
    assert 0 < spec["params"] < total and spec["host_bytes"] <= room
    assert f"the other {total - spec['params']} wait for it" in speculating[4].describe()
    assert spec["hits"] and spec["misses"]
    monkeypatch.undo()
    assert_same_bits(speculating, run(speculate=False))


def test_non_finite_norm_commits_nothing_speculative():
    results = []
    for speculate in (False, True):
        torch.manual_seed(0)
        model = TinyLM()
        opt = torch.optim.AdamW(param_groups(model), lr=3e-3)
        model, opt = trainstream.wrap(model, opt, max_grad_norm=1e9, tuning=trainstream.Tuning(placement="offload"))
        opt.speculative_clipping = speculate
        tokens = torch.randint(0, 97, (4, 17), generator=torch.Generator().manual_seed(2))
        model.loss(tokens).backward()
        opt.step()
        opt.zero_grad()
        (model.loss(tokens) * float("inf")).backward()  # every gradient non-finite
        opt.step()
        opt.zero_grad()
        opt.synchronize()
        assert not torch.isfinite(torch.tensor(opt.last_grad_norm))
        results.append(([p.clone() for p in model.parameters()], opt.report()["speculation"]))
    for a, b in zip(results[0][0], results[1][0]):
        assert torch.equal(a.detach().view(torch.int32), b.detach().view(torch.int32))  # NaNs too
    assert results[1][1]["hits"] == 1 and results[1][1]["misses"] == 1


def test_speculation_is_not_used_without_clipping_or_when_switched_off():
    *_, opt = run(speculate=True, thresholds=[None, None])
    assert opt.report()["speculation"] == {"params": 0, "host_bytes": 0, "hits": 0, "misses": 0, "waited": 0,
                                                 "vram_term_bytes": 0, "terms_held": 0}
    *_, opt = run(speculate=False, thresholds=[1e9, 1e9])
    spec = opt.report()["speculation"]
    assert spec["params"] > 0 and spec["hits"] == spec["misses"] == 0


def test_a_verdict_that_lands_during_forward_decides_whether_backward_speculates():
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(param_groups(model), lr=3e-3)
    model, opt = trainstream.wrap(model, opt, max_grad_norm=1e-3, tuning=trainstream.Tuning(placement="offload"))
    tokens = torch.randint(0, 97, (4, 17), generator=torch.Generator().manual_seed(2))
    model.loss(tokens).backward()
    opt.step()  # speculated, and clipped
    opt.zero_grad()
    opt.synchronize()
    assert opt.report()["speculation"]["misses"] == 1
    # As on a GPU whose verdict download finishes after the next forward has begun: not landed at
    # forward, landed by the first gradient of backward.
    verdict = type("Verdict", (), {"landed": False, "commits": False})()
    opt.clipping.expect(verdict, speculated=True, speculates=True)
    opt.clipping.last_unclipped = True
    loss = model.loss(tokens)
    assert opt.clipping.verdict_pending  # forward found it still on its way
    verdict.landed = True
    loss.backward()
    assert not opt.clipping.verdict_pending and not any(s.speculated for s in opt.slots.order)
    opt.step()
    opt.zero_grad()
    spec = opt.report()["speculation"]
    assert spec["misses"] == 2 and spec["waited"] == 1  # (the stand-in verdict counted as the second miss)


class _PinningRunsOut:
    """The pipeline, except that host memory for second state sets runs out after `left` of them."""

    def __init__(self, pipeline, left: int) -> None:
        self._pipeline, self._left = pipeline, left

    def enable_speculation(self, host):
        if self._left == 0:
            raise trainstream.NativeError("cannot pin 64 MiB of host memory")
        self._left -= 1
        return self._pipeline.enable_speculation(host)

    def __getattr__(self, name):
        return getattr(self._pipeline, name)


def test_host_memory_that_runs_out_while_second_sets_are_taken_leaves_the_rest_waiting(caplog):
    """Pinned memory may run out before MemAvailable says so: the parameters that got a second set
    speculate, the others wait for the norm (with a warning that says so), and the bits are still
    the waiting path's."""
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(param_groups(model), lr=3e-3, betas=(0.9, 0.95))
    model, opt = trainstream.wrap(model, opt, max_grad_norm=THRESHOLDS[0],
                                  tuning=trainstream.Tuning(placement="offload", speculative_clipping=False))
    pipeline = opt.engine.pipeline
    opt.engine.pipeline = _PinningRunsOut(pipeline, left=3)
    with caplog.at_level("WARNING", logger="trainstream"):
        opt.speculative_clipping = True
    opt.engine.pipeline = pipeline
    total = len(list(model.parameters()))
    assert opt.speculation["params"] == 3
    assert f"the other {total - 3} wait for it" in opt.describe()
    assert "no host memory for more second state sets" in caplog.text
    g = torch.Generator().manual_seed(1)
    losses = []
    for threshold in THRESHOLDS:
        opt.max_grad_norm = threshold
        loss = model.loss(torch.randint(0, 97, (4, 17), generator=g))
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    assert opt.speculation["hits"] and opt.speculation["misses"]
    waiting = run(speculate=False)
    assert losses == waiting[0]
    for key, value in model.state_dict().items():
        assert torch.equal(value, waiting[2][key]), key
