"""The per-layer view of a scaler's backward: the float32 reference pass a recorded step starts with, and what each
scale point did in it (``LossScaler.start_recording``, ``layer_records``, ``describe``).

The records are the same for every method: adaptive records its own points; the others a measure-only transform
of the model (all factors 1), so underflow can be compared between methods.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn

from adaloss.records import OUTPUT_RECORD, LayerRecord

from .scale_state import ScaleState


@contextmanager
def _preserved_rng_and_buffers(model: nn.Module) -> Iterator[None]:
    """Run a side computation without changing the RNG streams or any buffer (batch-norm statistics)."""
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        yield
    finally:
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)


def run_reference_pass(model: nn.Module, run_with: Callable[..., Any], state: ScaleState,
                       reference_loss: Callable[[Any], tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Run ``reference_loss(run_with)`` (float32, unscaled) and its backward, so that every scale point of ``state``
    keeps its true input gradient, leaving ``model``'s RNG streams and buffers as they were; then arm ``state`` to
    record the next backward. Raises what the capture raises (``TransformError``)."""
    with _preserved_rng_and_buffers(model):
        state.reference_pass = True
        try:
            loss, inputs = reference_loss(run_with)
            torch.autograd.grad(loss, inputs)
        finally:
            state.reference_pass = False
    state.recording = True
    state.mark_stale()  # the reference pass ran the points: the next backward recomputes
    state.view("underflow")[:] = float("nan")
    state.output_records.clear()
    state.zeroed.clear()


def layer_records(state: ScaleState) -> list[LayerRecord]:
    """What each scale point of ``state`` did in the last recorded backward, read to the host in one transfer: the
    model outputs first (``output``), then every scale point in the order the forward first called them."""
    if not state.names:
        return []
    n = len(state.names)
    adaptive = state.adaptive
    arrays = state.arrays
    columns = [arrays["unbound"][:n], arrays["factor"][:n], arrays["in_scale"][:n], arrays["underflow"][:n],
               arrays["weight_scale"][:n]]
    rows = torch.stack(columns).tolist()
    records = []
    for name, value in sorted(state.output_records.items()):
        factor = float(state.cache(name)) if adaptive else 1.0
        records.append(LayerRecord(layer=OUTPUT_RECORD if name == "output" else name, unbound_factor=factor,
                                   factor=factor, accumulated_scale=factor * state.loss_scale,
                                   underflow_fraction=float(value)))
    zeroed = state.zeroed
    for name, unbound, factor, scale, underflow, weight_scale in zip(state.names, *rows):
        if not adaptive:
            unbound = factor = 1.0
            weight_scale = scale
        records.append(LayerRecord(layer=name, unbound_factor=unbound, factor=factor, accumulated_scale=scale,
                                   underflow_fraction=underflow, weight_scale=weight_scale,
                                   zeroed_fraction=float(zeroed[name]) if name in zeroed else math.nan))
    return records


def describe_points(state: ScaleState) -> str:
    """The scale points of ``state`` as a table (name, operation, fan)."""
    if not state.names:
        return "adaptive scaling: scale points are found when the model first runs"
    width = max(len(name) for name in state.names)
    lines = [f"adaptive scaling ({state.options.loss_scale_method}): {len(state.names)} scale points"]
    lines += [f"  {name:<{width}}  {kind:<14} fan {fan}" for name, (kind, fan) in state.kinds.items()]
    return "\n".join(lines)
