"""adaloss for PyTorch::

    from adaloss.torch import LossScaler, GraphedStep, MixedPrecisionForward

- :class:`LossScaler` (``scaler.py``): every loss-scaling method behind the calls of ``torch.amp.GradScaler``; for
  adaptive it transforms the model in place (``capture.py`` captures the forward, ``graph_transform.py`` rewrites
  it with the scale points of ``points.py`` and ``scale_ops.py``, whose per-model state is ``scale_state.py``).
- :class:`GraphedStep` (``graphs.py``): a whole training step captured in a CUDA graph.
- :class:`MixedPrecisionForward` (``precision.py``): the autocast and pure float16/bfloat16 forwards.
"""

from adaloss.errors import TransformError
from adaloss.torch.graphs import GraphedStep
from adaloss.torch.precision import MixedPrecisionForward
from adaloss.torch.scaler import LossScaler

__all__ = ["GraphedStep", "LossScaler", "MixedPrecisionForward", "TransformError"]
