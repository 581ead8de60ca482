"""One error hierarchy: every exception TrainStream raises as its own derives from
trainstream.errors.TrainStreamError, and from the built-in exception it stands for; the native
core's errors arrive as those classes, CUDA failures with their code, call and location."""

from __future__ import annotations

import html
import pathlib
import re

import pytest
import torch

import trainstream
from trainstream import errors
from trainstream._native import _C

BUILT_IN_BASE = {
    "TrainStreamError": Exception,
    "UnsupportedSetupError": ValueError,
    "VramBudgetError": RuntimeError,
    "TrainingLoopError": RuntimeError,
    "HostMemoryError": MemoryError,
    "NativeError": RuntimeError,
    "UnsupportedError": RuntimeError,
    "CudaError": RuntimeError,
}


def test_every_exported_error_derives_from_one_base_and_its_built_in():
    assert sorted(errors.__all__) == sorted(BUILT_IN_BASE)
    for name, built_in in BUILT_IN_BASE.items():
        cls = getattr(errors, name)
        assert issubclass(cls, errors.TrainStreamError), name
        assert issubclass(cls, built_in), name
        assert cls.__module__ == "trainstream.errors" and cls.__name__ == name
    assert issubclass(errors.UnsupportedError, errors.NativeError)
    assert issubclass(errors.CudaError, errors.NativeError)
    assert not issubclass(errors.UnsupportedSetupError, RuntimeError)  # `except RuntimeError` is unchanged
    assert not issubclass(errors.TrainStreamError, (ValueError, RuntimeError))


def test_the_native_classes_are_the_ones_the_core_raises():
    for name in ("TrainStreamError", "NativeError", "UnsupportedError", "CudaError"):
        assert getattr(errors, name) is getattr(_C, name)


def test_package_errors_are_caught_by_the_base():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(errors.TrainStreamError, match="torch.optim.AdamW"):
        trainstream.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_a_native_failure_is_a_native_error():
    pipeline = _C.host_pipeline(1)
    with pytest.raises(errors.NativeError, match="host memory") as caught:
        pipeline.add_param(1 << 46, "float32", False)  # 256 TiB of fp32 state: refused
    assert type(caught.value) is errors.NativeError
    assert isinstance(caught.value, RuntimeError)


def test_a_bad_native_argument_stays_a_plain_value_error():
    with pytest.raises(ValueError, match="unknown ISA") as caught:
        _C.HostAdamW(1, "avx3")
    assert not isinstance(caught.value, errors.TrainStreamError)


@pytest.mark.skipif(not _C.has_cuda, reason="a CPU-only build has no CUDA calls to fail")
def test_a_cuda_failure_is_a_cuda_error_with_its_code_call_and_location():
    missing = _C.cuda_info()["device_count"]  # one past the last device (0 without a GPU)
    with pytest.raises(errors.CudaError) as caught:
        _C.cuda_pipeline(missing, 0, 0)
    error = caught.value
    assert isinstance(error, errors.NativeError) and isinstance(error, RuntimeError)
    assert isinstance(error.code, int) and error.code != 0
    assert error.name.startswith("cudaError")
    assert error.call == "cudaSetDevice(device_)"
    assert re.fullmatch(r"cuda_transfer\.cpp:\d+", error.location)
    assert str(error).startswith(f"CUDA error {error.name} (")
    assert f"in {error.call} [{error.location}]" in str(error)


def test_a_cuda_error_raised_without_details_has_them_as_none():
    error = errors.CudaError("no details")
    assert (error.code, error.name, error.call, error.location) == (None, None, None, None)


def test_every_error_is_in_the_troubleshooting_table():
    page = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "index.html").read_text()
    table = page[page.index('<h2 id="trouble">'):]
    table = html.unescape(table[:table.index("</table>")])
    for name in errors.__all__:
        assert f"<code>{name}</code>" in table, f"{name} is not in docs/index.html's troubleshooting table"


def test_host_memory_refusal_is_a_host_memory_error(monkeypatch):
    from trainstream.fixtures import TinyLM

    monkeypatch.setattr(_C, "host_memory_available", lambda: 1000)  # bytes, as wrap() reads them
    model = TinyLM()
    with pytest.raises(errors.HostMemoryError, match="host RAM") as caught:
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()),
                         tuning=trainstream.Tuning(placement="offload"))
    assert isinstance(caught.value, MemoryError)
