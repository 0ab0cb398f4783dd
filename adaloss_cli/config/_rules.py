"""Rules that involve more than one key, checked after every key passed on its own.

Each rule reads the flat map of valid values (``"training.optimizer.lr" -> 0.05``); a key that failed its own check
is absent, and rules that need it are skipped, so one mistake is never reported twice.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from ._messages import show
from .problems import ProblemCollector

Values = Mapping[str, Any]

DATASETS_WITH_ROOT = ("cifar10", "cifar100", "mnist")


def check_rules(values: Values, collector: ProblemCollector) -> None:
    """Run every cross-key rule, adding what fails to ``collector``."""
    for rule in RULES:
        rule(values, collector)


def _nesterov_needs_momentum(values: Values, collector: ProblemCollector) -> None:
    momentum = values.get("training.optimizer.momentum")
    if values.get("training.optimizer.nesterov") is True and momentum == 0:
        collector.add("training.optimizer.nesterov",
                      "got true while training.optimizer.momentum is 0; nesterov needs momentum > 0 "
                      "(set momentum, or nesterov: false)")


def _betas_below_one(values: Values, collector: ProblemCollector) -> None:
    for i, beta in enumerate(values.get("training.optimizer.betas") or ()):
        if not 0.0 <= beta < 1.0:
            collector.add(f"training.optimizer.betas[{i}]", f"got {show(beta)}; must be a number >= 0 and < 1")


def _milestones_are_increasing_fractions(values: Values, collector: ProblemCollector) -> None:
    milestones = values.get("training.lr_schedule.milestones") or ()
    for i, milestone in enumerate(milestones):
        key = f"training.lr_schedule.milestones[{i}]"
        if not 0.0 < milestone < 1.0:
            collector.add(key, f"got {show(milestone)}; must be a fraction of training, > 0 and < 1")
        elif i > 0 and milestone <= milestones[i - 1]:
            collector.add(key, f"got {show(milestone)} after {show(milestones[i - 1])}; "
                               "milestones must be strictly increasing")


def _dataset_root_given(values: Values, collector: ProblemCollector) -> None:
    name = values.get("data.name")
    if name in DATASETS_WITH_ROOT and "data.root" in values and not values["data.root"]:
        # Point at data.root when the file has it (as null), else at the data.name that asks for it.
        written = "data.root" in collector.lines or collector.from_override("data.root")
        collector.add("data.root", f"got {show(values['data.root'])}; must be the folder holding the {name} files "
                                   f"when data.name is {name}", at="data.root" if written else "data.name")


def _ordered(low_key: str, high_key: str, strict: bool) -> Callable[[Values, ProblemCollector], None]:
    """A rule: when both keys are set, ``low_key`` must be below (``strict``) or at most ``high_key``."""
    def rule(values: Values, collector: ProblemCollector) -> None:
        low, high = values.get(low_key), values.get(high_key)
        if low is None or high is None or low < high or (low == high and not strict):
            return
        relation = "<" if strict else "<="
        collector.add(low_key, f"got {show(low)} with {high_key.rsplit('.', 1)[-1]} {show(high)}; "
                               f"must be {relation} {high_key}")
    rule.__name__ = f"_{low_key}_below_{high_key}"
    return rule


RULES: tuple[Callable[[Values, ProblemCollector], None], ...] = (
    _nesterov_needs_momentum,
    _betas_below_one,
    _milestones_are_increasing_fractions,
    _dataset_root_given,
    _ordered("loss_scaling.dynamic.min_scale", "loss_scaling.dynamic.max_scale", strict=False),
    _ordered("loss_scaling.adaptive.u_min", "loss_scaling.adaptive.u_max", strict=True),
)
