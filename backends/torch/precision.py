"""Mixed-precision forward passes for PyTorch: fp32 master weights, low-precision compute.

The model's parameters stay float32: they are the master weights the optimizer updates, and what checkpoints hold.
In float16/bfloat16 mode each forward casts the parameters (differentiably) and the input to the compute dtype, so
activations and activation gradients really are low precision and really underflow, while parameter gradients flow
back through the cast into float32. Normalisation layers keep float32 parameters (their kernels accept a
low-precision input with float32 weights), as apex O2 and torch.amp do.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

_FP32_MODULES = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm)


def kept_in_fp32(model: nn.Module) -> set[str]:
    """Qualified names of parameters that stay float32 in the forward (normalisation layers)."""
    names = set()
    for module_name, module in model.named_modules():
        if isinstance(module, _FP32_MODULES):
            prefix = f"{module_name}." if module_name else ""
            names.update(prefix + p for p, _ in module.named_parameters(recurse=False))
    return names


class MixedPrecisionForward:
    """Runs a model's forward in a compute dtype, returning float32 logits for a float32 loss.

    Built from the model whose parameter names it will see; it also runs transformed views of that model (the
    adaptive or measuring GraphModule), which keep the same parameter names.
    """

    def __init__(self, model: nn.Module, dtype_name: str) -> None:
        self.dtype = DTYPES[dtype_name]
        self._keep = kept_in_fp32(model)

    @property
    def is_mixed(self) -> bool:
        """Whether the compute dtype differs from the float32 master weights."""
        return self.dtype != torch.float32

    def __call__(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Forward ``x`` through ``model`` in the compute dtype; the logits come back as float32."""
        if not self.is_mixed:
            return model(x)
        # Every name of every parameter, so tied weights need no untying pass over the module tree (which cost more
        # than the casts on small models).
        params = {name: p if name in self._keep else p.to(self.dtype)
                  for name, p in model.named_parameters(remove_duplicate=False)}
        out = functional_call(model, params, (x.to(self.dtype),), strict=False, tie_weights=False)
        return out.float()
