"""benchmarks/report.py, run as a script: every results table in README.md and docs/ is what the
JSON in docs/results gives, and regenerating them is idempotent."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from trainstream import placement as planner

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "report.py"
RESULTS = ROOT / "docs" / "results"
DOCUMENTS = ("README.md", "docs/benchmarks.md", "docs/architecture.md")


def report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_committed_tables_are_what_their_json_gives():
    done = report(str(RESULTS), "--check")
    assert done.returncode == 0, done.stderr
    assert "every table matches" in done.stdout


def test_the_readme_table_is_generated():
    readme = (ROOT / "README.md").read_text()
    assert "<!-- results:budget_sweep -->" in readme and "<!-- /results:budget_sweep -->" in readme


def copy_documents(root: Path) -> None:
    for doc in DOCUMENTS:
        (root / doc).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / doc, root / doc)


def test_a_table_edited_by_hand_is_found_and_regenerated_once(tmp_path):
    copy_documents(tmp_path)
    page = tmp_path / "docs" / "benchmarks.md"
    original = page.read_text()
    start = original.index("<!-- results:budget_sweep -->")
    edited = original[:start] + original[start:].replace("0.168 s", "0.150 s", 1)
    assert edited != original
    page.write_text(edited)

    done = report(str(RESULTS), "--root", str(tmp_path), "--check")
    assert done.returncode == 1 and "docs/benchmarks.md" in done.stderr
    assert page.read_text() == edited  # --check writes nothing

    done = report(str(RESULTS), "--root", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert page.read_text() == original
    again = report(str(RESULTS), "--root", str(tmp_path))
    assert "updated nothing" in again.stdout and page.read_text() == original


def test_a_results_file_no_table_shows_fails_the_check(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    (results / "orphan.json").write_text('{"columns": ["a"], "rows": [["1"]]}')
    done = report(str(results), "--check")
    assert done.returncode == 1 and "orphan" in done.stderr


def test_the_streaming_price_is_measured_against_its_bound(tmp_path):
    """stream_price: each capped run against the tightest resident one and against the largest of
    GPU compute, host updates and weight copies, taken from its plan's profile."""
    sys.path.insert(0, str(SCRIPT.parent))
    import report as module

    profile = asdict(planner.Profile(
        params=[planner.ParamCost(f"p{i}", 10**8, 4, i // 3, 0.0, 0.0, 0) for i in range(10)],
        blocks=[planner.BlockCost(0, 0, 0.002, weight_bytes=10**9) for _ in range(4)], accumulation_steps=1,
        clipping=True, forward_s=0.03, backward_s=0.06, forward_peak=0, tail_peak=0, host_s_per_param=1e-10,
        d2h_bytes_per_s=5e10, h2d_bytes_per_s=5e10, device_bytes_per_s=3e12))

    def run(cap, step, streamed, resident):
        plan = {"profile": profile, "blocks": ["kept", "recomputed", "kept", "kept"], "recomputed": [1],
                "streamed_blocks": streamed, "resident_params": resident}
        return {"mode": "trainstream", "cap_GB": cap, "step_s": step, "peak_vram_GB": cap or 20.0, "params": 10**9,
                "plan": plan}

    record = {"args": {"hidden": 64, "layers": 4, "batch": 1, "seq": 8, "clip": 1.0},
              "results": [run(None, 0.05, 0, 10), run(6.0, 0.1, 0, 2), run(4.0, 0.2, 3, 0)]}
    (tmp_path / "stream_price.json").write_text(json.dumps(record))
    bound = module.streaming_bound(record["results"][2]["plan"])
    # GPU 0.092 s (a recomputed block's forward on top), host 0.1 s (every parameter offloaded);
    # up, 3 GB of streamed weights twice and block 0's 1.2 GB of updated weights at 50 GB/s
    assert (round(bound["gpu_s"], 3), round(bound["host_s"], 3), round(bound["copies_s"], 3)) == (0.092, 0.1, 0.144)
    table = module.TABLES["stream_price"](tmp_path)
    assert "| 4 GB | 3 | 0.200 s, 4.00 GB | 2.00x |" in table  # against the 6 GB run, the tightest resident one
    assert table.count("1.39x") == 1  # 0.2 s against its 0.144 s bound
    assert "compares with the 6 GB run" in table


def test_each_modes_runs_reduce_to_their_median_in_first_run_order():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import report as script
    finally:
        sys.path.remove(str(SCRIPT.parent))
    results = [{"mode": "b", "step_s": 0.3}, {"mode": "a", "step_s": 0.2}, {"mode": "b", "step_s": 0.1},
               {"mode": "a", "error": "out of memory"}, {"mode": "b", "step_s": 0.2}]
    assert script.medians(results) == [
        {"mode": "b", "runs": 3, "median_s": 0.2, "min_s": 0.1, "max_s": 0.3},
        {"mode": "a", "runs": 1, "median_s": 0.2, "min_s": 0.2, "max_s": 0.2}]
