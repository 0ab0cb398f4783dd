"""The PyTorch backend: models, mixed precision, the fx transform for per-layer loss scaling, and ``LossScaler``.

Library use::

    from adaloss_cli.backends.torch import LossScaler, MixedPrecisionForward
"""

from adaloss_cli.backends.torch.precision import MixedPrecisionForward
from adaloss_cli.backends.torch.scaler import LossScaler
from adaloss_cli.backends.torch.transform import TransformError, transform_model

__all__ = ["LossScaler", "MixedPrecisionForward", "TransformError", "transform_model"]
