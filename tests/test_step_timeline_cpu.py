"""benchmarks/step_timeline.py on the CPU, run as a script: every mode runs, and the phases
account for the step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "step_timeline.py"
MODES = ("gpu-adamw", "trainstream", "trainstream+vramacc", "trainstream+paged")
PLANNED = "trainstream+planned"  # wrap() with no placement option: the planner's plan
TINY = ["--device", "cpu", "--hidden", "64", "--layers", "2", "--heads", "4", "--intermediate", "128",
        "--vocab", "128", "--batch", "2", "--seq", "16", "--warmup", "1", "--steps", "2"]


def timeline(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


def test_the_modes_are_the_scripts():
    done = timeline("--help")
    assert done.returncode == 0, done.stderr
    assert "{" + ",".join((*MODES, PLANNED)) + "}" in done.stdout


def test_the_planned_mode_times_the_plan_and_describes_it(tmp_path):
    out = tmp_path / "timeline.json"
    done = timeline(*TINY, "--warmup", "4", "--mode", PLANNED, "--clip", "1.0", "--json", str(out))  # (the last --warmup counts)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert len(result["steps"]) == 2 and result["max_grad_norm"] == 1.0
    assert result["placement"].startswith("placement: ") and result["placement"] in done.stdout


@pytest.mark.parametrize("mode", MODES)
def test_timeline_accounts_for_every_micro_batch(mode, tmp_path):
    out = tmp_path / "timeline.json"
    done = timeline(*TINY, "--mode", mode, "--acc", "3", "--json", str(out))
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["mode"] == mode and len(result["steps"]) == 2
    for step in result["steps"]:
        names = [p["phase"] for p in step["phases"]]
        assert names == ["forward 0", "backward 0", "forward 1", "backward 1", "forward 2", "backward 2",
                         "optimizer.step"]
        assert all(p["host_ms"] > 0 and p["gpu_ms"] is None for p in step["phases"])
        assert sum(p["host_ms"] for p in step["phases"]) == pytest.approx(step["step_host_ms"])
        starts = step["block_starts_host_ms"]  # both layers, in order, within the first forward
        assert len(starts) == 2 and 0 < starts[0] < starts[1] < step["phases"][0]["host_ms"]
    assert done.stdout.count("whole step") == 2 and "GPU ms" not in done.stdout
    assert done.stdout.count("blocks start, host ms") == 2
    if mode.startswith("trainstream"):  # every parameter updated on the host, each timed step
        engine = result["host_engine"]
        assert engine["elements_per_step"] == 98624 and engine["busy_ms_per_step"] > 0  # (the tiny model's parameters)
        assert "host engine: busy" in done.stdout
    else:
        assert "host_engine" not in result


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_cuda_without_gpu_says_so():
    done = timeline("--device", "cuda")
    assert done.returncode == 2
    assert "needs a CUDA GPU" in done.stderr


def test_paged_mode_takes_a_share_of_activations(tmp_path):
    out = tmp_path / "timeline.json"
    done = timeline(*TINY, "--layers", "3", "--mode", "trainstream+paged", "--activations", "0.5", "--json", str(out))
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["mode"] == "trainstream+paged"


@pytest.mark.parametrize("mode", ["gpu-adamw", "trainstream"])
def test_a_clipped_timeline_says_whether_the_speculation_committed(mode, tmp_path):
    out = tmp_path / "timeline.json"
    done = timeline(*TINY, "--mode", mode, "--clip", "1e9", "--json", str(out))
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["max_grad_norm"] == 1e9 and "max_grad_norm=1e+09" in done.stdout
    if mode == "trainstream":  # a norm that never clips: every window after the first commits
        speculation = result["speculation"]
        assert speculation["hits"] >= 2 and speculation["misses"] == 0, speculation
