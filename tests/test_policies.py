"""Global loss-scale policies: every dynamic preset reproduces its peer's scale trajectory step by step."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest

from adaloss_cli.config.schema import (DYNAMIC_PRESETS, SCALING_METHODS, AdaptiveScalingConfig, DynamicScalingConfig,
                                       FixedScalingConfig, LossScalingConfig)
from adaloss_cli.core import (CONFIG_KNOBS, KNOBS, PRESETS, AdaptiveGlobal, DynamicScaling, FixedScaling, NoScaling, StepAction,
                              build_policy, dynamic_problems, resolve_dynamic)
from adaloss_cli.errors import LossScaleFloorError, UserError

STEP, SKIP, RETRY = StepAction.STEP, StepAction.SKIP, StepAction.RETRY


def dynamic(preset: str, **overrides) -> DynamicScaling:
    return build_policy(LossScalingConfig(method="dynamic", dynamic=DynamicScalingConfig(preset=preset, **overrides)))


def clean(policy, n: int) -> None:
    for _ in range(n):
        assert policy.update(False) is STEP


def overflow(policy, expected_scale: float, action: StepAction = SKIP) -> None:
    assert policy.update(True) is action
    assert policy.scale == expected_scale


# --- the presets table ------------------------------------------------------------------------------------------------

def test_presets_cover_the_schema_choices_and_every_knob():
    assert tuple(PRESETS) == DYNAMIC_PRESETS
    for knobs in PRESETS.values():
        assert tuple(knobs) == KNOBS


@pytest.mark.parametrize("preset, init, interval, hysteresis, floor, ceiling, on_floor, on_overflow", [
    ("pytorch", 2.0 ** 16, 2000, 1, None, None, "clamp", "skip"),
    ("apex", 2.0 ** 16, 2000, 1, None, 2.0 ** 24, "clamp", "skip"),
    ("deepspeed", 2.0 ** 16, 1000, 2, 1.0, None, "raise", "skip"),
    ("megatron", 2.0 ** 32, 1000, 2, 1.0, None, "clamp", "skip"),
    ("mindspore", 2.0 ** 24, 2000, 1, 1.0, None, "clamp", "skip"),
    ("nnabla", 8.0, 2001, 1, None, None, "clamp", "retry"),
    ("chainer", 1.0, 1000, 1, 1.0, 65504.0, "clamp", "skip"),
])
def test_preset_values(preset, init, interval, hysteresis, floor, ceiling, on_floor, on_overflow):
    knobs = PRESETS[preset]
    assert (knobs["init_scale"], knobs["growth_interval"], knobs["hysteresis"], knobs["min_scale"],
            knobs["max_scale"], knobs["on_floor"], knobs["on_overflow"]) == (
        init, interval, hysteresis, floor, ceiling, on_floor, on_overflow)
    assert (knobs["growth_factor"], knobs["backoff_factor"]) == (2.0, 0.5)
    assert knobs["grow_every_step_until_overflow"] is (preset == "chainer")


def test_presets_are_read_only():
    with pytest.raises(TypeError):
        PRESETS["pytorch"]["init_scale"] = 1.0  # type: ignore[index]


# --- each peer's trajectory -------------------------------------------------------------------------------------------

def test_pytorch_grows_after_2000_clean_steps_halves_on_overflow_and_has_no_floor():
    p = dynamic("pytorch")
    assert p.scale == 2.0 ** 16
    clean(p, 1999)
    assert p.scale == 2.0 ** 16
    clean(p, 1)
    assert p.scale == 2.0 ** 17
    overflow(p, 2.0 ** 16)
    clean(p, 1999)
    overflow(p, 2.0 ** 15)  # the overflow restarts the count: no growth at 1999 clean steps
    clean(p, 2000)
    assert p.scale == 2.0 ** 16
    for k in range(1, 31):
        overflow(p, 2.0 ** (16 - k))
    assert p.scale == 2.0 ** -14


def test_apex_caps_the_scale_at_2_to_24():
    p = dynamic("apex")
    for k in range(1, 9):
        clean(p, 2000)
        assert p.scale == 2.0 ** (16 + k)
    clean(p, 2000)
    assert p.scale == 2.0 ** 24
    overflow(p, 2.0 ** 23)
    for k in range(1, 40):  # no floor
        overflow(p, 2.0 ** (23 - k))


def test_deepspeed_hysteresis_2_absorbs_one_overflow_until_the_next_growth():
    p = dynamic("deepspeed")
    overflow(p, 2.0 ** 16)          # first overflow: step skipped, scale kept
    assert p.hysteresis_left == 1
    clean(p, 500)
    overflow(p, 2.0 ** 15)          # not consecutive, still counts (consecutive_hysteresis false)
    overflow(p, 2.0 ** 14)          # hysteresis spent: every overflow halves until a growth
    clean(p, 999)
    assert p.scale == 2.0 ** 14
    clean(p, 1)
    assert p.scale == 2.0 ** 15     # grows after 1000 clean steps in a row and refills the hysteresis
    overflow(p, 2.0 ** 15)
    overflow(p, 2.0 ** 14)


def test_deepspeed_raises_at_the_floor():
    p = dynamic("deepspeed")
    overflow(p, 2.0 ** 16)
    for k in range(1, 17):
        overflow(p, 2.0 ** (16 - k))
    assert p.scale == 1.0
    with pytest.raises(LossScaleFloorError) as err:
        p.update(True)
    message = str(err.value)
    assert "scale 1" in message and "min_scale" in message and "on_floor: clamp" in message


def test_megatron_starts_at_2_to_32_and_clamps_at_1():
    p = dynamic("megatron")
    assert p.scale == 2.0 ** 32
    overflow(p, 2.0 ** 32)
    for k in range(1, 33):
        overflow(p, 2.0 ** (32 - k))
    overflow(p, 1.0)
    overflow(p, 1.0)
    clean(p, 1000)
    assert p.scale == 2.0


def test_mindspore_window_2000_and_floor_1():
    p = dynamic("mindspore")
    assert p.scale == 2.0 ** 24
    clean(p, 2000)
    assert p.scale == 2.0 ** 25
    for k in range(1, 26):
        overflow(p, 2.0 ** (25 - k))
    overflow(p, 1.0)


def test_nnabla_reruns_the_batch_up_to_100_times_then_skips():
    p = dynamic("nnabla")
    assert p.scale == 8.0
    for attempt in range(100):
        assert p.update(True, attempt=attempt) is RETRY
        assert p.scale == 8.0 * 0.5 ** (attempt + 1)
    assert p.update(True, attempt=100) is SKIP
    assert p.scale == 8.0 * 0.5 ** 101  # no floor
    assert (p.overflows, p.retries, p.skipped_steps) == (101, 100, 1)


def test_nnabla_grows_every_2001_clean_steps():
    p = dynamic("nnabla")
    clean(p, 2000)
    assert p.scale == 8.0
    clean(p, 1)
    assert p.scale == 16.0
    assert p.update(True) is RETRY
    assert p.update(False, attempt=1) is STEP
    clean(p, 1999)
    assert p.scale == 8.0
    clean(p, 1)
    assert p.scale == 16.0


def test_chainer_doubles_every_step_until_the_first_overflow_then_ramps_by_2_to_the_1_over_1000():
    p = dynamic("chainer")
    assert p.scale == 1.0
    for k in range(1, 16):
        clean(p, 1)
        assert p.scale == 2.0 ** k
    clean(p, 1)
    assert p.scale == 65504.0       # Chainer's _loss_scale_max, fp16's largest value
    clean(p, 5)
    assert p.scale == 65504.0
    overflow(p, 32752.0)
    multiplier = math.pow(2.0, 1.0 / 1000)  # what Chainer computes once in loss_scaling()
    expected = 32752.0
    for _ in range(1200):
        clean(p, 1)
        expected = max(1, min(65504, expected * multiplier))
        assert p.scale == expected
    assert p.scale == 65504.0


def test_chainer_early_overflow_ends_the_warm_start():
    p = dynamic("chainer")
    clean(p, 3)
    overflow(p, 4.0)
    clean(p, 1)
    assert p.scale == 4.0 * math.pow(2.0, 1.0 / 1000)
    for _ in range(10):
        p.update(True)
    assert p.scale == 1.0           # floor 1


# --- the same trajectories against transcriptions of each peer's own update code -------------------------------------

def ref_gradscaler(seq):
    """torch._amp_update_scale_ with GradScaler's defaults."""
    scale, tracker = 2.0 ** 16, 0
    for found_inf in seq:
        if found_inf:
            scale, tracker = scale * 0.5, 0
        else:
            tracker += 1
            if tracker == 2000:
                if math.isfinite(scale * 2.0):
                    scale *= 2.0
                tracker = 0
        yield scale, SKIP if found_inf else STEP


def ref_apex(seq):
    """apex.amp.scaler.LossScaler.update_scale, loss_scale="dynamic"."""
    loss_scale, unskipped, min_loss_scale, max_loss_scale = 2.0 ** 16, 0, None, 2.0 ** 24
    for has_overflow in seq:
        if has_overflow:
            loss_scale = max(min_loss_scale, loss_scale / 2.) if min_loss_scale else loss_scale / 2.
            unskipped = 0
        else:
            unskipped += 1
        if unskipped == 2000:
            loss_scale = min(max_loss_scale, loss_scale * 2.)
            unskipped = 0
        yield loss_scale, SKIP if has_overflow else STEP


def ref_deepspeed(seq):
    """deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler.update_scale with the fp16 config defaults."""
    cur_scale, cur_iter, last_overflow_iter = 2.0 ** 16, 0, -1
    scale_window, min_scale, delayed_shift, cur_hysteresis = 1000, 1, 2, 2
    for overflow_ in seq:
        if overflow_:
            if delayed_shift == 1 or cur_hysteresis == 1:
                if cur_scale == min_scale:
                    raise LossScaleFloorError("Current loss scale already at minimum")
                cur_scale = max(cur_scale / 2.0, min_scale)
            else:
                cur_hysteresis -= 1
            last_overflow_iter = cur_iter
        else:
            if (cur_iter - last_overflow_iter) % scale_window == 0:
                cur_hysteresis = delayed_shift
                cur_scale *= 2.0
        cur_iter += 1
        yield cur_scale, SKIP if overflow_ else STEP


def ref_megatron(seq):
    """megatron.core.optimizer.grad_scaler.DynamicGradScaler.update with Megatron's defaults."""
    scale, growth_tracker, hysteresis_tracker = 2.0 ** 32, 0, 2
    for found_inf in seq:
        if found_inf:
            growth_tracker = 0
            hysteresis_tracker -= 1
            if hysteresis_tracker <= 0:
                scale = max(scale * 0.5, 1.0)
        else:
            growth_tracker += 1
            if growth_tracker == 1000:
                growth_tracker, hysteresis_tracker = 0, 2
                scale *= 2.0
        yield scale, SKIP if found_inf else STEP


def ref_mindspore(seq):
    """mindspore.nn.DynamicLossScaleUpdateCell.construct with DynamicLossScaleManager's defaults."""
    loss_scale, cur_iter, last_overflow_iter, window = 2.0 ** 24, 1, 0, 2000
    for overflow_ in seq:
        on_overflow = max(loss_scale / 2, 1.0) if overflow_ else loss_scale
        should_inc = window <= cur_iter - last_overflow_iter
        if overflow_ or should_inc:
            last_overflow_iter = cur_iter
        loss_scale = on_overflow * 2 if should_inc and not overflow_ else on_overflow
        cur_iter += 1
        yield loss_scale, SKIP if overflow_ else STEP


def ref_chainer(seq):
    """chainer.Optimizer.update_loss_scale after loss_scaling(interval=1000)."""
    loss_scale, multiplier_, isnan_ever = 1.0, math.pow(2.0, 1.0 / 1000), False
    for isnan in seq:
        isnan_ever = isnan_ever or isnan
        multiplier = 0.5 if isnan else multiplier_ if isnan_ever else 2.0
        loss_scale = max(1, min(65504, loss_scale * multiplier))
        yield loss_scale, SKIP if isnan else STEP


def bursty_overflows(seed: int, n: int, p_first: float, p_again: float = 0.3) -> list[bool]:
    rng, seq = random.Random(seed), []
    for _ in range(n):
        seq.append(rng.random() < (p_again if seq and seq[-1] else p_first))
    return seq


def run(trajectory):
    out = []
    try:
        for item in trajectory:
            out.append(item)
    except LossScaleFloorError:
        out.append("floor")
    return out


def ours(preset, seq):
    p = dynamic(preset)
    for found in seq:
        yield p.update(found), p.scale


@pytest.mark.parametrize("preset, reference", [
    ("pytorch", ref_gradscaler), ("apex", ref_apex), ("deepspeed", ref_deepspeed), ("megatron", ref_megatron),
    ("mindspore", ref_mindspore), ("chainer", ref_chainer),
])
@pytest.mark.parametrize("seed, p_first", [(0, 1 / 3000), (1, 1 / 800), (2, 1 / 150), (3, 0.02)])
def test_preset_matches_a_transcription_of_the_peer(preset, reference, seed, p_first):
    seq = bursty_overflows(seed, 12000, p_first)
    expected = run(reference(seq))
    got = run((scale, action) for action, scale in ours(preset, seq))
    assert got == expected


def test_pytorch_preset_matches_gradscalers_own_update_kernel():
    torch = pytest.importorskip("torch")
    seq = bursty_overflows(7, 9000, 1 / 1500)
    scale = torch.full((), 2.0 ** 16)
    tracker = torch.zeros((), dtype=torch.int32)
    p = dynamic("pytorch")
    for found in seq:
        torch._amp_update_scale_(scale, tracker, torch.full((), float(found)), 2.0, 0.5, 2000)
        p.update(found)
        assert (p.scale, p.growth_tracker) == (scale.item(), tracker.item())


# --- knobs: overrides, validation, the other options ------------------------------------------------------------------

def test_explicit_fields_override_the_preset_and_unset_fields_keep_it():
    cfg = DynamicScalingConfig(preset="deepspeed", growth_interval=3, hysteresis=1, on_floor="clamp")
    knobs = resolve_dynamic(cfg)
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
    knobs = resolve_dynamic(DynamicScalingConfig(preset=preset))
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
    p = dynamic("pytorch", init_scale=1e308, growth_interval=1)
    clean(p, 3)
    assert p.scale == 1e308


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
    from adaloss_cli.config.loader import scaling_config
    p = build_policy(LossScalingConfig(method="adaptive"))
    assert [p.update(True, attempt=k) for k in range(4)] == [RETRY] * 3 + [SKIP]
    assert build_policy(scaling_config("adaptive", {})).update(True) is SKIP
    assert build_policy(scaling_config("adaptive", {"on_overflow": "retry"})).update(True) is RETRY


def test_build_policy_covers_every_method_and_rejects_others():
    for method in SCALING_METHODS:
        assert build_policy(LossScalingConfig(method=method)).method == method
    with pytest.raises(UserError, match=r"Choose between \[none, fixed, dynamic, adaptive\]"):
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
    assert p.state_dict() == {"method": "dynamic", "scale": 2.0 ** 32, "growth_tracker": 0, "hysteresis_left": 1,
                              "seen_overflow": True, "overflows": 1, "skipped_steps": 1, "retries": 0}


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
