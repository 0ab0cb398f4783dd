"""Learning-rate schedules as a pure function of the step, shared by every backend.

Being stateless, the schedule needs nothing in a checkpoint beyond the step counter.
"""

from __future__ import annotations

import bisect
import math

from adaloss_cli.config.schema import ScheduleConfig


def learning_rate(step: int, total_steps: int, base_lr: float, cfg: ScheduleConfig) -> float:
    """The learning rate for 0-based optimizer step ``step`` out of ``total_steps``.

    Linear warm-up from 0 over ``warmup_steps``, then constant, step (multiply by gamma at each milestone, given as
    fractions of training) or cosine (down to ``min_lr`` at the last step).
    """
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return base_lr * (step + 1) / cfg.warmup_steps
    if cfg.name == "constant":
        return base_lr
    if cfg.name == "step":
        boundaries = [round(m * total_steps) for m in cfg.milestones]
        return base_lr * cfg.gamma ** bisect.bisect_right(boundaries, step)
    if cfg.name == "cosine":
        span = max(total_steps - cfg.warmup_steps - 1, 1)
        progress = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
        return cfg.min_lr + (base_lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown learning-rate schedule {cfg.name!r}")
