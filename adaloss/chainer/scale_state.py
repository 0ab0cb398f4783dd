"""The state of one adaptively scaled Chainer model: the scale table and the per-point factors and measurements,
as NumPy or CuPy float32 arrays on the model's device (the scale points in ``scale_points.py`` read and write it)."""

from __future__ import annotations

from typing import Any

import numpy as np

from adaloss.options import AdaptiveScalingConfig
from adaloss.core.scale_schedule import ScaleSchedule

from .compat import import_chainer

chainer = import_chainer()

__all__ = ["ScaleState"]


class ScaleState(ScaleSchedule):
    """Shared state of one transformed model: the scale table and the per-point factors and measurements.

    ``options`` None means measure-only: every factor is 1 and the table holds the global loss scale everywhere
    (used to measure underflow for the none/fixed/dynamic methods). Arrays live in ``xp`` (numpy or cupy), float32.
    When the scale points recompute what is :class:`~adaloss.core.scale_schedule.ScaleSchedule`'s decision.
    """

    def __init__(self, xp: Any, num_slots: int, num_points: int, options: AdaptiveScalingConfig | None,
                 init_scale: float, origin_slot: int) -> None:
        self.xp = xp
        self.init_schedule(options)
        self.origin_slot = origin_slot
        self.call_order: list[int] = []   # scale points in the order the forward first called them
        self._called: set[int] = set()
        self.table = xp.full((num_slots,), init_scale, dtype=np.float32)
        size = (max(num_points, 1),)
        self.unbound = xp.ones(size, dtype=np.float32)
        self.factor = xp.ones(size, dtype=np.float32)
        self.weight_unbound = xp.full(size, np.inf, dtype=np.float32)
        self.weight_factor = xp.ones(size, dtype=np.float32)
        self.weight_scale = xp.full(size, init_scale, dtype=np.float32)
        self.underflow = xp.full((max(num_points, 1),), np.nan, dtype=np.float32)
        self.output_factor = xp.ones((), dtype=np.float32)
        self.output_underflow = xp.full((), np.nan, dtype=np.float32)
        self.output_used = False
        self.branch_common: dict[int, Any] = {}  # per branch point: its common scale, reused between refreshes

    def branch_cache(self, index: int) -> Any:
        """The 0-d array holding branch ``index``'s common scale."""
        if index not in self.branch_common:
            self.branch_common[index] = self.xp.ones((), dtype=np.float32)
        return self.branch_common[index]

    @property
    def measuring(self) -> bool:
        """Whether this pass measures layer input gradients (the reference pass or a recorded pass)."""
        return self.recording or self.reference_pass

    def called(self, index: int) -> None:
        """Note that scale point ``index`` ran (records are listed in forward order)."""
        if index not in self._called:
            self._called.add(index)
            self.call_order.append(index)

    def set_loss_scale(self, scale: float) -> None:
        """The loss scale at the origin (slot 0); measure-only: the scale of every edge."""
        if self.adaptive:
            self.table[0] = scale
        else:
            self.table[...] = scale
        self.note_origin_scale(scale)

    def to_device(self, xp: Any, put: Any) -> None:
        """Move every array with ``put`` (a function array -> array on the new device)."""
        self.xp = xp
        for name in ("table", "unbound", "factor", "weight_unbound", "weight_factor", "weight_scale", "underflow",
                     "output_factor", "output_underflow"):
            setattr(self, name, put(getattr(self, name)))
        self.branch_common = {i: put(a) for i, a in self.branch_common.items()}

    def state_dict_values(self) -> dict[str, Any]:
        """The per-layer state a checkpoint must hold (as NumPy arrays) and the iteration counter."""
        host = chainer.backend.CpuDevice().send
        return {"iteration": self.iteration, "headroom": self.headroom, "table": np.array(host(self.table)),
                **{name: np.array(host(getattr(self, name))) for name in _POINT_ARRAYS},
                "output_factor": np.array(host(self.output_factor)),
                "branch_common": {i: np.array(host(a)) for i, a in self.branch_common.items()}}

    def load_state_values(self, values: dict[str, Any]) -> None:
        """Restore :meth:`state_dict_values` (shapes must match: the same model)."""
        self.iteration = int(values["iteration"])
        self.headroom = float(values.get("headroom", 1.0))
        for name in ("table", *_POINT_ARRAYS):
            if name not in values:  # a checkpoint from before the weight gradient's own factor
                continue
            target = getattr(self, name)
            source = np.asarray(values[name], dtype=np.float32)
            if source.shape != target.shape:
                raise ValueError(f"loss-scaler state '{name}' has shape {source.shape}, this model needs "
                                 f"{target.shape}: the checkpoint is from another model")
            target[...] = self.xp.asarray(source)
        # Reused between refreshes (update_per_n_iteration), so a resume mid-interval needs them too.
        if "output_factor" in values:
            self.output_factor[...] = self.xp.asarray(np.asarray(values["output_factor"], dtype=np.float32))
        for index, common in values.get("branch_common", {}).items():
            self.branch_cache(int(index))[...] = self.xp.asarray(np.asarray(common, dtype=np.float32))
        self.mark_stale()


#: Per-point arrays of the state, after the table (see ScaleSchedule.scale_arrays).
_POINT_ARRAYS = ("unbound", "factor", "weight_unbound", "weight_factor", "weight_scale")
