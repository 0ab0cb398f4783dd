"""Global loss-scale policies' options and state: explicit knobs override a preset, inconsistent knobs are user
errors, the none/fixed/adaptive policies and build_policy, and state_dict round trips of every policy."""

from __future__ import annotations

import dataclasses
import json

import pytest

from adaloss.options import (DYNAMIC_PRESETS, SCALING_METHODS, AdaptiveScalingConfig, DynamicScalingConfig,
                             FixedScalingConfig, LossScalingConfig)
from adaloss.core.policies import (AdaptiveGlobal, DynamicScaling, FixedScaling, NoScaling, StepAction,
                                   build_policy)
from adaloss.core.presets import PRESETS, dynamic_problems
from adaloss.options import CONFIG_KNOBS
from adaloss.errors import UserError
from test_policies import RETRY, SKIP, STEP, bursty_overflows, clean, dynamic, overflow


# --- knobs: overrides, validation, the other options ------------------------------------------------------------------

def test_explicit_fields_override_the_preset_and_unset_fields_keep_it():
    cfg = DynamicScalingConfig(preset="deepspeed", growth_interval=3, hysteresis=1, on_floor="clamp")
    knobs = cfg.resolved()
    expected = {**PRESETS["deepspeed"], "growth_interval": 3, "hysteresis": 1, "on_floor": "clamp"}
    assert knobs == {key: expected[key] for key in CONFIG_KNOBS}
    p = dynamic("deepspeed", growth_interval=3, hysteresis=1, on_floor="clamp")
    assert p.knobs == expected
    overflow(p, 2.0 ** 15)           # hysteresis 1: the first overflow halves
    clean(p, 3)
    assert p.scale == 2.0 ** 16
    for _ in range(20):
        p.update(True)
    assert p.scale == 1.0            # clamps instead of raising


@pytest.mark.parametrize("preset", DYNAMIC_PRESETS)
def test_resolved_knobs_written_back_as_config_fields_run_the_same_machine(preset):
    knobs = DynamicScalingConfig(preset=preset).resolved()
    assert set(knobs) <= {f.name for f in dataclasses.fields(DynamicScalingConfig)}
    assert dynamic(preset, **knobs).knobs == dict(PRESETS[preset])


def test_grow_every_step_until_overflow_on_another_preset():
    p = dynamic("pytorch", init_scale=1.0, growth_interval=4, grow_every_step_until_overflow=True)
    clean(p, 5)
    assert p.scale == 32.0
    overflow(p, 16.0)
    clean(p, 3)
    assert p.scale == 16.0
    clean(p, 1)
    assert p.scale == 32.0


def test_retry_on_a_skip_preset_and_the_attempt_limit():
    p = dynamic("pytorch", on_overflow="retry", max_retries=2)
    assert [p.update(True, attempt=a) for a in range(3)] == [RETRY, RETRY, SKIP]
    assert p.scale == 2.0 ** 13
    assert (p.overflows, p.retries, p.skipped_steps) == (3, 2, 1)


def test_growth_never_makes_the_scale_infinite():
    p = dynamic("pytorch", init_scale=1e38, growth_interval=1)
    clean(p, 3)
    assert p.scale == 2e38  # 4e38 would be inf in float32, where every scale is applied


@pytest.mark.parametrize("overrides, fragment", [
    (dict(preset="apex", init_scale=2.0 ** 30), "init_scale 1.07374e+09 is above max_scale 1.67772e+07 (preset apex)"),
    (dict(preset="megatron", init_scale=0.5), "init_scale 0.5 is below min_scale 1"),
    (dict(preset="chainer", min_scale=2.0 ** 20), "min_scale 1.04858e+06 is above max_scale 65504"),
    (dict(preset="pytorch", on_floor="raise"), "on_floor is raise but min_scale is null"),
])
def test_inconsistent_knobs_are_a_user_error_naming_the_keys(overrides, fragment):
    with pytest.raises(UserError) as err:
        dynamic(**overrides)
    assert fragment in str(err.value)
    assert "loss_scaling.dynamic." in str(err.value)


def test_dynamic_problems_collects_every_problem():
    knobs = {**PRESETS["pytorch"], "min_scale": 4.0, "max_scale": 2.0, "init_scale": 8.0}
    assert len(dynamic_problems(knobs)) == 2


def test_unknown_preset_and_knob():
    with pytest.raises(UserError, match="Choose between"):
        DynamicScaling("tensorflow")
    with pytest.raises(TypeError, match="unknown knobs"):
        DynamicScaling("pytorch", scale_window=10)


# --- none, fixed, adaptive --------------------------------------------------------------------------------------------

def test_none_has_scale_1_and_skips_non_finite_gradients():
    p = build_policy(LossScalingConfig(method="none"))
    assert isinstance(p, NoScaling) and p.scale == 1.0
    assert [p.update(f) for f in (False, True, False)] == [STEP, SKIP, STEP]
    assert (p.overflows, p.skipped_steps, p.retries, p.scale) == (1, 1, 0, 1.0)


@pytest.mark.parametrize("skip, action", [(True, SKIP), (False, STEP)])
def test_fixed_scale_is_constant_and_skip_on_overflow_decides(skip, action):
    p = build_policy(LossScalingConfig(method="fixed", fixed=FixedScalingConfig(scale=512.0, skip_on_overflow=skip)))
    assert isinstance(p, FixedScaling)
    assert p.update(True) is action
    assert p.update(False) is STEP
    assert (p.scale, p.overflows, p.skipped_steps) == (512.0, 1, int(skip))


def test_adaptive_global_scale_is_its_init_scale():
    p = build_policy(LossScalingConfig(method="adaptive", adaptive=AdaptiveScalingConfig(init_scale=4.0,
                                                                                          on_overflow="skip")))
    assert isinstance(p, AdaptiveGlobal)
    assert p.update(True) is SKIP and p.update(False) is STEP and p.scale == 4.0


def test_adaptive_retries_by_default_in_configs_and_skips_by_default_in_the_library():
    from adaloss.options import scaling_options
    p = build_policy(LossScalingConfig(method="adaptive"))
    assert [p.update(True, attempt=k) for k in range(4)] == [RETRY] * 3 + [SKIP]
    assert build_policy(scaling_options("adaptive", {})).update(True) is SKIP
    assert build_policy(scaling_options("adaptive", {"on_overflow": "retry"})).update(True) is RETRY


def test_build_policy_covers_every_method_and_rejects_others():
    for method in SCALING_METHODS:
        assert build_policy(LossScalingConfig(method=method)).method == method
    with pytest.raises(UserError, match=r"must be one of: none, fixed, dynamic, adaptive \(did you mean 'fixed'\?\)"):
        build_policy(dataclasses.replace(LossScalingConfig(), method="static"))


def test_step_action_is_its_string():
    assert StepAction("retry") is RETRY and str(SKIP) == "skip" and STEP == "step"


# --- state_dict ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", DYNAMIC_PRESETS)
def test_state_dict_round_trip_mid_trajectory_continues_identically(preset):
    seq = bursty_overflows(11, 6000, 1 / 700)
    overrides = {"on_floor": "clamp"} if preset == "deepspeed" else {}
    a = dynamic(preset, **overrides)
    for found in seq[:3000]:
        a.update(found)
    state = json.loads(json.dumps(a.state_dict()))
    assert state == a.state_dict()
    b = dynamic(preset, **overrides)
    b.load_state_dict(state)
    assert b.state_dict() == a.state_dict()
    for i, found in enumerate(seq[3000:]):
        attempt = 1 if preset == "nnabla" and i % 7 == 0 else 0
        assert a.update(found, attempt) is b.update(found, attempt)
        assert a.scale == b.scale
    assert b.state_dict() == a.state_dict()


def test_state_dict_contents_and_counters():
    p = dynamic("megatron")
    p.update(True)
    assert p.state_dict() == {"method": "dynamic", "preset": "megatron", **PRESETS["megatron"], "scale": 2.0 ** 32,
                              "growth_tracker": 0, "hysteresis_left": 1, "seen_overflow": True, "overflows": 1,
                              "skipped_steps": 1, "retries": 0}


def test_a_state_dict_carries_the_knobs_and_loading_it_restores_them():
    """A policy built with other knobs takes the saved ones (GradScaler's state dict holds its factors and
    interval too); a state saved before the knobs were part of it keeps the loader's."""
    saved = dynamic("pytorch", growth_factor=4.0, backoff_factor=0.25, growth_interval=7, max_scale=2.0 ** 20)
    loader = dynamic("pytorch")
    loader.load_state_dict(saved.state_dict())
    assert (loader.growth_factor, loader.backoff_factor, loader.growth_interval, loader.max_scale) == (
        4.0, 0.25, 7, 2.0 ** 20)
    old = {k: v for k, v in saved.state_dict().items() if k not in ("preset", *PRESETS["pytorch"])}
    kept = dynamic("pytorch", growth_interval=3)
    kept.load_state_dict(old)
    assert kept.growth_interval == 3 and kept.scale == saved.scale


def test_a_state_dict_with_impossible_knobs_is_refused_by_name():
    """A state dict is data from a file: its knobs get the config fields' checks and words."""
    state = dynamic("pytorch").state_dict()
    state["backoff_factor"], state["on_floor"] = 2.0, "explode"
    with pytest.raises(UserError, match=r"(?s)dynamic.backoff_factor: got 2.0; must be a number > 0 and <= 1.*"
                                        r"dynamic.on_floor: got 'explode'; must be one of: clamp, raise"):
        dynamic("pytorch").load_state_dict(state)
    adaptive = build_policy(LossScalingConfig(method="adaptive"))
    state = adaptive.state_dict()
    state["growth_interval"] = 0
    with pytest.raises(UserError, match=r"adaptive.growth_interval: got 0; must be an integer >= 1"):
        adaptive.load_state_dict(state)


@pytest.mark.parametrize("method", SCALING_METHODS)
def test_every_policy_round_trips_its_counters(method):
    a = build_policy(LossScalingConfig(method=method, adaptive=AdaptiveScalingConfig(on_overflow="skip")))
    for found in (True, False, True):
        a.update(found)
    b = build_policy(LossScalingConfig(method=method))
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.state_dict() == a.state_dict()
    assert (b.overflows, b.skipped_steps) == (2, 2)


def test_loading_another_methods_state_is_a_user_error():
    state = build_policy(LossScalingConfig(method="fixed")).state_dict()
    with pytest.raises(UserError, match="'fixed', but loss_scaling.method is 'dynamic'"):
        dynamic("pytorch").load_state_dict(state)
