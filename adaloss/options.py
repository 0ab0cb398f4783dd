"""The loss-scaling options: frozen dataclasses, one per method, each checked where it is built.

One spelling per knob, from the YAML key to the dataclass field: ``LossScaler(model, "dynamic", growth_factor=4.0)``
builds a :class:`DynamicScalingConfig` through :func:`scaling_options`, the app's YAML schema nests these same
classes under ``loss_scaling``, and the core reads their fields by these names. Every field carries its help text
and constraints (``adaloss.fields``), so a bad value gets the same message whether it came from a keyword or a
config file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Optional

from adaloss.core.adaptive import RULES
from adaloss.core.adaptive_stats import default_range, underflow_k
from adaloss.core.presets import KNOBS, PRESETS, preset_knobs
from adaloss.errors import OptionError
from adaloss.fields import (CheckedOptions, close_matches, did_you_mean, keys_of, option, section, show)

__all__ = ["ADAPTIVE_METHODS", "CONFIG_KNOBS", "DYNAMIC_PRESETS", "FLOOR_BEHAVIOURS", "LIBRARY_DEFAULTS",
           "OVERFLOW_BEHAVIOURS", "SCALE_MAX", "SCALING_METHODS", "AdaptiveScalingConfig", "DynamicScalingConfig",
           "FixedScalingConfig", "LossScalingConfig", "scaling_options"]

SCALING_METHODS = ("none", "fixed", "dynamic", "adaptive")
#: The peers whose dynamic loss scaling a preset reproduces (``adaloss.core.presets``).
DYNAMIC_PRESETS = tuple(PRESETS)
FLOOR_BEHAVIOURS = ("clamp", "raise")
OVERFLOW_BEHAVIOURS = ("skip", "retry")
#: The adaptive rules, from their registry (``adaloss.core.adaptive.RULES``): the one source of the list.
ADAPTIVE_METHODS = tuple(RULES)
SCALE_MAX = 1e38  # scales live in float32 tensors (largest finite value 3.4e38)


@dataclass(frozen=True)
class FixedScalingConfig(CheckedOptions):
    """Static loss scaling: one constant scale S."""

    section_path: ClassVar[str] = "loss_scaling.fixed"
    scale: float = option(128.0, "The constant loss scale S.", min=0.0, max=SCALE_MAX, exclusive_min=True)
    skip_on_overflow: bool = option(True, "Skip the optimizer step when a gradient is not finite "
                                    "(MindSpore's drop_overflow_update).")


@dataclass(frozen=True)
class DynamicScalingConfig(CheckedOptions):
    """Dynamic loss scaling: one state machine, with presets that reproduce each peer's defaults.

    Fields left unset (null) take the preset's value (:meth:`resolved`).
    """

    section_path: ClassVar[str] = "loss_scaling.dynamic"
    ordered: ClassVar[tuple] = (("min_scale", "max_scale", False),)
    preset: str = option("pytorch", "Defaults to start from.", choices=DYNAMIC_PRESETS)
    init_scale: Optional[float] = option(None, "Initial loss scale. null: the preset's value.", min=0.0, max=SCALE_MAX, exclusive_min=True)
    growth_factor: Optional[float] = option(None, "Multiplier after growth_interval clean steps. null: the preset's value.", min=1.0)
    backoff_factor: Optional[float] = option(None, "Multiplier on overflow. null: the preset's value.", min=0.0, max=1.0, exclusive_min=True)
    growth_interval: Optional[int] = option(None, "Clean steps in a row before the scale grows. null: the preset's value.", min=1)
    hysteresis: Optional[int] = option(None, "Overflows tolerated before the scale backs off. null: the preset's value.", min=1)
    min_scale: Optional[float] = option(None, "Floor of the scale. null: the preset's value.", min=0.0, max=SCALE_MAX, exclusive_min=True)
    max_scale: Optional[float] = option(None, "Ceiling of the scale. null: the preset's value.", min=0.0, max=SCALE_MAX, exclusive_min=True)
    on_floor: Optional[str] = option(None, "At min_scale with another overflow: clamp (keep going) or raise "
                                     "(stop the run as diverged).", choices=FLOOR_BEHAVIOURS)
    on_overflow: Optional[str] = option(None, "skip the step, or retry the same batch with the smaller scale.",
                                        choices=OVERFLOW_BEHAVIOURS)
    max_retries: Optional[int] = option(None, "retry: attempts per batch before the step is skipped.", min=1)
    grow_every_step_until_overflow: Optional[bool] = option(
        None, "Double every step until the first overflow (Chainer's warm start).")
    smooth_growth: Optional[bool] = option(
        None, "Grow by growth_factor^(1/growth_interval) after every clean step instead of in one jump (Chainer).")

    def resolved(self) -> dict[str, Any]:
        """Every knob a config can set (:data:`CONFIG_KNOBS`), the preset's value where this section leaves it
        unset: written back into a config file, it loads again and runs the same state machine (the knobs only a
        preset sets follow from ``preset``)."""
        preset = preset_knobs(self.preset)
        return {key: preset[key] if getattr(self, key) is None else getattr(self, key) for key in CONFIG_KNOBS}


@dataclass(frozen=True)
class AdaptiveScalingConfig(CheckedOptions):
    """Adaptive per-layer loss scaling (Zhao et al., IJCAI 2020), with adaloss's range-filling default rule.

    The per-layer factor math (``adaloss.core.adaptive``) reads these fields as they are, with two derived values:
    :attr:`k` and :meth:`range_for`. :meth:`paper` gives the reference implementation's settings.
    """

    section_path: ClassVar[str] = "loss_scaling.adaptive"
    ordered: ClassVar[tuple] = (("u_min", "u_max", True),)
    loss_scale_method: str = option(
        "max_range", "How each layer's factor is computed: max_range (largest factor an exact bound allows), "
        "measured_range (the paper's rule on the measured share of underflow), or the paper's approx_range, "
        "abs_range, element_wise_range, fixed.", choices=ADAPTIVE_METHODS)
    init_scale: float = option(1.0, "Scale the loss is multiplied by (the output point then sets its own).",
                               min=0.0, max=SCALE_MAX, exclusive_min=True)
    u_min: Optional[float] = option(None, "Smallest magnitude to keep (default by dtype: 6e-8 fp16, 1e-23 fp32).",
                                    min=0.0, max=SCALE_MAX, exclusive_min=True)
    u_max: Optional[float] = option(None, "Largest magnitude allowed (default by dtype: 65504 fp16, 1e23 fp32).",
                                    min=0.0, max=SCALE_MAX, exclusive_min=True)
    n_uf_threshold: float = option(1e-3, "Tolerated fraction of underflowing values (approx_range, "
                                   "measured_range).", min=0.0, max=0.5, exclusive_min=True)
    scale_upper_bound: float = option(16.0, "Largest per-layer factor (approx_range, measured_range with "
                                      "use_bound).", min=0.0, max=SCALE_MAX, exclusive_min=True)
    accum_upper_bound: Optional[float] = option(
        None, "Largest accumulated scale a layer may create, counted from the output (approx_range, "
        "measured_range with use_bound); null: only the range caps it (the paper used 1024).",
        min=0.0, max=SCALE_MAX, exclusive_min=True)
    power_of_two: bool = option(True, "Round each factor down to a power of two (exact scaling).")
    use_bound: bool = option(True, "Apply scale_upper_bound and accum_upper_bound (approx_range, measured_range).")
    fixed_loss_scale: float = option(1.0, "loss_scale_method=fixed: the constant per-layer factor.", min=0.0,
                                     max=SCALE_MAX, exclusive_min=True)
    update_per_n_iteration: int = option(1, "Recompute the statistics every N training iterations.", min=1)
    exact_bounds: bool = option(True, "Give each layer's weight gradient a factor of its own, bounded exactly "
                                     "from the layer input, so it cannot overflow (false: the paper's shared factor).")
    backoff_factor: float = option(0.5, "On an overflow, multiply the top of the range every factor aims at by "
                                   "this (and recompute).", min=0.0, max=1.0, exclusive_min=True)
    growth_interval: int = option(2000, "Clean steps in a row before a backed-off range grows back by "
                                  "1/backoff_factor (up to u_max).", min=1)
    on_overflow: str = option("retry", "retry the same batch with the backed-off range (a rare overflow costs one "
                              "more forward and backward, not a batch), or skip the step as GradScaler does (the "
                              "library's LossScaler skips by default: a user's loop does not re-run a batch).",
                              choices=OVERFLOW_BEHAVIOURS)
    max_retries: int = option(3, "retry: attempts per batch before the step is skipped.", min=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        # Derived values, read on every layer of every refresh (not fields: equality and hashing ignore them).
        object.__setattr__(self, "_k", underflow_k(self.n_uf_threshold))
        object.__setattr__(self, "_ranges", {})

    @classmethod
    def paper(cls, **overrides: Any) -> "AdaptiveScalingConfig":
        """The reference implementation's settings (approx_range, accumulated cap 1024, the weight gradient at the
        input gradient's factor), with ``overrides`` on top: what reproduces the paper's factors."""
        settings: dict[str, Any] = {"loss_scale_method": "approx_range", "accum_upper_bound": 1024.0,
                                    "exact_bounds": False}
        settings.update(overrides)
        return cls(**settings)

    @property
    def k(self) -> float:
        """sqrt(2) * erfinv(n_uf_threshold): the Gaussian quantile the paper's approx_range aims at."""
        return self._k  # type: ignore[attr-defined]

    def range_for(self, dtype: Any) -> tuple[float, float]:
        """(u_min, u_max): the values given, else the defaults of ``dtype`` (6e-8 and 65504 for float16)."""
        ranges = self._ranges  # type: ignore[attr-defined]
        found = ranges.get(dtype)
        if found is None:
            lo, hi = (None, None) if self.u_min is not None and self.u_max is not None else default_range(dtype)
            found = ranges[dtype] = (lo if self.u_min is None else self.u_min,
                                     hi if self.u_max is None else self.u_max)
        return found


@dataclass(frozen=True)
class LossScalingConfig(CheckedOptions):
    """Which loss-scaling method to use, and its knobs."""

    section_path: ClassVar[str] = "loss_scaling"
    method: str = option("dynamic", "Loss-scaling method.", choices=SCALING_METHODS)
    fixed: FixedScalingConfig = section(FixedScalingConfig, "method=fixed.")
    dynamic: DynamicScalingConfig = section(DynamicScalingConfig, "method=dynamic.")
    adaptive: AdaptiveScalingConfig = section(AdaptiveScalingConfig, "method=adaptive.")


#: The dynamic knobs a config can set: all but ``smooth_growth``, which is preset-only (Chainer) until the schema
#: grows a field for it; one added to :class:`DynamicScalingConfig` joins this tuple by itself.
CONFIG_KNOBS = tuple(k for k in KNOBS if k in {f.name for f in dataclasses.fields(DynamicScalingConfig)})

#: Where the library's ``LossScaler`` departs from the config file's defaults. The trainer retries an overflowing
#: adaptive batch itself; in a user's loop (or Lightning's, accelerate's) nothing re-runs the batch, so the library
#: skips the step, as GradScaler does. ``on_overflow="retry"`` with a loop that checks ``should_retry`` opts in.
LIBRARY_DEFAULTS: dict[str, dict[str, Any]] = {"adaptive": {"on_overflow": "skip"}}

_SECTIONS = {"fixed": FixedScalingConfig, "dynamic": DynamicScalingConfig, "adaptive": AdaptiveScalingConfig}


def scaling_options(method: str, options: Mapping[str, Any] | None = None) -> LossScalingConfig:
    """The options of one loss-scaling method from keywords (as ``LossScaler(model, method, **options)`` takes
    them): the keys of the method's config section, checked as a config file's are. An :class:`OptionError` (a
    ``ValueError``) lists every problem, each naming its key and what it allows."""
    options = dict(options or {})
    if method not in SCALING_METHODS:
        raise OptionError(f"loss_scaling.method: got {show(method)}; must be one of: {', '.join(SCALING_METHODS)}"
                          f"{did_you_mean(close_matches(str(method), SCALING_METHODS))}")
    if method == "none":
        if options:
            raise OptionError(f"method 'none' takes no options, got {sorted(options)}")
        return LossScalingConfig(method="none")
    cls = _SECTIONS[method]
    keys = keys_of(cls)
    problems = [f"{cls.section_path}.{key}: unknown key; valid keys in {cls.section_path}: {', '.join(keys)}"
                f"{did_you_mean(close_matches(key, keys))}" for key in options if key not in keys]
    known = {key: value for key, value in options.items() if key in keys}
    try:
        chosen = cls(**{**LIBRARY_DEFAULTS.get(method, {}), **known})
    except OptionError as err:
        problems += err.problems
    if problems:
        raise OptionError.listing(f"invalid {method} loss-scaling options", problems)
    return LossScalingConfig(method=method, **{method: chosen})
