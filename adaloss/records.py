"""What a scaler reports per layer: what it did on a recorded step (:class:`LayerRecord`, the same for every method
and framework, one row of a run's ``scales.csv``), and the per-layer scales of adaptive scaling as they stand
(:class:`LayerScale`, ``LossScaler.layer_scales()``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OUTPUT_RECORD", "LayerRecord", "LayerScale"]

#: Layer name of the record for the model output, where the float32 loss gradient is cast to the model's dtype.
OUTPUT_RECORD = "output"


@dataclass
class LayerRecord:
    """What the scaler did at one scale point on a recorded step (one row of scales.csv).

    ``accumulated_scale`` is the scale the layer's input gradient carries, ``weight_scale`` the one its weight
    gradient was computed at; ``underflow_fraction`` the share of input-gradient elements lost to underflow, and
    ``zeroed_fraction`` the share that is zero in low precision but not in float32 for any reason (it also counts
    ReLU or max-pool decisions of the low-precision forward that differ from float32's, which no scale changes)."""
    layer: str
    unbound_factor: float
    factor: float
    accumulated_scale: float
    underflow_fraction: float
    weight_scale: float = float("nan")
    zeroed_fraction: float = float("nan")


@dataclass(frozen=True)
class LayerScale:
    """One scale point's scales as they stand (adaptive scaling), for logging and inspection.

    ``factor`` multiplies the gradient arriving at the layer's output to make its input gradient; ``weight_factor``
    is the one its weight gradient was computed with, and ``weight_scale`` the scale that weight gradient carried
    before it was divided back: the layer's own loss scale, what ``GradScaler.get_scale()`` is for a whole model."""
    layer: str
    factor: float
    weight_factor: float
    weight_scale: float
