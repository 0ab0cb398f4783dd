"""adaloss: fp16 mixed-precision training with none, fixed, dynamic or adaptive per-layer loss scaling.

The library, by framework::

    from adaloss.torch import LossScaler, GraphedStep, MixedPrecisionForward   # PyTorch
    from adaloss.chainer import LossScaler, Fork                                # Chainer (pip install 'adaloss[chainer]')

Framework integrations (each needs its framework installed)::

    from adaloss.lightning import AdalossPrecision, AdalossFabricPrecision  # Lightning Trainer and Fabric plugins
    from adaloss.accelerate import attach                                  # accelerate and transformers.Trainer

Framework-free parts: ``adaloss.options`` (the loss-scaling options, as frozen dataclasses), ``adaloss.core`` (the
global scale policies and the per-layer factor math, written once for every framework), ``adaloss.errors``. The
command line is ``adaloss`` (``python -m adaloss_cli``), an app built on this library; nothing here imports it.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
