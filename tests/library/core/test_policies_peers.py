"""Global loss-scale policies against their peers' own code: each dynamic preset's trajectory on random bursty
overflow sequences equals that of a transcription of the peer's update code (GradScaler, apex, DeepSpeed, Megatron,
MindSpore, Chainer), and the pytorch preset follows GradScaler's own update kernel."""

from __future__ import annotations

import math

import pytest

from adaloss.errors import LossScaleFloorError
from test_policies import SKIP, STEP, bursty_overflows, dynamic

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
