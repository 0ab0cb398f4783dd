"""The PyTorch backend: models, mixed precision, the graph transform for per-layer loss scaling, and ``LossScaler``.

Library use::

    from adaloss_cli.backends.torch import LossScaler, GraphedStep
"""

from adaloss_cli.backends.torch.graph_transform import TransformError
from adaloss_cli.backends.torch.graphs import GraphedStep
from adaloss_cli.backends.torch.precision import MixedPrecisionForward
from adaloss_cli.backends.torch.scaler import LossScaler

__all__ = ["GraphedStep", "LossScaler", "MixedPrecisionForward", "TransformError"]
