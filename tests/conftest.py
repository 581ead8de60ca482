"""Shared pytest setup: GPU tests skip without CUDA; ISA fixtures for the host AdamW engine.

Run the tests against the installed package (`pip install .`, then pytest from outside the
checkout or by path): the source tree has no compiled `trainstream._C`.
"""

from __future__ import annotations

import gc

import pytest
import torch

ALL_ISAS = ("scalar", "avx2", "avx512")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    no_cuda = pytest.mark.skip(reason="needs a CUDA GPU; torch.cuda.is_available() is False")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(no_cuda)


@pytest.fixture(autouse=True)
def collect_earlier_garbage(request):
    """A wrapped model and its optimizer reference each other through hooks, so a finished test's
    model is freed by the cycle collector, at a moment of its choosing. Collect it before each GPU
    test: otherwise it may vanish halfway through the next test's memory figures."""
    if "gpu" in request.keywords and torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def supported_isas() -> list[str]:
    """The ISAs this CPU can run, per the native core's own detection."""
    from trainstream import _C

    return [name for name in ALL_ISAS if _C.isa_supported(name)]


@pytest.fixture(params=ALL_ISAS)
def isa(request, supported_isas) -> str:
    """Each ISA in turn; the ones this CPU lacks are skipped, visibly."""
    if request.param not in supported_isas:
        pytest.skip(f"this CPU cannot run the {request.param} kernels")
    return request.param
