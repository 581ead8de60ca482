"""Loads the compiled core, so that a broken or partial install says what is wrong."""

from __future__ import annotations

try:
    from trainstream import _C
except ImportError as exc:  # pragma: no cover - only on a broken install
    raise ImportError(
        "trainstream's native module (trainstream._C) is missing or failed to load: "
        f"{exc}. Reinstall with `pip install --force-reinstall trainstream`, or from a checkout "
        "with `pip install .`."
    ) from exc

# The native core's exceptions (see trainstream.errors for the whole hierarchy).
TrainStreamError = _C.TrainStreamError
NativeError = _C.NativeError
UnsupportedError = _C.UnsupportedError
CudaError = _C.CudaError


def require_cuda_build() -> None:
    """Raise a clear error when the core was built without its CUDA layer."""
    if not _C.has_cuda:
        raise UnsupportedError(
            "this trainstream build has no CUDA support (it was compiled without a CUDA toolkit). "
            "Install a CUDA wheel, or rebuild with nvcc on PATH: "
            "CMAKE_ARGS=-DTRAINSTREAM_WITH_CUDA=ON pip install ."
        )
