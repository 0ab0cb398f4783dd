"""The mode of ``LossScaler(model, "adaptive")`` without ``compile``: chosen at the model's first forward, on the
device its parameters are on then (Lightning, Fabric and accelerate move the model after the scaler is attached).

- a model on a CUDA device runs compiled steps (:class:`~.compiled.CompiledMode`, not chosen by the user: it compiles
  a few graphs at most and gives way to ``GraphedStep``), where Triton is installed (else eager steps, with a
  warning that says why they are slower);
- a model sharded with FSDP2 runs eager steps (its pieces are captured one by one, eagerly);
- everything else runs eager steps: on a CPU compiling costs seconds and saved nothing where measured (2 cores,
  the shipped digits MLP: 1.7 ms a step eager, whose Linear points lay out their float16 products for torch's CPU
  loop, and 1.8 ms compiled, after about 8 s of compiling).
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping

import torch
from torch import nn

from .base import ExecutionMode
from .eager import EagerMode

__all__ = ["DefaultMode", "compiles_by_default"]


class DefaultMode(EagerMode):
    """Eager until the first forward, which replaces it with the mode :meth:`resolve` picks; ``options``: the
    compiled mode's Inductor options (``LossScaler(compile_options=...)``)."""

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        self.options = dict(options or {})

    def resolve(self, model: nn.Module) -> ExecutionMode:
        """The mode for ``model`` where its parameters are now (an FSDP2 model's pieces never get here: the capture
        gives them eager steps)."""
        first = next(iter(model.parameters()), None)
        device = first.device if first is not None else torch.device("cpu")
        if compiles_by_default(device):
            from .compiled import CompiledMode  # (its Inductor machinery loads when it first compiles)
            return CompiledMode(chosen=False, options=self.options)
        return EagerMode()


def compiles_by_default(device: torch.device, warn: bool = True) -> bool:
    """Whether the default mode compiles on ``device``: a CUDA device where Inductor can generate its kernels
    (Triton). Without Triton, a warning (``warn``) says why the steps are slower and how to silence it."""
    if device.type != "cuda":
        return False
    from torch.utils._triton import has_triton
    if not has_triton():
        if warn:
                warnings.warn("adaloss: Triton is not installed, so Inductor cannot compile the adaptive steps for CUDA; "
                          "they run eagerly (correct, about 3x slower than compiled; pip install triton, or "
                          "pass LossScaler(..., compile=False) to silence this)", RuntimeWarning, stacklevel=2)
        return False
    return True
