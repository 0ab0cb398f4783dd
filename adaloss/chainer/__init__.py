"""adaloss for Chainer: adaptive loss scaling (and every other method) in your own Chainer training loop.

Importing this package does not import Chainer; its names load on first use, through :mod:`.compat` (which works
around setuptools' distutils shim, so no manual step is needed). Without Chainer installed, ``from adaloss.chainer
import LossScaler`` raises an ImportError that says how to install it.

Using adaptive loss scaling in your own training loop::

    import chainer, chainer.functions as F, chainer.links as L
    from adaloss.chainer import LossScaler, Fork

    model = chainer.Sequential(L.Linear(784, 256), F.relu, L.Linear(256, 10))
    scaler = LossScaler(model, "adaptive", loss_scale_method="approx_range")   # transforms the links in place
    optimizer = chainer.optimizers.MomentumSGD(lr=0.05); optimizer.setup(model)
    for x, t in batches:                       # x may be float16: scale points cast W and b to x's dtype
        model.cleargrads()
        y = scaler.output(model(x))            # float32 logits through the output point
        scaler.backward(F.softmax_cross_entropy(y, t))   # parameter gradients come out unscaled, in float32
        scaler.step(optimizer)                 # skips the update when a gradient is NaN/Inf
        scaler.update()

What is supported: models built from ``L.Linear`` and ``L.Convolution2D`` (the scale points; exact classes, not
subclasses), ``L.BatchNormalization`` and parameter-free functions, in any graph Chainer can record. Where a value
feeds several consumers (a residual block), declare it with a :class:`Fork` link (``a, b = self.fork(x)``), as the
app's ResNet blocks do; an undeclared fan-out whose gradients carry different scales is refused at the first
backward, naming the producer. Links that own other parameters (EmbedID, LSTM's own weights, Deconvolution2D, a
Chain with its own Parameter), a link called twice per forward, and tied weights are refused by name. The methods
none, fixed and dynamic use the same ``LossScaler`` with the global scale policies of ``adaloss.core.policies``.
"""

from __future__ import annotations

import importlib
from typing import Any

from adaloss.chainer.compat import INSTALL_COMMAND, is_chainer_available

__all__ = ["Fork", "LossScaler", "transform_links"]

_EXPORTS = {"Fork": "adaloss.chainer.scale_points", "LossScaler": "adaloss.chainer.scaler",
            "transform_links": "adaloss.chainer.transform"}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if not is_chainer_available():
        raise ImportError(f"adaloss.chainer.{name} needs Chainer, which is not installed; install it with: "
                          f"{INSTALL_COMMAND}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
