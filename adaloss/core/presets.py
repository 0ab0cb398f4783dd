"""The dynamic loss-scaling presets: each peer's defaults as values of adaloss's one state machine.

Every preset is a full knob dict (the keys of :data:`KNOBS`); a config's `loss_scaling.dynamic` section names a preset
and overrides any knob it sets explicitly (``DynamicScalingConfig.resolved``). The state machine itself is
:class:`adaloss.core.policies.DynamicScaling`; its docstring says where each peer's code differs from it.

Values were read from the peers' own code (their current main branches, and Chainer's last release):

- pytorch:   torch/amp/grad_scaler.py, GradScaler.__init__ defaults, and the update kernel `_amp_update_scale_`.
- apex:      apex/amp/scaler.py, LossScaler.__init__ (what `amp.initialize(loss_scale="dynamic")` builds).
- deepspeed: deepspeed/runtime/constants.py (the `fp16` JSON section's defaults) and
             deepspeed/runtime/fp16/loss_scaler.py, DynamicLossScaler.
- megatron:  megatron/core/optimizer/optimizer_config.py (initial_loss_scale, min_loss_scale, loss_scale_window,
             hysteresis; the same defaults as the --initial-loss-scale etc. flags) and
             megatron/core/optimizer/grad_scaler.py, DynamicGradScaler (factors 2.0 / 0.5 are hard-coded where
             megatron/core/optimizer/__init__.py builds it).
- mindspore: mindspore/train/loss_scale_manager.py, DynamicLossScaleManager.__init__, and
             mindspore/nn/wrap/loss_scale.py, DynamicLossScaleUpdateCell (floor `minimum_loss_scale` = 1.0).
- nnabla:    nnabla/experimental/mixed_precision_training.py, DynamicLossScalingUpdater.
- chainer:   chainer/optimizer.py, Optimizer.loss_scaling / update_loss_scale (v7.8.1).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

from adaloss.errors import UserError

#: The knobs of the dynamic state machine, in the order of `DynamicScalingConfig`.
KNOBS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "hysteresis", "min_scale", "max_scale",
         "on_floor", "on_overflow", "max_retries", "grow_every_step_until_overflow", "smooth_growth")

# Not a knob of any peer but nnabla: how many times a batch may be re-run when a user switches `on_overflow` to
# retry on another preset. nnabla's `_max_recursive_count`.
_MAX_RETRIES = 100

_PRESETS: dict[str, dict[str, Any]] = {
    # torch.amp.GradScaler(init_scale=2.**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000).
    # No floor and no ceiling; the step is skipped on inf/NaN. (GradScaler refuses a growth that would make the
    # fp32 scale infinite; adaloss refuses one that makes its float scale infinite.)
    "pytorch": dict(init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                    hysteresis=1, min_scale=None, max_scale=None, on_floor="clamp", on_overflow="skip",
                    max_retries=_MAX_RETRIES, grow_every_step_until_overflow=False, smooth_growth=False),
    # apex.amp LossScaler(init_scale=2.**16, scale_factor=2., scale_window=2000, min_loss_scale=None,
    # max_loss_scale=2.**24). (apex.fp16_utils' legacy DynamicLossScaler has other defaults: 2**32, window 1000.)
    "apex": dict(init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                 hysteresis=1, min_scale=None, max_scale=2.0 ** 24, on_floor="clamp", on_overflow="skip",
                 max_retries=_MAX_RETRIES, grow_every_step_until_overflow=False, smooth_growth=False),
    # DeepSpeed fp16 section: initial_scale_power 16, loss_scale_window 1000, hysteresis 2,
    # consecutive_hysteresis false, min_loss_scale 1; scale_factor 2 (DynamicLossScaler default). The scaler's
    # raise_error_at_min_scale defaults to True ("Current loss scale already at minimum"), and the JSON config
    # cannot turn it off. (When an fp16 section sets none of these keys, some DeepSpeed optimizers fall back to
    # DynamicLossScaler's class defaults instead: 2**32 and no hysteresis.)
    "deepspeed": dict(init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=1000,
                      hysteresis=2, min_scale=1.0, max_scale=None, on_floor="raise", on_overflow="skip",
                      max_retries=_MAX_RETRIES, grow_every_step_until_overflow=False, smooth_growth=False),
    # Megatron-LM: --initial-loss-scale 2**32, --min-loss-scale 1.0, --loss-scale-window 1000, --hysteresis 2,
    # DynamicGradScaler(growth_factor=2.0, backoff_factor=0.5). Clamps at the floor, no ceiling.
    "megatron": dict(init_scale=2.0 ** 32, growth_factor=2.0, backoff_factor=0.5, growth_interval=1000,
                     hysteresis=2, min_scale=1.0, max_scale=None, on_floor="clamp", on_overflow="skip",
                     max_retries=_MAX_RETRIES, grow_every_step_until_overflow=False, smooth_growth=False),
    # MindSpore DynamicLossScaleManager(init_loss_scale=2**24, scale_factor=2, scale_window=2000); the update cell
    # floors the scale at 1.0 and the manager always drops the overflowing update. (The host-side
    # `update_loss_scale` also raises after more than 1000 overflows in a row; the device cell used in training
    # does not, and neither does adaloss.)
    "mindspore": dict(init_scale=2.0 ** 24, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                      hysteresis=1, min_scale=1.0, max_scale=None, on_floor="clamp", on_overflow="skip",
                      max_retries=_MAX_RETRIES, grow_every_step_until_overflow=False, smooth_growth=False),
    # nnabla DynamicLossScalingUpdater(scale=8.0, scaling_factor=2.0, N=2000): on inf/NaN it halves the scale and
    # calls update() again, at most `_max_recursive_count` = 100 times, then gives the batch up. No floor, no ceiling.
    # Closest, not exact: its counter test `if self._counter > self.N` grows after N+1 clean steps in steady state
    # but after N+2 following an overflow or at the start; adaloss uses N+1 = 2001 throughout. Its re-run calls the
    # user's data_feeder again: with a feeder that loads a new batch, nnabla retries on the next batch, adaloss on
    # the same one (the behaviour its docs describe).
    "nnabla": dict(init_scale=8.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2001,
                   hysteresis=1, min_scale=None, max_scale=None, on_floor="clamp", on_overflow="retry",
                   max_retries=100, grow_every_step_until_overflow=False, smooth_growth=False),
    # Chainer optimizer.loss_scaling(interval=1000, scale=None): starts at 1.0 and doubles after every update until
    # the first non-finite gradient ever; from then on multiplies by 2**(1/interval) after every clean update and by
    # 0.5 after an overflow; always clipped to [1, _loss_scale_max = 65504] (fp16's largest value, not a power of
    # two). Exact with smooth_growth: the per-step multiplier is growth_factor ** (1 / effective interval).
    "chainer": dict(init_scale=1.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=1000,
                    hysteresis=1, min_scale=1.0, max_scale=65504.0, on_floor="clamp", on_overflow="skip",
                    max_retries=_MAX_RETRIES, grow_every_step_until_overflow=True, smooth_growth=True),
}

#: preset name -> full knob dict (read-only).
PRESETS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {name: MappingProxyType(knobs) for name, knobs in _PRESETS.items()})

assert all(tuple(knobs) == KNOBS for knobs in PRESETS.values()), "every preset must set every knob"


def preset_knobs(name: str) -> dict[str, Any]:
    """A fresh copy of the full knob dict of preset `name`."""
    if name not in PRESETS:
        raise UserError(f"loss_scaling.dynamic.preset: unknown preset {name!r}. "
                        f"Choose between [{', '.join(PRESETS)}].")
    return dict(PRESETS[name])


def dynamic_problems(knobs: Mapping[str, Any], preset: str | None = None) -> list[str]:
    """Every cross-field problem of a resolved knob dict, one message each (empty when the knobs are usable).

    Single-field ranges are the schema's job; these need two fields at once.
    """
    origin = f" (preset {preset})" if preset else ""
    key = "loss_scaling.dynamic."
    lo, hi, init = knobs["min_scale"], knobs["max_scale"], knobs["init_scale"]
    problems = []
    if lo is not None and hi is not None and lo > hi:
        problems.append(f"{key}min_scale {lo:g} is above max_scale {hi:g}{origin}: lower min_scale or raise "
                        f"max_scale.")
    if lo is not None and init < lo:
        problems.append(f"{key}init_scale {init:g} is below min_scale {lo:g}{origin}: raise init_scale or lower "
                        f"min_scale.")
    if hi is not None and init > hi:
        problems.append(f"{key}init_scale {init:g} is above max_scale {hi:g}{origin}: lower init_scale or raise "
                        f"max_scale.")
    if knobs["on_floor"] == "raise" and lo is None:
        problems.append(f"{key}on_floor is raise but min_scale is null{origin}, so there is no floor to reach: "
                        f"set min_scale (e.g. 1.0) or on_floor: clamp.")
    return problems
