"""Activation paging on the CPU: block detection, the policy, and the pager's bookkeeping (views,
tensors saved twice, prefetch order, checkpointing, autocast casts) with host copies standing in
for PCIe. Results must be bit-identical with and without paging."""

from __future__ import annotations

import contextlib
import time
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import trainstream
from trainstream.activations import light
from trainstream.activations import pager as activation_pager
from trainstream.activations import Plan, Profile, find_blocks, plan_paging
from trainstream.units import parse_bytes
from trainstream.fixtures import TinyLM


@pytest.fixture(autouse=True)
def page_small_tensors(monkeypatch):
    monkeypatch.setattr(activation_pager, "MIN_BYTES", 1024)  # the test models' activations are small


def test_find_blocks_picks_the_layer_stack():
    name, blocks = find_blocks(TinyLM(layers=3))
    assert name == "blocks" and len(blocks) == 3

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.small = nn.ModuleList(nn.Linear(2, 2) for _ in range(5))
            self.big = nn.ModuleList(nn.Linear(64, 64) for _ in range(3))
            self.mixed = nn.ModuleList([nn.Linear(99, 99), nn.ReLU()])

    name, blocks = find_blocks(Mixed())
    assert name == "big" and len(blocks) == 3
    assert find_blocks(nn.Linear(3, 3)) == ("", [])


def test_wrap_without_blocks_says_what_to_do():
    model = nn.Sequential(nn.Linear(8, 8))
    with pytest.raises(ValueError, match="blocks="):
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()), activations=1.0)


def test_pager_without_blocks_only_recasts():
    from trainstream.activations import ActivationPager

    model = nn.Sequential(nn.Linear(8, 8))
    pager = ActivationPager(model, device=torch.device("cpu"), share=None, vram_budget=None)
    assert pager.report()["paged_blocks"] == 0 and "no repeated blocks" in pager.describe()
    model(torch.randn(2, 8)).sum().backward()
    assert pager.report()["paged_bytes_per_step"] == 0


@pytest.mark.parametrize("text,expected", [
    ("24GB", 24_000_000_000), ("22.5 GiB", int(22.5 * 2**30)), ("512mb", 512_000_000), (1 << 30, 1 << 30),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["24 parsecs", "", "-3GB", 0, True])
def test_parse_bytes_refuses(bad):
    with pytest.raises((ValueError, TypeError)):
        parse_bytes(bad)


@pytest.mark.parametrize("kwargs,error", [
    (dict(activations="sometimes"), ValueError),
    (dict(activations=1.5), ValueError),
    # without the placement planner a budget is the pager's, and the pager's alone
    (dict(activations="off", vram_budget="10GB", placement="offload"), ValueError),
    (dict(vram_budget="10GB", placement="offload"), trainstream.UnsupportedSetupError),  # a CPU model
    (dict(recompute="yes"), TypeError),
])
def test_wrap_refuses_bad_activation_options(kwargs, error):
    model = TinyLM()
    tuning = {k: kwargs.pop(k) for k in ("placement", "recompute") if k in kwargs}
    with pytest.raises(error):
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()), tuning=trainstream.Tuning(**tuning),
                         **kwargs)


def profile(n=8, block_gb=1.0, block_ms=20.0, bw_gbps=50.0, peak_gb=None, input_gb=0.0):
    return Profile([int(block_gb * 1e9)] * n, [block_ms / 1e3] * n, bw_gbps * 1e9, bw_gbps * 1e9,
                   None if peak_gb is None else int(peak_gb * 1e9), [int(input_gb * 1e9)] * n)


def test_policy_auto_pages_what_hides():
    # 1 GB at 50 GB/s is 20 ms: exactly one block's compute, so every pageable block hides
    plan = plan_paging(profile(block_ms=20.0))
    assert plan.paged_blocks == 7 and plan.hidden and plan.pageable_blocks == 7
    # at 10 ms per block a copy takes two blocks' time: the backlog grows, only a prefix hides
    plan = plan_paging(profile(block_ms=10.0))
    assert 0 < plan.paged_blocks < 7 and plan.hidden
    assert not plan_paging(profile(block_ms=10.0), share=1.0).hidden
    assert plan_paging(profile(block_ms=1.0)).paged_blocks == 0


def test_policy_share_and_keep_last():
    assert plan_paging(profile(), share=0.0).paged_blocks == 0
    assert plan_paging(profile(), share=0.5).paged_blocks == 4  # of 7 pageable
    assert plan_paging(profile(), share=1.0).paged_blocks == 7
    assert plan_paging(profile(), share=1.0, keep_last=3).paged_blocks == 5


def test_policy_budget_pages_until_it_fits():
    # profiled with 7 blocks paged: peak 10 GB; each block left on the device adds 1 GB
    plan = plan_paging(profile(block_ms=1.0, peak_gb=10.0), vram_budget=int(13.5e9))
    assert plan.paged_blocks == 4 and plan.budget_met
    assert plan.expected_peak_bytes == int(13e9)
    assert not plan.hidden  # the copies are exposed, and the plan says so
    # the last block too, if the budget needs it (its copy back cannot hide)
    plan = plan_paging(profile(block_ms=1.0, peak_gb=10.0), vram_budget=int(9e9))
    assert plan.paged_blocks == 8 and plan.budget_met and not plan.hidden
    plan = plan_paging(profile(block_ms=1.0, peak_gb=10.0), vram_budget=int(8e9))
    assert plan.paged_blocks == 8 and plan.budget_met is False
    # a budget never pages less than auto would
    assert plan_paging(profile(block_ms=20.0, peak_gb=10.0), vram_budget=int(100e9)).paged_blocks == 7


def test_policy_budget_recomputes_before_it_pages_exposed():
    # no copy hides (1 ms of compute per 1 GB block); a recomputed block keeps its 0.1 GB input.
    # Nothing paged or recomputed: 17 GB; each recomputed block takes 0.9 GB off.
    slow = profile(block_ms=1.0, peak_gb=10.0, input_gb=0.1)
    plan = plan_paging(slow, vram_budget=int(13.5e9), recompute=True)
    assert plan.paged_blocks == 0 and plan.recomputed == (0, 1, 2, 3) and plan.budget_met
    assert plan.expected_peak_bytes == pytest.approx(13.4e9)
    assert plan.recompute_seconds == pytest.approx(4e-3) and plan.copy_seconds == 0.0
    plan = plan_paging(slow, vram_budget=int(10.5e9), recompute=True)
    assert plan.paged_blocks == 0 and plan.recomputed == tuple(range(8)) and plan.budget_met
    # recomputing all is 9.8 GB: above 9.5, so the inputs of the first recomputed blocks are paged
    plan = plan_paging(slow, vram_budget=int(9.5e9), recompute=True)
    assert plan.paged_blocks == 3 and plan.recomputed == tuple(range(8)) and plan.budget_met
    assert plan.paged_bytes == pytest.approx(0.3e9) and not plan.hidden  # 2 ms of copies a block, 1 of compute
    # at 3 ms of compute a block, no whole block's copy hides (20 ms), but the inputs' copies do
    plan = plan_paging(profile(block_ms=3.0, peak_gb=10.0, input_gb=0.1), vram_budget=int(9.5e9), recompute=True)
    assert plan.paged_blocks == 3 and plan.recomputed == tuple(range(8)) and plan.hidden
    plan = plan_paging(slow, vram_budget=int(8e9), recompute=True)
    assert plan.paged_blocks == 8 and plan.recomputed == tuple(range(8)) and plan.budget_met is False
    # copies that hide still go first; recomputing starts after them
    plan = plan_paging(profile(block_ms=20.0, peak_gb=10.0, input_gb=0.1), vram_budget=int(9.5e9),
                       recompute=True)
    assert plan.paged_blocks == 7 and plan.recomputed == (7,) and plan.hidden
    # a budget already met changes nothing
    assert plan_paging(slow, vram_budget=int(20e9), recompute=True).recomputed == ()
    # blocks that the model checkpoints itself keep only their inputs: nothing to gain there
    done = Profile([int(0.1e9)] * 8, [1e-3] * 8, 50e9, 50e9, int(10e9), [int(0.1e9)] * 8)
    plan = plan_paging(done, vram_budget=int(10.45e9), recompute=True)
    assert plan.recomputed == () and plan.paged_blocks == 3


# ------------------------------------------------------------------- bit-exact paging
class ViewBlock(nn.Module):
    """Saves views, one storage twice, a transposed weight and a chunked activation."""

    def __init__(self, dim):
        super().__init__()
        self.w = nn.Parameter(torch.randn(dim, 2 * dim) / dim**0.5)
        self.v = nn.Parameter(torch.randn(dim, dim) / dim**0.5)

    def forward(self, x):
        h = x @ self.w  # saves x and the weight
        a, b = h.chunk(2, dim=-1)  # two views of h's storage
        s = torch.sigmoid(a)  # saves s
        y = s * b  # saves s again and b, a view of h
        u = y @ self.v.t()  # saves y and a view of a weight
        z = y.t() @ torch.ones_like(y[:, 0])  # saves a transposed view of y (and a tiny tensor)
        return x + u * y + z.mean()  # saves u and y again


class ViewNet(nn.Module):
    def __init__(self, dim=48, layers=4, ckpt=None):
        super().__init__()
        self.layers = nn.ModuleList(ViewBlock(dim) for _ in range(layers))
        self.ckpt = ckpt

    def forward(self, x):
        if self.ckpt == "reentrant":
            x = x.requires_grad_()  # reentrant checkpoint needs an input that requires grad
        for layer in self.layers:
            if self.ckpt is None:
                x = layer(x)
            else:
                x = checkpoint(layer, x, use_reentrant=self.ckpt == "reentrant")
        return x.square().mean()


def run(model_fn, steps=4, setup=None, **wrap_kwargs):
    torch.manual_seed(0)
    model = model_fn()
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), **wrap_kwargs)
    if setup is not None:
        setup(opt.activation_pager)
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(steps):
        x = torch.randn(64, 48, generator=g)
        loss = model(x)
        loss.backward()
        losses.append(loss.detach().clone())
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    return model, opt, losses


@pytest.mark.parametrize("ckpt", [None, "reentrant", "non-reentrant"])
def test_paging_is_bit_exact_with_views_and_checkpointing(ckpt):
    ref, _, ref_losses = run(lambda: ViewNet(ckpt=ckpt), activations="off")
    model, opt, losses = run(lambda: ViewNet(ckpt=ckpt), activations=1.0)
    for a, b in zip(ref_losses, losses):
        assert torch.equal(a, b)
    for p, q in zip(ref.parameters(), model.parameters()):
        assert torch.equal(p, q)
    report = opt.report()["activations"]
    assert report["paged_blocks"] == 3 and report["pageable_blocks"] == 3
    if ckpt is None:
        assert report["paged_bytes_per_step"] > 0
        assert report["on_demand_fetches"] == 0  # every block was prefetched before its backward
    else:  # checkpointed blocks keep only their inputs, and checkpoint handles those
        assert report["paged_bytes_per_step"] == 0


class DropBlock(ViewBlock):
    """ViewBlock with dropout: recomputing it must draw the same mask."""

    def forward(self, x):
        return super().forward(nn.functional.dropout(x, 0.3, training=True))


class DropNet(ViewNet):
    def __init__(self, layers=4):
        super().__init__(layers=layers)
        self.layers = nn.ModuleList(DropBlock(48) for _ in range(layers))


@pytest.mark.parametrize("paged", [1, 3], ids=["inputs-kept", "inputs-paged"])
def test_recomputed_blocks_are_bit_exact_and_prefetch_the_paged_ones(paged):
    def recompute_three(pager):  # block 0 paged; blocks 1 to 3 recomputed, the inputs of those < paged paged
        pager.apply_plan(Plan(paged, 3, "test", recomputed=(1, 2, 3)))

    ref, _, ref_losses = run(DropNet, activations="off")
    model, opt, losses = run(DropNet, activations=1.0, setup=recompute_three)
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), model.parameters()))
    report = opt.report()["activations"]
    assert report["paged_blocks"] == paged and report["recomputed_blocks"] == 3
    # a recomputed block saves only its input (64x48 fp32), through checkpoint
    assert report["kept_bytes_per_step"] == (4 - paged) * 64 * 48 * 4
    assert report["on_demand_fetches"] == 0  # each recompute prefetched the block before it
    assert "3 recomputed" in opt.activation_pager.describe()
    assert all("forward" in vars(layer) for layer in model.layers[1:])
    opt.remove_hooks()
    assert not any("forward" in vars(layer) for layer in model.layers)


@pytest.mark.parametrize("paged", [1, 3], ids=["inputs-kept", "inputs-paged"])
def test_lightly_recomputed_blocks_are_bit_exact_and_keep_their_matmuls_outputs(paged):
    def light_three(pager):  # as above, the three blocks recomputed lightly (light.py)
        pager.apply_plan(Plan(paged, 3, "test", light=(1, 2, 3)))

    ref, _, ref_losses = run(DropNet, activations="off")
    model, opt, losses = run(DropNet, activations=1.0, setup=light_three)
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses))  # (the same dropout masks)
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), model.parameters()))
    report = opt.report()["activations"]
    assert report["light_blocks"] == 3 and report["recomputed_blocks"] == 0
    assert report["kept_bytes_per_step"] == (4 - paged) * 64 * 48 * 4  # the inputs, as with whole recompute
    assert "3 recomputed lightly" in opt.activation_pager.describe()
    opt.remove_hooks()
    assert not any("forward" in vars(layer) for layer in model.layers)


def test_the_census_counts_what_light_recompute_keeps_and_reruns():
    block = nn.Sequential(nn.Linear(48, 192), nn.GELU(), nn.Linear(192, 48))
    x = torch.randn(4, 16, 48, requires_grad=True)
    census = light.Census()
    with census:
        block(x).sum()
    # kept: the two matmuls' outputs; rerun: the GELU and the sum (their outputs are new storages;
    # views of the matmuls' outputs are not)
    assert census.kept_bytes == 4 * 16 * (192 + 48) * 4
    assert census.redone_ops == 2 and census.redone_bytes == 4 * 16 * 192 * 4 + 4
    # every op passes selective checkpointing's policy: the views and the kept matmuls too
    assert census.dispatched_ops > census.redone_ops + 2
    assert light.seconds(2, 1000, 10, 1e9, 1e-5) == pytest.approx(3e-6 + 2 * light.OP_SECONDS + 2 * 10 * 1e-5)
    # that policy runs in Python: tens of microseconds an op on a CPU, not nothing and not a millisecond
    assert 0 < light.dispatch_seconds(torch.device("cpu")) < 1e-3


def test_a_block_that_writes_into_a_matmuls_output_is_not_offered_light_recompute():
    block = nn.Sequential(nn.Linear(48, 192), nn.ReLU(inplace=True), nn.Linear(192, 48))
    x = torch.randn(4, 16, 48, requires_grad=True)
    census = light.Census()
    with census:
        block(x)
    assert census.mutated
    # what it would meet in backward
    with pytest.raises(RuntimeError, match="mutated"):
        checkpoint(block, x, use_reentrant=False, context_fn=light.context).sum().backward()
    clean = light.Census()
    with clean:
        nn.Sequential(nn.Linear(48, 192), nn.ReLU(), nn.Linear(192, 48))(x)
    assert not clean.mutated


def test_a_freed_matmul_output_whose_address_is_reused_is_not_a_write_into_it():
    # a paged block frees its kept outputs during forward: an in-place op on a new tensor at the
    # same address is not a write into what light recompute keeps. (64 MB: above glibc's largest
    # mmap threshold, so a freed block goes back to the kernel and the next one of its size
    # comes back at its address; small ones are not reused reliably.)
    x, w = torch.randn(4096, 1), torch.randn(1, 4096)

    def reused_address():
        for _ in range(100):
            y = x @ w
            address = y.data_ptr()
            del y
            z = torch.empty(4096, 4096)
            if z.data_ptr() == address:
                return z
        pytest.fail("the allocator never reused a freed address: this test tests nothing")
    census = light.Census()
    with census:
        reused_address().add_(1.0)
    assert not census.mutated
    with census:
        (x @ w).relu_()
    assert census.mutated  # a write into a live kept output still counts


def test_ops_run_aside_from_the_census_are_not_the_blocks():
    # the pager's pack hook runs inside the block's forward; on CUDA its record_stream writes
    # into the saved matmul output, by its schema
    block = nn.Sequential(nn.Linear(48, 192), nn.GELU(), nn.Linear(192, 48))
    x = torch.randn(4, 16, 48, requires_grad=True)
    for aside in (False, True):
        census = light.Census()

        def pack(t):
            with census.aside() if aside else contextlib.nullcontext():
                torch.ops.aten.resize_(t.detach(), t.shape)  # writes, by its schema, and changes nothing
            return t
        with census, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            block(x)
        assert census.mutated != aside
        assert census.redone_ops == 1  # the GELU


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast"])
def test_the_census_counts_what_selective_checkpointing_keeps_of_a_llama_layer(autocast):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=352, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=4, use_cache=False)
    model = transformers.LlamaForCausalLM(config)
    layer = model.model.layers[0]
    x = torch.randn(2, 64, 128, requires_grad=True)
    rotary = model.model.rotary_emb(x, torch.arange(64)[None])
    contexts = []

    def context():
        contexts.append(light.context())
        return contexts[-1]

    census = light.Census()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        with census:
            layer(x, position_embeddings=rotary)
        checkpoint(lambda h: layer(h, position_embeddings=rotary), x, use_reentrant=False, context_fn=context)
    cache = getattr(contexts[0][0], "storage", None)  # (torch's own record of what it keeps)
    if cache is None:
        pytest.skip("this torch keeps its selective checkpointing cache elsewhere")
    kept = {w.val.untyped_storage().data_ptr(): w.val.untyped_storage().nbytes()
            for entries in cache.values() for v in entries.values() for w in (v if isinstance(v, tuple) else (v,))
            if isinstance(getattr(w, "val", None), torch.Tensor)}
    assert census.kept_bytes == sum(kept.values()) > 0
    assert census.redone_ops > 10


class CacheBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(48, 48)

    def forward(self, x, past_key_values=None):
        h = self.linear(x)
        if past_key_values is not None:  # like a KV cache: an entry per call
            past_key_values.append(h.detach())
        return torch.tanh(h) + x


class CacheNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(CacheBlock() for _ in range(3))

    def forward(self, x, cache=None):
        for layer in self.layers:
            x = layer(x, past_key_values=cache)
        return x.square().mean()


def test_blocks_that_update_a_cache_are_not_recomputed():
    torch.manual_seed(0)
    model, ref = CacheNet(), CacheNet()
    ref.load_state_dict(model.state_dict())
    pager = activation_pager.ActivationPager(model, device=torch.device("cpu"), share=0.0, vram_budget=None)
    pager.apply_plan(Plan(0, 2, "test", recomputed=(1, 2)))
    x = torch.randn(64, 48)
    cache = []
    with pytest.warns(UserWarning, match="use_cache=False"):
        model(x, cache).backward()
    assert len(cache) == 3  # each block ran once
    ref(x, []).backward()
    assert all(torch.equal(p.grad, r.grad) for p, r in zip(model.parameters(), ref.parameters()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x).backward()  # no cache: recomputed, silently


def test_storage_saved_twice_is_paged_once():
    model = ViewNet(layers=2)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), activations=1.0)
    x = torch.randn(64, 48)
    model(x).backward()
    # block 0 pages the storages of h (through b), s, y (saved three times) and u, once each;
    # not x: the caller holds the model's input, so paging it would free nothing
    paged = opt.report()["activations"]["paged_bytes_per_step"]
    assert paged == 4 * 64 * (96 + 48 + 48 + 48)
    assert opt.report()["activations"]["held_elsewhere_bytes_per_step"] == 0
    opt.step()


def test_slots_are_reused_every_step():
    model = ViewNet()
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), activations=1.0)
    native = opt.activation_pager.native
    seen = []
    for _ in range(6):
        model(torch.randn(64, 48)).backward()
        opt.step()
        seen.append(native.stats())
    assert seen[0]["slots"] > 0
    assert all(s["slots"] == seen[0]["slots"] for s in seen)
    assert all(s["reserved_bytes"] == seen[0]["reserved_bytes"] for s in seen)
    assert all(s["in_use_bytes"] == 0 for s in seen)  # backward gave every slot back
    assert seen[-1]["paged_in_bytes"] == seen[-1]["paged_out_bytes"] > 0


def test_no_paging_outside_blocks_or_under_no_grad():
    model = ViewNet(layers=3)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), activations=1.0)
    with torch.no_grad():
        model(torch.randn(64, 48))
    assert opt.activation_pager.native.stats()["paged_out_bytes"] == 0


def test_autocast_weight_casts_are_recomputed_bit_exactly():
    def tiny():
        torch.manual_seed(0)
        return TinyLM(dim=64, layers=3)

    def train(**kw):
        model = tiny()
        model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), **kw)
        g = torch.Generator().manual_seed(5)
        losses = []
        for _ in range(3):
            tokens = torch.randint(0, 97, (4, 17), generator=g)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model.loss(tokens)
            loss.backward()
            losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        return model, opt, losses

    ref, _, ref_losses = train(activations="off")
    model, opt, losses = train(activations=0.5)
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), model.parameters()))
    assert opt.report()["activations"]["recast_bytes_per_step"] > 0


def test_auto_profile_finishes_when_a_block_does_not_run():
    """The profiled forward times the blocks that ran; one that was skipped counts as empty."""
    from trainstream.activations import ActivationPager

    class SkipsOne(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4))

        def forward(self, x):
            for i, block in enumerate(self.blocks):
                if i != 2:  # e.g. layer drop
                    x = block(x)
            return x.square().sum()

    torch.manual_seed(0)
    model, ref = SkipsOne(), SkipsOne()
    ref.load_state_dict(model.state_dict())
    pager = ActivationPager(model, device=torch.device("cpu"), share=None, vram_budget=None)
    settled = []
    pager.settle = lambda: settled.append(pager._forwards)
    x = torch.randn(32, 64)
    for _ in range(3):  # cold forward, timed forward, then the plan
        model.zero_grad()
        model(x).backward()
    assert settled == [1]  # before the timed forward only
    assert pager.report()["state"] == "paging"
    assert pager.profile.block_bytes[2] == 0 and pager.profile.block_seconds[2] == 0.0
    assert pager.profile.block_seconds[0] > 0 and pager.profile.block_bytes[0] > 0
    assert pager.plan.paged_blocks == 3  # host copies cost nothing here: every pageable block
    # what a recomputed block would keep: block 0 reads the model's input (held by the caller)
    assert pager.profile.block_input_bytes == [0, 32 * 64 * 4, 0, 32 * 64 * 4]
    ref(x).backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        assert (p.grad is None and r.grad is None) or torch.equal(p.grad, r.grad)  # block 2: None


def test_a_blocks_profiled_time_leaves_out_what_the_hooks_took():
    """What recomputing a block costs is its forward without the pager's hooks, which run only in
    the profiled step's paging: hooks that take 50 ms a tensor do not make the block look slow
    (a block of this size computes in well under that, even on a loaded machine)."""
    from trainstream.activations import ActivationPager

    class Deep(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(3))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x.square().sum()

    model = Deep()
    pager = ActivationPager(model, device=torch.device("cpu"), share=None, vram_budget=None)
    pack = pager._pack

    def slow_pack(x):
        time.sleep(0.05)
        return pack(x)
    pager._pack = slow_pack
    x = torch.randn(32, 64)
    for step in range(3):  # cold forward, timed forward, then the plan
        model.zero_grad()
        model(x).backward()
        if step == 1:
            hooks = list(pager._hook_times)
    assert all(h >= 0.1 for h in hooks)  # each block saves its linear's input and the GELU's
    assert all(0 < t < 0.05 for t in pager.profile.block_seconds), (pager.profile.block_seconds, hooks)


def test_activations_held_outside_autograd_are_reported():
    """A block that keeps a saved tensor (as a KV cache does) frees nothing by paging it: the
    report counts those bytes apart, the per-block figures leave them out, and one warning says
    what to do."""

    class CachingBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(64, 64)

        def forward(self, x, cache):
            h = self.linear(x)
            cache.append(h)  # like a KV cache
            return torch.nn.functional.gelu(h)  # saves h for backward

    class Cached(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(CachingBlock() for _ in range(3))
            self.cache, self.keep_cache = [], True

        def forward(self, x):
            cache = []
            x = x.clone()
            for block in self.blocks:
                x = block(x, cache)
            self.cache = cache if self.keep_cache else []
            return x.square().sum()

    model = Cached()
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), activations=1.0)
    x = torch.randn(32, 64)
    h_bytes = 32 * 64 * 4
    with pytest.warns(UserWarning, match="use_cache=False"):
        model(x).backward()
    report = opt.report()["activations"]
    assert report["paged_blocks"] == 2
    # blocks 0 and 1 page their input and h; h stays in the cache
    assert report["paged_bytes_per_step"] == 4 * h_bytes
    assert report["held_elsewhere_bytes_per_step"] == 2 * h_bytes
    assert opt.activation_pager.last.block_bytes[:2] == [h_bytes, h_bytes]  # what paging frees
    assert "stayed referenced outside autograd" in opt.activation_pager.describe()
    opt.step()
    model.keep_cache = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x).backward()
    opt.step()
    report = opt.report()["activations"]
    assert report["held_elsewhere_bytes_per_step"] == 0
    assert opt.activation_pager.last.block_bytes[:2] == [2 * h_bytes, 2 * h_bytes]


def test_describe_points_to_recomputing_when_copies_are_exposed(monkeypatch):
    model = ViewNet()
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), activations=1.0)
    model(torch.randn(64, 48)).backward()
    opt.step()
    pager = opt.activation_pager
    real = pager.report()
    assert real["paged_bytes_per_step"] > 0
    timing = {"copy_s_per_step": 0.1, "d2h_GBps": 50.0, "h2d_GBps": 50.0, "forward_s": 0.05}
    for hidden, paged, hint in ((True, real["paged_bytes_per_step"], False),
                                (False, real["paged_bytes_per_step"], True),
                                (False, 0, False)):
        report = dict(real, **timing, copy_hidden=hidden, paged_bytes_per_step=paged)
        monkeypatch.setattr(pager, "report", lambda report=report: report)
        assert ("recomputes blocks" in pager.describe()) is hint


class CastBlock(nn.Module):
    """Three projections of one activation under autocast: three casts of it, or two when it is
    changed in place in between."""

    def __init__(self, dim, bump):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.bump = bump

    def forward(self, x):
        h = x * 1.5
        a = self.q(h)
        if self.bump:
            h.mul_(2)  # new values: their cast must not be taken for the first one
        b, c = self.k(h), self.v(h)
        return x + (a * b + c).float()


class CastNet(nn.Module):
    def __init__(self, dim, bump):
        super().__init__()
        self.layers = nn.ModuleList(CastBlock(dim, bump) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


@pytest.mark.parametrize("bump", [False, True], ids=["same", "changed-in-place"])
def test_repeated_casts_of_an_activation_are_saved_once_and_stay_exact(bump):
    rows, dim = 8192, 64  # a bf16 cast of 1 MiB: large enough to page

    def train(activations):
        torch.manual_seed(0)
        model = CastNet(dim, bump)
        model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                      activations=activations)
        g = torch.Generator().manual_seed(3)
        losses = []
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(rows, dim, generator=g))
            loss.backward()
            losses.append(loss.detach().clone())
            opt.step()
        opt.synchronize()
        return model, opt, losses

    ref, _, ref_losses = train("off")
    model, opt, losses = train(1.0)  # blocks 0 and 1 paged, block 2 kept
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), model.parameters()))
    report = opt.report()["activations"]
    # blocks 1 and 2; block 0 reads the input, whose casts have no autograd history to go by
    shared_per_block = (1 if bump else 2) * rows * dim * 2
    assert report["shared_cast_bytes_per_step"] == 2 * shared_per_block
    assert report["on_demand_fetches"] == 0


@pytest.mark.parametrize("recompute", [False, True, "light"], ids=["paged", "recomputed", "light"])
def test_hugging_face_llama_under_autocast_pages_bit_exactly(recompute):
    transformers = pytest.importorskip("transformers")

    def train(activations):
        config = transformers.LlamaConfig(
            vocab_size=256, hidden_size=128, intermediate_size=352, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=64, use_cache=False)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
        model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      activations=activations)
        if opt.activation_pager is not None:
            opt.activation_pager.min_bytes = 0  # page this small model's activations too
            if recompute:  # layer 0 paged, layers 1 and 2 recomputed (with the layers' keyword arguments)
                ways = {"light": (1, 2)} if recompute == "light" else {"recomputed": (1, 2)}
                opt.activation_pager.apply_plan(Plan(1, 2, "test", **ways))
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(3):
            tokens = torch.randint(0, 256, (2, 64), generator=g)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            losses.append(loss.detach())
            opt.step()
        opt.synchronize()
        return model, opt, losses

    ref, _, ref_losses = train("off")
    model, opt, losses = train(1.0)
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), model.parameters()))
    report = opt.report()["activations"]
    # k and v repeat q's cast of the normed hidden states, up repeats gate's: three repeats of
    # 2x64x128 bf16 values in each layer that the pager sees (a recomputed one it does not)
    assert report["paged_bytes_per_step"] > 0
    assert report["shared_cast_bytes_per_step"] == (1 if recompute else 3) * 3 * 2 * 64 * 128 * 2
