"""adaloss: fp16 mixed-precision training with none, fixed, dynamic or adaptive per-layer loss scaling.

The library, by framework (each re-exports that backend's public API and follows it)::

    from adaloss.torch import LossScaler, MixedPrecisionForward     # PyTorch
    from adaloss.chainer import LossScaler, Fork                    # Chainer (pip install 'adaloss[chainer]')

Framework integrations (each needs its framework installed)::

    from adaloss.lightning import AdalossPrecision, AdalossFabricPrecision  # Lightning Trainer and Fabric plugins
    from adaloss.accelerate import attach                                  # accelerate and transformers.Trainer

The command line is ``adaloss`` (``python -m adaloss_cli``); its code lives in the ``adaloss_cli`` package.
"""

from adaloss_cli import __version__

__all__ = ["__version__"]
