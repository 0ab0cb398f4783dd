"""adaloss for PyTorch::

    from adaloss.torch import LossScaler, GraphedStep, MixedPrecisionForward

- :class:`LossScaler` (``scaler.py``): every loss-scaling method behind the calls of ``torch.amp.GradScaler``; for
  adaptive it transforms the model in place (``capture.py`` captures the forward, ``graph_transform.py`` rewrites
  it with the scale points of ``points.py`` and ``scale_ops.py``, whose per-model state is ``scale_state.py``).
- :class:`GraphedStep` (``modes/cuda_graph.py``): a whole training step captured in a CUDA graph. The ways a
  transformed model's steps run (eager, compiled, CUDA graphs) are one module each under ``modes/``.
- :class:`MixedPrecisionForward` (``precision.py``): the autocast and pure float16/bfloat16 forwards.
"""

from adaloss.errors import TransformError
from adaloss.torch.modes.cuda_graph import GraphedStep
from adaloss.torch.precision import MixedPrecisionForward
from adaloss.torch.scaler import LossScaler

__all__ = ["GraphedStep", "LossScaler", "MixedPrecisionForward", "TransformError"]
