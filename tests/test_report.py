"""benchmarks/report.py, run as a script: every results table in README.md and docs/ is what the
JSON in docs/results gives, and regenerating them is idempotent."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

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
