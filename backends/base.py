"""The interface every backend adapter implements.

The engine owns the loop, the schedule, the data order and every file; a backend only turns NumPy batches into one
optimizer step or one evaluation in its framework, and exposes its state for checkpoints.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, Sequence

import numpy as np

from adaloss.records import LayerRecord, LayerScale
from adaloss_cli.config.schema import ExperimentConfig

Batch = tuple[np.ndarray, np.ndarray]

@dataclass
class StepOutcome:
    """The result of one optimizer step (all micro-batches, all retries)."""
    loss: float
    overflow: bool
    skipped: bool
    scale: float
    retries: int = 0
    layers: list[LayerRecord] = field(default_factory=list)
    #: Recorded steps of adaptive scaling: every layer's scales after the step (``LossScaler.layer_scales``).
    layer_scales: list[LayerScale] = field(default_factory=list)


@dataclass
class EvalResult:
    """Mean loss and accuracy over a whole evaluation split.

    ``examples`` counts the predictions the means are over: the examples, or the token positions of a language
    model's sequences.
    """
    loss: float
    accuracy: float
    examples: int


class Backend(ABC):
    """A training framework behind one interface: build, step, evaluate, save and restore."""

    name: ClassVar[str]
    #: Set by the engine's test-only fault hook: make this step's loss NaN (see engine.FAULT_ENV).
    inject_nonfinite_loss: bool = False
    #: A line for the user before the first step when it will take long (compiling), or None.
    start_notice: str | None = None

    def __init__(self, config: ExperimentConfig, input_shape: tuple[int, ...], num_classes: int,
                 device: str) -> None:
        self.config = config
        self.input_shape = input_shape
        self.num_classes = num_classes
        self.device = device

    @staticmethod
    @abstractmethod
    def resolve_device(requested: str) -> str:
        """Turn 'auto'/'cpu'/'cuda' into the device to use; UserError if it is not available."""

    @abstractmethod
    def train_step(self, micro_batches: Sequence[Batch], lr: float, record: bool = False) -> StepOutcome:
        """Forward, backward (with loss scaling) and the optimizer step over the micro-batches of one step.

        ``record`` asks for per-layer records (scales and measured underflow) in the outcome.
        """

    @abstractmethod
    def evaluate(self, batches: Iterable[Batch]) -> EvalResult:
        """Loss and accuracy over the given batches, without touching training state."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue training exactly: model, optimizer, loss-scaling state, RNG."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    @abstractmethod
    def describe(self) -> str:
        """A short human-readable description of the model (and its scale points, when adaptive)."""

    def peak_memory_bytes(self) -> int | None:
        """Peak device memory used, where the framework reports it; None where it does not."""
        return None

    def final_scale(self) -> float:
        """The global loss scale at the end of training."""
        return float("nan")
