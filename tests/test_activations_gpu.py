"""Activation paging on a CUDA GPU: bit-exact losses and gradients, the VRAM it saves, no leak,
the VRAM budget, and Hugging Face models. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import trainstream
from trainstream.activations import ActivationPager, Plan
from trainstream.fixtures import TinyLM

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda", 0)


def tokens(step: int, batch: int = 8, seq: int = 257, vocab: int = 1000) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(step)
    return torch.randint(0, vocab, (batch, seq), device="cuda", generator=g)


def tiny(dtype, dim=512, layers=6):
    torch.manual_seed(0)
    return TinyLM(vocab=1000, dim=dim, layers=layers, heads=8, seq=512).to(DEVICE, dtype)


def train_with_pager(dtype, share, steps=5, dim=512, layers=6, batch=8, plan=None):
    """Plain torch AdamW on the GPU; the pager (if any) is the only difference between runs."""
    model = tiny(dtype, dim, layers)
    pager = None if share is None else ActivationPager(model, device=DEVICE, share=share, vram_budget=None)
    if plan is not None:
        pager.apply_plan(plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    history, peaks = [], []
    before = torch.cuda.memory_allocated()  # what an earlier run still holds
    for step in range(steps):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.float32):
            loss = model.loss(tokens(step, batch=batch))
        loss.backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - before)
        history.append((loss.detach().clone(), [p.grad.clone() for p in model.parameters()]))
        opt.step()
        opt.zero_grad()
    return history, peaks, pager


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-autocast", "bf16-weights"])
def test_paging_is_bit_exact(dtype):
    ref, _, _ = train_with_pager(dtype, None)
    got, _, pager = train_with_pager(dtype, 1.0)
    report = pager.report()
    print(pager.describe())
    assert report["paged_blocks"] == 5 and report["paged_bytes_per_step"] > 0
    if dtype == torch.float32:
        assert report["recast_bytes_per_step"] > 0
    for (loss_a, grads_a), (loss_b, grads_b) in zip(ref, got):
        assert torch.equal(loss_a, loss_b)
        assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


@pytest.mark.parametrize("light", [False, True], ids=["whole", "light"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-autocast", "bf16-weights"])
def test_recomputed_blocks_are_bit_exact(dtype, light):
    # block 0 paged, block 1 recomputed from its paged input, block 2 kept, 3 to 5 recomputed
    # (lightly: their matmuls' and attention's outputs kept)
    ref, ref_peaks, _ = train_with_pager(dtype, None)
    got, peaks, pager = train_with_pager(dtype, 1.0, plan=Plan(2, 5, "test", **{
        "light" if light else "recomputed": (1, 3, 4, 5)}))
    report = pager.report()
    print(pager.describe())
    print(f"peaks without the pager {[round(p / 1e6) for p in ref_peaks]} MB, with it {[round(p / 1e6) for p in peaks]} MB")
    assert report["light_blocks" if light else "recomputed_blocks"] == 4 and report["on_demand_fetches"] == 0
    assert max(peaks[1:]) < max(ref_peaks[1:])
    for (loss_a, grads_a), (loss_b, grads_b) in zip(ref, got):
        assert torch.equal(loss_a, loss_b)
        assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


def test_no_leak_over_100_steps():
    model = tiny(torch.float32)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-4), activations=1.0,
                                  tuning=trainstream.Tuning(placement="offload"))
    native = opt.activation_pager.native
    allocated, slots, reserved = [], [], []
    for step in range(100):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model.loss(tokens(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        opt.synchronize()
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
        stats = native.stats()
        slots.append(stats["slots"])
        reserved.append(stats["reserved_bytes"])
    print(f"allocated {min(allocated[5:]) / 1e6:.1f}..{max(allocated[5:]) / 1e6:.1f} MB, slots {slots[-1]}, "
          f"pinned {reserved[-1] / 1e6:.0f} MB")
    assert max(allocated[5:]) - min(allocated[5:]) <= 1 << 20
    assert len(set(slots[5:])) == 1 and len(set(reserved[5:])) == 1
    assert native.stats()["in_use_bytes"] == 0


def wrapped_run(steps=4, layers=8, recompute=True, **wrap_kwargs):
    """wrap() on a 1024-wide model, batch 16x512; returns the optimizer and the last step's peak.

    Gradients and AdamW state live on the host, so the peak is weights plus activations."""
    model = tiny(torch.float32, dim=1024, layers=layers)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-4), **wrap_kwargs,
                                  tuning=trainstream.Tuning(placement="offload", recompute=recompute))
    for step in range(steps):
        opt.synchronize()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()  # every step, as a benchmark would: the profile must not care
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model.loss(tokens(step, batch=16, seq=513))
        loss.backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    torch.cuda.synchronize()
    return opt, torch.cuda.max_memory_allocated()


def test_peak_vram_drops_by_what_is_paged():
    # share 0 and share 1 both recompute the weight casts: the difference is paging alone. In
    # backward two paged blocks are back on the device at a time (the one running and the one
    # prefetched), so the drop approaches (blocks - 3) / (blocks - 1) of the bytes paged: 91% here.
    opt, kept = wrapped_run(layers=24, activations=0.0)
    opt.remove_hooks()
    opt, paged_peak = wrapped_run(layers=24, activations=1.0)
    paged = opt.report()["activations"]["paged_bytes_per_step"]
    drop = kept - paged_peak
    print(f"peak with nothing paged {kept / 1e9:.3f} GB, paged {paged_peak / 1e9:.3f} GB: drop "
          f"{drop / 1e9:.3f} GB for {paged / 1e9:.3f} GB paged ({drop / paged:.0%})")
    assert drop >= 0.8 * paged


@pytest.mark.parametrize("recompute", [False, True], ids=["paging", "recomputing"])
def test_vram_budget_is_met_and_reported(recompute):
    opt, kept = wrapped_run(activations=0.0)
    opt.remove_hooks()
    opt, paged = wrapped_run(activations=1.0)
    opt.remove_hooks()
    budget = (kept + paged) // 2
    opt, peak = wrapped_run(vram_budget=budget, recompute=recompute)
    pager = opt.activation_pager
    report = pager.report()
    print(f"budget {budget / 1e9:.3f} GB (nothing paged {kept / 1e9:.3f}, all paged {paged / 1e9:.3f}), "
          f"last step peak {peak / 1e9:.3f} GB, expected {report['expected_peak_GB']:.3f} GB")
    print(pager.describe())
    assert report["state"] == "paging" and report["budget_met"]
    if recompute:  # what hides is paged, the rest recomputed
        assert report["recomputed_blocks"] > 0 and report["recompute_s"] > 0
    else:
        assert 0 < report["paged_blocks"] < report["pageable_blocks"]
        assert report["recomputed_blocks"] == 0
    assert peak <= budget
    assert report["d2h_GBps"] > 1 and report["forward_s"] > 0


@pytest.mark.parametrize("recompute", [False, True, "light"], ids=["paged", "recomputed", "light"])
def test_huggingface_llama_with_attention_mask_is_bit_exact(recompute):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1376,
                                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                                      max_position_embeddings=512)
    config._attn_implementation = "sdpa"

    def run(share):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).to(DEVICE)
        pager = None if share is None else ActivationPager(model, device=DEVICE, share=share, vram_budget=None)
        if pager is not None and recompute:  # layers 0 and 1 paged, 2 and 3 recomputed (with keyword arguments)
            pager.apply_plan(Plan(2, 3, "test", **{"light" if recompute == "light" else "recomputed": (2, 3)}))
        ids = tokens(0, batch=4, seq=256)
        mask = torch.ones_like(ids)
        mask[:, :17] = 0  # left padding
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()], pager

    loss_a, grads_a, _ = run(None)
    loss_b, grads_b, pager = run(1.0)
    assert pager.blocks_name == "model.layers"
    assert pager.report()["paged_bytes_per_step"] > 0
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
