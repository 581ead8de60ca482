"""benchmarks/host_calls.py on the CPU, run as a script: the calls it times are the ones the
hooks and step() make, once per parameter where they should be."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "host_calls.py"
TINY = ["--device", "cpu", "--hidden", "64", "--layers", "2", "--heads", "4", "--intermediate", "128",
        "--vocab", "128", "--batch", "2", "--seq", "16", "--warmup", "2", "--steps", "3"]
PARAMS = 21  # the tiny Llama's: embedding, 2 x 9 in the blocks, final norm, head


@pytest.mark.parametrize("clip", [None, "1e9"])
def test_every_gradient_is_taken_once_and_a_norm_that_never_clips_commits_every_update(tmp_path, clip):
    out = tmp_path / "calls.json"
    done = subprocess.run([sys.executable, str(SCRIPT), *TINY, *(["--clip", clip] if clip else []), "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    calls = {r["call"]: r["calls_per_step"] for r in json.loads(out.read_text())["rows"]}
    assert calls["gradient_hooks.take"] == calls["[gradient hooks]"] == calls["pipeline.land_gradient"] == PARAMS
    assert calls["[step() call]"] == 1
    if clip:  # measured on the device as they arrive, speculated, and all committed at step() in one call
        assert calls["norms.add"] == PARAMS
        assert calls["clipping.commit"] == calls["pipeline.commit"] == 1
        assert "pipeline.submit_many" not in calls
    else:  # updated as they arrive: nothing measured or committed
        assert "norms.add" not in calls and "clipping.commit" not in calls
