"""The PyTorch backend of the app: the training-step adapter (``adapter.py``), the model zoo (``models.py``,
``transformer_models.py``) and data-parallel wiring (``distributed.py``), built on the library's ``adaloss.torch``.

``from adaloss_cli.backends.torch import LossScaler`` (and ``GraphedStep``, ``MixedPrecisionForward``,
``TransformError``) still works for one release, with a DeprecationWarning: the library's API is ``adaloss.torch``,
where those classes are defined. This alias goes in the next release.
"""

from __future__ import annotations

import warnings
from typing import Any

_MOVED = ("GraphedStep", "LossScaler", "MixedPrecisionForward", "TransformError")


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        import adaloss.torch

        warnings.warn(f"adaloss_cli.backends.torch.{name} is deprecated: import it from adaloss.torch",
                      DeprecationWarning, stacklevel=2)
        return getattr(adaloss.torch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
