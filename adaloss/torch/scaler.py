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

import functools
import inspect
import warnings
from collections import defaultdict
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Mapping

import torch
from torch import nn

from adaloss.records import LayerRecord, LayerScale
from adaloss.scalars import scaling_scalars, write_scalars
from adaloss.options import LossScalingConfig, scaling_options
from adaloss.core.policies import ScalePolicy, StepAction, build_policy

from .capture import compiled, install, sharded_pieces
from .modes.default import DefaultMode
from adaloss.errors import TransformError
from .recording import describe_points, layer_records, run_reference_pass
from .scale_state import ScaleState


def _device_of(model: nn.Module) -> torch.device:
    first = next(iter(model.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


@functools.lru_cache(maxsize=64)
def _takes_grad_scaler(step: Callable[..., Any]) -> bool:
    """Whether an optimizer's step function has GradScaler's deprecated ``grad_scaler`` keyword."""
    try:
        return "grad_scaler" in inspect.signature(step).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


class _Stage(Enum):
    """Where one optimizer is in the current iteration (GradScaler's ``OptState``)."""
    READY = "ready"          # nothing done yet
    UNSCALED = "unscaled"    # unscale_ divided its gradients and noted the overflow flag
    CHECKED = "checked"      # step checked its gradients and left the dividing to the optimizer (AMP protocol)
    STEPPED = "stepped"      # step ran (or skipped) it


@dataclass
class _OptimizerRecord:
    """One optimizer's iteration: its stage, its overflow flag on the device, and that flag read back."""
    stage: _Stage = _Stage.READY
    found_inf: torch.Tensor | None = None
    found: bool | None = None


class LossScaler:
    """Loss scaling for a PyTorch training loop, with the calls of ``torch.amp.GradScaler``.

    Args:
        model: the model to train, with float32 parameters. For ``adaptive`` it is transformed in place (its forward
            is captured with torch.compile and rewritten so that every layer's backward carries a scale of its own;
            its parameters, ``state_dict`` and any optimizer stay as they are); ``scaler.model`` is ``model``. The
            other methods only use it for ``compile`` and the per-layer records of the trainer, and take None.
        method: ``none``, ``fixed``, ``dynamic`` or ``adaptive``.
        config: a validated ``LossScalingConfig`` (as the trainer passes); otherwise ``options`` are the keys of
            the method's config section, e.g. ``scale=128`` for fixed, ``preset="deepspeed"`` or ``init_scale``,
            ``growth_factor``, ``backoff_factor``, ``growth_interval``, ``max_scale`` for dynamic,
            ``loss_scale_method="abs_range"`` for adaptive.
        enabled: False makes every call a pass-through (``scale`` returns the loss, ``step`` calls
            ``optimizer.step()``), as ``GradScaler(enabled=False)``: call sites need no ``if``.
        compile: run the model compiled by torch.compile's Inductor. Adaptive: refresh steps and steps between
            refreshes each run as one compiled forward and backward, with no Python per layer (see
            ``modes/compiled.py``). Other methods: ``model.compile()``. Each input shape compiles at its first
            step of each kind: seconds to minutes. None (the default): adaptive scaling of a model on a CUDA
            device runs compiled steps (eager ones, with a warning, where Triton is missing, and without one for
            a model sharded with FSDP2 or with a ``process_group``), every other case eager steps (on a CPU
            compiling costs seconds, and the digits MLP's eager step is as fast as its compiled one); the other
            methods leave the model as it is. ``"regional"`` (adaptive): compiled steps in which Inductor
            compiles each group of identical repeated blocks (``modes/regional.py``) once, inside the whole
            graph: the same factors and gradients, and for a Transformer a compile that hardly grows with its
            depth (Inductor's part of a 12-block GPT's first step 15 s against 40 s, measured on a CPU), for
            about 5% more kernels per step (they cannot fuse across a block's boundary); on ResNet-50 a tenth
            less compiling, 17% more kernels.
        compile_options: Inductor options for what ``compile`` compiles (the names of ``torch.compile(options=...)``,
            keys of ``torch._inductor.config``), on top of adaloss's own for the adaptive steps (combo kernels).
            E.g. ``{"triton.cudagraphs": True}``: Inductor's CUDA graphs, which on an H200 took the nanoGPT's
            adaptive step from 1.29x an eager GradScaler step to 0.72-0.83x (0.57x with statistics every 100 steps)
            by removing its kernel launches; as with ``torch.compile``, a tensor the model returned is then
            overwritten by a later step (read it, or clone it, before the next forward). With ``compile=None``
            they apply where the default compiles (adaptive scaling on a CUDA device). Checked here; refused with
            ``compile=False``, and where nothing would compile (another method without ``compile=True``, a
            ``process_group`` without it).
        process_group: with data-parallel training (e.g. ``torch.distributed.group.WORLD``), the group whose
            processes must agree on skipping a step: the overflow flag is all-reduced and the loss given to
            :meth:`step` averaged, in one collective before the step's single host read. Adaptive scales stay per
            process: every parameter gradient leaves backward unscaled, so DistributedDataParallel averages true
            gradients whatever scales each process chose.

    As with GradScaler, one scaler serves several losses and optimizers per iteration (``scale(loss).backward()``
    for each loss, ``step(optimizer)`` for each optimizer, then ``update()`` once); an adaptive scaler transforms
    one model, so give each model trained with adaptive scaling its own scaler (models chained in one loss, a
    GAN's generator and critic, must then keep the same ``init_scale``: each model's input gradient leaves it at
    that scale). What adaptive scaling cannot do right it refuses by name: differentiating through its model twice
    (``create_graph=True``, a gradient penalty) and pickling (save :meth:`state_dict` instead).
    """

    def __init__(self, model: nn.Module | None, method: str = "dynamic", *, config: LossScalingConfig | None = None,
                 enabled: bool = True, process_group: Any = None, compile: bool | str | None = None,
                 compile_options: Mapping[str, Any] | None = None, **options: Any) -> None:
        if "fused" in options:
            raise TypeError("LossScaler(fused=...) was retired: the per-point compiled refresh was no faster than "
                            "the plain device path (2.9x against 2.7x a GradScaler step on ResNet-50, H200) and 30x "
                            "slower when Inductor tuned it on small shapes. compile=True compiles whole steps")
        if isinstance(compile, str) and compile != "regional":
            raise ValueError(f"LossScaler(compile={compile!r}): choose True, False, None (the default: compiled "
                             "on CUDA) or 'regional' (identical repeated blocks compiled once)")
        if compile_options is not None:
            if compile is False:
                raise ValueError("LossScaler(compile=False, compile_options=...): options for the compiler need "
                                 "compiling; drop compile=False, or the options")
            from .modes.compiled import check_inductor_options
            compile_options = check_inductor_options(compile_options, "LossScaler(compile_options=...)")
        self.config = config if config is not None else scaling_options(method, options)
        self.method = self.config.method
        if compile_options is not None and self.method != "adaptive" and not compile:
            raise ValueError(f"LossScaler({self.method!r}, compile_options=...): {self.method} scaling compiles the "
                             "model only with compile=True; pass it, or drop the options")
        if compile_options is not None and compile is None and process_group is not None:
            raise ValueError("LossScaler(process_group=..., compile_options=...): with a process group the steps "
                             "run eagerly unless compile=True; pass it, or drop the options")
        self.policy: ScalePolicy = build_policy(self.config)
        if model is None and ((self.method == "adaptive" and enabled) or compile):
            raise ValueError(f"LossScaler(None, {self.method!r}{', compile=True' if compile else ''}) needs the "
                             "model it scales: pass it as the first argument")
        self.model = model
        self.enabled = bool(enabled)
        self.process_group = process_group
        self.state: ScaleState | None = None
        self._measuring: Any = None
        self._measuring_state: ScaleState | None = None
        self.stepped = False
        if self.method == "adaptive" and self.enabled:
            device = _device_of(model)
            self.state = ScaleState(self.config.adaptive, self.policy.scale, device)
            if compile:
                from .modes.compiled import CompiledMode  # (its Inductor machinery loads when it first compiles)

                from .modes.regional import repeated_blocks

                blocks = repeated_blocks(model) if compile == "regional" else None
                self.state.mode = CompiledMode(options=compile_options, blocks=blocks)
            elif compile is None and process_group is None:  # chosen at the first forward, where the model is then
                self.state.mode = DefaultMode(compile_options)  # (data-parallel: eager, as the trainer, until tested)
            install(model, self.state)
        elif compile:
            model.compile(options=compile_options)  # in place, as the adaptive model's capture: the parameters stay
        self._optimizers: dict[int, _OptimizerRecord] = {}
        self._read_this_iteration = False
        self._model_ids: frozenset[int] | None = None
        self._attempt = 0
        self.last_action: StepAction | None = None
        self.last_loss: float | None = None
        self.found_overflow = False

    # -- precision -----------------------------------------------------------------------------------------------------

    def set_pure_dtype(self, dtype: torch.dtype | None) -> None:
        """The pure low-precision mode (no autocast): the transformed graph casts floating inputs and parameters to
        ``dtype`` itself (normalisation parameters stay float32). Only adaptive and measuring graphs use it.

        Call it before the model's first forward: the graph captured then carries what the pure mode needs (the
        accumulation guards of docs/algorithm.md 2.4), so a graph captured for another mode is refused."""
        if self.state is not None and self.state.graphs and dtype != self.state.pure_dtype:
            raise RuntimeError("LossScaler.set_pure_dtype must be called before the model's first forward: its graph "
                               "was captured for another precision mode")
        for state in (self.state, self._measuring_state):
            if state is not None:
                state.pure_dtype = dtype
        self._pure_dtype = dtype

    # -- the GradScaler calls -------------------------------------------------------------------------------------------

    def get_scale(self) -> float:
        """The factor the model's parameter gradients carry when ``backward()`` returns, until :meth:`unscale_`
        divides it out: what ``GradScaler.get_scale()`` is, so code that reads it to interpret or clip gradients
        stays right. none: 1; fixed: its scale; dynamic: the current scale (it changes only in :meth:`update`);
        1.0 when disabled.

        adaptive: 1.0. Every layer picks its own scale, and each parameter gradient of the model leaves
        ``backward()`` already divided by the scale it was computed at. The loss is still multiplied by
        :attr:`loss_scale` (``init_scale``, 1 by default), so a gradient outside the model (a parameter the loss
        uses directly) carries that instead; :meth:`unscale_` divides each by its own. The per-layer scales are
        :meth:`layer_scales` (and :meth:`layer_records` on recorded steps); :meth:`log_to` writes them to
        TensorBoard."""
        if not self.enabled or self.method == "adaptive":
            return 1.0
        return float(self.policy.scale)

    @property
    def loss_scale(self) -> float:
        """What :meth:`scale` multiplies the loss by (1.0 when disabled): :meth:`get_scale` for every method but
        adaptive, whose ``init_scale`` it is."""
        return float(self.policy.scale) if self.enabled else 1.0

    def scale(self, outputs: Any) -> Any:
        """Multiply the loss (or each tensor of a list or tuple of them, nested or not) by :attr:`loss_scale`
        before ``backward()``. A float16 or bfloat16 loss is promoted to float32 first, as GradScaler does (65536
        times a float16 loss of 1 would be inf)."""
        if not self.enabled:
            return outputs
        scale = self.policy.scale
        if isinstance(outputs, torch.Tensor):
            if outputs.dtype in (torch.float32, torch.float64):
                return outputs if scale == 1.0 else outputs * scale
            if not outputs.is_floating_point():
                raise ValueError(f"LossScaler.scale: the loss must be a floating-point tensor, not {outputs.dtype}")
            return outputs.float() * scale
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        raise ValueError(f"LossScaler.scale: outputs must be a Tensor or a list or tuple of Tensors, not "
                         f"{type(outputs).__name__}")

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

    def _record_of(self, optimizer: torch.optim.Optimizer) -> _OptimizerRecord:
        return self._optimizers.setdefault(id(optimizer), _OptimizerRecord())

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale they carry, in place, and note whether any is not finite.

        Call it before gradient clipping so that clipping sees true gradients; :meth:`step` calls it otherwise.
        Once per optimizer per iteration, as GradScaler: a second call before :meth:`update` raises (it would
        divide again).
        """
        if not self.enabled:
            return
        record = self._record_of(optimizer)
        if record.stage is _Stage.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if record.stage is _Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        if self.state is not None:
            self.state.settle()  # a compiled refresh's values, before anything reads the state
        self._check_adaptive_ran(optimizer)
        record.found_inf = self._unscale_grads(optimizer, divide=True)
        record.stage = _Stage.UNSCALED

    def _unscale_grads(self, optimizer: torch.optim.Optimizer, divide: bool) -> torch.Tensor:
        """Divide every gradient of ``optimizer`` by the scale it carries (``divide``; else only check them) with
        torch's fused multi-tensor kernel; returns the overflow flag, 0.0 or 1.0, as a 0-d float32 tensor.

        A sparse gradient is checked and divided through its values; a float16 one is coalesced first, since
        summing its duplicate indices may overflow where the uncoalesced values did not (as GradScaler does). A
        float16 gradient is refused when dividing, as GradScaler refuses it: dividing in float16 underflows again
        what scaling saved (keep float32 parameters, the master weights, and compute in float16 with autocast)."""
        grads: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if divide and grad.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients: the optimizer holds a float16 "
                                     "parameter. Keep the parameters in float32 and compute in float16 under "
                                     "torch.autocast (or precision.mode: pure), as GradScaler requires too")
                if grad.is_sparse:
                    if grad.dtype == torch.float16:
                        p.grad = grad = grad.coalesce()
                    grad = grad._values()
                divisor = self._grad_divisor(p) if divide else 1.0
                grads[(grad.device, grad.dtype, divisor)].append(grad)
        # One flag per device, shared by its groups: the kernel only ever writes 1.0 into it, so the flag stays
        # 0 or 1, which is what a fused optimizer's skip needs (it skips on exactly 1.0; a sum of two groups' flags
        # would make it apply a step of NaN gradients). It is 0-d, the shape fused Adam's step counter takes.
        flags: dict[torch.device, torch.Tensor] = {}
        for (device, _, divisor), tensors in grads.items():
            flag = flags.setdefault(device, torch.zeros((), dtype=torch.float32, device=device))
            inv = torch.full((), 1.0 / divisor, dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, inv)
        found, *others = list(flags.values()) or [torch.zeros((), dtype=torch.float32, device=self._device())]
        for flag in others:  # (a model split over devices)
            found = torch.maximum(found, flag.to(found.device))
        return found

    def _device(self) -> torch.device:
        return _device_of(self.model) if self.model is not None else torch.device("cpu")

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

        Call it once per optimizer per iteration, then :meth:`update` once: with several optimizers each is
        unscaled and checked on its own, and the scale changes only in :meth:`update`. Each call reads its
        overflow flag back to the host (one read; GradScaler reads it too, to skip). ``loss`` (optional, keyword)
        comes back in the same transfer and is kept in ``last_loss``, so logging the loss costs no extra
        synchronisation; so do, after a refresh on a device, the adaptive factors the steps until the next refresh
        apply.

        An optimizer with ``_step_supports_amp_scaling`` (torch's fused optimizers, or one of your own) is given
        the AMP protocol's attributes for its ``step()``: ``grad_scale`` (the scale tensor its gradients still
        carry, or None once unscaled; adaptive always unscales first, since its gradients carry several scales)
        and ``found_inf`` (the overflow flag, 0.0 here: an overflowing step is not called).
        """
        if not self.enabled:
            self.stepped = True
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if LossScaler is enabled (as GradScaler): "
                               "run the forward and backward yourself, then call step.")
        record = self._record_of(optimizer)
        if record.stage is _Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        amp_protocol = getattr(optimizer, "_step_supports_amp_scaling", False)
        if amp_protocol and _takes_grad_scaler(getattr(optimizer.step, "__func__", optimizer.step)):
            raise TypeError(
                f"{type(optimizer).__name__}.step takes grad_scaler=, GradScaler's deprecated way of passing itself "
                "to an optimizer, whose code then calls GradScaler's private methods; LossScaler cannot stand in "
                "there. Read the protocol's optimizer.grad_scale and optimizer.found_inf in step() instead")
        grad_scale = None
        if record.stage is _Stage.READY:
            if amp_protocol and self.method != "adaptive":  # the optimizer divides as it steps
                record.found_inf = self._unscale_grads(optimizer, divide=False)
                grad_scale = torch.full((), self.policy.scale, dtype=torch.float32, device=record.found_inf.device)
                record.stage = _Stage.CHECKED
            else:
                self.unscale_(optimizer)
        found = self._read_back(record, loss)
        record.stage = _Stage.STEPPED
        self.stepped = not (found and self.policy.skips_on_overflow)
        if not self.stepped:
            return None
        if not amp_protocol:
            return optimizer.step(*args, **kwargs)
        optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
        optimizer.found_inf = torch.zeros_like(record.found_inf)  # type: ignore[attr-defined]
        try:
            return optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale, optimizer.found_inf  # type: ignore[attr-defined]

    def _read_back(self, record: _OptimizerRecord, loss: torch.Tensor | None) -> bool:
        """The step's one host read: ``record``'s overflow flag (all-reduced over the process group), the loss
        when given, and the first time in an iteration the adaptive factors the next steps apply."""
        values = record.found_inf.reshape(1).float()
        if loss is not None:
            values = torch.cat([values, loss.detach().reshape(1).float().to(values.device)])
        if self.process_group is not None:
            values = self._all_reduce(values)
        mirror = None
        if not self._read_this_iteration:  # the iteration's first read
            self.found_overflow = False
            mirror = self.state.mirror_request() if self.state is not None else None
            self._read_this_iteration = True
        if mirror is not None:  # the factors of the steps until the next refresh, in the same read
            values = torch.cat([values, mirror.to(values.device)])
        found, *rest = values.tolist()
        if mirror is not None:
            self.state.receive_mirror(rest[len(rest) - mirror.numel():])
            del rest[len(rest) - mirror.numel():]
        if rest:
            self.last_loss = rest[0]
        record.found = bool(found)
        self.found_overflow = self.found_overflow or record.found
        return record.found

    def unscale_on_device(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """:meth:`unscale_` without any host read, for a step captured in a CUDA graph (``modes.cuda_graph.GraphedStep``):
        returns the overflow flag, 0.0 or 1.0, as a 0-d float32 device tensor, for a fused optimizer to skip on."""
        if not self.enabled:
            device = next(p.device for g in optimizer.param_groups for p in g["params"])
            return torch.zeros((), dtype=torch.float32, device=device)
        self._optimizers.pop(id(optimizer), None)  # a new step: a capture that raised may have left one
        self.unscale_(optimizer)
        return self._optimizers[id(optimizer)].found_inf

    @property
    def steps_on_overflow(self) -> bool:
        """Whether an overflowing step is applied anyway (fixed scaling with ``skip_on_overflow: false``, or a
        disabled scaler); every other policy skips or retries it."""
        return not self.enabled or not self.policy.skips_on_overflow

    def finish_device_step(self, optimizer: torch.optim.Optimizer, found_overflow: bool,
                           loss: float | None = None) -> None:
        """After a step whose optimizer applied the skip itself on the device (:meth:`unscale_on_device`): the
        flag read back, then :meth:`update`. The two agree: the optimizer was given the flag exactly when the
        policy never steps on an overflow (see :attr:`steps_on_overflow`)."""
        self.last_loss = loss
        if not self.enabled:
            self.stepped, self.last_action = True, StepAction.STEP
            return
        record = self._record_of(optimizer)
        record.found, record.stage = bool(found_overflow), _Stage.STEPPED
        self.found_overflow = record.found
        self._read_this_iteration = True
        self.stepped = not (record.found and self.policy.skips_on_overflow)
        self.update()

    def _all_reduce(self, values: torch.Tensor) -> torch.Tensor:
        """[overflow flags..., loss?] over the process group in one collective: the flags are 0 or positive, so
        their sum is non-zero exactly when their maximum is (any process overflowed); the loss becomes the mean."""
        import torch.distributed as dist

        dist.all_reduce(values, group=self.process_group)
        values[1:] /= dist.get_world_size(self.process_group)
        return values

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Finish the iteration: the policy sees whether any optimizer's gradients overflowed (the scale grows or
        backs off here, never in :meth:`step`), and the next ``backward`` starts a new step (or the retry of this
        one). ``new_scale`` sets the loss scale from now on, as in ``GradScaler.update``.

        Without any :meth:`step` or :meth:`unscale_` since the last update nothing was checked: the policy is not
        consulted (GradScaler raises there) and only the iteration ends."""
        if not self.enabled:
            return
        records = [r for r in self._optimizers.values() if r.found_inf is not None or r.found is not None]
        self._read_unread(records)
        found = any(r.found for r in records)
        self.last_action = self.policy.update(found, self._attempt) if records else None
        if new_scale is not None:
            self.policy.set_scale(float(new_scale))
        retry = self.last_action is StepAction.RETRY
        self._attempt = self._attempt + 1 if retry else 0
        self._optimizers.clear()
        self._read_this_iteration = False
        self.found_overflow = found  # what this iteration found, until the next one reads its first flag
        for state in (self.state, self._measuring_state):
            if state is not None:
                state.finish_iteration(retry)
                state.backward_passes = 0
        if self.state is not None:
            self.state.set_headroom(self.policy.headroom)  # type: ignore[attr-defined]

    def _read_unread(self, records: list[_OptimizerRecord]) -> None:
        """The flags of optimizers unscaled but never stepped this iteration, in one host read (GradScaler's update
        counts them too)."""
        unread = [r for r in records if r.found is None]
        if not unread:
            return
        flags = torch.stack([r.found_inf.reshape(()).float().to(unread[0].found_inf.device) for r in unread])
        if self.process_group is not None:
            import torch.distributed as dist

            dist.all_reduce(flags, group=self.process_group)
        for r, value in zip(unread, flags.tolist()):
            r.found = bool(value)

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
        if self.model is None:
            return None
        if self._measuring is None and sharded_pieces(self.model) is not None:
            warnings.warn("underflow is not measured on a model sharded with FSDP2: the measure-only twin would "
                          "capture the whole model, and Dynamo cannot trace FSDP2's hooks", stacklevel=3)
            self._measuring = False
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

    # -- per-layer scales and logging ----------------------------------------------------------------------------

    def layer_scales(self) -> list[LayerScale]:
        """Adaptive scaling's per-layer scales and factors as they stand, one :class:`~adaloss.records.LayerScale`
        per scale point in the order the forward first called them: what the next steps apply (until the next
        refresh recomputes them). Empty for the other methods (every layer carries :meth:`get_scale`), when
        disabled, and before the model's first forward.

        One device-to-host read for all layers, when it is called: the training step never calls it, so read it on
        the steps you log (a recorded step's :meth:`layer_records` also has every layer's scales)."""
        state = self.state if self.method == "adaptive" else None
        if state is None or not state.names:
            return []
        state.settle()  # a compiled refresh's values, before anything reads the state
        n = len(state.names)
        rows = torch.stack([state.arrays[name][:n] for name in ("factor", "weight_factor", "weight_scale")]).tolist()
        return [LayerScale(layer=name, factor=factor, weight_factor=weight_factor, weight_scale=weight_scale)
                for name, factor, weight_factor, weight_scale in zip(state.names, *rows)]

    def scalars(self, records: list[LayerRecord] | None = None) -> dict[str, float]:
        """What a metrics logger should plot for this scaler now, as ``{tag: value}`` (``adaloss.scalars`` lists
        the tags): the loss scale, the steps skipped so far and, for adaptive, the log2 of every layer's scale.
        Pass a recorded step's :meth:`layer_records` as ``records`` to add each layer's underflow. Reads the device
        once (adaptive), as :meth:`layer_scales`."""
        return scaling_scalars(self.loss_scale, self.policy.skipped_steps if self.enabled else 0,
                               self.layer_scales(), records or ())

    def log_to(self, writer: Any, step: int, records: list[LayerRecord] | None = None) -> None:
        """Write :meth:`scalars` to ``writer`` at ``step``: a ``torch.utils.tensorboard.SummaryWriter`` (or any
        writer with its ``add_scalar(tag, value, step)``)::

            writer = SummaryWriter("runs/my-run")
            ...
            if step % 50 == 0:
                scaler.log_to(writer, step)

        Call it on the steps you log, after :meth:`update`: it reads the per-layer scales from the device."""
        write_scalars(writer, self.scalars(records), step)

    # -- state -----------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume scaling exactly: the method, the policy's knobs and state, and for adaptive
        every per-layer scale. Empty when disabled, as GradScaler's.

        A dynamic scaler's state dict is also a ``torch.amp.GradScaler`` state dict (it carries ``scale``,
        ``growth_factor``, ``backoff_factor``, ``growth_interval`` and ``_growth_tracker`` as GradScaler names them),
        so a job can switch back with ``grad_scaler.load_state_dict(loss_scaler.state_dict())``; the dynamic knobs
        GradScaler has no field for (hysteresis, floor and ceiling) stay behind."""
        if not self.enabled:
            return {}
        state: dict[str, Any] = {"method": self.method, "policy": self.policy.state_dict()}
        if self.state is not None:
            state["layers"] = self.state.state_dict_values()
        if self.method == "dynamic":
            policy = state["policy"]
            state.update({"scale": policy["scale"], "growth_factor": policy["growth_factor"],
                          "backoff_factor": policy["backoff_factor"], "growth_interval": policy["growth_interval"],
                          "_growth_tracker": policy["growth_tracker"]})
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`, knobs included; refuses state saved for another method. A dynamic scaler
        also loads a ``torch.amp.GradScaler`` state dict (scale, factors, interval and growth tracker; the other
        knobs stay this scaler's), so a running job can switch to adaloss."""
        if not self.enabled:
            return
        if not state_dict:
            raise RuntimeError("The source state dict is empty, possibly because it was saved from a disabled "
                               "scaler (a disabled LossScaler or GradScaler saves nothing).")
        state = state_dict
        if "method" not in state and "_growth_tracker" in state:
            state = self._from_gradscaler(state)
        if state.get("method") != self.method:
            raise ValueError(f"loss-scaler state is for method {state.get('method')!r}, not {self.method!r}")
        self.policy.load_state_dict(state["policy"])
        if self.state is not None and "layers" in state:
            self.state.load_state_values(state["layers"])
            self.state.set_headroom(self.policy.headroom)  # type: ignore[attr-defined]

    def _from_gradscaler(self, saved: dict[str, Any]) -> dict[str, Any]:
        """A ``torch.amp.GradScaler`` state dict in this scaler's form (dynamic only)."""
        if self.method != "dynamic":
            raise ValueError(f"a torch.amp.GradScaler state dict loads into a dynamic LossScaler only, not into "
                             f"{self.method!r}: build LossScaler(model, 'dynamic') to continue that job's scaling")
        policy = self.policy.state_dict()
        policy.update(scale=float(saved["scale"]), growth_factor=float(saved["growth_factor"]),
                      backoff_factor=float(saved["backoff_factor"]), growth_interval=int(saved["growth_interval"]),
                      growth_tracker=int(saved["_growth_tracker"]))
        return {"method": "dynamic", "policy": policy}

    # -- pickling ----------------------------------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        """What a pickle (or ``copy.deepcopy``) keeps: the method, its knobs and state, never the model (a dynamic
        scaler needs none; pickling one used to carry a whole copy of it). An adaptive scaler refuses: its state
        lives in the graph it installed in its model, which an unpickled scaler would not be attached to."""
        if self.enabled and self.method == "adaptive":
            raise TypeError("an adaptive LossScaler cannot be pickled or deep-copied: its per-layer state lives in "
                            "the model it transformed. Save scaler.state_dict() (with the model's) and load it into "
                            "LossScaler(model, 'adaptive') built on the restored model")
        if self.process_group is not None:
            raise TypeError("a LossScaler with a process_group cannot be pickled: the group cannot travel; save "
                            "scaler.state_dict() and build the scaler again in each process")
        if self._optimizers:
            raise RuntimeError("LossScaler pickling is only allowed between iterations (before the first step or "
                               "after update()), as GradScaler's: an optimizer was unscaled or stepped since the "
                               "last update()")
        return {"config": self.config, "enabled": self.enabled, "state": self.state_dict()}

    def __setstate__(self, saved: dict[str, Any]) -> None:
        self.__init__(None, config=saved["config"], enabled=saved["enabled"])  # type: ignore[misc]
        if saved["state"]:
            self.load_state_dict(saved["state"])
