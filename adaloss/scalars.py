"""What a loss scaler reports to a metrics logger: one flat ``{tag: float}`` dict, the same for every method and
framework, written by ``LossScaler.log_to(writer, step)`` (TensorBoard's ``SummaryWriter``), by the Lightning and
accelerate integrations through their own loggers, and by the ``adaloss`` command line.

Tags (TensorBoard groups a dashboard by the part before the first ``/``)::

    scaling/loss_scale                 what the loss is multiplied by (adaptive: init_scale, 1 by default)
    scaling/skipped_steps              optimizer steps skipped on overflow so far
    scaling/layer_scale_log2_min       adaptive: log2 of the smallest, median and largest per-layer scale
    scaling/layer_scale_log2_median
    scaling/layer_scale_log2_max
    layer_scale_log2/<layer>           adaptive: log2 of each layer's scale (LayerScale.weight_scale)
    underflow_fraction/<layer>         recorded steps: the share of the layer's input gradient lost to underflow

Per-layer scales are written in log2 (14 reads as 2^14 = 16384): they span dozens of powers of two on deep nets,
which a linear axis flattens into one line. Nothing here reads a device: the scaler hands over host numbers.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from adaloss.records import LayerRecord, LayerScale

__all__ = ["LAYER_SCALE", "SCALING", "UNDERFLOW", "ScaleSpread", "power_of_two", "scale_spread", "scaling_scalars",
           "write_scalars"]

#: Tag groups.
SCALING = "scaling"
LAYER_SCALE = "layer_scale_log2"
UNDERFLOW = "underflow_fraction"


def power_of_two(value: float) -> str:
    """``2^14`` for an exact power of two, else the number (``3``, ``0.75``)."""
    if not math.isfinite(value) or value <= 0:
        return f"{value:g}"
    mantissa, exponent = math.frexp(value)
    return f"2^{exponent - 1}" if mantissa == 0.5 else f"{value:g}"


@dataclass(frozen=True)
class ScaleSpread:
    """The smallest, median and largest of a set of per-layer scales; ``str()`` is how a log line shows them:
    ``2^3..2^14 (median 2^9)``."""
    low: float
    median: float
    high: float

    def __str__(self) -> str:
        if self.low == self.high:
            return power_of_two(self.low)
        return f"{power_of_two(self.low)}..{power_of_two(self.high)} (median {power_of_two(self.median)})"


def scale_spread(scales: Iterable[float]) -> ScaleSpread | None:
    """The :class:`ScaleSpread` of the finite, positive ``scales`` (None when there are none: not adaptive, or the
    model has not run yet). The median of an even count is the lower middle one, so it is one of the scales (a
    power of two when they are)."""
    values = sorted(v for v in scales if math.isfinite(v) and v > 0)
    if not values:
        return None
    return ScaleSpread(values[0], statistics.median_low(values), values[-1])


def scaling_scalars(loss_scale: float, skipped_steps: int, layer_scales: Sequence[LayerScale] = (),
                    records: Sequence[LayerRecord] = ()) -> dict[str, float]:
    """The tags of this module's docstring: the global scale and skip count, the per-layer scales (adaptive) and,
    from a recorded step's ``records``, each layer's underflow (layers whose underflow was not measured are left
    out)."""
    scalars = {f"{SCALING}/loss_scale": float(loss_scale), f"{SCALING}/skipped_steps": float(skipped_steps)}
    spread = scale_spread(s.weight_scale for s in layer_scales)
    if spread is not None:
        scalars.update({f"{SCALING}/{LAYER_SCALE}_min": math.log2(spread.low),
                        f"{SCALING}/{LAYER_SCALE}_median": math.log2(spread.median),
                        f"{SCALING}/{LAYER_SCALE}_max": math.log2(spread.high)})
    for scale in layer_scales:
        if math.isfinite(scale.weight_scale) and scale.weight_scale > 0:
            scalars[f"{LAYER_SCALE}/{scale.layer}"] = math.log2(scale.weight_scale)
    for record in records:
        if math.isfinite(record.underflow_fraction):
            scalars[f"{UNDERFLOW}/{record.layer}"] = float(record.underflow_fraction)
    return scalars


def write_scalars(writer: Any, scalars: Mapping[str, float], step: int) -> None:
    """``writer.add_scalar(tag, value, step)`` for each tag: a ``torch.utils.tensorboard.SummaryWriter`` (or any
    writer with that method, such as tensorboardX's)."""
    for tag, value in scalars.items():
        writer.add_scalar(tag, value, step)
