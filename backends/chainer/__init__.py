"""The Chainer backend, and adaptive loss scaling for your own Chainer models.

Importing this package does not import Chainer; its names load on first use (Chainer is imported through
:mod:`._compat`, which works around setuptools' distutils shim, so no manual step is needed).

Using adaptive loss scaling in your own training loop::

    import chainer, chainer.functions as F, chainer.links as L
    from adaloss_cli.backends.chainer import LossScaler, Fork
    from adaloss_cli.backends.chainer.optimizers import TorchSGD   # or any chainer.Optimizer

    model = chainer.Sequential(L.Linear(784, 256), F.relu, L.Linear(256, 10))
    scaler = LossScaler(model, "adaptive", loss_scale_method="approx_range")   # transforms the links in place
    optimizer = TorchSGD(lr=0.05, momentum=0.9); optimizer.setup(model)
    for x, t in batches:                       # x may be float16: scale points cast W and b to x's dtype
        model.cleargrads()
        y = scaler.output(model(x))            # float32 logits through the output point
        scaler.backward(F.softmax_cross_entropy(y, t))   # parameter gradients come out unscaled, in float32
        scaler.step(optimizer)                 # skips the update when a gradient is NaN/Inf
        scaler.update()

What is supported: models built from ``L.Linear`` and ``L.Convolution2D`` (the scale points; exact classes, not
subclasses), ``L.BatchNormalization`` and parameter-free functions, in any graph Chainer can record. Where a value
feeds several consumers (a residual block), declare it with a :class:`Fork` link (``a, b = self.fork(x)``), as the
zoo's ResNet blocks do; an undeclared fan-out whose gradients carry different scales is refused at the first
backward, naming the producer. Links that own other parameters (EmbedID, LSTM's own weights, Deconvolution2D, a
Chain with its own Parameter), a link called twice per forward, and tied weights are refused by name. The methods
none, fixed and dynamic use the same ``LossScaler`` with the global scale of ``adaloss_cli.core.policies``.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["ChainerBackend", "Fork", "LossScaler", "TransformError", "transform_links"]

_EXPORTS = {
    "ChainerBackend": ".adapter",
    "Fork": ".scale_points",
    "LossScaler": ".scaler",
    "TransformError": ".transform",
    "transform_links": ".transform",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
