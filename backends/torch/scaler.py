"""``LossScaler``: loss scaling for a PyTorch training loop, shaped like ``torch.amp.GradScaler``.

Every adaloss method (none, fixed, dynamic, adaptive) sits behind the same calls, so switching method is one
argument::

    scaler = LossScaler(model, "adaptive")       # adaptive: the model is transformed in place
    with torch.autocast("cuda", torch.float16):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    stepped = scaler.step(optimizer)              # False when the step was skipped (overflow)
    scaler.update()

Unscaling and the overflow check use torch's fused multi-tensor kernel; the only device-to-host read per step is
the skip decision in :meth:`step`. With ``process_group`` (data-parallel training), the overflow flag and the loss
are all-reduced before that read, so every process takes the same decision and logs the same loss.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Any, Callable

import torch
from torch import nn

from adaloss_cli.backends.base import LayerRecord
from adaloss_cli.config.loader import scaling_config
from adaloss_cli.config.schema import LossScalingConfig
from adaloss_cli.core.adaptive import AdaptiveOptions
from adaloss_cli.core.policies import ScalePolicy, StepAction, build_policy

from .capture import compiled, install
from .graph_transform import TransformError
from .recording import describe_points, layer_records, run_reference_pass
from .scale_state import ScaleState


def _device_of(model: nn.Module) -> torch.device:
    first = next(iter(model.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


class LossScaler:
    """Loss scaling for one model and optimizer, with the call pattern of ``torch.amp.GradScaler``.

    Args:
        model: the model to train, with float32 parameters. For ``adaptive`` it is transformed in place (its forward
            is captured with torch.compile and rewritten so that every layer's backward carries a scale of its own;
            its parameters, ``state_dict`` and any optimizer stay as they are); ``scaler.model`` is ``model``.
        method: ``none``, ``fixed``, ``dynamic`` or ``adaptive``.
        config: a validated ``LossScalingConfig`` (as the trainer passes); otherwise ``options`` are the keys of
            the method's config section, e.g. ``scale=128`` for fixed, ``preset="deepspeed"`` for dynamic,
            ``loss_scale_method="abs_range"`` for adaptive.
        enabled: False makes every call a pass-through (``scale`` returns the loss, ``step`` calls
            ``optimizer.step()``), as ``GradScaler(enabled=False)``: call sites need no ``if``.
        fused: adaptive only: run each layer's refresh (statistics and factor math) as one torch.compile'd
            function, a few fused kernels instead of dozens of tiny ones (see ``ScaleState.use_fused_refresh``
            for why it is off by default). On CPU the factor math runs on host scalars either way.
        compile: run the model compiled by torch.compile's Inductor. Adaptive: refresh steps and steps between
            refreshes each run as one compiled forward and backward, with no Python per layer (see
            ``compiled_steps.py``). Other methods: ``model.compile()``. Each input shape compiles at its first
            step of each kind: seconds to minutes.
        process_group: with data-parallel training (e.g. ``torch.distributed.group.WORLD``), the group whose
            processes must agree on skipping a step: the overflow flag is all-reduced and the loss given to
            :meth:`step` averaged, in one collective before the step's single host read. Adaptive scales stay per
            process: every parameter gradient leaves backward unscaled, so DistributedDataParallel averages true
            gradients whatever scales each process chose.
    """

    def __init__(self, model: nn.Module, method: str = "dynamic", *, config: LossScalingConfig | None = None,
                 enabled: bool = True, process_group: Any = None, fused: bool = False, compile: bool = False,
                 **options: Any) -> None:
        self.config = config if config is not None else scaling_config(method, options)
        self.method = self.config.method
        self.policy: ScalePolicy = build_policy(self.config)
        self.model = model
        self.enabled = bool(enabled)
        self.process_group = process_group
        self.state: ScaleState | None = None
        self._measuring: Any = None
        self._measuring_state: ScaleState | None = None
        self.stepped = False
        if self.method == "adaptive" and self.enabled:
            device = _device_of(model)
            self.state = ScaleState(AdaptiveOptions.from_config(self.config.adaptive), self.policy.scale, device)
            self.state.use_fused_refresh(fused)
            self.state.compile_steps = bool(compile)
            install(model, self.state)
        elif compile:
            model.compile()  # in place, as the adaptive model's capture: the module and its parameters stay
        self._found_inf: torch.Tensor | None = None
        self._model_ids: frozenset[int] | None = None
        self._attempt = 0
        self.last_action: StepAction | None = None
        self.last_loss: float | None = None
        self.found_overflow = False

    # -- precision -----------------------------------------------------------------------------------------------------

    def set_pure_dtype(self, dtype: torch.dtype | None) -> None:
        """The pure low-precision mode (no autocast): the transformed graph casts floating inputs and parameters to
        ``dtype`` itself (normalisation parameters stay float32). Only adaptive and measuring graphs use it."""
        for state in (self.state, self._measuring_state):
            if state is not None:
                state.pure_dtype = dtype
        self._pure_dtype = dtype

    # -- the GradScaler calls -------------------------------------------------------------------------------------------

    def get_scale(self) -> float:
        """The global loss scale the next backward will use (1.0 when disabled)."""
        return float(self.policy.scale) if self.enabled else 1.0

    def scale(self, outputs: Any) -> Any:
        """Multiply the loss (or each tensor of a list or tuple of them) by the loss scale before ``backward()``."""
        scale = self.policy.scale
        if not self.enabled or scale == 1.0:
            return outputs
        if isinstance(outputs, torch.Tensor):
            return outputs * scale
        return type(outputs)(self.scale(o) for o in outputs)

    def is_enabled(self) -> bool:
        """Whether the scaler does anything (``enabled`` at construction)."""
        return self.enabled

    def get_growth_factor(self) -> float:
        """What the scale (dynamic) or the headroom (adaptive) grows by after growth_interval clean steps; 1.0
        for methods that never grow."""
        return float(getattr(self.policy, "growth_factor", 1.0))

    def set_growth_factor(self, new_factor: float) -> None:
        """Set :meth:`get_growth_factor` (dynamic and adaptive only)."""
        self._set_knob("growth_factor", float(new_factor))

    def get_backoff_factor(self) -> float:
        """What the scale (dynamic) or the headroom (adaptive) is multiplied by on an overflow; 1.0 for methods
        that never back off."""
        return float(getattr(self.policy, "backoff_factor", 1.0))

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set :meth:`get_backoff_factor` (dynamic and adaptive only)."""
        self._set_knob("backoff_factor", float(new_factor))

    def get_growth_interval(self) -> int:
        """Clean steps in a row before the scale or headroom grows (0 for methods that never grow)."""
        return int(getattr(self.policy, "growth_interval", 0))

    def set_growth_interval(self, new_interval: int) -> None:
        """Set :meth:`get_growth_interval` (dynamic and adaptive only)."""
        self._set_knob("growth_interval", int(new_interval))

    def _set_knob(self, name: str, value: Any) -> None:
        if not hasattr(self.policy, name):
            raise ValueError(f"loss-scaling method {self.method!r} has no {name}; it applies to dynamic and "
                             "adaptive")
        setattr(self.policy, name, value)

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last :meth:`step` skipped the optimizer step (an overflow)."""
        return not self.stepped

    def _grad_divisor(self, p: torch.Tensor) -> float:
        """What ``p``'s gradient is divided by after backward: adaptive scaling leaves its model's parameter
        gradients unscaled; any other gradient carries the loss scale."""
        if self.method == "adaptive" and id(p) in self._model_parameter_ids():
            return 1.0
        return self.policy.scale

    def _model_parameter_ids(self) -> frozenset[int]:
        if self._model_ids is None:
            self._model_ids = frozenset(id(p) for p in self.model.parameters())
        return self._model_ids

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the loss scale in place and note whether any is not finite.

        Call it before gradient clipping so that clipping sees true gradients; :meth:`step` calls it otherwise.
        """
        if self._found_inf is not None or not self.enabled:
            return
        if self.state is not None:
            self.state.settle()  # a compiled refresh's values, before anything reads the state
        self._check_adaptive_ran(optimizer)
        grads: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    grads[(p.grad.device, p.grad.dtype, self._grad_divisor(p))].append(p.grad)
        # One flag per device, shared by its groups: the kernel only ever writes 1.0 into it, so the flag stays
        # 0 or 1, which is what a fused optimizer's skip needs (it skips on exactly 1.0; a sum of two groups' flags
        # would make it apply a step of NaN gradients). It is 0-d, the shape fused Adam's step counter takes.
        flags: dict[torch.device, torch.Tensor] = {}
        for (device, _, divisor), tensors in grads.items():
            flag = flags.setdefault(device, torch.zeros((), dtype=torch.float32, device=device))
            inv = torch.full((), 1.0 / divisor, dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, inv)
        found, *others = list(flags.values()) or [torch.zeros((), dtype=torch.float32)]
        for flag in others:  # (a model split over devices)
            found = torch.maximum(found, flag.to(found.device))
        self._found_inf = found

    def _check_adaptive_ran(self, optimizer: torch.optim.Optimizer) -> None:
        """Adaptive scaling must have run in this step's backward, or the gradients were never scaled: say so
        instead of training silently without it."""
        state = self.state
        if state is None or state.backward_passes or state.reference_pass:
            return
        ids = self._model_parameter_ids()
        if any(p.grad is not None and id(p) in ids for g in optimizer.param_groups for p in g["params"]):
            raise RuntimeError(
                "adaloss: adaptive loss scaling did not run in this backward although the model has gradients. "
                "The forward did not go through the transformed model: call the model itself (model(x)), not "
                "model.forward(x) or a copy of it, and do not torch.compile or replace it after building the "
                "LossScaler (if torch.compile reached its recompile limit, raise torch._dynamo.config.recompile_limit)")

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, loss: torch.Tensor | None = None,
             **kwargs: Any) -> Any:
        """``optimizer.step(*args, **kwargs)`` unless a gradient overflowed, as ``GradScaler.step``: returns what
        the optimizer returned, or None when the step was skipped (:attr:`stepped` says which).

        ``loss`` (optional, keyword) is read back in the same device-to-host transfer as the overflow flag and kept
        in ``last_loss``, so logging the loss costs no extra synchronisation; so are, after a refresh on a device,
        the adaptive factors the steps until the next refresh apply. After an overflow, ``last_action``
        says whether the policy wants the step skipped or the same batch retried with the new scale.
        """
        if not self.enabled:
            self.stepped = True
            return optimizer.step(*args, **kwargs)
        self.unscale_(optimizer)
        values = self._found_inf.reshape(1).float()
        if loss is not None:
            values = torch.cat([values, loss.detach().reshape(1).float().to(values.device)])
        if self.process_group is not None:
            values = self._all_reduce(values)
        mirror = self.state.mirror_request() if self.state is not None else None
        if mirror is not None:  # the factors of the steps until the next refresh, in the same read
            values = torch.cat([values, mirror.to(values.device)])
        found, *rest = values.tolist()
        if mirror is not None:
            self.state.receive_mirror(rest[len(rest) - mirror.numel():])
            del rest[len(rest) - mirror.numel():]
        if rest:
            self.last_loss = rest[0]
        self.found_overflow = bool(found)
        self.last_action = self.policy.update(self.found_overflow, self._attempt)
        self.stepped = self.last_action is StepAction.STEP
        return optimizer.step(*args, **kwargs) if self.stepped else None

    def unscale_on_device(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """:meth:`unscale_` without any host read, for a step captured in a CUDA graph (``graphs.GraphedStep``):
        returns the overflow flag, 0.0 or 1.0, as a 0-d float32 device tensor, for a fused optimizer to skip on."""
        if not self.enabled:
            device = next(p.device for g in optimizer.param_groups for p in g["params"])
            return torch.zeros((), dtype=torch.float32, device=device)
        self._found_inf = None  # a new step: a capture that raised may have left one
        self.unscale_(optimizer)
        return self._found_inf

    @property
    def steps_on_overflow(self) -> bool:
        """Whether an overflowing step is applied anyway (fixed scaling with ``skip_on_overflow: false``, or a
        disabled scaler); every other policy skips or retries it."""
        return not self.enabled or getattr(self.policy, "skip_on_overflow", True) is False

    def finish_device_step(self, found_overflow: bool, loss: float | None = None) -> None:
        """After a step whose optimizer applied the skip itself on the device (:meth:`unscale_on_device`): the
        policy's decision from the flag read back, then :meth:`update`. The two agree: the optimizer was given the
        flag exactly when the policy never steps on an overflow (see :attr:`steps_on_overflow`)."""
        self.last_loss = loss
        self.found_overflow = bool(found_overflow)
        self.last_action = self.policy.update(self.found_overflow, self._attempt) if self.enabled else StepAction.STEP
        self.stepped = self.last_action is StepAction.STEP
        self.update()

    def _all_reduce(self, values: torch.Tensor) -> torch.Tensor:
        """[overflow flag, loss?] over the process group in one collective: the flags are 0 or positive, so their
        sum is non-zero exactly when their maximum is (any process overflowed); the loss becomes the mean."""
        import torch.distributed as dist

        dist.all_reduce(values, group=self.process_group)
        values[1:] /= dist.get_world_size(self.process_group)
        return values

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Finish the iteration: the next ``backward`` starts a new step (or the retry of this one). ``new_scale``
        sets the loss scale from now on, as in ``GradScaler.update``."""
        if not self.enabled:
            return
        if new_scale is not None:
            self.policy.set_scale(float(new_scale))
        retry = self.last_action is StepAction.RETRY
        self._attempt = self._attempt + 1 if retry else 0
        self._found_inf = None
        for state in (self.state, self._measuring_state):
            if state is not None:
                state.finish_iteration(retry)
                state.backward_passes = 0
        if self.state is not None:
            self.state.set_headroom(self.policy.headroom)  # type: ignore[attr-defined]

    @property
    def should_retry(self) -> bool:
        """Whether the last step asked to re-run the same batch (retry on overflow)."""
        return self.last_action is StepAction.RETRY

    # -- per-layer view: scale points, recording, underflow -------------------------------------------------------

    def _active_state(self) -> ScaleState | None:
        return self.state if self.method == "adaptive" else self._measuring_state

    def measuring_model(self) -> Callable[..., Any] | None:
        """What to run a recorded step with: the adaptive model, or a measure-only transform of ``model`` (same
        parameters, all factors 1); None, with a warning, when the model cannot be captured."""
        if self.method == "adaptive":
            return self.model
        if self._measuring is None:
            self._measuring_state = ScaleState(None, self.policy.scale, _device_of(self.model))
            self._measuring_state.pure_dtype = getattr(self, "_pure_dtype", None)
            self._measuring = compiled(self.model, self._measuring_state)
        return self._measuring or None

    def start_recording(self, reference_loss: Callable[[Any], tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """Record per-layer factors and underflow during the next backward; returns the model to run it with.

        ``reference_loss(model)`` must run the same batch through ``model`` in float32 and return ``(loss, input)``
        with ``input`` requiring grad. It runs first, unscaled, to get every scale point's true input gradient;
        RNG and buffers (batch-norm statistics) are restored afterwards, so the recorded step itself is unchanged.
        Underflow is then the share of each layer's input gradient lost to underflow (see ``points.py``).
        """
        model = self.measuring_model()
        state = self._active_state()
        if model is None or state is None:
            return self.model
        try:
            run_reference_pass(self.model, model, state, reference_loss)
        except TransformError as err:
            if self.method == "adaptive":
                raise
            warnings.warn(f"underflow is not measured: {err}", stacklevel=2)
            self._measuring = False
            return self.model
        if self.method != "adaptive":
            state.set_loss_scale(self.policy.scale)
        return model

    def layer_records(self) -> list[LayerRecord]:
        """What each scale point did in the last recorded backward (one device-to-host read for all layers).

        The first records are the model outputs (``output``), where the float32 loss gradient is cast to the
        model's dtype; then every scale point by name, in the order the forward first called them."""
        state = self._active_state()
        return layer_records(state) if state is not None else []

    def describe(self) -> str:
        """The adaptive scale points as a table (name, operation, fan); they are found when the model first runs."""
        return describe_points(self.state) if self.state is not None else ""

    # -- state -----------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume scaling exactly."""
        state: dict[str, Any] = {"method": self.method, "policy": self.policy.state_dict()}
        if self.state is not None:
            state["layers"] = self.state.state_dict_values()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; refuses state saved for another method."""
        state = state_dict
        if state.get("method") != self.method:
            raise ValueError(f"loss-scaler state is for method {state.get('method')!r}, not {self.method!r}")
        self.policy.load_state_dict(state["policy"])
        if self.state is not None and "layers" in state:
            self.state.load_state_values(state["layers"])
            self.state.set_headroom(self.policy.headroom)  # type: ignore[attr-defined]
