"""`python -m trainstream`: info, bench and verify on a machine without a GPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch


def cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainstream", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_info_reports_versions_and_host():
    done = cli("info", "--json", "--quick")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["torch"] == torch.__version__
    assert report["host_isa"] in ("scalar", "avx2", "avx512")
    assert report["host_cpus"] >= 1 and report["host_ram_GiB"] > 0
    if not torch.cuda.is_available():
        assert report["gpu"] is None


def test_info_measures_host_bandwidth():
    done = cli("info", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["host_triad_GBps"] > 0
    assert "measuring" in done.stderr  # progress for the part a person waits on


def test_bench_compares_with_torch_fused():
    done = cli("bench", "--params", "1048576", "--steps", "2", "--hidden", "64", "--layers", "2",
               "--batch", "8", "--train-steps", "2", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["trainstream_ns_per_param"] > 0 and result["torch_fused_ns_per_param"] > 0
    assert result["train_stock"]["step_s"] > 0 and result["train_trainstream"]["step_s"] > 0


def test_verify_without_gpu_says_so():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: verify runs for real in the GPU suite")
    done = cli("verify")
    assert done.returncode == 2
    assert "FAIL" in done.stderr and "CUDA" in done.stderr


def test_native_module_loads_and_runs_without_torch():
    """What the wheel build's smoke test checks: _C needs neither torch nor a GPU."""
    from pathlib import Path

    script = Path(__file__).with_name("wheel_smoke.py")
    code = ("import sys, runpy; sys.modules['torch'] = None; "  # any import of torch would fail
            f"runpy.run_path({str(script)!r}, run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "wheel ok" in done.stdout
