"""Regenerate every results table (and plot) in README.md and docs/ from the benchmarks' JSON.

    python benchmarks/report.py [RESULTS_DIR] [--check] [--plots]

RESULTS_DIR (default docs/results) holds the JSON the benchmark scripts wrote. A document marks
the place of a table with two comments, `<!-- results:NAME -->` and `<!-- /results:NAME -->`;
everything between them is replaced by the table NAME rendered from its files in RESULTS_DIR
(TABLES below), followed by when, on what and by which command it was measured. Running the
script again changes nothing. With --check it writes nothing and exits 1 if a document is not
what the JSON gives, or if a results file is shown by no table (a CPU test runs that). With --plots it also redraws the figures in PLOTS
(needs matplotlib).

A results file is what a script wrote with --json: train_step.py, budget_sweep.py,
copy_under_load.py, bench_host_adamw, examples/hf_finetune.py; for adamw_vs_torch.py, the JSON
line it prints. Beside that, "about" says {"date", "hardware", "software", "command", "method",
"notes", "labels"}: train_step.py and budget_sweep.py write the date, hardware and command
themselves; add the rest by hand. A file with "columns" and "rows" is a table recorded as it was
published, for comparisons whose code is gone (what was tried): its "about" has a "method"
where no exact command survives. Any NAME.json of that shape can be placed with a marker.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from trainstream import placement as planner

from common import PEER_NAMES, medians, plot_curves, plot_runs, plot_sweep  # (nothing there trains, nor imports a runner)

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = ("README.md", "docs/benchmarks.md", "docs/architecture.md")
MARKER = re.compile(r"(<!-- results:([\w-]+) -->\n)(.*?)(<!-- /results:\2 -->)", re.S)

# What each mode of train_step.py is, in words (a file's about.labels overrides).
LABELS = {
    "gpu-adamw": "GPU AdamW (fused), nothing offloaded",
    "gpu-adamw+ckpt": "PyTorch + gradient checkpointing",
    "gpu-adamw+noclip": "GPU AdamW (fused), no clipping",
    "trainstream": "TrainStream",
    "trainstream+vramacc": "TrainStream, `accumulate_in_vram=True`",
    "trainstream+stream4": "TrainStream, the last 4 blocks' weights streamed",
    "trainstream+stream8": "TrainStream, the last 8 blocks' weights streamed",
    "deepspeed3": "DeepSpeed ZeRO-3, parameters and optimizer offloaded",
    "trainstream+auto": 'TrainStream, activations="auto"',
    "trainstream+8bit": "TrainStream, torchao's AdamW8bit",
    "trainstream+8bit+sr": "TrainStream, torchao's AdamW8bit, bf16_stochastic_round=True",
    "gpu-adamw+8bit": "torchao's AdamW8bit on the GPU, nothing offloaded",
    "trainstream+paged": "TrainStream, activations paged or recomputed (`+paged`)",
    "trainstream+ckpt": "TrainStream + gradient checkpointing (Hugging Face, non-reentrant)",
    "trainstream+save_on_cpu": "TrainStream + torch.autograd.graph.save_on_cpu(pin_memory=True)",
    "torchao": "torchao CPUOffloadOptimizer",
    "deepspeed": "DeepSpeed ZeRO-2, optimizer offloaded",
    "no-optimizer": "no optimizer: forward and backward, each gradient dropped at once",
}


# ------------------------------------------------------------------------------ helpers
READ: set[str] = set()  # the results files some table was drawn from


def load(results: Path, name: str) -> dict:
    READ.add(name)
    with open(results / f"{name}.json") as f:
        return json.load(f)


def s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f} s"


def gb(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} GB"


def bold(text: str, on: bool) -> str:
    return f"**{text}**" if on else text


def markdown_table(columns: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def caption(records: list[tuple[str, dict]]) -> str:
    """When, on what and how each file was measured: one paragraph per file, led by its label
    when a table comes from several."""
    out = []
    for label, record in records:
        about = record.get("about", {})
        hardware = about.get("hardware") or record.get("gpu") or record.get("cpu") or "hardware not recorded"
        where = "; ".join(x for x in (hardware, about.get("software")) if x)
        date = about.get("date") or str(record.get("date", ""))[:10] or "date not recorded"
        how = f"`{about['command']}`" if about.get("command") else about.get("method", "Command not recorded")
        how = how[:1].upper() + how[1:]
        text = f"{label}: " if label else ""
        text += f"{date}, {where}. {how}."
        if about.get("notes"):
            text += " " + about["notes"]
        out.append(f"<sub>{text}</sub>")
    return "\n\n".join(out)


def model_words(args: dict, params: int | None) -> str:
    size = f"{params / 1e9:.2f}B Llama-style model" if params else "Llama-style model"
    weights = "fp32 weights under bf16 autocast" if args.get("weights", "fp32") == "fp32" and args.get(
        "autocast", True) else f"{args.get('weights', 'fp32')} weights"
    return f"{size} (hidden {args['hidden']}, {args['layers']} layers), batch {args['batch']}x{args['seq']}, {weights}"


def label_of(record: dict, mode: str) -> str:
    return record.get("about", {}).get("labels", {}).get(mode) or LABELS.get(mode, mode)


# ------------------------------------------------------------------------------ tables
def budget_sweep(name: str):
    return lambda results: sweep_table(load(results, name))


def sweep_table(record: dict) -> str:
    """TrainStream with no option but clipping against the peers, one row per VRAM cap."""
    ran = list(dict.fromkeys(r["mode"] for r in record["results"]))
    variants = [(mode, label_of(record, mode)) for mode in ran if mode.startswith("trainstream+")]
    peers = [(mode, name) for mode, name in [("trainstream", "TrainStream"), *variants, *PEER_NAMES.items()]
             if mode in ran]  # (a peer the run left out: no column)
    caps = []
    for r in record["results"]:
        if r["cap_GB"] not in caps:
            caps.append(r["cap_GB"])
    rows = []
    for cap in caps:
        here = {r["mode"]: r for r in record["results"] if r["cap_GB"] == cap}
        fastest = min((r["step_s"] for r in here.values() if r.get("step_s") is not None), default=None)
        row = ["none" if cap is None else f"{cap:g} GB"]
        for mode, _ in peers:
            r = here.get(mode)
            if r is None:
                row.append("-")
            elif r.get("step_s") is None:
                row.append((r.get("error") or r.get("skipped") or "failed").split(":")[0])
            else:
                cell = bold(s(r["step_s"]), r["step_s"] == fastest) + f", {gb(r['peak_vram_GB'])}"
                row.append(cell + (f" ({r['placement']})" if r.get("placement") else ""))
        rows.append(row)
    args = record["args"]
    params = next((r["params"] for r in record["results"] if r.get("params")), None)
    intro = (f"Step time and peak VRAM; {model_words(args, params)}, `max_grad_norm={args['clip']}`, "
             f"accumulation {args['acc']}. The cap is `torch.cuda.set_per_process_memory_fraction`; "
             f"TrainStream is wrapped with `max_grad_norm` alone. Fastest in bold.")
    return "\n\n".join([intro, markdown_table(["VRAM cap"] + [name for _, name in peers], rows),
                        caption([("", record)])])


BOUND = ("The bound is what the step cannot beat: the largest of the GPU's forward, backward and recomputes, the "
         "host updates of the offloaded parameters and the busier direction of PCIe at the measured pinned "
         "bandwidth (streamed weights twice a micro-batch, updated weights, gradients, and with accumulation the "
         "host sums the GPU adds each micro-batch to), all from the plan's profile.")


def streaming_bound(placement: dict) -> dict:
    """What a step cannot beat (placement.bound_seconds), for a recorded report()["placement"].
    Files from before the report listed the recomputed blocks take them from the block kinds
    (which show a recomputed block in the paged range as paged)."""
    kinds = placement["blocks"] or []

    def which(key: str, kind: str) -> tuple[int, ...]:
        recorded = placement.get(key)
        return tuple(recorded if recorded is not None else (j for j, k in enumerate(kinds) if k == kind))

    plan = planner.Plan(resident=placement["resident_params"], streamed=placement["streamed_blocks"] or 0,
                        recomputed=which("recomputed", "recomputed"), light=which("recomputed_lightly", "recomputed lightly"))
    return planner.bound_seconds(planner.profile_from(placement["profile"]), plan)


def stream_price(name: str):
    """budget_sweep.py of TrainStream alone down to budgets its weights do not fit: each step
    against the resident one and against its bound (streaming_bound)."""
    def render(results: Path) -> str:
        record = load(results, name)
        ours = [r for r in record["results"] if r["mode"] == "trainstream" and r.get("step_s") is not None]
        resident = [r for r in ours if not r["plan"]["streamed_blocks"]]
        base = min(resident, key=lambda r: r["cap_GB"] or float("inf"))  # the tightest cap it fits without streaming
        rows = []
        for r in ours:
            b = streaming_bound(r["plan"])
            rows.append(["none" if r["cap_GB"] is None else f"{r['cap_GB']:g} GB", str(r["plan"]["streamed_blocks"]),
                         f"{s(r['step_s'])}, {gb(r['peak_vram_GB'])}", f"{r['step_s'] / base['step_s']:.2f}x",
                         s(b["gpu_s"]), s(b["host_s"]), s(b["copies_s"]), f"{r['step_s'] / b['bound_s']:.2f}x"])
        params = ours[0]["params"]
        where = "the uncapped run" if base["cap_GB"] is None else f"the {base['cap_GB']:g} GB run"
        intro = (f"{model_words(record['args'], params)}, `max_grad_norm={record['args']['clip']}`; TrainStream "
                 f"wrapped with `max_grad_norm` alone under each cap (`set_per_process_memory_fraction`), so the "
                 f"planner streams as many blocks' weights as the cap needs. \"vs resident\" compares with {where}, "
                 f"the tightest that kept every weight on the GPU. {BOUND}")
        table = markdown_table(["VRAM cap", "blocks streamed", "step, peak", "vs resident", "GPU compute",
                                "host update", "PCIe copies", "step / bound"], rows)
        return "\n\n".join([intro, table, caption([("", record)])])
    return render


def stream_large(results: Path) -> str:
    """train_step.py runs of models whose weights exceed the cap, built in host memory: the step
    against the plan's estimate, and the host memory the plan takes and the machine used."""
    records = [load(results, n) for n in ("stream_6b_12gb", "stream_7b_24gb")]
    rows = []
    for record in records:
        r = next(x for x in record["results"] if x["mode"] == "trainstream")
        report = r["report"]
        placement = report["placement"]
        kinds = placement["blocks"]
        bound = streaming_bound(placement)
        rows.append([f"{r['params'] / 1e9:.2f}B ({record['args']['layers']} layers)", f"{record['args']['vram_cap_gb']:g} GB",
                     f"{s(r['step_s'])} (expected {s(placement['expected_step_s'])})",
                     f"{s(bound['gpu_s'])} / {s(bound['host_s'])} / {s(bound['copies_s'])}: "
                     f"{r['step_s'] / bound['bound_s']:.2f}x",
                     f"{gb(r['peak_vram_GB'])} (expected {gb(placement['expected_peak_bytes'] / 1e9)})",
                     f"{placement['streamed_blocks']} of {len(kinds)} streamed; {kinds.count('paged')} paged, "
                     f"{kinds.count('recomputed')} recomputed",
                     f"{report['host_bytes_per_param']:.1f} B a parameter, {report['activations']['host_bytes_reserved'] / 1e9:.1f} GB "
                     f"of activation slots; {record['host_used_peak_MiB'] * 2**20 / 1e9:.0f} GB in use at most",
                     f"{r['setup_s']:.0f} s"])
    intro = (f"Llama with 4096-wide layers (intermediate {records[0]['args']['intermediate']}), bf16 weights, batch "
             f"{records[0]['args']['batch']}x{records[0]['args']['seq']}, `max_grad_norm={records[0]['args']['clip']}`, "
             f"built in host memory and wrapped with `max_grad_norm` alone under a VRAM cap.")
    table = markdown_table(["model", "VRAM cap", "step", "GPU / host / copies bound: step over it", "peak VRAM",
                            "blocks", "host memory", "set-up"], rows)
    return "\n\n".join([intro, table, BOUND, caption([(f"row {i + 1}", r) for i, r in enumerate(records)])])


def plan_accuracy(name: str):
    """plan_accuracy.py: the planner's expected step time and peak beside the measured ones."""
    def render(results: Path) -> str:
        record = load(results, name)
        bounded = all("bound" in r for r in record["results"])  # (files from before the bound was recorded lack it)
        def recomputed(r: dict) -> str:
            light = r.get("light_blocks") or 0  # (files from before light recompute lack it)
            return f"{r['recomputed_blocks']}" + (f" + {light} lightly" if light else "")

        rows = [[r["variation"], str(r["resident_params"]), recomputed(r),
                 s(r["expected_step_s"]), s(r["step_s"]), f"{r['step_s'] / r['expected_step_s']:.2f}",
                 gb(r["expected_peak_GB"]), gb(r["peak_GB"])]
                + ([f"{r['step_s'] / r['bound']['bound_s']:.2f}x"] if bounded else []) for r in record["results"]]
        a = record["args"]
        intro = (f"{model_words(a, record.get('params'))}, `max_grad_norm={a['clip']}`, `vram_budget=\"{a['vram_budget']}\"`: the "
                 f"plan wrap() chose and variations of it, applied one after another in one process."
                 + (f" {BOUND}" if bounded else ""))
        table = markdown_table(["plan", "resident params", "blocks recomputed", "expected step", "measured",
                                "measured / expected", "expected peak", "peak"] + (["step / bound"] if bounded else []),
                               rows)
        return "\n\n".join([intro, table, caption([("", record)])])
    return render


def adamw_vs_torch(results: Path) -> str:
    r = load(results, "adamw_vs_torch")
    forms = [("trainstream", f"trainstream ({r['isa']})"), ("torch_fused", "torch.optim.AdamW, fused=True"),
             ("torch_foreach", "torch.optim.AdamW, foreach"), ("torch_for", "torch.optim.AdamW, for-loop")]
    best = min(r[f"{k}_ns_per_param"] for k, _ in forms if r.get(f"{k}_ns_per_param"))
    rows = []
    for key, name in forms:
        ns = r.get(f"{key}_ns_per_param")
        if ns is None:
            rows.append([name, "skipped", "-"])
            continue
        gbps = f"{28 / ns:.1f}"
        if key == "trainstream":
            gbps += f" ({100 * 28 / ns / r['triad_GBps']:.0f}% of the {r['triad_GBps']:.0f} GB/s triad of the same run)"
        rows.append([name, bold(f"{ns:.3f}", ns == best), gbps])
    intro = f"{r['params'] / 1e6:.0f}M fp32 parameters, {r['threads']} threads; lower ns/param is better."
    reference = {"torch_for": "for-loop", "torch_foreach": "foreach"}[r["max_abs_diff_reference"]]
    diff = (f"Largest weight difference from torch's {reference} AdamW after {r['steps'] + 1} steps: "
            f"{r['max_abs_diff']:.1e}.")
    return "\n\n".join([intro, markdown_table(["optimizer", "ns/param", "GB/s at 28 B/param"], rows), diff,
                        caption([("", r)])])


ENGINE_OUTPUTS = {"weights": "new weights", "term": "update term",
                  "next": "update term, new moments into a second set (a speculated update)",
                  "8bit": "new weights, blockwise 8-bit moments (torchao's AdamW8bit)"}


def engine_outputs(name: str):
    """bench_host_adamw: the host AdamW's rate by gradient dtype and what it writes."""
    def render(results: Path) -> str:
        r = load(results, name)
        rows = [[f"{x['grad']} gradients", ENGINE_OUTPUTS[x["output"]], f"{x['bytes_per_param']:.0f}",
                 f"{x['ns_per_param']:.4f}", f"{x['GBps']:.0f}", f"{x['triad_GBps']:.0f}" if x.get("triad_GBps") else "-"]
                for x in r["rows"]]
        return "\n\n".join([markdown_table(["gradients", "host writes", "bytes/param", "ns/param", "GB/s", "triad GB/s"],
                                           rows), caption([("", r)])])
    return render


def engine_8bit(name: str):
    """bench_host_adamw: the blockwise 8-bit update beside the exact one, by ISA and threads, in
    parameters a second against the exact update of the same gradients, ISA and threads."""
    def render(results: Path) -> str:
        r = load(results, name)
        exact = {(x["isa"], x["threads"], x["grad"]): x["ns_per_param"] for x in r["rows"] if x["output"] == "weights"}
        rows = []
        for x in r["rows"]:
            if x["output"] not in ("weights", "8bit"):
                continue
            ratio = exact.get((x["isa"], x["threads"], x["grad"]))
            rows.append([x["isa"], str(x["threads"]), x["grad"], "8-bit" if x["output"] == "8bit" else "exact",
                         f"{x['bytes_per_param']:.1f}", f"{x['ns_per_param']:.4f}", f"{x['GBps']:.0f}",
                         f"{100 * x['GBps'] / x['triad_GBps']:.0f}%", f"{ratio / x['ns_per_param']:.2f}x" if ratio else "-"])
        columns = ["ISA", "threads", "gradients", "moments", "bytes/param", "ns/param", "GB/s", "of the triad",
                   "params/s vs exact"]
        return "\n\n".join([markdown_table(columns, rows), caption([("", r)])])
    return render


def engine_threads(results: Path) -> str:
    r = load(results, "engine_threads")
    rows = [[str(x["threads"]), f"{x['GBps']:.1f}", f"{x['ns_per_param']:.4f}"] for x in r["rows"]]
    return "\n\n".join([markdown_table(["threads", "GB/s", "ns/param"], rows), caption([("", r)])])


def runs(name: str):
    """A train_step.py file as it ran: one row per mode, step time against the first GPU AdamW
    run (or the first mode) and peak VRAM; the fastest offloading mode in bold."""
    def render(results: Path) -> str:
        record = load(results, name)
        done = [r for r in record["results"] if r.get("step_s") is not None]
        base = next((r["step_s"] for r in done if r["mode"] == "gpu-adamw"), done[0]["step_s"] if done else None)
        others = [r["step_s"] for r in done if r["mode"] != "gpu-adamw"]
        fastest = min(others) if others else None
        rows = []
        for r in record["results"]:
            if r.get("step_s") is None:
                rows.append([label_of(record, r["mode"]), r.get("error") or "-", "-", gb(r.get("peak_vram_GB"))])
                continue
            rows.append([label_of(record, r["mode"]),
                         bold(s(r["step_s"]), r["mode"] != "gpu-adamw" and r["step_s"] == fastest),
                         f"{r['step_s'] / base:.2f}x" if base else "-", gb(r.get("peak_vram_GB"))])
        params = next((r["params"] for r in record["results"] if r.get("params")), None)
        intro = f"{model_words(record['args'], params)}, accumulation {record['args']['acc']}."
        against = "vs GPU AdamW" if any(r["mode"] == "gpu-adamw" for r in done) else "vs the first"
        tables = [markdown_table(["mode", "step", against, "peak VRAM"], rows)]
        summary = medians(record["results"])
        if any(m["runs"] > 1 for m in summary):  # a mode ran more than once: its spread, and medians
            first = summary[0]["median_s"]
            tables.append(markdown_table(
                ["mode", "runs", "median step", "fastest - slowest", "median vs the first"],
                [[label_of(record, m["mode"]), str(m["runs"]), s(m["median_s"]), f"{s(m['min_s'])} - {s(m['max_s'])}",
                  f"{m['median_s'] / first:.2f}x"] for m in summary]))
        return "\n\n".join([intro, *tables, caption([("", record)])])
    return render


def host_memory(name: str):
    """train_step.py runs with what each took of host memory: the process's resident set at the
    end, and what TrainStream itself held by role (report()["host_budget"]["held_bytes"])."""
    def render(results: Path) -> str:
        record = load(results, name)
        done = [r for r in record["results"] if r.get("step_s") is not None]
        base = next((r["step_s"] for r in done if r["mode"] == "gpu-adamw"), None)
        rows = []
        for r in record["results"]:
            held = (r.get("report") or {}).get("host_budget", {}).get("held_bytes")
            parts = "-" if held is None else ", ".join(
                f"{role.replace('_', ' ')} {value / 1e9:.2f}" for role, value in held.items() if value) or "none"
            step = r.get("step_s")
            rows.append([label_of(record, r["mode"]), s(step) if step else r.get("error") or "-",
                         f"{step / base:.2f}x" if step and base else "-", gb(r.get("peak_vram_GB")),
                         gb(r.get("host_rss_GB")), parts])
        params = next((r["params"] for r in record["results"] if r.get("params")), None)
        cap = record["args"].get("vram_cap_gb")
        intro = (f"{model_words(record['args'], params)}, accumulation {record['args']['acc']}, "
                 f"{'a ' + format(cap, 'g') + ' GB VRAM cap' if cap else 'no VRAM cap'}.")
        table = markdown_table(["mode", "step", "vs GPU AdamW", "peak VRAM", "process RSS",
                                "TrainStream holds on the host (GB)"], rows)
        return "\n\n".join([intro, table, caption([("", record)])])
    return render


def accumulation(results: Path) -> str:
    """Update terms against uploaded masters, by accumulation; repeated modes are repeated runs."""
    records = [load(results, n) for n in ("step_acc1", "step_acc8", "step_acc32")]
    rows = []
    for record in records:
        acc = record["args"]["acc"]
        by = {"gpu": [], "terms": [], "master": []}
        for r in record["results"]:
            kind = "gpu" if r["mode"] == "gpu-adamw" else "master" if "master" in r["mode"].split("+") else "terms"
            by[kind].append(r)
        ref = statistics.mean(r["step_s"] for r in by["gpu"])

        def cell(rs: list[dict], ratio: bool = False, strong: bool = False) -> str:
            if not rs:
                return "-"
            times = " and ".join(f"{r['step_s']:.3f} s" + (f" ({r['step_s'] / ref:.2f}x)" if ratio else "") for r in rs)
            peaks = sorted({r["peak_vram_GB"] for r in rs if r.get("peak_vram_GB") is not None})
            return bold(times, strong) + (" at " + " and ".join(gb(p) for p in peaks) if peaks else "")

        vram = any("vramacc" in r["mode"] for r in record["results"])
        rows.append([f"{acc}" + (", summed in VRAM" if vram else ""), cell(by["gpu"]),
                     cell(by["terms"], ratio=True, strong=True), cell(by["master"])])
    table = markdown_table(["accumulation", "GPU AdamW", "TrainStream (x GPU AdamW's mean)",
                            "TrainStream uploading fp32 masters (`+master`)"], rows)
    intro = f"{model_words(records[0]['args'], records[0]['results'][0]['params'])}; modes alternating in one process."
    return "\n\n".join([intro, table, caption([(f"accumulation {r['args']['acc']}", r) for r in records])])


def activation_budget(results: Path) -> str:
    records = [load(results, n) for n in ("activation_budget_fp32", "activation_budget_bf16")]
    rows = []
    for record in records:
        by = {r["mode"]: r for r in record["results"]}
        off = by["trainstream"]["step_s"]
        budgeted = [by[m]["step_s"] for m in ("trainstream+paged", "trainstream+paged+pageonly")]

        def cell(r: dict, ratio: bool) -> str:
            text = s(r["step_s"]) + (f" ({r['step_s'] / off:.2f}x)" if ratio else "") + f", {gb(r['peak_vram_GB'])}"
            text = bold(text, ratio and r["step_s"] == min(budgeted))
            if r.get("expected_peak_GB") is not None:
                text += f" (expected {gb(r['expected_peak_GB'])})"
            return text + (f": {r['note']}" if r.get("note") else "")

        rows.append([record["args"]["weights"], cell(by["trainstream"], False), cell(by["trainstream+paged"], True),
                     cell(by["trainstream+paged+pageonly"], True)])
    budget = records[0]["args"]["vram_budget"]
    table = markdown_table(["weights", 'activations="off"', f'vram_budget="{budget}"',
                            "the same budget, paging only (`recompute=False`)"], rows)
    intro = (f"{model_words(records[0]['args'], records[0]['results'][0]['params'])}, accumulation 1, every "
             f"parameter offloaded. Step time (x the run without paging), peak VRAM, what the policy chose.")
    return "\n\n".join([intro, table, caption([(f"{r['args']['weights']} weights", r) for r in records])])


def activation_ways(results: Path) -> str:
    records = [load(results, n) for n in ("activation_ways_fp32", "activation_ways_bf16")]
    modes = []
    for record in records:
        modes += [r["mode"] for r in record["results"] if r["mode"] not in modes]
    rows = []
    for mode in modes:
        budget = records[0]["args"].get("vram_budget")
        row = [f'TrainStream, vram_budget="{budget}", paging only' if mode == "trainstream+paged"
               else label_of(records[0], mode)]
        for record in records:
            r = next((x for x in record["results"] if x["mode"] == mode), None)
            row.append("-" if r is None else f"{s(r['step_s'])}, {gb(r['peak_vram_GB'])}"
                       + (f" ({r['note']})" if r.get("note") else ""))
        rows.append(row)
    table = markdown_table(["how activations are kept", "fp32 weights", "bf16 weights"], rows)
    intro = (f"{model_words(records[0]['args'], records[0]['results'][0]['params'])} (bf16 weights in the last "
             f"column), accumulation 1; step time and peak VRAM.")
    return "\n\n".join([intro, table, caption([(f"{r['args']['weights']} weights", r) for r in records])])


def large_models(results: Path) -> str:
    names = ("large_4b_fp32", "large_5b_bf16", "large_6b_bf16", "large_4b_fp32_recompute")
    records = [load(results, n) for n in names]
    rows = []
    for record in records:
        a = record["args"]
        ours = next(r for r in record["results"] if r["mode"].startswith("trainstream"))
        peer = next((r for r in record["results"] if r["mode"] == "gpu-adamw"), None)
        weights = "fp32 weights, bf16 autocast" if a["weights"] == "fp32" else "bf16 weights"
        paged = f"{ours['activations_paged_GB']:g} GB" + (f" ({ours['note']})" if ours.get("note") else "")
        setup = f"{ours['setup_s']:.0f} s" if ours.get("setup_s") is not None else "-"
        rows.append([f"{ours['params'] / 1e9:.2f}B, {weights}, batch {a['batch']}x{a['seq']}",
                     f"{ours['step_s']:.3f} s/step, peak {gb(ours['peak_vram_GB'])}", paged, setup,
                     "-" if peer is None else peer.get("error", s(peer.get("step_s")))])
    table = markdown_table(["model", "TrainStream", "activations paged per step", "set-up", "GPU AdamW"], rows)
    intro = (f"Llama with {records[0]['args']['hidden']}-wide layers (intermediate "
             f"{records[0]['args']['intermediate']}) under a {records[0]['args']['vram_cap_gb']:g} GB VRAM cap.")
    return "\n\n".join([intro, table, caption([(f"row {i + 1}", r) for i, r in enumerate(records)])])


def hf_finetune(results: Path) -> str:
    r = load(results, "hf_finetune")
    rows = [[name, f"{run['seconds_per_step']:.3f} s", gb(run.get("peak_vram_GB"))]
            for name, run in (("TrainStreamTrainer", r["runs"]["trainstream"]),
                              ("transformers.Trainer", r["runs"]["stock"]))]
    a = r["args"]
    intro = (f"A small Llama (hidden {a['hidden']}, {a['layers']} layers), batch {a['batch']}x{a['seq']}, "
             f"accumulation {a['accumulation']}, {a['steps']} steps; losses within "
             f"{r['loss_max_rel_diff']:.1e} relative of each other.")
    return "\n\n".join([intro, markdown_table(["trainer", "step", "peak VRAM"], rows), caption([("", r)])])


def hf_trainer(name: str):
    """hf_trainer.py: stock Trainer against TrainStreamTrainer at each accumulation and compile setting."""
    return lambda results: hf_table(load(results, name))


def hf_table(record: dict) -> str:
    def setting(r):  # (runs from before --logging-steps logged every 500 steps, TrainingArguments' default)
        return r["acc"], r["compile"], r.get("logging_steps", 500)

    stock = {setting(r): r["step_s"] for r in record["results"] if r["trainer"] == "stock"}
    rows = []
    for r in record["results"]:
        base, step, diff = stock.get(setting(r)), r["step_s"], r.get("max_rel_loss_diff_vs_stock")
        rows.append([str(r["acc"]), "on" if r["compile"] else "off", str(setting(r)[2]),
                     "TrainStreamTrainer" if r["trainer"] == "trainstream" else "transformers.Trainer",
                     s(step) if step else r.get("error", "-"), f"{step / base:.2f}x" if step and base else "-",
                     gb(r.get("peak_vram_GB")), f"{diff:.1e}" if diff is not None and r["trainer"] != "stock" else "-"])
    a = record["args"]
    intro = (f"{model_words(a, None)}; TrainingArguments' defaults (`max_grad_norm=1.0`, linear schedule) with "
             f"`bf16=True`; TrainStreamTrainer with no option.")
    table = markdown_table(["accumulation", "torch_compile", "logging_steps", "trainer", "step", "vs stock",
                            "peak VRAM", "largest relative loss difference"], rows)
    return "\n\n".join([intro, table, caption([("", record)])])


def deepspeed3_offload(results: Path) -> str:
    """DeepSpeed ZeRO-3 with parameters and optimizer offloaded, on the large shapes: its step or
    how it failed, and the machine's memory in use at its peak."""
    record = load(results, "deepspeed3_offload")
    rows = [[r["shape"], f"{r['cap_GB']:g} GB", s(r["step_s"]) if r.get("step_s") else r["error"],
             gb(r.get("peak_vram_GB")), f"{r['machine_peak_MiB'] * 2**20 / 1e9:.1f} GB"] for r in record["results"]]
    intro = ("DeepSpeed ZeRO-3, parameters and optimizer offloaded (pinned), batch 1x1024, clip 1.0, the model's "
             "own loss.")
    table = markdown_table(["model", "VRAM cap", "step", "peak VRAM", "machine's memory in use, peak"], rows)
    return "\n\n".join([intro, table, caption([("", record)])])


def large_8b_class(name: str):
    """The 8B-class shapes under 24 and 16 GB caps at accumulation 8, the model built in host
    memory: the step against the bound its plan's profile sets, host memory, and DeepSpeed
    ZeRO-3 offload's step (or how it failed) beside them."""
    return lambda results: _large_8b_class(load(results, name))


def _large_8b_class(record: dict) -> str:
    names = {"trainstream+8bit+sr": "TrainStream, AdamW8bit (bf16 stochastic rounding)",
             "deepspeed3": "DeepSpeed ZeRO-3 offload"}
    rows = []
    for r in record["results"]:
        head = [r["shape"], f"{r['cap_GB']:g} GB", names[r["mode"]]]
        memory = f"{r['machine_peak_MiB'] * 2**20 / 1e9:.1f} GB"
        if r.get("step_s") is None:
            rows.append(head + [r["error"], "-", "-", "-", memory, "-"])
            continue
        bound = streaming_bound(r["report"]["placement"])["bound_s"]
        rows.append(head + [s(r["step_s"]), f"{r['step_s'] / bound:.2f}x of {bound:.2f} s", f"{r['tokens_per_s']:.0f}",
                            gb(r["peak_vram_GB"]), memory, f"{r['report']['host_bytes_per_param']:.2f} B"])
    intro = ("The Llama-3-8B shape (8.03B: hidden 4096, 32 layers, intermediate 14336, 32 heads, 8 key/value heads, "
             "vocabulary 128256) and the Qwen2.5-7B shape (7.62B: hidden 3584, 28 layers, intermediate 18944, 28 heads, "
             "4 key/value heads, vocabulary 152064, biased q/k/v), bf16 weights, batch 1x2048, accumulation 8, clip 1.0, "
             "the model's own loss. " + BOUND)
    table = markdown_table(["model", "VRAM cap", "optimizer", "step", "vs bound", "tokens/s", "peak VRAM",
                            "machine's memory in use, peak", "host bytes a parameter"], rows)
    return "\n\n".join([intro, table, caption([("", record)])])


def copy_under_load(results: Path) -> str:
    records = [load(results, n) for n in ("copy_under_load_a", "copy_under_load_b")]

    def v(x) -> str:
        return "-" if x is None else f"{x:.1f}"

    rows = []
    for key, name in (("h2d", "host to device"), ("d2h", "device to host"), ("both", "both at once, each way")):
        rows.append([f"pinned copy, {name}"] + [v(r[f"copy_GBps_{w}"][key]) for r in records
                                                   for w in ("alone", "with_engine")])
    rows.append(["AdamW engine (26 B/param)"] + [v(x) for r in records
                                                for x in (r["engine_GBps_alone"], r["engine_GBps_with_copies"])])
    table = markdown_table(["GB/s", "machine 1, alone", "with the other running", "machine 2, alone",
                            "with the other running"], rows)
    intro = (f"Pinned copies of {records[0]['copy_bytes'] / 1e9:.0f} GB and the host AdamW engine updating "
             f"{records[0]['params'] / 1e6:.0f}M parameters on {records[0]['engine_threads']} threads, each alone and "
             f"both at once (the engine against copies both ways).")
    return "\n\n".join([intro, table, caption([(f"machine {i + 1}", r) for i, r in enumerate(records)])])


def timeline(name: str):
    """A step_timeline.py file: each timed step by phase on the GPU, and how often the thread that
    queues the forward reached a new block."""
    def render(results: Path) -> str:
        record = load(results, name)
        phases = [p["phase"] for p in record["steps"][0]["phases"]]
        rows = []
        for k, step in enumerate(record["steps"]):
            starts = step["block_starts_host_ms"]
            pace = statistics.median(b - a for a, b in zip(starts, starts[1:]))
            rows.append([str(k + 1)] + [f"{p['gpu_ms']:.1f}" for p in step["phases"]]
                        + [f"{step['step_gpu_ms']:.1f}", f"{starts[0]:.1f}", f"{pace:.1f}"])
        table = markdown_table(["step"] + [f"{p} (GPU ms)" for p in phases]
                               + ["whole step (GPU ms)", "first block queued at (ms)", "a block queued every (ms)"], rows)
        engine = record.get("host_engine")
        lines = [line for line in record.get("placement", "").splitlines()
                 if line.startswith(("placement:", "activations:", "expected step"))]
        if engine:
            lines.append(f"host engine: busy {engine['busy_ms_per_step']:.1f} ms a step, "
                         f"{engine['elements_per_step'] / 1e6:.0f}M elements")
        return "\n\n".join([table, "\n".join(f"- {line}" for line in lines), caption([("", record)])])
    return render


def host_overhead(name: str):
    """A host_overhead.py comparison: each build's runs, the host time of each phase by mode."""
    def render(results: Path) -> str:
        record = load(results, name)
        builds = list(dict.fromkeys(r["build"] for r in record["runs"]))
        rows = []
        for build in builds:
            mine = [r["rows"] for r in record["runs"] if r["build"] == build]
            for k, row in enumerate(mine[0]):
                rows.append([build, row["mode"]] + [" and ".join(f"{run[k][f'{phase}_ms']:.2f}" for run in mine)
                                                    for phase in ("forward", "backward", "step")])
        table = markdown_table(["build", "mode", "forward (ms)", "backward (ms)", "step() (ms)"], rows)
        return "\n\n".join([table, caption([("", record)])])
    return render


def host_calls(name: str):
    """host_calls.py runs side by side: each call's host time a step (and a call), the calls of the
    first run first."""
    def render(results: Path) -> str:
        record = load(results, name)
        runs = [{row["call"]: row for row in run["rows"]} for run in record["runs"]]
        calls = list(dict.fromkeys(call for run in record["runs"] for call in (row["call"] for row in run["rows"])))
        rows = [[f"`{call}`"] + [f"{run[call]['ms_per_step']:.2f} ({run[call]['us_per_call']:.0f} us x "
                                 f"{run[call]['calls_per_step']:g})" if call in run else "-" for run in runs]
                for call in calls]
        rows.append(["whole step"] + [f"{1e3 * run['step_s']:.1f}" for run in record["runs"]])
        columns = ["call"] + [f"{run['label']}: ms a step (a call x calls)" for run in record["runs"]]
        return "\n\n".join([markdown_table(columns, rows), caption([("", record)])])
    return render


def recorded_table(name: str):
    """A NAME.json with "columns" and "rows": a comparison recorded as it was published."""
    def render(results: Path) -> str:
        record = load(results, name)
        return "\n\n".join([markdown_table(record["columns"], record["rows"]), caption([("", record)])])
    return render


CONVERGENCE_LABELS = {
    "stock": "stock: torch AdamW (fused, GPU), clip_grad_norm_",
    "trainstream": "TrainStream, torch.optim.AdamW",
    "trainstream-8bit": "TrainStream, torchao AdamW8bit (fp32 master)",
    "trainstream-8bit-sr": "TrainStream, AdamW8bit, bf16 weights rounded stochastically",
    "torchao-8bit": "torchao AdamW8bit on the GPU",
}


def convergence(results: Path) -> str:
    """convergence.py's runs: held-out loss along the way, final losses against the first run's
    (stock), how often the clip did not bite, and what became of the speculated updates."""
    record = load(results, "convergence")
    runs = record["runs"]
    base = runs[0]["final_held_out_loss"]
    steps = [s for s, _ in runs[0]["held_out"]][1::2]
    rows = []
    for r in runs:
        held = dict(r["held_out"])
        spec = r.get("speculation")
        rows.append([CONVERGENCE_LABELS.get(r["mode"], r["mode"]),
                     *(f"{held[s]:.4f}" if s in held else "-" for s in steps),
                     f"{(r['final_held_out_loss'] / base - 1) * 100:+.2f}%", f"{r['final_train_loss']:.4f}",
                     f"{r['norm_under_clip_share'] * 100:.1f}%",
                     f"{spec['hits']} / {spec['misses']} / {spec['waited']}" if spec else "-"])
    columns = ["mode", *(f"held out, step {s}" for s in steps), "vs stock", "training loss",
               "norm under 1.0", "speculated: committed / redone / waited"]
    return "\n\n".join([markdown_table(columns, rows), caption([("", record)])])


TABLES = {
    "budget_sweep": budget_sweep("budget_sweep"),
    "budget_sweep_acc8": budget_sweep("budget_sweep_acc8"),
    "budget_sweep_margins_acc1": budget_sweep("budget_sweep_margins_acc1"),
    "budget_sweep_margins_acc8": budget_sweep("budget_sweep_margins_acc8"),
    "stream_price": stream_price("stream_price"),
    "stream_large": stream_large,
    "plan_accuracy_20gb": plan_accuracy("plan_accuracy_20gb"),
    "plan_accuracy_light": plan_accuracy("plan_accuracy_light"),
    "adamw_vs_torch": adamw_vs_torch,
    "engine_update_term": engine_outputs("engine_update_term"),
    "engine_speculation": engine_outputs("engine_speculation"),
    "engine_threads": engine_threads,
    "peers_acc8": runs("peers_acc8"),
    "vram_floor": runs("vram_floor"),
    "accumulation": accumulation,
    "activation_budget": activation_budget,
    "activation_ways": activation_ways,
    "large_models": large_models,
    "hf_finetune": hf_finetune,
    "copy_under_load": copy_under_load,
    "hf_trainer": hf_trainer("hf_trainer"),
    "hf_trainer_compiled_gate": hf_trainer("hf_trainer_compiled_gate"),
    "hf_trainer_logging1": hf_trainer("hf_trainer_logging1"),
    "compile_acc8": runs("compile_acc8"),
    "compile_cap16": runs("compile_cap16"),
    "deepspeed3_offload": deepspeed3_offload,
    "large_8b_class": large_8b_class("large_8b_class"),
    "large_8b_class_host_adds": large_8b_class("large_8b_class_host_adds"),
    "clipping_planned_16gb": runs("clipping_planned_16gb"),
    "clipping_bf16_held": runs("clipping_bf16_held"),
    "clipping_never_one_commit_four_rounds": runs("clipping_never_one_commit_four_rounds"),
    "clipping_regimes_one_commit": runs("clipping_regimes_one_commit"),
    "host_calls_one_commit": host_calls("host_calls_one_commit"),
    "host_memory_uncapped": host_memory("host_memory_uncapped"),
    "engine_8bit": engine_8bit("engine_8bit"),
    "host_memory_vocab152k_16gb": host_memory("host_memory_vocab152k_16gb"),
    "adamw8bit_43b_12gb": host_memory("adamw8bit_43b_12gb"),
    "adamw8bit_43b_12gb_sr": host_memory("adamw8bit_43b_12gb_sr"),
    "adamw8bit_13b_24gb": host_memory("adamw8bit_13b_24gb"),
    "convergence": convergence,
}

# figure -> results file: train_step.py runs drawn as step time and peak VRAM bars
PLOTS = {
    "docs/img/budget_1b.png": "activation_budget_fp32",
    "docs/img/paging_1b.png": "activation_ways_fp32",
}
# figure -> convergence.py's runs: their loss curves
CURVE_PLOTS = {
    "docs/img/convergence.png": "convergence",
}
# figure -> budget_sweep.py files: step time against the VRAM cap, one panel per accumulation
SWEEP_PLOTS = {
    "docs/img/budget_sweep.png": ("budget_sweep", "budget_sweep_acc8"),
}


def render(name: str, results: Path) -> str:
    if name in TABLES:
        return TABLES[name](results)
    if (results / f"{name}.json").exists():
        return recorded_table(name)(results)
    raise SystemExit(f"no table named {name!r}: add it to TABLES or write {results / name}.json with columns and rows")


def update(text: str, results: Path) -> str:
    return MARKER.sub(lambda m: m.group(1) + render(m.group(2), results) + "\n" + m.group(4), text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="?", default=str(ROOT / "docs" / "results"), help="the JSON files")
    ap.add_argument("--root", default=str(ROOT), help="the checkout whose documents are updated")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a document is out of date")
    ap.add_argument("--plots", action="store_true", help="also redraw " + ", ".join([*PLOTS, *CURVE_PLOTS, *SWEEP_PLOTS]))
    args = ap.parse_args(argv)
    results, root = Path(args.results), Path(args.root)
    stale = []
    for doc in DOCUMENTS:
        path = root / doc
        if not path.exists():
            continue
        text = path.read_text()
        new = update(text, results)
        if new == text:
            continue
        stale.append(doc)
        if not args.check:
            path.write_text(new)
    if args.plots and not args.check:
        for figure, name in PLOTS.items():
            plot_runs(load(results, name)["results"], str(root / figure))
            print(f"drew {figure}")
        for figure, name in CURVE_PLOTS.items():
            plot_curves(load(results, name)["runs"], str(root / figure))
            print(f"drew {figure}")
        for figure, names in SWEEP_PLOTS.items():
            rows = [r for name in names for r in load(results, name)["results"]]
            plot_sweep(rows, sorted({r["acc"] for r in rows}), str(root / figure))
            print(f"drew {figure}")
    unused = sorted(p.stem for p in results.glob("*.json") if p.stem not in READ)
    if args.check:
        if stale:
            print("out of date with " + str(results) + ": " + ", ".join(stale)
                  + " (run python benchmarks/report.py to regenerate)", file=sys.stderr)
        if unused:
            print("results no table shows (place a marker or remove them): " + ", ".join(unused), file=sys.stderr)
        if stale or unused:
            return 1
        print("every table matches " + str(results))
        return 0
    if unused:
        print("note: results no table shows: " + ", ".join(unused), file=sys.stderr)
    print("updated " + (", ".join(stale) if stale else "nothing: every table was up to date"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
