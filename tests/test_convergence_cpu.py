"""benchmarks/convergence.py in TrainStream's CPU mode, on a tiny model: every mode trains on the
standard library's source and writes its curve and figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "convergence.py"
TINY = ["--device", "cpu", "--hidden", "64", "--layers", "2", "--intermediate", "128", "--seq", "32",
        "--batch", "2", "--steps", "6", "--eval-every", "3"]


@pytest.mark.parametrize("mode", ["stock", "trainstream", "trainstream-8bit", "trainstream-8bit-sr", "torchao-8bit"])
def test_each_mode_writes_its_curve(tmp_path, mode):
    pytest.importorskip("torchao")
    out = tmp_path / f"{mode}.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--mode", mode, "--json", str(out), *TINY],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    run = json.loads(out.read_text())
    assert run["complete"] and run["steps_done"] == 6 and len(run["loss"]) == 6
    assert [step for step, _ in run["held_out"]] == [3, 6]
    assert all(0 < loss < 10 for loss in run["loss"]) and len(run["grad_norms"]) == 6
    if mode.startswith("trainstream"):
        assert set(run["speculation"]) >= {"hits", "misses"}
    if mode == "trainstream-8bit-sr":
        assert "rounded stochastically" in run["describe"]


def test_the_curves_plot_is_drawn_from_the_runs_files(tmp_path):
    pytest.importorskip("matplotlib")
    files = []
    for mode, shift in (("stock", 0.0), ("trainstream", 0.01)):
        run = {"mode": mode, "params": 99_000_000, "loss": [3.0 - 0.01 * i + shift for i in range(120)],
               "final_held_out_loss": 1.8 + shift}
        files.append(tmp_path / f"{mode}.json")
        files[-1].write_text(json.dumps(run))
    png = tmp_path / "curves.png"
    done = subprocess.run([sys.executable, str(SCRIPT), "--plot", str(png), *map(str, files)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
