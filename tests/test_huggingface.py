"""TrainStreamTrainer against the stock Trainer on a tiny Llama, on the CPU."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from trainstream.integrations.huggingface import TrainStreamTrainer, _unwrap  # noqa: E402
from trainstream.errors import UnsupportedSetupError  # noqa: E402
from trainstream.optimizer import OffloadedAdamW  # noqa: E402


class TokenData(torch.utils.data.Dataset):
    def __init__(self, n: int = 48, seq: int = 16, vocab: int = 101) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(config)


def arguments(tmp_path, **overrides):
    kwargs = dict(output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=4,
                  gradient_accumulation_steps=2, learning_rate=3e-3, weight_decay=0.1, adam_beta2=0.95,
                  max_grad_norm=0.5, lr_scheduler_type="cosine", warmup_steps=2, logging_steps=1,
                  save_strategy="no", report_to=[], use_cpu=True, seed=0, data_seed=0,
                  dataloader_num_workers=0, disable_tqdm=True)
    kwargs.update(overrides)
    return transformers.TrainingArguments(**kwargs)


def run(trainer_cls, tmp_path):
    trainer = trainer_cls(model=tiny_llama(), args=arguments(tmp_path), train_dataset=TokenData())
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return trainer, logs


def test_losses_and_grad_norms_match_the_stock_trainer(tmp_path):
    _, stock = run(transformers.Trainer, tmp_path / "stock")
    trainer, ours = run(TrainStreamTrainer, tmp_path / "ts")
    assert len(ours) == len(stock) == 6
    assert [e["loss"] for e in ours] == pytest.approx([e["loss"] for e in stock], rel=1e-5)
    assert [e["grad_norm"] for e in ours] == pytest.approx([e["grad_norm"] for e in stock], rel=1e-4)
    assert all(e["grad_norm"] > 0.5 for e in ours[:2])  # clipping was active
    report = _unwrap(trainer.optimizer).report()  # (the log reads the two figures without building it)
    assert all(e["trainstream_host_GB"] == round(report["host_bytes_used"] / 1e9, 3)
               and e["trainstream_isa"] == report["isa"] for e in ours)
    assert all(p.grad is None for p in trainer.model.parameters())


def test_accelerate_leaves_the_offloaded_state_where_it_is(tmp_path, monkeypatch):
    # accelerate's optimizer placement copies the whole state dict to the device and loads it
    # back: on a GPU, every offloaded state tensor at once. Neither may happen to ours.
    calls = []
    for name in ("state_dict", "load_state_dict"):
        original = getattr(OffloadedAdamW, name)
        monkeypatch.setattr(OffloadedAdamW, name, lambda self, *a, _f=original, _n=name: calls.append(_n) or _f(self, *a))
    trainer = TrainStreamTrainer(model=tiny_llama(), args=arguments(tmp_path, max_steps=2), train_dataset=TokenData())
    trainer.train()
    assert calls == []
    assert trainer.optimizer.device_placement is False  # (accelerate's wrapper around ours)


def test_a_step_that_reads_only_the_loss_keeps_the_logits_in_bf16(tmp_path, monkeypatch):
    # accelerate's mixed-precision wrapper copies the bf16 logits to fp32 after each forward: VRAM
    # at the step's peak, for a loss that is fp32 already. Where the step reads only the model's
    # own loss, the copy is skipped; where a loss is made from the outputs, it is kept.
    from accelerate.utils.operations import ConvertOutputsToFp32
    converted = []  # (with autograd on or off: the profiler's timing replay runs without)
    original = ConvertOutputsToFp32.__call__

    def counted(self, *args, **kwargs):
        converted.append(torch.is_grad_enabled())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ConvertOutputsToFp32, "__call__", counted)
    losses = {}
    for name, options in (("own", {}), ("smoothed", {"label_smoothing_factor": 0.1})):
        args = arguments(tmp_path / name, max_steps=2, bf16=True, **options)
        trainer = TrainStreamTrainer(model=tiny_llama(), args=args, train_dataset=TokenData())
        converted.clear()
        trainer.train()
        losses[name] = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        assert sum(converted) == (0 if name == "own" else 4), name  # (2 steps of 2 micro-batches)
    stock = transformers.Trainer(model=tiny_llama(), args=arguments(tmp_path / "stock", max_steps=2, bf16=True),
                                 train_dataset=TokenData())
    stock.train()
    assert losses["own"] == pytest.approx([e["loss"] for e in stock.state.log_history if "loss" in e], rel=1e-5)


def test_fp16_is_refused(tmp_path):
    args = arguments(tmp_path)
    args.fp16 = True  # set after construction: TrainingArguments itself rejects fp16 on a CPU
    with pytest.raises(UnsupportedSetupError, match="fp16"):
        TrainStreamTrainer(model=tiny_llama(), args=args, train_dataset=TokenData())


def test_finetune_example_runs_side_by_side(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "hf_finetune.py"
    done = subprocess.run([sys.executable, str(script), "--hidden", "64", "--layers", "2", "--seq", "32",
                           "--vocab", "500", "--steps", "3", "--compare", "--json", "runs.json"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "loss agreement over 3 steps" in done.stdout
    worst = float(done.stdout.split("max relative difference")[1].split()[0])
    assert worst <= 1e-5
    import json

    record = json.loads((tmp_path / "runs.json").read_text())  # what benchmarks/report.py reads
    assert record["about"]["command"].startswith("python examples/hf_finetune.py --hidden 64")
    assert record["runs"]["stock"]["seconds_per_step"] > 0 and record["loss_max_rel_diff"] <= 1e-5


def test_a_grouped_query_qwen2_trains_as_under_stock_adamw():
    """The Qwen2 shape the benchmarks build (biased q/k/v, fewer key/value heads than query
    heads): wrap() finds its blocks and trains it to the same weights as torch.optim.AdamW."""
    import trainstream
    from trainstream.fixtures import causal_lm_loss, llama

    def trained(wrapped: bool):
        torch.manual_seed(0)
        model = llama(vocab=101, hidden=64, layers=2, heads=4, kv_heads=2, seq=16, intermediate=96, arch="qwen2")
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        if wrapped:
            model, opt = trainstream.wrap(model, opt, max_grad_norm=1.0, activations=1.0,
                                          tuning=trainstream.Tuning(placement="offload"))
        for ids in TokenData(n=12).ids.view(3, 4, 16):
            causal_lm_loss(model, ids).backward()
            if not wrapped:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        if wrapped:
            opt.synchronize()
            assert opt.activation_pager.blocks_name.endswith("layers") and len(opt.activation_pager.blocks) == 2
        return model

    stock, ours = trained(False), trained(True)
    assert type(ours).__name__ == "Qwen2ForCausalLM" and ours.model.layers[0].self_attn.k_proj.bias is not None
    assert ours.config.num_key_value_heads == 2
    for a, b in zip(stock.parameters(), ours.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # (a step moves a weight 3e-3)


def test_an_unknown_architecture_is_refused():
    from trainstream.fixtures import llama
    with pytest.raises(ValueError, match="qwen2"):
        llama(vocab=11, hidden=8, layers=1, heads=2, seq=4, arch="mistral")
