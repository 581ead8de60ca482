"""Fine-tune a causal LM with TrainStreamTrainer, optionally side by side with the stock Trainer.

    python examples/hf_finetune.py                       # a small Llama built from a config
    python examples/hf_finetune.py --model PATH_OR_NAME  # a local checkpoint or hub name
    python examples/hf_finetune.py --compare             # also run transformers.Trainer
    python examples/hf_finetune.py --compare --json F    # and write the runs to F (benchmarks/report.py)

The data is random tokens (nothing needs downloading), so the loss shows that the two trainers
agree rather than that the model learns. With --compare it prints the loss agreement, step time
and peak VRAM of both. Needs: pip install transformers accelerate.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import tempfile
import time

import torch
import transformers

from trainstream.integrations.huggingface import TrainStreamTrainer
from trainstream.fixtures import RandomTokens


def load_model(args) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    if args.model:  # no KV cache in training: it would keep every layer's keys and values in VRAM
        return transformers.AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32,
                                                                 use_cache=False)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=int(2.6875 * args.hidden),
        num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 64), max_position_embeddings=args.seq, use_cache=False)
    return transformers.LlamaForCausalLM(config)


def train(trainer_cls, args, output_dir: str) -> dict:
    model = load_model(args)
    cuda = torch.cuda.is_available()
    training_args = transformers.TrainingArguments(
        output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accumulation, learning_rate=args.lr, weight_decay=0.1,
        max_grad_norm=1.0, lr_scheduler_type="cosine", warmup_steps=max(1, args.steps // 10),
        logging_steps=1, save_strategy="no", report_to=[], bf16=cuda, use_cpu=not cuda, seed=0,
        data_seed=0, dataloader_num_workers=0, disable_tqdm=True)
    vocab = model.config.vocab_size
    trainer = trainer_cls(model=model, args=training_args,
                          train_dataset=RandomTokens(args.steps * args.batch * args.accumulation, args.seq, vocab))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    logs = [e for e in trainer.state.log_history if "loss" in e]
    return {
        "losses": [e["loss"] for e in logs],
        "grad_norms": [e.get("grad_norm") for e in logs],
        "seconds_per_step": seconds / args.steps,
        "peak_vram_GB": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="local path or hub name (default: build a small Llama)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--accumulation", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--compare", action="store_true", help="also run the stock transformers.Trainer")
    ap.add_argument("--json", default=None, help="write the runs (and the loss agreement) to this file")
    args = ap.parse_args(argv)

    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        runs["trainstream"] = train(TrainStreamTrainer, args, tmp)
        if args.compare:
            runs["stock"] = train(transformers.Trainer, args, tmp)
    for name, r in runs.items():
        vram = f"{r['peak_vram_GB']:.2f} GB" if r["peak_vram_GB"] is not None else "n/a (CPU)"
        print(f"{name:<12} {r['seconds_per_step']:.3f} s/step  peak VRAM {vram}  "
              f"final loss {r['losses'][-1]:.4f}")
    worst = None
    if args.compare:
        ours, stock = runs["trainstream"]["losses"], runs["stock"]["losses"]
        worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours, stock))
        print(f"loss agreement over {len(ours)} steps: max relative difference {worst:.2e}")
    if args.json:
        hardware = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU only"
        about = {"date": datetime.date.today().isoformat(), "hardware": hardware,
                 "command": shlex.join(["python", "examples/hf_finetune.py", *(sys.argv[1:] if argv is None else argv)])}
        with open(args.json, "w") as f:
            json.dump({"about": about, "args": vars(args), "runs": runs, "loss_max_rel_diff": worst}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
