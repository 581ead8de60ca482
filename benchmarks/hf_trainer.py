"""The Hugging Face Trainer as users run it, stock against TrainStreamTrainer, side by side.

    python benchmarks/hf_trainer.py --accs 1,8 --compile off,on --logging-steps 1,500 --json hf.json
    python benchmarks/hf_trainer.py --vram-cap-gb 16 --vram-budget 15GB   # where a cap binds

TrainingArguments keep their defaults where users keep them (max_grad_norm=1.0, the AdamW
settings, the linear schedule) with bf16=True; the model is train_step.py's (the 0.95B Llama at
batch 4x1024 by default, fp32 weights under bf16 autocast). Step time is the wall time of the
steps after --warmup, from a callback that waits for the GPU (and TrainStream's host work) at
both ends; losses are recorded without synchronising and compared at the end.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time

import torch
import transformers

from trainstream.fixtures import RandomTokens

from common import add_model_arguments, build_model, write_json


class Clock(transformers.TrainerCallback):
    """Times the steps after `warmup`, waiting for the device and the optimizer at both ends."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.start, self.end, self.optimizer = warmup, None, None, None

    def _settle(self) -> float:
        if hasattr(self.optimizer, "synchronize"):
            self.optimizer.synchronize()
        torch.cuda.synchronize()
        return time.perf_counter()

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        self.optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
        if state.global_step == self.warmup:
            self.start = self._settle()
            torch.cuda.reset_peak_memory_stats()
        elif state.global_step == state.max_steps:
            self.end = self._settle()


def recording(trainer_cls):
    class Recording(trainer_cls):
        losses: list

        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            self.losses.append((loss[0] if isinstance(loss, tuple) else loss).detach())
            return loss
    return Recording


def run(kind: str, acc: int, compiled: bool, logging_steps: int, args) -> dict:
    from trainstream.integrations.huggingface import TrainStreamTrainer

    torch.manual_seed(0)
    model = build_model(args, "cuda")
    steps = args.warmup + args.steps
    clock = Clock(args.warmup)
    with tempfile.TemporaryDirectory() as out:
        training_args = transformers.TrainingArguments(
            output_dir=out, max_steps=steps, per_device_train_batch_size=args.batch,
            gradient_accumulation_steps=acc, bf16=True, torch_compile=compiled, save_strategy="no",
            logging_steps=logging_steps,
            report_to=[], seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True)
        trainer_cls = recording(TrainStreamTrainer if kind == "trainstream" else transformers.Trainer)
        # a VRAM budget as a user gives it: the Trainer's extra keyword (the cap binds stock too)
        budgeted = kind == "trainstream" and args.vram_budget
        extra = {"trainstream_options": {"vram_budget": args.vram_budget}} if budgeted else {}
        trainer = trainer_cls(model=model, args=training_args, callbacks=[clock],
                              train_dataset=RandomTokens(steps * args.batch * acc, args.seq, args.vocab), **extra)
        trainer.losses = []
        result = {"trainer": kind, "acc": acc, "compile": compiled, "logging_steps": logging_steps}
        try:
            trainer.train()
        except torch.OutOfMemoryError:  # (under --vram-cap-gb: a row that says so)
            result.update(step_s=None, error="out of memory")
        else:
            result.update(step_s=(clock.end - clock.start) / args.steps,
                          peak_vram_GB=torch.cuda.max_memory_allocated() / 1e9,
                          losses=torch.stack(trainer.losses).float().view(steps, acc).mean(1).tolist())
        optimizer = clock.optimizer
        if hasattr(optimizer, "report") and "error" not in result:
            report = optimizer.report()
            result["placement"] = {k: report["placement"][k] for k in ("resident_params", "offloaded_params")}
            result["speculation"] = report["speculation"]
            print(optimizer.describe(), flush=True)  # (the plan the run got, for comparing with train_step.py's)
            optimizer.remove_hooks()
    del trainer, model
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(ap)
    ap.add_argument("--accs", default="1,8")
    ap.add_argument("--compile", default="off,on", help="comma list of off, on (TrainingArguments.torch_compile)")
    ap.add_argument("--trainers", default="stock,trainstream")
    ap.add_argument("--logging-steps", default="500",
                    help="comma list of TrainingArguments.logging_steps (500 is its default; 1 logs every step)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--vram-cap-gb", type=float, default=None,
                    help="cap this process's VRAM (torch.cuda.set_per_process_memory_fraction)")
    ap.add_argument("--vram-budget", default=None,
                    help="TrainStreamTrainer's trainstream_options={'vram_budget': ...}, e.g. 15GB")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.vram_cap_gb:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.vram_cap_gb * 1e9 / total))
    results = []
    for acc in (int(a) for a in args.accs.split(",")):
        for compiled in (c == "on" for c in args.compile.split(",")):
            for logging_steps in (int(n) for n in args.logging_steps.split(",")):
                for kind in args.trainers.split(","):
                    results.append(run(kind, acc, compiled, logging_steps, args))
                    print(json.dumps({k: v for k, v in results[-1].items() if k != "losses"}), flush=True)
    print(f"\n{torch.cuda.get_device_name()}  hidden={args.hidden} layers={args.layers} batch={args.batch}x{args.seq}"
          f" weights={args.weights} bf16=True max_grad_norm=1.0")
    print(f"{'acc':>4}{'compile':>9}{'logging':>9}{'trainer':>13}{'step s':>9}{'vs stock':>10}{'peak GB':>9}"
          f"{'max loss diff':>15}")
    for r in results:
        stock = next((s for s in results if s["trainer"] == "stock"
                      and all(s[k] == r[k] for k in ("acc", "compile", "logging_steps"))), None)
        head = f"{r['acc']:>4}{'on' if r['compile'] else 'off':>9}{r['logging_steps']:>9}{r['trainer']:>13}"
        if r["step_s"] is None or stock is None or stock["step_s"] is None:  # (no stock run to compare with)
            print(head + f"{'-' if r['step_s'] is None else format(r['step_s'], '.3f'):>9}  {r.get('error', '')}")
            continue
        diff = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], stock["losses"]))
        r["max_rel_loss_diff_vs_stock"] = diff
        print(head + f"{r['step_s']:>9.3f}{r['step_s'] / stock['step_s']:>9.2f}x{r['peak_vram_GB']:>9.2f}{diff:>15.2e}")
    if args.json:
        write_json(args.json, {"args": vars(args), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "transformers": transformers.__version__, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
