"""benchmarks/copy_under_load.py without a GPU: the engine loop runs and stops; the copies say
they need CUDA."""

from __future__ import annotations

import runpy
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "copy_under_load.py"


def test_engine_loop_updates_until_stopped():
    # the script's definitions, loaded from its file without running main() or touching sys.path
    EngineLoop = runpy.run_path(str(SCRIPT), run_name="copy_under_load")["EngineLoop"]
    loop = EngineLoop(1 << 16, threads=1)
    before = loop.p.clone()
    loop.start()
    time.sleep(0.05)
    loop.stop()
    steps = loop.steps
    assert steps > 0 and not torch.equal(loop.p, before)
    time.sleep(0.01)
    assert loop.steps == steps  # stopped means stopped
    assert loop.gbps(1.0, 10) == pytest.approx(10 * (1 << 16) * 26 / 1e9)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_without_gpu_says_so():
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "needs a CUDA GPU" in done.stderr
