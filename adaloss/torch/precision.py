"""Mixed-precision forward passes for PyTorch: fp32 master weights, low-precision compute.

The model's parameters stay float32: they are the master weights the optimizer updates, and what checkpoints hold.
Two ways to compute in float16/bfloat16 (``precision.mode``):

- ``autocast`` (the default, how users train): the forward runs under ``torch.autocast``: matrix products and
  convolutions in the low-precision dtype, reductions, softmax, normalisation and the loss in float32 (torch's
  autocast op lists), parameter copies cast per use. Activation gradients of the low-precision ops really are low
  precision and really underflow.
- ``pure``: every floating input and parameter (except normalisation layers') is cast to the compute dtype and
  every activation is low precision, as in apex O2 or a model converted with ``.half()`` but with float32 masters.
  Element-wise operations and their gradients run in low precision too, so more values underflow than under
  autocast. The adaptive model does these casts inside its transformed graph (so that it sees the float32 parameters
  and unscales their gradients in float32); the other methods cast around the model with ``functional_call``.

Integer inputs (token ids) are never cast. Either way the logits come back as float32 for a float32 loss.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MODES = ("autocast", "pure")

_FP32_MODULES = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm)


def kept_in_fp32(model: nn.Module) -> set[str]:
    """Qualified names of parameters that stay float32 in the pure mode's forward (normalisation layers)."""
    names = set()
    for module_name, module in model.named_modules():
        if isinstance(module, _FP32_MODULES):
            prefix = f"{module_name}." if module_name else ""
            names.update(prefix + p for p, _ in module.named_parameters(recurse=False))
    return names


def cast_floating(x: Any, dtype: torch.dtype) -> Any:
    """x in ``dtype`` when it is a floating-point tensor; integer tensors (token ids) and others as they are."""
    return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x


class MixedPrecisionForward:
    """Runs a model's forward in a compute dtype, returning float32 logits for a float32 loss.

    ``in_graph``: the model casts for the pure mode itself (a model transformed for adaptive scaling); then the pure
    mode only calls it. Built from the model whose parameter names it will see.
    """

    def __init__(self, model: nn.Module, dtype_name: str, mode: str = "autocast", in_graph: bool = False) -> None:
        if mode not in MODES:
            raise ValueError(f"precision mode must be one of {MODES}, got {mode!r}")
        self.dtype = DTYPES[dtype_name]
        self.mode = mode
        self.in_graph = in_graph
        self._keep = kept_in_fp32(model)

    @property
    def is_mixed(self) -> bool:
        """Whether the compute dtype differs from the float32 master weights."""
        return self.dtype != torch.float32

    def autocast(self, device_type: str) -> Any:
        """The autocast context of the autocast mode (a no-op context otherwise)."""
        if self.is_mixed and self.mode == "autocast":
            return torch.autocast(device_type, dtype=self.dtype)
        return nullcontext()

    def __call__(self, model: Any, x: torch.Tensor) -> torch.Tensor:
        """Forward ``x`` through ``model`` in the compute dtype; the logits come back as float32."""
        if not self.is_mixed:
            return model(x)
        if self.mode == "autocast":
            with torch.autocast(x.device.type, dtype=self.dtype):
                return model(x).float()
        if self.in_graph or not isinstance(model, nn.Module):
            return model(x).float()
        # Every name of every parameter, so tied weights need no untying pass over the module tree (which cost more
        # than the casts on small models).
        params = {name: p if name in self._keep else p.to(self.dtype)
                  for name, p in model.named_parameters(remove_duplicate=False)}
        out = functional_call(model, params, (cast_floating(x, self.dtype),), strict=False, tie_weights=False)
        return out.float()
