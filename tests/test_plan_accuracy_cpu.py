"""benchmarks/plan_accuracy.py on the CPU, run as a script: each variation of the plan is
applied as asked and trained, and the planner's expectation stands beside it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "plan_accuracy.py"
TINY = ["--device", "cpu", "--hidden", "64", "--layers", "4", "--heads", "4", "--intermediate", "128",
        "--vocab", "128", "--batch", "2", "--seq", "16", "--warmup", "1", "--steps", "1", "--vram-budget", "100MB"]


def test_every_variation_is_applied_and_measured(tmp_path):
    out = tmp_path / "plan_accuracy.json"
    done = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--light", "--json", str(out)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    rows = {r["variation"]: r for r in json.loads(out.read_text())["results"]}
    everything = rows["everything resident, nothing recomputed"]
    params = everything["resident_params"]
    assert params > 2 and everything["recomputed_blocks"] == 0 and everything["streamed_blocks"] == 0
    assert rows["only the last parameter in forward order offloaded"]["resident_params"] == params - 1
    assert rows["half the parameters offloaded"]["resident_params"] == params // 2
    assert rows["every parameter resident, 2 blocks recomputed"]["recomputed_blocks"] == 2
    hooked = rows["everything resident, hooks on, nothing paged"]
    assert hooked["resident_params"] == params and hooked["step_terms"]["hooks_s"] > 0
    light = [r for name, r in rows.items() if "recomputed lightly" in name]
    assert [(r["light_blocks"], r["resident_params"]) for r in light] == [(2, params), (4, params)]
    assert light[1]["step_terms"]["recompute_s"] > light[0]["step_terms"]["recompute_s"] > 0
    # (the variations that name what they recompute recompute nothing else, lightly or whole)
    assert all(r["light_blocks"] == 0 for name, r in rows.items() if not name.startswith("chosen") and "lightly" not in name)
    again = rows["chosen, again"]
    assert {k: again[k] for k in ("resident_params", "recomputed_blocks", "light_blocks", "expected_step_s")} == \
        {k: rows["chosen"][k] for k in ("resident_params", "recomputed_blocks", "light_blocks", "expected_step_s")}
    streamed = [r for name, r in rows.items() if "weights streamed" in name]
    assert [r["streamed_blocks"] for r in streamed] == [1, 2, 4]
    assert [r["resident_params"] for r in streamed] == sorted((r["resident_params"] for r in streamed), reverse=True)
    assert streamed[-1]["resident_params"] <= 1  # every block streams: at most the embedding stays
    for r in rows.values():
        assert r["step_s"] > 0 and r["expected_step_s"] > 0 and r["peak_GB"] is None
