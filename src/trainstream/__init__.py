"""TrainStream: train models larger than the GPU's memory on one GPU."""

__version__ = "0.1.0"

from trainstream.host_adamw import HostAdamW  # noqa: E402

__all__ = ["HostAdamW", "__version__"]
