"""The test models now live in the package: import them from trainstream.testing. This module
stays only for the test files that still import it by this name."""

from trainstream.testing import Attention, Block, TinyLM, param_groups, warmup_cosine  # noqa: F401
