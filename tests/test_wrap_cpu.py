"""wrap() on a CPU model: the same hooks, host buffers, worker thread and AdamW engine as on a
GPU, with plain copies in place of CUDA streams. Parity is against torch.optim.AdamW driven the
ordinary way (autograd accumulation, clip_grad_norm_, an LR scheduler)."""

from __future__ import annotations

import copy
import gc
import io
import os
import threading
import weakref

import pytest
import torch

import trainstream
from trainstream.baselines import engine_threads_since, gate_every_forward, thread_names
from trainstream.fixtures import TinyLM, param_groups, warmup_cosine
from trainstream.optimizer import wrapped_by

STEPS = 20


def batches(steps: int, acc: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, 97, (4, 17), generator=g) for _ in range(acc)] for _ in range(steps)]


def make(freeze_first_block: bool = True, dtype=torch.float32):
    torch.manual_seed(0)
    model = TinyLM().to(dtype)
    if freeze_first_block:
        for p in model.blocks[0].parameters():
            p.requires_grad_(False)
    opt = torch.optim.AdamW(param_groups(model), lr=3e-3, betas=(0.9, 0.95))
    return model, opt


def train(model, opt, data, *, clip=None, wrapped=False, sched=None):
    acc = len(data[0])
    norms = []
    for micro_batches in data:
        for tokens in micro_batches:
            (model.loss(tokens) / acc).backward()
        if clip is not None and not wrapped:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
        if wrapped and clip is not None:
            norms.append(opt.last_grad_norm)
    if wrapped:
        opt.synchronize()
    return norms


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize(
    "acc,clip,in_vram,tol",
    [(1, None, False, 3e-7), (4, None, False, 3e-7), (1, 1.0, False, 1e-6), (4, 1.0, False, 1e-6),
     (4, None, True, 3e-7), (4, 1.0, True, 1e-6)],
    ids=["plain", "accumulate4", "clip", "accumulate4+clip", "accumulate4-in-vram", "accumulate4-in-vram+clip"],
)
def test_parity_with_torch_adamw(acc, clip, in_vram, tol):
    data = batches(STEPS, acc)
    ref, ref_opt = make()
    ref_norms = train(ref, ref_opt, data, clip=clip, sched=warmup_cosine(ref_opt, 5, STEPS))

    model, opt = make()
    frozen_before = [p.detach().clone() for p in model.blocks[0].parameters()]
    model, opt = trainstream.wrap(model, opt, max_grad_norm=clip, accumulation_steps=acc,
                                  tuning=trainstream.Tuning(accumulate_in_vram=in_vram))
    norms = train(model, opt, data, clip=clip, wrapped=True, sched=warmup_cosine(opt, 5, STEPS))

    assert max_diff(ref, model) <= tol
    assert model.head.weight is model.embed.weight  # still tied
    for before, p in zip(frozen_before, model.blocks[0].parameters()):
        assert torch.equal(before, p)  # frozen layer untouched
    if clip is not None:
        assert norms == pytest.approx(ref_norms, rel=1e-5)
        assert all(n > clip for n in norms[:3])  # clipping really was active


def test_bf16_weights_keep_fp32_master():
    """bf16 weights: the host master follows fp32 AdamW; the model holds master rounded to bf16."""
    model, opt = make(dtype=torch.bfloat16)
    ref_master = copy.deepcopy(model).float()
    ref_params = dict(ref_master.named_parameters())
    ref_opt = torch.optim.AdamW(param_groups(ref_master), lr=3e-3, betas=(0.9, 0.95))
    names = {p: n for n, p in model.named_parameters()}
    for p in model.parameters():
        if p.requires_grad:  # registered before wrap(), so it sees each gradient first
            p.register_post_accumulate_grad_hook(
                lambda q: setattr(ref_params[names[q]], "grad", q.grad.float().clone()))
    model, opt = trainstream.wrap(model, opt)
    for (tokens,) in batches(5, 1):
        model.loss(tokens).backward()
        opt.step()
        ref_opt.step()
        ref_opt.zero_grad()
    opt.synchronize()
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        master = opt.state[p]["master_param"]
        assert (master - ref_params[n].detach()).abs().max().item() <= 3e-7
        assert torch.equal(p.detach(), master.to(torch.bfloat16))


@pytest.mark.parametrize("acc,in_vram,clip", [(1, False, None), (1, False, 1.0), (4, True, None)],
                         ids=["plain", "clip", "accumulate4-in-vram"])
def test_bf16_exact_gradients_cross_as_bf16_without_changing_a_bit(acc, in_vram, clip):
    """Under bf16 autocast a Linear's weight gradient is bf16 widened to fp32: it is sent as bf16
    (half the bytes). The tied embedding's gradient (a sum), the norms' and sums of micro-batches
    in VRAM are not, and cross whole. Either way training is bit-identical to the packing
    switched off."""
    data = batches(4, acc)
    runs = {}
    for pack in (True, False):
        model, opt = make(freeze_first_block=False)
        model, opt = trainstream.wrap(model, opt, accumulation_steps=acc, max_grad_norm=clip,
                                      tuning=trainstream.Tuning(accumulate_in_vram=in_vram, placement="offload"))
        opt.pack_gradients = pack
        with torch.autocast("cpu", dtype=torch.bfloat16):  # with clipping the update reads them at step()
            train(model, opt, data, clip=clip, wrapped=True)
        runs[pack] = model, opt
    (packed, opt), (plain, plain_opt) = runs[True], runs[False]
    for p, q in zip(packed.parameters(), plain.parameters()):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key], plain_opt.state[q][key])
    packs = {n: opt.slots[p].host.last_gradient_as_bf16 for n, p in packed.named_parameters()}
    share = opt.report()["gradients_sent_as_bf16"]
    if in_vram:
        assert not any(packs.values()) and share == 0.0
    else:
        assert packs["blocks.0.attn.qkv.weight"] and packs["blocks.2.down.weight"]
        assert not packs["embed.weight"]  # embedding gradient plus the tied head's
        assert not any(v for n, v in packs.items() if "norm" in n)
        assert 0.5 < share < 1.0
    assert plain_opt.report()["gradients_sent_as_bf16"] == 0.0


def test_gradients_are_not_packed_when_paging_is_asked_for():
    """The pack kernels compete with backward for SMs: a share or a budget of paging turns them
    off; "auto" (paging only what hides behind compute) and a share of 0 do not."""
    for activations, packs in (("off", True), (0.0, True), (0.5, False)):
        model, opt = make()
        model, opt = trainstream.wrap(model, opt, activations=activations)
        assert opt.engine.pipeline.pack_gradients is packs, activations
        opt.pack_gradients = False
        assert opt.engine.pipeline.pack_gradients is False
        opt.pack_gradients = True
        assert opt.engine.pipeline.pack_gradients is packs


def test_forward_gates_stand_down_once_settled_and_return_with_the_next_update():
    """A module's pre-hook orders the stream after its weights' uploads; having done so, it skips
    that call until another update is queued. Once no update is queued and every upload has
    finished, the gates stand down altogether, and queuing the next update wakes them. The hooks
    themselves stay put (torch.compile would recompile for hooks that come and go)."""
    model, opt = make(freeze_first_block=False)
    model, opt = trainstream.wrap(model, opt, accumulation_steps=4,
                                  tuning=trainstream.Tuning(accumulate_in_vram=True, placement="offload"))
    gated = []
    settled = [False]  # whether the pipeline may report itself settled

    class Spy:  # counts the native gate calls, passes everything through
        def __init__(self, inner):
            self.inner = inner

        def gate(self, hosts, stream):
            gated.append(len(hosts))
            return self.inner.gate(hosts, stream)

        def settled(self, hosts):
            return settled[0] and self.inner.settled(hosts)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    opt.engine.pipeline = Spy(opt.engine.pipeline)
    modules = sum(1 for m in model.modules() if any(True for _ in m.parameters(recurse=False)))

    def pre_hooks() -> int:  # the gates, and the root's own check
        return sum(len(m._forward_pre_hooks) for m in model.modules())

    hooks = pre_hooks()
    assert hooks == modules + 1

    def window() -> tuple[list[int], list[bool]]:
        calls, on = [], []
        for tokens in batches(1, 4)[0]:
            before = len(gated)
            loss = model.loss(tokens) / 4
            calls.append(len(gated) - before)
            on.append(opt.gates.on)
            loss.backward()
        return calls, on

    # Not settled: the first forward gates every module, the rest of the window skips the calls.
    assert window() == ([modules, 0, 0, 0], [True] * 4)
    opt.step()
    opt.synchronize()
    settled[0] = True
    # Settled: the gates stand down at the first forward of the window...
    assert window() == ([0, 0, 0, 0], [False] * 4)
    # ...and the last backward, which queued the updates, woke them.
    assert opt.gates.on
    opt.step()
    opt.synchronize()
    gate_every_forward(opt)  # the benchmarks' baseline: gates stay awake and every forward waits
    assert window() == ([modules] * 4, [True] * 4)
    opt.step()
    assert pre_hooks() == hooks


def test_gradients_hooks_capture_and_release():
    model, opt = make(freeze_first_block=False)
    model, opt = trainstream.wrap(model, opt)
    model.loss(batches(1, 1)[0][0]).backward()
    assert all(p.grad is None for p in model.parameters())
    opt.step()
    report = opt.report()
    assert report["trainable_params"] == sum(p.numel() for p in model.parameters())
    assert report["host_memory_kind"] == "pageable"
    assert report["host_bytes_per_param"] >= 16


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread names are read from Linux's /proc")
@pytest.mark.parametrize("niceness", [None, 0, 19])
def test_the_engine_threads_carry_names_that_tools_show_and_run_nicer(niceness):
    """The engine's threads yield to the thread that launches the GPU's work (Tuning's default:
    5 nicer), which keeps its own priority."""
    before = thread_names()
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    tuning = dict(engine_niceness=niceness) if niceness is not None else {}
    model, opt = make()
    model, opt = trainstream.wrap(model, opt, tuning=trainstream.Tuning(placement="offload", threads=2, **tuning))
    started = engine_threads_since(before, count=2)
    engine = [t for t, name in started.items() if name == "ts-engine"]
    assert len(engine) == opt.report()["threads"] == 2
    expected = 5 if niceness is None else niceness
    assert opt.report()["engine_niceness"] == expected
    assert [os.getpriority(os.PRIO_PROCESS, t) for t in engine] == [min(mine + expected, 19)] * 2
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine


@pytest.mark.parametrize("niceness", [-1, 20, True, 2.0])
def test_an_engine_niceness_out_of_range_is_refused(niceness):
    with pytest.raises(ValueError, match="engine_niceness must be an integer from 0 to 19"):
        trainstream.Tuning(engine_niceness=niceness)


@pytest.mark.parametrize("kwargs", [
    {},
    dict(max_grad_norm=1.0, accumulation_steps=2),
    dict(activations=0.5, tuning=trainstream.Tuning(placement="offload")),
    dict(max_grad_norm=1.0, tuning=trainstream.Tuning(placement="offload", streamed_blocks=1)),
    dict(tuning=trainstream.Tuning(placement="gpu")),
], ids=["default", "clip+acc2", "paged", "streamed", "resident"])
def test_a_dropped_model_and_optimizer_are_freed(kwargs):
    """Nothing outlives the user's references: a tensor's hooks are held where the garbage
    collector cannot see them, so a cycle through them would keep every buffer alive."""
    def run():
        model, opt = make()
        model, opt = trainstream.wrap(model, opt, **kwargs)
        train(model, opt, batches(2, kwargs.get("accumulation_steps", 1)), wrapped=True)
        return [weakref.ref(x) for x in (model, opt, next(model.parameters()))]

    refs = run()
    gc.collect()
    assert [r() for r in refs] == [None] * 3


def test_state_dict_round_trip_and_resume_are_identical():
    data = batches(10, 1)
    model, opt = make()
    model, opt = trainstream.wrap(model, opt)
    train(model, opt, data[:5], wrapped=True)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    train(model, opt, data[5:], wrapped=True)

    buf.seek(0)
    ckpt = torch.load(buf)
    resumed, ropt = make()
    resumed, ropt = trainstream.wrap(resumed, ropt)
    resumed.load_state_dict(ckpt["model"])
    ropt.load_state_dict(ckpt["opt"])
    train(resumed, ropt, data[5:], wrapped=True)
    assert max_diff(model, resumed) == 0.0
    sd = ropt.state_dict()
    assert set(sd["state"][0]) >= {"step", "exp_avg", "exp_avg_sq"}
    assert float(sd["state"][0]["step"]) == 10


def test_a_state_dict_outlives_its_optimizer():
    """The state tensors are views of the pipeline's host buffers: they keep them alive, so a
    state dict kept after its optimizer is gone (and another one has taken host memory) still
    holds what it held (it used to read freed memory)."""
    import gc

    import weakref

    data = batches(3, 1)
    model, opt = make()
    model, opt = trainstream.wrap(model, opt, tuning=trainstream.Tuning(placement="offload"))
    train(model, opt, data, wrapped=True)
    kept = opt.state_dict()
    snapshot = copy.deepcopy(kept)
    buffers_owner = weakref.ref(opt.engine.pipeline)
    opt.remove_hooks()
    del model, opt
    gc.collect()
    assert buffers_owner() is not None  # the state tensors keep the host buffers alive
    other, other_opt = make()
    other, other_opt = trainstream.wrap(other, other_opt)  # new host buffers
    train(other, other_opt, batches(3, 1, seed=7), wrapped=True)
    for i, entry in snapshot["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(kept["state"][i][key], entry[key])


def test_torch_adamw_checkpoint_loads_and_continues_identically():
    data = batches(8, 1)
    ref, ref_opt = make()
    train(ref, ref_opt, data[:4])
    ckpt = {"model": copy.deepcopy(ref.state_dict()), "opt": copy.deepcopy(ref_opt.state_dict())}
    train(ref, ref_opt, data[4:])

    model, opt = make()
    model, opt = trainstream.wrap(model, opt)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    train(model, opt, data[4:], wrapped=True)
    assert max_diff(ref, model) <= 3e-7
    # and back: our state dict loads into a plain torch AdamW
    back, back_opt = make()
    back.load_state_dict(model.state_dict())
    back_opt.load_state_dict(opt.state_dict())
    assert torch.equal(back_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


@pytest.mark.parametrize("acc,clip,in_vram", [(1, None, False), (4, 1.0, False), (4, None, True)],
                         ids=["plain", "accumulate4+clip", "accumulate4-in-vram"])
def test_update_terms_give_the_weights_an_uploaded_master_gives_bit_for_bit(acc, clip, in_vram):
    """fp32 weights updated by adding the host's update term where they live are the weights that
    uploading an updated host master gives, bit for bit; switching to masters midway (which
    reloads them from the model) changes nothing either."""
    data = batches(6, acc)
    runs = {}
    for how in ("terms", "master", "switched"):
        model, opt = make()
        model, opt = trainstream.wrap(model, opt, max_grad_norm=clip, accumulation_steps=acc,
                                      tuning=trainstream.Tuning(accumulate_in_vram=in_vram))
        assert opt.upload_update_terms  # the default
        opt.upload_update_terms = how == "terms" or how == "switched"
        train(model, opt, data[:3], clip=clip, wrapped=True)
        if how == "switched":
            opt.upload_update_terms = False
        train(model, opt, data[3:], clip=clip, wrapped=True)
        runs[how] = model, opt
    (ref, ref_opt) = runs["master"]
    for how in ("terms", "switched"):
        model, opt = runs[how]
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p, q), how
            if p.requires_grad:
                for key in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(opt.state[p][key], ref_opt.state[q][key]), how


def test_weights_changed_behind_our_back_are_picked_up():
    data = batches(3, 1)
    model, opt = make()
    model, opt = trainstream.wrap(model, opt)
    train(model, opt, data[:1], wrapped=True)
    with torch.no_grad():
        model.norm.weight.fill_(2.0)  # user code writes a weight
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(param_groups(ref), lr=3e-3, betas=(0.9, 0.95))
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # our state tensors are live views
    train(model, opt, data[1:], wrapped=True)
    train(ref, ref_opt, data[1:])
    assert max_diff(ref, model) <= 3e-7


def test_scheduler_and_lr_edits_are_seen():
    model, opt = make()
    base = opt
    model, opt = trainstream.wrap(model, opt)
    assert opt.param_groups is base.param_groups
    opt.param_groups[0]["lr"] = 0.0
    opt.param_groups[1]["lr"] = 0.0
    before = [p.detach().clone() for p in model.parameters()]
    for g in opt.param_groups:
        g["weight_decay"] = 0.0
    train(model, opt, batches(2, 1), wrapped=True)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("in_vram", [False, True], ids=["host-sum", "vram-sum"])
def test_early_step_with_accumulation_matches_torch(in_vram):
    """step() after 2 of accumulation_steps=4 backward passes updates from what was summed."""
    data = batches(3, 2)
    ref, ref_opt = make()
    ref_norms = train(ref, ref_opt, data, clip=1e9)  # clips nothing; gives the norms
    model, opt = make()
    model, opt = trainstream.wrap(model, opt, accumulation_steps=4,
                                  tuning=trainstream.Tuning(accumulate_in_vram=in_vram, track_grad_norm=True))
    norms = []
    for micro_batches in data:
        for tokens in micro_batches:
            (model.loss(tokens) / 2).backward()
        opt.step()
        opt.zero_grad()
        norms.append(opt.last_grad_norm)
    opt.synchronize()
    assert max_diff(ref, model) <= 3e-7
    assert norms == pytest.approx(ref_norms, rel=1e-5)


def test_accumulate_in_vram_keeps_the_sum_on_the_device_until_the_last_backward():
    model, opt = make(freeze_first_block=False)
    model, opt = trainstream.wrap(model, opt, accumulation_steps=3,
                                  tuning=trainstream.Tuning(accumulate_in_vram=True, placement="offload"))
    first, second, third = batches(1, 3)[0]
    model.loss(first).backward()
    model.loss(second).backward()
    kept = {p: p.grad.clone() for p in model.parameters()}  # autograd's running sum, as in torch
    model.loss(third).backward()
    assert all(p.grad is None for p in model.parameters())  # sent to the host from the hooks
    opt.step()
    report = opt.report()
    assert {p["window_sum"] for p in report["placement"]["params"]} == {"vram"}
    assert report["host_bytes_per_param"] < 20  # no host accumulator: master, moments, landing
    assert all(g.abs().sum() > 0 for g in kept.values())


@pytest.mark.parametrize("on_host", [True, False])
def test_the_engine_counts_the_time_it_spends_adding_micro_batches(on_host):
    """Tuning(add_on_host=True): the engine's threads add the later micro-batches into the host
    sums, and time it; else the transfer adds them, and no thread does."""
    model, opt = make(freeze_first_block=False)
    model, opt = trainstream.wrap(model, opt, accumulation_steps=3,
                                  tuning=trainstream.Tuning(add_on_host=on_host, placement="offload"))
    before = opt.engine.pipeline.stats()
    train(model, opt, batches(2, 3), wrapped=True)
    after = opt.engine.pipeline.stats()
    assert (after["adding_seconds"] > before["adding_seconds"]) == on_host
    # micro-batch 2 of each of the two windows (without clipping, the third is added by its update's job)
    added = 2 * sum(p.numel() for p in model.parameters())
    assert after["added_elements"] - before["added_elements"] == (added if on_host else 0)
    assert after["busy_seconds"] > before["busy_seconds"]
    assert 0 <= after["landing_wait_seconds"] < 60


def test_accumulate_in_vram_refuses_bf16_weights():
    model, opt = make(dtype=torch.bfloat16)
    with pytest.raises(trainstream.UnsupportedSetupError, match="fp32 weights"):
        trainstream.wrap(model, opt, accumulation_steps=2, tuning=trainstream.Tuning(accumulate_in_vram=True))


def test_too_many_backward_passes_is_an_error():
    model, opt = make()
    model, opt = trainstream.wrap(model, opt, accumulation_steps=2)
    tokens = batches(1, 1)[0][0]
    model.loss(tokens).backward()
    model.loss(tokens).backward()
    with pytest.raises(trainstream.TrainingLoopError, match="call optimizer.step"):
        model.loss(tokens).backward()


def test_grad_norm_tracking_without_clipping():
    data = batches(1, 1)
    ref, _ = make()
    (ref.loss(data[0][0])).backward()
    expected = float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters() if p.grad is not None]))
    model, opt = make()
    model, opt = trainstream.wrap(model, opt, tuning=trainstream.Tuning(track_grad_norm=True))
    model.loss(data[0][0]).backward()
    opt.step()
    assert opt.last_grad_norm == pytest.approx(expected, rel=1e-5)


# ------------------------------------------------------------------------------ refusals
def test_refuses_other_optimizers():
    model = TinyLM()
    with pytest.raises(trainstream.UnsupportedSetupError, match="torch.optim.AdamW"):
        trainstream.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))

    class AdamW8bit(torch.optim.Optimizer):  # named as torchao's and bitsandbytes' are
        def __init__(self, params):
            super().__init__(params, {})

    with pytest.raises(trainstream.UnsupportedSetupError, match="implements no other low-bit or paged optimizer"):
        trainstream.wrap(model, AdamW8bit(model.parameters()))

    class Tweaked(torch.optim.AdamW):  # a subclass may step differently: never run as torch's AdamW
        pass

    with pytest.raises(trainstream.UnsupportedSetupError, match="subclass of torch's AdamW"):
        trainstream.wrap(model, Tweaked(model.parameters()))
    assert all(wrapped_by(p) is None for p in model.parameters())


def test_refuses_amsgrad_and_adam_l2():
    model = TinyLM()
    with pytest.raises(trainstream.UnsupportedSetupError, match="amsgrad"):
        trainstream.wrap(model, torch.optim.AdamW(model.parameters(), amsgrad=True))
    with pytest.raises(trainstream.UnsupportedSetupError, match="L2"):
        trainstream.wrap(model, torch.optim.Adam(model.parameters(), weight_decay=0.1))


def test_adam_without_weight_decay_is_adamw():
    data = batches(5, 1)
    torch.manual_seed(0)
    ref = TinyLM()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    model, opt = trainstream.wrap(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    train(ref, ref_opt, data)
    train(model, opt, data, wrapped=True)
    assert max_diff(ref, model) <= 3e-7


def test_refuses_fp16_weights_and_grad_scaler():
    model = TinyLM().half()
    with pytest.raises(trainstream.UnsupportedSetupError, match="loss scaling"):
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()))
    model, opt = make()
    model, opt = trainstream.wrap(model, opt)
    with pytest.raises(trainstream.UnsupportedSetupError, match="GradScaler"):
        opt.step(grad_scaler=object())


def test_refuses_trainable_params_missing_from_optimizer():
    model = TinyLM()
    with pytest.raises(trainstream.UnsupportedSetupError, match="not in the optimizer"):
        trainstream.wrap(model, torch.optim.AdamW(model.blocks.parameters()))


def test_rejects_bad_arguments():
    model = TinyLM()
    with pytest.raises(ValueError, match="accumulation_steps"):
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()), accumulation_steps=0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()), max_grad_norm=-1.0)
    with pytest.raises(ValueError, match="unknown ISA"):
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()), tuning=trainstream.Tuning(isa="sse9"))


def test_cuda_model_without_cuda_build_or_gpu_is_refused_clearly(monkeypatch):
    from trainstream import _native

    monkeypatch.setattr(_native._C, "has_cuda", False)
    with pytest.raises(_native.UnsupportedError, match="no CUDA support"):
        _native.require_cuda_build()


def test_verify_example_says_no_gpu_and_fails_without_cuda():
    import subprocess
    import sys
    from pathlib import Path

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the example runs for real in the GPU suite")
    script = Path(__file__).resolve().parents[1] / "examples" / "verify_ram_offload.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "FAIL" in done.stderr and "CUDA" in done.stderr
