"""The experiment config: the schema (frozen dataclasses) and the loader that validates YAML into it."""

from .loader import load_config, load_config_dict
from .problems import ConfigError, Problem
from .schema import (
    AdaptiveScalingConfig,
    DataConfig,
    DynamicScalingConfig,
    ExperimentConfig,
    FixedScalingConfig,
    LossScalingConfig,
    ModelConfig,
    OptimizerConfig,
    OutputConfig,
    PrecisionConfig,
    RunConfig,
    ScheduleConfig,
    TrainingConfig,
)

__all__ = [
    "AdaptiveScalingConfig",
    "ConfigError",
    "DataConfig",
    "DynamicScalingConfig",
    "ExperimentConfig",
    "FixedScalingConfig",
    "LossScalingConfig",
    "ModelConfig",
    "OptimizerConfig",
    "OutputConfig",
    "PrecisionConfig",
    "Problem",
    "RunConfig",
    "ScheduleConfig",
    "TrainingConfig",
    "load_config",
    "load_config_dict",
]
