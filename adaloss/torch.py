"""adaloss for PyTorch: ``LossScaler``, ``MixedPrecisionForward`` and the rest of the PyTorch backend's public API.

::

    from adaloss.torch import LossScaler, MixedPrecisionForward

Every name of ``adaloss_cli.backends.torch.__all__`` is re-exported, so this module follows that package.
"""

from adaloss_cli.backends.torch import *  # noqa: F401,F403 -- the backend's __all__ is this module's API
from adaloss_cli.backends.torch import __all__  # noqa: F401
