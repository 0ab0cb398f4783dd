"""``LossScaler``: loss scaling for a PyTorch training loop, shaped like ``torch.amp.GradScaler``.

Every adaloss method (none, fixed, dynamic, adaptive) sits behind the same four calls, so switching method is one
argument::

    scaler = LossScaler(model, "dynamic", preset="deepspeed")
    model = scaler.model
    scaler.scale(loss).backward()
    stepped = scaler.step(optimizer)   # False when the step was skipped (overflow)
    scaler.update()

Unscaling and the overflow check use torch's fused multi-tensor kernel; the only device-to-host read per step is
the skip decision in :meth:`step`. With ``process_group`` (data-parallel training), the overflow flag and the loss
are all-reduced before that read, so every process takes the same decision and logs the same loss.
"""

from __future__ import annotations

import copy
import warnings
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from adaloss_cli.backends.base import LayerRecord
from adaloss_cli.config.loader import scaling_config
from adaloss_cli.config.schema import LossScalingConfig
from adaloss_cli.core.adaptive import AdaptiveOptions
from adaloss_cli.core.policies import ScalePolicy, StepAction, build_policy

from .scale_state import ScaleState
from .transform import UNSCALE_AFTER_BACKWARD, UNSCALE_PER_PARAMETER, TransformError, transform_model


def _distributed_initialized() -> bool:
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@contextmanager
def _preserved_rng_and_buffers(model: nn.Module) -> Iterator[None]:
    """Run a side computation without changing the RNG streams or any buffer (batch-norm statistics, scales)."""
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        yield
    finally:
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)


class LossScaler:
    """Loss scaling for one model and optimizer, with the call pattern of ``torch.amp.GradScaler``.

    Args:
        model: the model to train, with float32 parameters. ``scaler.model`` is the model to use from then on: for
            ``adaptive`` it is a transformed copy (torch.fx) whose backward carries per-layer scales and whose
            parameter gradients leave backward already unscaled; for the other methods it is ``model`` itself.
        method: ``none``, ``fixed``, ``dynamic`` or ``adaptive``.
        config: a validated ``LossScalingConfig`` (as the trainer passes); otherwise ``options`` are the keys of
            the method's config section, e.g. ``scale=128`` for fixed, ``preset="deepspeed"`` for dynamic,
            ``loss_scale_method="abs_range"`` for adaptive.
        passthrough_modules: extra parameter-owning module types the adaptive transform may treat like batch norm
            (parameter gradients unscaled, no factor of their own).
        process_group: with data-parallel training (e.g. ``torch.distributed.group.WORLD``), the group whose
            processes must agree on skipping a step: the overflow flag is all-reduced (any process's overflow skips
            the step everywhere) and the loss given to :meth:`step` averaged, in one collective before the step's
            single host read. Adaptive scales stay per process: parameter gradients leave backward unscaled, so
            DistributedDataParallel averages true gradients whatever scales each process chose. (Adaptive
            unscales each gradient as it is computed when ``process_group`` is given or torch.distributed is
            initialised with several processes, and in one batch at the end of backward otherwise: build the
            scaler after ``init_process_group``.)
    """

    def __init__(self, model: nn.Module, method: str = "dynamic", *, config: LossScalingConfig | None = None,
                 passthrough_modules: Iterable[type] = (), process_group: Any = None, **options: Any) -> None:
        self.config = config if config is not None else scaling_config(method, options)
        self.method = self.config.method
        self.policy: ScalePolicy = build_policy(self.config)
        self._passthrough = tuple(passthrough_modules)
        self._measuring: nn.Module | None = None
        if self.method == "adaptive":
            options_ = AdaptiveOptions.from_config(self.config.adaptive)
            # DistributedDataParallel averages each gradient during backward, so it must be unscaled by then.
            unscale = (UNSCALE_PER_PARAMETER if process_group is not None or _distributed_initialized()
                       else UNSCALE_AFTER_BACKWARD)
            self.model = transform_model(copy.deepcopy(model), options_, init_scale=self.policy.scale,
                                         passthrough_modules=self._passthrough, unscale=unscale)
        else:
            self.model = model
        self.process_group = process_group
        self._found_inf: torch.Tensor | None = None
        self._model_ids: frozenset[int] | None = None
        self._attempt = 0
        self.last_action: StepAction | None = None
        self.last_loss: float | None = None
        self.found_overflow = False

    def get_scale(self) -> float:
        """The global loss scale the next backward will use."""
        return float(self.policy.scale)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """Multiply the loss by the current loss scale before ``backward()``."""
        scale = self.policy.scale
        return loss if scale == 1.0 else loss * scale

    def _grad_divisor(self, p: torch.Tensor) -> float:
        """What ``p``'s gradient is divided by after backward: adaptive scaling unscales the gradients of its
        model's parameters itself; any other gradient carries the loss scale."""
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
        if self._found_inf is not None:
            return
        # Adaptive scaling unscales and checks its model's gradients when each backward pass ends: only gradients
        # it did not handle (parameters from elsewhere in the optimizer) are left to check here.
        state = self._active_state() if self.method == "adaptive" else None
        checked = state.checked_parameters() if state is not None else frozenset()
        found = state.found_inf if checked else None
        grads: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None and id(p) not in checked:
                    grads[(p.grad.device, p.grad.dtype, self._grad_divisor(p))].append(p.grad)
        for (device, _, divisor), tensors in grads.items():
            found_here = torch.zeros(1, device=device)
            inv = torch.full((1,), 1.0 / divisor, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_here, inv)
            found = found_here if found is None else found + found_here.to(found.device)
        self._found_inf = found if found is not None else torch.zeros(1)

    def step(self, optimizer: torch.optim.Optimizer, loss: torch.Tensor | None = None) -> bool:
        """Apply ``optimizer.step()`` unless a gradient overflowed; return whether it stepped.

        ``loss`` (optional) is read back in the same device-to-host transfer as the overflow flag and kept in
        ``last_loss``, so logging the loss costs no extra synchronisation. After an overflow, ``last_action`` says
        whether the policy wants the step skipped or the same batch retried with the smaller scale.
        """
        self.unscale_(optimizer)
        values = self._found_inf.reshape(1).float()
        if loss is not None:
            values = torch.cat([values, loss.detach().reshape(1).float().to(values.device)])
        if self.process_group is not None:
            values = self._all_reduce(values)
        found, *rest = values.tolist()
        if rest:
            self.last_loss = rest[0]
        self.found_overflow = bool(found)
        self.last_action = self.policy.update(self.found_overflow, self._attempt)
        if self.last_action is StepAction.STEP:
            optimizer.step()
        return self.last_action is StepAction.STEP

    def _all_reduce(self, values: torch.Tensor) -> torch.Tensor:
        """[overflow flag, loss?] over the process group in one collective: the flags are 0 or positive, so their
        sum is non-zero exactly when their maximum is (any process overflowed); the loss becomes the mean."""
        import torch.distributed as dist

        dist.all_reduce(values, group=self.process_group)
        values[1:] /= dist.get_world_size(self.process_group)
        return values

    def update(self) -> None:
        """Finish the iteration: the next ``backward`` starts a new step (or the retry of this one)."""
        retry = self.last_action is StepAction.RETRY
        self._attempt = self._attempt + 1 if retry else 0
        self._found_inf = None
        state = self._active_state()
        if state is not None:
            state.finish_iteration(retry)

    # -- per-layer view: scale points, recording, underflow -------------------------------------------------------

    def _active_state(self) -> ScaleState | None:
        """The scale state of the transformed model in use, if any has been built."""
        model = self.model if self.method == "adaptive" else (self._measuring or None)
        return model.adaloss.state if model is not None else None

    def measuring_model(self) -> nn.Module | None:
        """The model to run on a recorded step: the adaptive model, or a measure-only transform sharing ``model``'s
        parameters (None, with a warning, when the model cannot be transformed)."""
        if self.method == "adaptive":
            return self.model
        if self._measuring is None:
            try:
                self._measuring = transform_model(self.model, None, self.policy.scale, self._passthrough,
                                                  unscale=None)
            except TransformError as err:
                warnings.warn(f"underflow is not measured: {err}", stacklevel=2)
                self._measuring = False  # type: ignore[assignment]
        return self._measuring or None

    def start_recording(self, reference_loss: Callable[[nn.Module], tuple[torch.Tensor, torch.Tensor]]) -> nn.Module:
        """Record per-layer factors and underflow during the next backward; returns the model to run it with.

        ``reference_loss(model)`` must run the same batch through ``model`` in float32 and return ``(loss, input)``
        with ``input`` requiring grad. It runs first, unscaled, to get every scale point's true input gradient;
        RNG and buffers (batch-norm statistics) are restored afterwards, so the recorded step itself is unchanged.
        Underflow is then the share of each layer's input gradient that is zero in the training dtype where the
        float32 backward is not: values lost here or anywhere downstream.
        """
        model = self.measuring_model()
        if model is None:
            return self.model
        state = model.adaloss.state
        with _preserved_rng_and_buffers(model):
            state.reference_pass = True
            try:
                loss, inputs = reference_loss(model)
                torch.autograd.grad(loss, inputs)
            finally:
                state.reference_pass = False
        state.recording = True
        state.underflow.fill_(float("nan"))
        if model.adaloss.output is not None:
            model.adaloss.output.underflow.fill_(float("nan"))
        if self.method != "adaptive":
            state.set_loss_scale(self.policy.scale)
        return model

    def layer_records(self) -> list[LayerRecord]:
        """What each scale point did in the last recorded backward (one device-to-host read for all layers).

        The first record, ``output``, is the model output, where the float32 loss gradient is cast to the model's
        dtype; then every Linear/Conv scale point by qualified name.
        """
        state = self._active_state()
        if state is None:
            return []
        adaloss = self.measuring_model().adaloss
        points = list(adaloss.scale)
        n = len(points)
        ones = torch.ones(n, device=state.table.device)
        columns = [state.unbound[:n] if state.adaptive else ones, state.factor[:n] if state.adaptive else ones,
                   state.table[[p.in_slot for p in points]], state.underflow[:n]]
        names = [p.name for p in points]
        if adaloss.output is not None:
            out = adaloss.output
            head = [out.factor, out.factor, state.table[out.in_slot], out.underflow]
            columns = [torch.cat([h.reshape(1), c]) for h, c in zip(head, columns)]
            names.insert(0, out.name)
        if not names:
            return []
        rows = torch.stack(columns).tolist()
        return [LayerRecord(layer=name, unbound_factor=u, factor=f, accumulated_scale=a, underflow_fraction=uf)
                for name, u, f, a, uf in zip(names, *rows)]

    @property
    def should_retry(self) -> bool:
        """Whether the last step asked to re-run the same batch (nnabla-style retry on overflow)."""
        return self.last_action is StepAction.RETRY

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume scaling exactly."""
        state = {"method": self.method, "policy": self.policy.state_dict()}
        if self.method == "adaptive":
            adaloss = self.model.adaloss
            state["layers"] = adaloss.state.state_dict_values()
            # Reused between refreshes (update_per_n_iteration), so a resume mid-interval needs them too.
            state["branch_common"] = [b.common.cpu() for b in adaloss.branch]
            if adaloss.output is not None:
                state["output_factor"] = adaloss.output.factor.cpu()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; refuses state saved for another method."""
        if state.get("method") != self.method:
            raise ValueError(f"loss-scaler state is for method {state.get('method')!r}, not {self.method!r}")
        self.policy.load_state_dict(state["policy"])
        if self.method == "adaptive":
            adaloss = self.model.adaloss
            adaloss.state.load_state_values(state["layers"])
            for branch, common in zip(adaloss.branch, state.get("branch_common", [])):
                branch.common.copy_(common)
            if adaloss.output is not None and "output_factor" in state:
                adaloss.output.factor.copy_(state["output_factor"])
