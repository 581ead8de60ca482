"""`python -m trainstream`: demo, info, bench and verify on a machine without a GPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch


def cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainstream", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_demo_trains_beside_stock_adamw_and_agrees():
    done = cli("demo", "--steps", "6")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "[1/2] stock PyTorch" in out and "[2/2] TrainStream" in out
    assert out.count("      6 ") == 2  # the last step's progress line, once per run
    assert "where memory lives" in out and "offloaded" in out
    assert "agreement: largest relative loss difference" in out
    assert out.rstrip().endswith("PASS: TrainStream trained the same model as stock AdamW")


def test_demo_fails_when_the_runs_disagree(capsys):
    from trainstream.demo import Run, summarize

    weights = [torch.zeros(3)]
    stock = Run("stock", losses=[4.0, 3.0], seconds=[0.1, 0.1], memory=["m"], weights=weights)
    same = Run("trainstream", losses=[4.0, 3.0], seconds=[0.1, 0.1], memory=["m"], weights=weights)
    off = Run("trainstream", losses=[4.0, 3.01], seconds=[0.1, 0.1], memory=["m"], weights=weights)
    assert summarize(stock, same, cuda=False) == 0
    assert summarize(stock, off, cuda=False) == 1
    assert capsys.readouterr().out.rstrip().endswith("FAIL: TrainStream and stock AdamW disagree beyond the tolerance")


@pytest.mark.gpu
def test_demo_on_gpu_trains_within_a_budget_beside_stock_adamw():
    done = cli("demo", "--device", "cuda", "--steps", "8", "--hidden", "256", "--layers", "2", "--batch", "4")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "peak VRAM" in done.stdout and "vram_budget=" in done.stdout
    assert done.stdout.rstrip().endswith("PASS: TrainStream trained the same model as stock AdamW")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_demo_on_cuda_without_gpu_says_so():
    done = cli("demo", "--device", "cuda")
    assert done.returncode == 2 and "needs a CUDA GPU" in done.stderr


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


@pytest.mark.parametrize("extra_mib,verdict", [(0, 0), (40, 1)], ids=["staging-only", "leak"])
def test_verify_counts_the_staging_buffer_and_nothing_more(monkeypatch, capsys, extra_mib, verdict):
    """verify's verdict from the figures a GPU run would give: VRAM beyond the weights may be the
    update staging buffer (reported), plus the stock run's fixed overhead and 16 MiB, no more."""
    from trainstream import verify

    mib = 1 << 20
    overhead = mib  # what the stock run holds besides weights and optimizer state

    def run(kind, args):
        place = {"vram": 0, "pinned": 0, "pageable": 0}
        stock = kind == "stock"
        result = {
            "losses": [1.0, 0.9], "weights": dict(place, vram=100 * mib),
            "optimizer_state": dict(place, **({"vram": 200 * mib} if stock else {"pinned": 200 * mib})),
            "grads_seen_on_gpu_after_backward": 100 * mib if stock else 0,
            "vram_allocated": 300 * mib + overhead if stock else (100 + 64 + extra_mib) * mib + overhead,
        }
        if not stock:
            result["host"] = {"host_bytes_used": 1 << 30, "host_memory_kind": "pinned",
                              "host_bytes_per_param": 16.0, "threads": 16, "isa": "avx512",
                              "vram_staging_bytes": 64 * mib}
        return result

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "a GPU")
    monkeypatch.setattr(verify, "run", run)
    assert verify.main([]) == verdict
    out = capsys.readouterr().out
    assert "update staging buffer in VRAM" in out
    assert ("PASS" if verdict == 0 else "FAIL") in out.splitlines()[-1]


def test_native_module_loads_and_runs_without_torch():
    """What the wheel build's smoke test checks: _C needs neither torch nor a GPU."""
    from pathlib import Path

    script = Path(__file__).with_name("wheel_smoke.py")
    code = ("import sys, runpy; sys.modules['torch'] = None; "  # any import of torch would fail
            f"runpy.run_path({str(script)!r}, run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "wheel ok" in done.stdout
