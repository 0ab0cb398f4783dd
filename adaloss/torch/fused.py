"""The compiled refresh: the core's refresh functions (``adaloss.core.scale_steps``) under torch.compile.

On a device, a refresh of the adaptive factors is dozens of operations on single numbers per point; compiled whole
(Inductor), each point's statistics, factor math, reads and writes of the scale state, and the factors applied to its
gradients run as a few fused kernels. :meth:`~.scale_state.ScaleState.use_fused_refresh` installs these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from adaloss.core.array_ops import ops_for
from adaloss.core.scale_steps import refresh_branch, refresh_layer, refresh_output

from .scale_ops import Applied, times
from .scale_state import _POINT_ARRAYS

__all__ = ["FusedRefresh", "fused_refresh"]


@dataclass
class FusedRefresh:
    """Compiled drop-in replacements of the core's refresh functions (``adaloss.core.scale_steps``)."""
    layer: Any
    branch: Any
    output: Any


def _compiled(function: Any) -> Any:
    """``function`` compiled whole (fullgraph, dynamic shapes), called through a wrapper that first makes the array
    namespace of its gradients: creating one imports modules, which Dynamo cannot trace."""
    compiled = torch.compile(function, fullgraph=True, dynamic=True)

    def fused(gradient: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        ops_for(gradient)
        return compiled(*args, **kwargs)

    return fused


#: Where ``refresh_layer`` takes gy among its positional arguments: after the scale table and the five point arrays.
_GY = 1 + len(_POINT_ARRAYS)


def _layer_refresh() -> Any:
    """The compiled :func:`~adaloss.core.scale_steps.refresh_layer`, which also applies both factors to gy in
    its own kernels: (:class:`Applied` s, :class:`Applied` s_w, A_w)."""

    def refresh_and_apply(*args: Any, **kwargs: Any) -> tuple:
        factor, weight_factor, weight_scale = refresh_layer(*args, **kwargs)
        gy = args[_GY]
        return factor, weight_factor, weight_scale, times(gy, factor), times(gy, weight_factor)

    compiled = _compiled(refresh_and_apply)

    def refresh(*args: Any, **kwargs: Any) -> tuple:
        gy = args[_GY]
        factor, weight_factor, weight_scale, scaled, weight_scaled = compiled(gy, *args, **kwargs)
        return Applied(factor, scaled, gy), Applied(weight_factor, weight_scaled, gy), weight_scale

    return refresh


def _branch_refresh() -> Any:
    """The compiled :func:`~adaloss.core.scale_steps.refresh_branch`, which also applies each multiplier to
    its gradient in its own kernels: one :class:`Applied` per gradient."""

    def refresh_and_apply(grads: list, *args: Any, **kwargs: Any) -> tuple:
        multipliers = refresh_branch(grads, *args, **kwargs)
        return multipliers, [times(g, m) for g, m in zip(grads, multipliers)]

    compiled = _compiled(refresh_and_apply)

    def refresh(grads: list, *args: Any, **kwargs: Any) -> list:
        multipliers, scaled = compiled(grads[0], grads, *args, **kwargs)
        return [Applied(m, t, g) for m, t, g in zip(multipliers, scaled, grads)]

    return refresh


def _output_refresh() -> Any:
    """The compiled :func:`~adaloss.core.scale_steps.refresh_output`."""
    compiled = _compiled(refresh_output)
    return lambda g, *args, **kwargs: compiled(g, g, *args, **kwargs)


def fused_refresh() -> FusedRefresh:
    """Compiled refresh functions for scale, branch and join, and output points (each compiles on first use)."""
    return FusedRefresh(layer=_layer_refresh(), branch=_branch_refresh(), output=_output_refresh())
