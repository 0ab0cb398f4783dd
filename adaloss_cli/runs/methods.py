"""Method specs of ``adaloss compare``: ``fixed:128``, ``dynamic:deepspeed``, ``adaptive:abs_range``, ``fp32``.

A spec names one loss-scaling method (the same spelling as ``loss_scaling.method``) and optionally one option of it;
it turns into ``--set`` overrides applied on top of the user's config. ``fp32`` is the float32 baseline: precision
float32 with no loss scaling. The choices come from the config schema, so this list cannot disagree with it.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass

from adaloss.errors import UserError
from adaloss.options import ADAPTIVE_METHODS, DYNAMIC_PRESETS, SCALE_MAX, SCALING_METHODS

BASELINE = "fp32"

# method -> (config key its option sets, what the option is, its allowed values or None for a positive number)
_OPTIONS: dict[str, tuple[str, str, tuple[str, ...] | None]] = {
    "fixed": ("loss_scaling.fixed.scale", "<scale>", None),
    "dynamic": ("loss_scaling.dynamic.preset", "<preset>", DYNAMIC_PRESETS),
    "adaptive": ("loss_scaling.adaptive.loss_scale_method", "<loss_scale_method>", ADAPTIVE_METHODS),
}


@dataclass(frozen=True)
class MethodSpec:
    """One method to compare: its canonical label (``fixed:128``) and the overrides that select it."""
    label: str
    method: str
    overrides: tuple[str, ...]

    @property
    def is_baseline(self) -> bool:
        """Whether this is the float32 baseline the other methods' accuracy gap is measured against."""
        return self.label == BASELINE

    @property
    def dir_name(self) -> str:
        """The label as a portable directory name (``fixed:128`` -> ``fixed-128``)."""
        return re.sub(r"[^A-Za-z0-9._-]", "-", self.label)


def allowed_forms() -> str:
    """Every spec form, for error messages and ``--help``."""
    forms = [BASELINE, "none"]
    for method, (_, what, choices) in _OPTIONS.items():
        listed = f" ({', '.join(choices)})" if choices else " (a positive number, e.g. fixed:128)"
        forms.append(f"{method}, {method}:{what}{listed}")
    return "; ".join(forms)


def _number(text: str) -> str:
    """A fixed scale in its shortest exact spelling (``128.0`` -> ``128``, ``1e3`` -> ``1000``)."""
    value = float(text)
    if not (math.isfinite(value) and 0 < value <= SCALE_MAX):
        raise ValueError(text)
    return str(int(value)) if value.is_integer() and value < 1e16 else repr(value)


def _unknown(spec: str, why: str) -> UserError:
    names = [BASELINE, *SCALING_METHODS]
    near = difflib.get_close_matches(spec.partition(":")[0].lower(), names, n=1)
    hint = f" (did you mean '{near[0]}'?)" if near and near[0] != spec.partition(":")[0] else ""
    return UserError(f"method '{spec}': {why}{hint}; allowed forms: {allowed_forms()}")


def parse_method(spec: str) -> MethodSpec:
    """Parse one spec; an unknown one is a UserError naming it and the allowed forms."""
    name, colon, option = spec.strip().partition(":")
    if name == BASELINE and not colon:
        return MethodSpec(BASELINE, "none", ("precision.dtype=float32", "loss_scaling.method=none"))
    if name not in SCALING_METHODS:
        raise _unknown(spec, "unknown method")
    overrides = [f"loss_scaling.method={name}"]
    if not colon:
        return MethodSpec(name, name, tuple(overrides))
    if name not in _OPTIONS:
        raise _unknown(spec, f"{name} takes no option")
    key, what, choices = _OPTIONS[name]
    if choices is None:
        try:
            option = _number(option)
        except ValueError:
            raise _unknown(spec, f"{what} must be a positive number up to {SCALE_MAX:g}") from None
    elif option not in choices:
        raise _unknown(spec, f"{what} must be one of {', '.join(choices)}")
    overrides.append(f"{key}={option}")
    return MethodSpec(f"{name}:{option}", name, tuple(overrides))


def parse_methods(specs: list[str] | tuple[str, ...]) -> list[MethodSpec]:
    """Parse every spec; a spec given twice (after normalisation) is a UserError."""
    parsed: list[MethodSpec] = []
    for spec in specs:
        method = parse_method(spec)
        if any(m.label == method.label for m in parsed):
            raise UserError(f"method '{spec}' is given twice (as '{method.label}'); list each method once")
        parsed.append(method)
    if not parsed:
        raise UserError(f"no method given; name one or more of: {allowed_forms()}")
    return parsed


def label_of_config(config: dict) -> str:
    """The spec label of a run's resolved config.yaml: ``fp32``, ``none``, ``fixed:512``, ``dynamic:apex``, ...

    Options at their schema default are left out (``fixed`` for scale 128), so loose runs of one method group
    together.
    """
    from adaloss.options import AdaptiveScalingConfig, DynamicScalingConfig, FixedScalingConfig

    scaling = config.get("loss_scaling") or {}
    method = scaling.get("method", "dynamic")
    if method == "none" and (config.get("precision") or {}).get("dtype") == "float32":
        return BASELINE
    defaults = {"fixed": ("scale", FixedScalingConfig().scale), "dynamic": ("preset", DynamicScalingConfig().preset),
                "adaptive": ("loss_scale_method", AdaptiveScalingConfig().loss_scale_method)}
    if method not in defaults:
        return str(method)
    key, default = defaults[method]
    value = (scaling.get(method) or {}).get(key, default)
    if value == default:
        return method
    return f"{method}:{_number(str(value)) if method == 'fixed' else value}"
