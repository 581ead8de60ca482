"""TrainStream: train models larger than the GPU's memory on one GPU.

    model, optimizer = trainstream.wrap(model, optimizer)
"""

__version__ = "0.1.0"

from trainstream.errors import UnsupportedSetupError, VramBudgetError  # noqa: E402
from trainstream.host_adamw import HostAdamW, measure_triad  # noqa: E402
from trainstream.optimizer import OffloadedAdamW  # noqa: E402
from trainstream.tuning import Tuning  # noqa: E402
from trainstream.wrap import wrap  # noqa: E402

__all__ = ["HostAdamW", "OffloadedAdamW", "Tuning", "UnsupportedSetupError", "VramBudgetError", "__version__",
           "measure_triad", "wrap"]
