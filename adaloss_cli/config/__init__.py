"""The experiment config: the schema (frozen dataclasses, its ``loss_scaling`` section the library's own options)
and the loader that validates YAML into it."""

from .loader import load_config, load_config_dict
from .problems import ConfigError, Problem
from .schema import (
    DataConfig,
    ExperimentConfig,
    ModelConfig,
    OptimizerConfig,
    OutputConfig,
    PrecisionConfig,
    RunConfig,
    ScheduleConfig,
    TrainingConfig,
)

__all__ = [
    "ConfigError",
    "DataConfig",
    "ExperimentConfig",
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
