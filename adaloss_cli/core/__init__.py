"""Framework-free core: the loss-scale policies and (in other modules) the per-layer adaptive factor math."""

from adaloss_cli.core.policies import (AdaptiveGlobal, DynamicScaling, FixedScaling, NoScaling, ScalePolicy,
                                       StepAction, build_policy)
from adaloss_cli.core.presets import (CONFIG_KNOBS, KNOBS, PRESETS, dynamic_problems, preset_knobs,
                                      resolve_dynamic)

__all__ = [
    # global loss-scale policies (policies.py, presets.py)
    "StepAction", "ScalePolicy", "NoScaling", "FixedScaling", "DynamicScaling", "AdaptiveGlobal", "build_policy",
    "KNOBS", "CONFIG_KNOBS", "PRESETS", "preset_knobs", "resolve_dynamic", "dynamic_problems",
]
