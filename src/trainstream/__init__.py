"""TrainStream: train models larger than the GPU's memory on one GPU.

    model, optimizer = trainstream.wrap(model, optimizer)
"""

__version__ = "0.1.0"

from trainstream.errors import (CudaError, HostMemoryError, NativeError, TrainingLoopError,  # noqa: E402
                                TrainStreamError, UnsupportedError, UnsupportedSetupError, VramBudgetError)
from trainstream.host_adamw import HostAdamW, measure_triad  # noqa: E402
from trainstream.optimizer import OffloadedAdamW  # noqa: E402
from trainstream.tuning import Tuning  # noqa: E402
from trainstream.wrap import wrap  # noqa: E402

__all__ = ["CudaError", "HostAdamW", "HostMemoryError", "NativeError", "OffloadedAdamW", "TrainStreamError",
           "TrainingLoopError", "Tuning", "UnsupportedError", "UnsupportedSetupError", "VramBudgetError", "__version__",
           "measure_triad", "wrap"]
