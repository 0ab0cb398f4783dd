"""The global loss-scale policies: one scale S for the whole loss, and what to do after each backward.

Framework-free (plain Python floats): the engine multiplies the loss by :attr:`ScalePolicy.scale`, runs backward,
finds out whether any gradient is non-finite, and calls :meth:`ScalePolicy.update` once per backward; the returned
:class:`StepAction` says whether to apply the optimizer step, skip it, or re-run the same batch. Per-layer adaptive
factors live elsewhere; :class:`AdaptiveGlobal` only holds the scale at the loss.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import Enum
from typing import Any, Callable

from typing import TYPE_CHECKING

from adaloss.core.presets import KNOBS, dynamic_problems, preset_knobs
from adaloss.errors import LossScaleFloorError, UserError

if TYPE_CHECKING:  # the options import the core, never the reverse at import time
    from adaloss.options import LossScalingConfig

__all__ = ["FLOAT32_MAX", "StepAction", "ScalePolicy", "NoScaling", "FixedScaling", "DynamicScaling",
           "AdaptiveGlobal", "build_policy"]

#: The largest finite float32: every scale is applied as a float32 tensor somewhere (the loss, a gradient), so no
#: scale may grow past it (GradScaler keeps its scale in a float32 tensor and refuses such a growth too).
FLOAT32_MAX = 3.4028234663852886e38


class StepAction(str, Enum):
    """What the engine does with the gradients of the backward just checked."""
    STEP = "step"    # apply the optimizer step
    SKIP = "skip"    # drop these gradients and move on to the next batch
    RETRY = "retry"  # drop these gradients and re-run the same batch with the new scale

    def __str__(self) -> str:
        return self.value


class ScalePolicy(ABC):
    """One global loss scale S and the decision after each backward.

    Subclasses implement :meth:`_decide` (and, when they have them, :meth:`_settings` / :meth:`_load_settings` for
    the knobs and :meth:`_state` / :meth:`_load_state` for what changes while training); the counters of overflows,
    skipped steps and retries are kept here, the same way for every method.
    """

    method: str = ""

    def __init__(self) -> None:
        self._overflows = 0
        self._skipped_steps = 0
        self._retries = 0

    @property
    @abstractmethod
    def scale(self) -> float:
        """The scale S to multiply the loss by for the next backward."""

    def set_scale(self, scale: float) -> None:
        """Use ``scale`` from now on (``GradScaler.update(new_scale)``); the methods without a settable scale refuse."""
        if not (0 < scale <= FLOAT32_MAX) or not hasattr(self, "_scale"):
            raise ValueError(f"cannot set the loss scale of method {self.method!r} to {scale!r}: it must be a "
                             f"positive number up to float32's largest ({FLOAT32_MAX:g}), for fixed, dynamic or "
                             "adaptive")
        self._scale = float(scale)

    @property
    def skips_on_overflow(self) -> bool:
        """Whether a backward with a non-finite gradient keeps the optimizer from stepping (skip or retry); only
        fixed scaling with ``skip_on_overflow: false`` applies such a step."""
        return True

    def update(self, found_overflow: bool, attempt: int = 0) -> StepAction:
        """Record the outcome of one backward and say what to do with its gradients.

        Call exactly once per backward. `attempt` is the number of retries already made for this batch (0 for its
        first backward); only policies that retry look at it.
        """
        found_overflow = bool(found_overflow)
        action = self._decide(found_overflow, attempt)
        self._overflows += found_overflow
        self._skipped_steps += action is StepAction.SKIP
        self._retries += action is StepAction.RETRY
        return action

    @abstractmethod
    def _decide(self, found_overflow: bool, attempt: int) -> StepAction:
        """Update the state for one backward and return the action."""

    @property
    def overflows(self) -> int:
        """Backward passes that produced a non-finite gradient."""
        return self._overflows

    @property
    def skipped_steps(self) -> int:
        """Batches whose optimizer step was skipped."""
        return self._skipped_steps

    @property
    def retries(self) -> int:
        """Backward passes re-run on the same batch after an overflow."""
        return self._retries

    def state_dict(self) -> dict[str, Any]:
        """The policy's knobs and state as a JSON-serialisable dict (an exact round trip through
        :meth:`load_state_dict`: a policy built with other knobs takes the saved ones)."""
        return {"method": self.method, **self._settings(), **self._state(), "overflows": self._overflows,
                "skipped_steps": self._skipped_steps, "retries": self._retries}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict` of a policy of the same method. A state saved before the
        knobs were part of it keeps this policy's knobs."""
        if state.get("method") != self.method:
            raise UserError(f"Cannot resume: the checkpoint holds loss-scaling state of method "
                            f"{state.get('method')!r}, but loss_scaling.method is {self.method!r}. Resume with "
                            f"the run's own config.yaml, or start a new run.")
        self._load_settings(state)
        self._load_state(state)
        self._overflows = int(state["overflows"])
        self._skipped_steps = int(state["skipped_steps"])
        self._retries = int(state["retries"])

    def _settings(self) -> dict[str, Any]:
        return {}

    def _load_settings(self, state: dict[str, Any]) -> None:
        pass

    def _state(self) -> dict[str, Any]:
        return {}

    def _load_state(self, state: dict[str, Any]) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}(scale={self.scale!r})"


class NoScaling(ScalePolicy):
    """S = 1. A non-finite gradient is still skipped: it must never reach the weights."""

    method = "none"

    @property
    def scale(self) -> float:
        return 1.0

    def _decide(self, found_overflow: bool, attempt: int) -> StepAction:
        return StepAction.SKIP if found_overflow else StepAction.STEP


class FixedScaling(ScalePolicy):
    """A constant S. On overflow the step is skipped when `skip_on_overflow` (MindSpore's drop_overflow_update),
    else applied as is."""

    method = "fixed"

    def __init__(self, scale: float, skip_on_overflow: bool = True) -> None:
        super().__init__()
        self._scale = float(scale)
        self.skip_on_overflow = bool(skip_on_overflow)

    @property
    def scale(self) -> float:
        return self._scale

    @property
    def skips_on_overflow(self) -> bool:
        return self.skip_on_overflow

    def _decide(self, found_overflow: bool, attempt: int) -> StepAction:
        return StepAction.SKIP if found_overflow and self.skip_on_overflow else StepAction.STEP

    def _settings(self) -> dict[str, Any]:
        return {"scale": self._scale, "skip_on_overflow": self.skip_on_overflow}

    def _load_settings(self, state: dict[str, Any]) -> None:
        if "scale" in state:
            self.set_scale(float(state["scale"]))
        self.skip_on_overflow = bool(state.get("skip_on_overflow", self.skip_on_overflow))


class AdaptiveGlobal(ScalePolicy):
    """The global part of adaptive scaling: the loss multiplier (``adaptive.init_scale``) and the headroom.

    Per-layer factors are chosen where the gradients are (see ``core/scale_steps.py``); they aim at a share h of the
    top of the range (the *headroom*, 1 at first). Their bounds keep every layer's input and weight gradient in
    range, so an overflow can only come from elsewhere (a normalisation layer's backward, an attention softmax):
    then the step is skipped (or the batch retried), h is multiplied by ``backoff_factor`` so that the next attempt
    differs, and after ``growth_interval`` clean steps in a row h grows back by 1 / backoff_factor, up to 1 -- as
    GradScaler does with its one scale. Training can therefore never stall on the same overflow.
    """

    method = "adaptive"
    #: The headroom never backs off below this (2**-40 of u_max is below fp16's smallest normal number).
    MIN_HEADROOM = 2.0 ** -40

    def __init__(self, init_scale: float = 1.0, backoff_factor: float = 0.5, growth_interval: int = 2000,
                 on_overflow: str = "skip", max_retries: int = 3) -> None:
        super().__init__()
        if not 0.0 < backoff_factor <= 1.0 or growth_interval < 1 or on_overflow not in ("skip", "retry"):
            raise UserError(f"Invalid adaptive overflow settings: backoff_factor {backoff_factor!r} must be in (0, 1],"
                            f" growth_interval {growth_interval!r} >= 1, on_overflow {on_overflow!r} skip or retry")
        self._scale = float(init_scale)
        self.backoff_factor = float(backoff_factor)
        #: What the headroom grows by after growth_interval clean steps (back to where one overflow took it).
        self.growth_factor = 1.0 / self.backoff_factor
        self.growth_interval = int(growth_interval)
        self.on_overflow = on_overflow
        self.max_retries = int(max_retries)
        self._headroom = 1.0
        self._growth_tracker = 0

    @property
    def scale(self) -> float:
        return self._scale

    @property
    def headroom(self) -> float:
        """The share of u_max the per-layer factors aim at (1 unless overflows backed it off)."""
        return self._headroom

    def _decide(self, found_overflow: bool, attempt: int) -> StepAction:
        if found_overflow:
            self._growth_tracker = 0
            self._headroom = max(self._headroom * self.backoff_factor, self.MIN_HEADROOM)
            if self.on_overflow == "retry" and attempt < self.max_retries:
                return StepAction.RETRY
            return StepAction.SKIP
        self._growth_tracker += 1
        if self._growth_tracker >= self.growth_interval:
            self._growth_tracker = 0
            self._headroom = min(self._headroom * self.growth_factor, 1.0)
        return StepAction.STEP

    def _settings(self) -> dict[str, Any]:
        return {"scale": self._scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "on_overflow": self.on_overflow,
                "max_retries": self.max_retries}

    def _load_settings(self, state: dict[str, Any]) -> None:
        if "backoff_factor" not in state:  # saved before the knobs were part of the state
            return
        from adaloss.options import AdaptiveScalingConfig  # (the options import the core)

        # Each knob checked by its config field (an OptionError lists every bad one); growth_factor has none.
        saved = AdaptiveScalingConfig(init_scale=state["scale"], backoff_factor=state["backoff_factor"],
                                      growth_interval=state["growth_interval"], on_overflow=state["on_overflow"],
                                      max_retries=state["max_retries"])
        growth = float(state["growth_factor"])
        if not growth >= 1.0:
            raise UserError(f"Cannot load adaptive loss-scaling state: growth_factor {growth!r} must be >= 1")
        self.set_scale(saved.init_scale)
        self.backoff_factor, self.growth_factor = saved.backoff_factor, growth
        self.growth_interval = saved.growth_interval
        self.on_overflow, self.max_retries = saved.on_overflow, saved.max_retries

    def _state(self) -> dict[str, Any]:
        return {"headroom": self._headroom, "growth_tracker": self._growth_tracker}

    def _load_state(self, state: dict[str, Any]) -> None:
        self._headroom = float(state.get("headroom", 1.0))
        self._growth_tracker = int(state.get("growth_tracker", 0))


class DynamicScaling(ScalePolicy):
    """Dynamic loss scaling: one state machine whose knobs reproduce every peer (see `presets.py`).

    State: `scale`, `growth_tracker` (clean steps since the last growth or overflow), `hysteresis_left` and
    `seen_overflow`.

    - Clean step: growth_tracker += 1. The effective interval is 1 while `grow_every_step_until_overflow` holds and
      no overflow has been seen yet, else `growth_interval`. When growth_tracker reaches it: scale =
      min(scale * growth_factor, max_scale), growth_tracker = 0, hysteresis_left = hysteresis. With `smooth_growth`
      the scale instead grows by growth_factor ** (1 / effective interval) after every clean step (Chainer), and
      reaching the interval only resets the tracker and the hysteresis.
    - Overflow: seen_overflow = True, growth_tracker = 0, hysteresis_left -= 1; when hysteresis_left <= 0: at the
      floor (scale <= min_scale) with on_floor = raise, :class:`LossScaleFloorError`; else scale =
      max(scale * backoff_factor, min_scale). Then RETRY if on_overflow = retry and attempt < max_retries, else SKIP.

    Where the peers' code differs from this machine:

    - GradScaler, Megatron and apex amp are this machine exactly (GradScaler refuses a growth to a non-finite
      scale, as this one does).
    - DeepSpeed backs off when `cur_hysteresis == 1` and never decrements below 1, where this machine counts
      hysteresis_left down to 0 and below: the decisions are the same. DeepSpeed's `consecutive_hysteresis: true`
      (refill the hysteresis on every clean step, off by default) has no knob here. DeepSpeed and MindSpore count
      their window from the iteration of the last overflow (DeepSpeed modulo the window, MindSpore's update cell
      by moving that mark at each growth): both grow after the same clean steps as the tracker here.
    - nnabla grows after N+2 clean steps following an overflow but after N+1 in steady state; the preset uses N+1.
    - Chainer is exact with `smooth_growth` (its growth ramp is never reset by an overflow, and neither is the
      smooth one here).
    """

    method = "dynamic"

    def __init__(self, preset: str = "pytorch", **overrides: Any) -> None:
        """Start from `preset`'s knobs with `overrides` (knob name -> value) on top."""
        super().__init__()
        unknown = sorted(set(overrides) - set(KNOBS))
        if unknown:
            raise TypeError(f"DynamicScaling got unknown knobs {unknown}; the knobs are {list(KNOBS)}")
        knobs = preset_knobs(preset)
        knobs.update(overrides)
        problems = dynamic_problems(knobs, preset)
        if problems:
            raise UserError("Invalid dynamic loss-scaling settings:\n  " + "\n  ".join(problems))
        self.preset = preset
        self.init_scale = float(knobs["init_scale"])
        self.growth_factor = float(knobs["growth_factor"])
        self.backoff_factor = float(knobs["backoff_factor"])
        self.growth_interval = int(knobs["growth_interval"])
        self.hysteresis = int(knobs["hysteresis"])
        self.min_scale = None if knobs["min_scale"] is None else float(knobs["min_scale"])
        self.max_scale = None if knobs["max_scale"] is None else float(knobs["max_scale"])
        self.on_floor = str(knobs["on_floor"])
        self.on_overflow = str(knobs["on_overflow"])
        self.max_retries = int(knobs["max_retries"])
        self.grow_every_step_until_overflow = bool(knobs["grow_every_step_until_overflow"])
        self.smooth_growth = bool(knobs["smooth_growth"])

        self._scale = self.init_scale
        self._growth_tracker = 0
        self._hysteresis_left = self.hysteresis
        self._seen_overflow = False

    @property
    def knobs(self) -> dict[str, Any]:
        """The resolved knobs this machine runs with (the keys of `presets.KNOBS`)."""
        return {key: getattr(self, key) for key in KNOBS}

    @property
    def scale(self) -> float:
        return self._scale

    @property
    def growth_tracker(self) -> int:
        """Clean steps since the last growth or overflow."""
        return self._growth_tracker

    @property
    def hysteresis_left(self) -> int:
        """Overflows still tolerated before the scale backs off (<= 0: every overflow backs off)."""
        return self._hysteresis_left

    @property
    def seen_overflow(self) -> bool:
        """Whether any overflow has happened yet (ends the grow-every-step warm start)."""
        return self._seen_overflow

    def _decide(self, found_overflow: bool, attempt: int) -> StepAction:
        if found_overflow:
            self._on_overflow()
            if self.on_overflow == "retry" and attempt < self.max_retries:
                return StepAction.RETRY
            return StepAction.SKIP
        self._on_clean()
        return StepAction.STEP

    def _on_clean(self) -> None:
        warm = self.grow_every_step_until_overflow and not self._seen_overflow
        interval = 1 if warm else self.growth_interval
        self._growth_tracker += 1
        if self.smooth_growth:
            self._grow(self.growth_factor ** (1.0 / interval))
        if self._growth_tracker >= interval:
            if not self.smooth_growth:
                self._grow(self.growth_factor)
            self._growth_tracker = 0
            self._hysteresis_left = self.hysteresis

    def _grow(self, factor: float) -> None:
        grown = self._scale * factor
        if self.max_scale is not None:
            grown = min(grown, self.max_scale)
        if grown <= FLOAT32_MAX:  # as GradScaler: a scale infinite in float32 would make every gradient inf/NaN
            self._scale = grown

    def _on_overflow(self) -> None:
        self._seen_overflow = True
        self._growth_tracker = 0
        self._hysteresis_left -= 1
        if self._hysteresis_left > 0:
            return
        at_floor = self.min_scale is not None and self._scale <= self.min_scale
        if at_floor and self.on_floor == "raise":
            raise LossScaleFloorError(
                f"Gradients overflowed again with the dynamic loss scale already at its floor "
                f"(scale {self._scale:g} = min_scale {self.min_scale:g}, preset {self.preset}): training has "
                f"diverged. Fix: lower the learning rate or check the model and data for NaN/Inf, lower "
                f"loss_scaling.dynamic.min_scale, or set loss_scaling.dynamic.on_floor: clamp to keep going.")
        backed_off = self._scale * self.backoff_factor
        self._scale = backed_off if self.min_scale is None else max(backed_off, self.min_scale)

    def _settings(self) -> dict[str, Any]:
        return {"preset": self.preset, **self.knobs}

    def _load_settings(self, state: dict[str, Any]) -> None:
        if "growth_factor" not in state:  # saved before the knobs were part of the state
            return
        from adaloss.options import CONFIG_KNOBS, DynamicScalingConfig  # (the options import the core)

        knobs = {key: state.get(key, value) for key, value in self.knobs.items()}
        preset = str(state.get("preset", self.preset))
        # Each knob checked by its config field (an OptionError lists every bad one), then across knobs.
        DynamicScalingConfig(preset=preset, **{key: knobs[key] for key in CONFIG_KNOBS})
        knobs["smooth_growth"] = bool(knobs["smooth_growth"])
        problems = dynamic_problems(knobs, preset)
        if problems:
            raise UserError("Cannot load dynamic loss-scaling state:\n  " + "\n  ".join(problems))
        self.preset = preset
        for key, value in knobs.items():
            setattr(self, key, value)

    def _state(self) -> dict[str, Any]:
        return {"scale": self._scale, "growth_tracker": self._growth_tracker,
                "hysteresis_left": self._hysteresis_left, "seen_overflow": self._seen_overflow}

    def _load_state(self, state: dict[str, Any]) -> None:
        self._scale = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])
        self._hysteresis_left = int(state["hysteresis_left"])
        self._seen_overflow = bool(state["seen_overflow"])

    def __repr__(self) -> str:
        return f"DynamicScaling(preset={self.preset!r}, scale={self._scale!r})"


def _dynamic_from_config(cfg: LossScalingConfig) -> DynamicScaling:
    return DynamicScaling(cfg.dynamic.preset, **cfg.dynamic.resolved())


_BUILDERS: dict[str, Callable[[LossScalingConfig], ScalePolicy]] = {
    "none": lambda cfg: NoScaling(),
    "fixed": lambda cfg: FixedScaling(cfg.fixed.scale, cfg.fixed.skip_on_overflow),
    "dynamic": _dynamic_from_config,
    "adaptive": lambda cfg: AdaptiveGlobal(cfg.adaptive.init_scale, cfg.adaptive.backoff_factor,
                                           cfg.adaptive.growth_interval, cfg.adaptive.on_overflow,
                                           cfg.adaptive.max_retries),
}


def build_policy(cfg: LossScalingConfig) -> ScalePolicy:
    """The global loss-scale policy for a `loss_scaling` config section."""
    try:
        builder = _BUILDERS[cfg.method]
    except KeyError:
        raise UserError(f"loss_scaling.method: unknown method {cfg.method!r}. "
                        f"Choose between [{', '.join(_BUILDERS)}].") from None
    return builder(cfg)
