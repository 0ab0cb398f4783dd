"""Global loss-scale policies: every dynamic preset reproduces its peer's scale trajectory step by step (the presets
table, each peer's trajectory). Also the helpers the other test_policies_* files share: a preset's policy, clean
steps, an overflow, a bursty overflow sequence. The same trajectories against transcriptions of each peer's own update
code are in ``test_policies_peers.py``; knobs, the other methods and state_dict in ``test_policies_options.py``."""

from __future__ import annotations

import math
import random

import pytest

from adaloss.core.policies import DynamicScaling, StepAction, build_policy
from adaloss.core.presets import KNOBS, PRESETS
from adaloss.errors import LossScaleFloorError
from adaloss.options import DYNAMIC_PRESETS, DynamicScalingConfig, LossScalingConfig

STEP, SKIP, RETRY = StepAction.STEP, StepAction.SKIP, StepAction.RETRY


def dynamic(preset: str, **overrides) -> DynamicScaling:
    return build_policy(LossScalingConfig(method="dynamic", dynamic=DynamicScalingConfig(preset=preset, **overrides)))


def clean(policy, n: int) -> None:
    for _ in range(n):
        assert policy.update(False) is STEP


def overflow(policy, expected_scale: float, action: StepAction = SKIP) -> None:
    assert policy.update(True) is action
    assert policy.scale == expected_scale


def bursty_overflows(seed: int, n: int, p_first: float, p_again: float = 0.3) -> list[bool]:
    rng, seq = random.Random(seed), []
    for _ in range(n):
        seq.append(rng.random() < (p_again if seq and seq[-1] else p_first))
    return seq


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
