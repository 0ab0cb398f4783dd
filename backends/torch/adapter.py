"""The PyTorch backend: model, optimizer, mixed precision and loss scaling behind the Backend interface.

Under torchrun (a process group of several processes set up), the training forward goes through
DistributedDataParallel, the scaler's skip decision is all-reduced, and each process draws its own dropout masks.
"""

from __future__ import annotations

import hashlib
import math
import resource
from typing import Any, Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from adaloss_cli.backends.base import Backend, Batch, EvalResult, StepOutcome
from adaloss_cli.backends.torch.distributed import data_parallel, shard, world_size
from adaloss_cli.backends.torch.models import build_model, describe_model
from adaloss.torch.precision import MixedPrecisionForward
from adaloss.torch.scaler import LossScaler
from adaloss_cli.config.schema import LANGUAGE_MODELS, ExperimentConfig, OptimizerConfig
from adaloss.errors import UserError


def build_optimizer(params, cfg: OptimizerConfig, fused: bool | None = None) -> torch.optim.Optimizer:
    """SGD (momentum, Nesterov, weight decay) or Adam over float32 master parameters; ``fused`` as torch.optim's
    (a fused optimizer applies the overflow skip on the device, which a CUDA-graphed step needs)."""
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                               weight_decay=cfg.weight_decay, fused=fused)
    return torch.optim.Adam(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay,
                            fused=fused)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of (..., classes) logits against integer targets of shape (...): one label per example for
    classification, the next token at every position for a language model (the mean is over all positions)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction=reduction)


def _check_cuda_graphs(device: str, distributed: bool) -> None:
    """training.cuda_graphs needs one process on a CUDA device: say which part is missing."""
    if not device.startswith("cuda"):
        raise UserError(f"training.cuda_graphs: true needs a CUDA device, but this run is on {device} "
                        f"(torch {torch.__version__} sees {'a' if torch.cuda.is_available() else 'no'} CUDA "
                        "device); set cuda_graphs: false or use device: cuda")
    if distributed:
        raise UserError("training.cuda_graphs: true runs in one process; under torchrun with several processes "
                        "set cuda_graphs: false")


class TorchBackend(Backend):
    """Trains a zoo model with PyTorch in float32, float16 (fp32 master weights) or bfloat16."""

    name = "torch"
    #: Trains data-parallel under torchrun (see adaloss_cli.distributed).
    supports_distributed = True

    def __init__(self, config: ExperimentConfig, input_shape: tuple[int, ...], num_classes: int,
                 device: str) -> None:
        super().__init__(config, input_shape, num_classes, device)
        torch.manual_seed(config.run.seed)
        model = build_model(config.model, tuple(input_shape), num_classes).to(device)
        distributed = world_size() > 1
        #: Whether the model is sharded with FSDP2 (training.distributed: fsdp2 on several processes).
        self.sharded = distributed and config.training.distributed == "fsdp2"
        adaptive = config.loss_scaling.method == "adaptive"
        forward = MixedPrecisionForward(model, config.precision.dtype, config.precision.mode,
                                        in_graph=adaptive or self.sharded)
        pure = config.precision.mode == "pure" and forward.is_mixed
        if self.sharded:  # before the scaler and the optimizer, as FSDP2 users write it; adaptive scaling casts
            shard(model, forward.dtype if pure and not adaptive else None)  # in its graphs, from float32

        # training.compile null: the library's default (compiled for adaptive scaling on one CUDA device; eager
        # with a process group, and GraphedStep takes over with cuda_graphs)
        self.scaler = LossScaler(model, config=config.loss_scaling, compile=config.training.compile,
                                 process_group=torch.distributed.group.WORLD if distributed else None)
        self.model = self.scaler.model
        self.forward = forward
        if pure:
            self.scaler.set_pure_dtype(self.forward.dtype)
        # What training runs: the same forward, through DDP or FSDP2's hooks when there are several processes.
        self.train_forward = data_parallel(self.model, self.forward, sharded=self.sharded)
        graphs = config.training.cuda_graphs
        if graphs:
            _check_cuda_graphs(device, distributed)
        self.optimizer = build_optimizer(self.model.parameters(), config.training.optimizer, fused=graphs or None)
        #: The captured training step (training.cuda_graphs), or None for eager steps.
        self.graphed = self._graphed_step() if graphs else None
        self.start_notice = _compile_notice(self.scaler, device)  # (after GraphedStep, which replaces the mode)
        if distributed:  # same initial weights everywhere (DDP broadcast rank 0's), own dropout masks per process
            rank = torch.distributed.get_rank()
            torch.manual_seed(int(np.random.SeedSequence([config.run.seed, rank]).generate_state(1)[0]))
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats(device)

    def _graphed_step(self) -> Any:
        from adaloss.torch.modes.cuda_graph import GraphedStep

        clip = self.config.training.grad_clip_norm

        def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return cross_entropy(self.train_forward(self.model, x), y)

        def clip_gradients() -> None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)

        return GraphedStep(self.scaler, self.optimizer, loss_fn, before_step=clip_gradients if clip else None)

    @staticmethod
    def resolve_device(requested: str) -> str:
        """'auto' picks CUDA when present; asking for CUDA without it is a user error."""
        if requested == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if requested == "cuda" and not torch.cuda.is_available():
            raise UserError("device: 'cuda' was requested but torch sees no CUDA device "
                            f"(torch {torch.__version__}); use --device cpu or install a CUDA build of torch")
        return requested

    def _to_device(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        return (torch.from_numpy(np.ascontiguousarray(x)).to(self.device, non_blocking=True),
                torch.from_numpy(np.ascontiguousarray(y)).to(self.device, non_blocking=True))

    def _backward(self, micro_batches: Sequence[Batch], record: bool) -> torch.Tensor:
        """Scaled forward/backward over all micro-batches; returns the mean loss as a device tensor.

        On a recorded step the first micro-batch runs through the scaler's measuring model, with the input
        requiring grad so that the first layer's input gradient is measured too.
        """
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        for i, batch in enumerate(micro_batches):
            x, y = self._to_device(batch)
            model = self.model
            if record and i == 0:
                model = self.scaler.start_recording(self._reference_loss(x, y))
                if x.is_floating_point():  # token ids have no gradient
                    x = x.detach().requires_grad_(True)
            # Gradients are averaged over processes once, in the backward of the step's last micro-batch.
            with self.train_forward.accumulating(skip_sync=i < len(micro_batches) - 1):
                loss = cross_entropy(self.train_forward(model, x), y) / len(micro_batches)
                if self.inject_nonfinite_loss:
                    loss = loss * float("nan")
                self.scaler.scale(loss).backward()
            total = total + loss.detach()
        return total

    def _reference_loss(self, x: torch.Tensor, y: torch.Tensor):
        """The recorded batch's loss in float32, for the scaler's underflow reference pass.

        With token ids as input (no gradient), the parameters (which the measuring model shares) are what the
        reference backward differentiates, so it still reaches every layer.
        """
        def reference(model):
            if not x.is_floating_point():
                return cross_entropy(model(x), y), [p for p in self.model.parameters() if p.requires_grad]
            inputs = x.detach().float().requires_grad_(True)
            return cross_entropy(model(inputs), y), inputs
        return reference

    def train_step(self, micro_batches: Sequence[Batch], lr: float, record: bool = False) -> StepOutcome:
        """One optimizer step; on a retry request the same micro-batches are run again with the new scale."""
        for group in self.optimizer.param_groups:  # a graphed step copies a number into the tensor it reads
            group["lr"] = lr
        # Underflow is measured against a captured float32 twin of the model, which FSDP2's hooks rule out; the
        # layer scales of a recorded step are still read.
        logged, record = record, record and not self.sharded
        self.model.train()
        if self.graphed is not None and not record and len(micro_batches) == 1 and not self.inject_nonfinite_loss:
            return self._graphed_train_step(micro_batches[0])
        retries, overflowed = 0, False
        while True:
            scale = self.scaler.loss_scale
            loss = self._backward(micro_batches, record)
            layers = self.scaler.layer_records() if record else []
            self.scaler.unscale_(self.optimizer)
            if self.config.training.grad_clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.training.grad_clip_norm)
            self.scaler.step(self.optimizer, loss=loss)
            stepped = self.scaler.stepped
            overflowed = overflowed or self.scaler.found_overflow
            self.scaler.update()
            if not self.scaler.should_retry:
                break
            retries += 1
        return StepOutcome(loss=float(self.scaler.last_loss), overflow=overflowed, skipped=not stepped,
                           scale=scale, retries=retries, layers=layers,
                           layer_scales=self.scaler.layer_scales() if logged else [])

    def _graphed_train_step(self, batch: Batch) -> StepOutcome:
        """One optimizer step replayed from its CUDA graph (retries included); recorded steps run eagerly."""
        scale = self.scaler.loss_scale
        loss = self.graphed(*self._to_device(batch))
        graphed = self.graphed
        return StepOutcome(loss=loss, overflow=graphed.last_overflowed, skipped=not self.scaler.stepped,
                           scale=scale, retries=graphed.last_retries, layers=[])

    @torch.no_grad()
    def evaluate(self, batches: Iterable[Batch]) -> EvalResult:
        """Mean cross-entropy and accuracy over every prediction (each example, or each token position of a language
        model), in the training compute dtype (with rank 0's batch-norm statistics)."""
        self.train_forward.sync_buffers()
        self.model.eval()
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        correct = torch.zeros((), device=self.device, dtype=torch.int64)
        count = 0
        batches = list(batches)
        for batch in batches:
            x, y = self._to_device(batch)
            logits = self.forward(self.model, x)
            loss_sum += cross_entropy(logits, y, reduction="sum").double()
            correct += (logits.argmax(dim=-1) == y).sum()
            count += y.numel()
        if self.sharded:
            self._match_other_processes_forwards(len(batches))
        loss = loss_sum.item() / max(count, 1)
        return EvalResult(loss=loss if math.isfinite(loss) else float("nan"),
                          accuracy=correct.item() / max(count, 1), examples=count)

    def _full_state(self) -> bool:
        """Whether checkpoints hold the model and optimizer as full, rank-independent state dicts (FSDP2 runs, so
        that they resume on any number of processes) rather than the plain ``state_dict()`` of one process."""
        return self.config.training.distributed == "fsdp2"

    def _match_other_processes_forwards(self, ran: int) -> None:
        """An FSDP2 forward gathers parameters with every process, so all run as many: a process with fewer
        evaluation batches (the split's shares differ by one) runs one-example forwards whose results it drops."""
        most = torch.tensor([ran], dtype=torch.int64)
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
        if ran < int(most):
            tokens = self.config.model.name in LANGUAGE_MODELS
            x = torch.zeros((1, *self.input_shape), dtype=torch.int64 if tokens else torch.float32,
                            device=self.device)
            for _ in range(int(most) - ran):
                self.forward(self.model, x)

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer, scaler and torch RNG states. An FSDP2 run's model and optimizer are gathered into full
        state dicts (every process takes part; rank 0's copy is the one saved) with torch.distributed.checkpoint's
        state-dict utilities, the optimizer's keyed by parameter name."""
        if self._full_state():
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=options)
        else:
            model_state, optimizer_state = self.model.state_dict(), self.optimizer.state_dict()
        state = {"model": model_state, "optimizer": optimizer_state,
                 "scaler": self.scaler.state_dict(), "torch_rng": torch.get_rng_state()}
        if self.device.startswith("cuda"):
            state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (an FSDP2 run's full state is sharded onto this run's processes, however
        many trained it)."""
        if self._full_state():
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"], options=StateDictOptions(full_state_dict=True))
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        if self.graphed is not None:  # the optimizer's state tensors are new: capture again
            self.graphed.reset()
        self.scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(state["torch_rng"])
        if "cuda_rng" in state and self.device.startswith("cuda"):
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)

    def rank_state(self) -> dict[str, Any]:
        """What differs between processes of a distributed run: per-layer scales and random-number streams."""
        state = {"scaler": self.scaler.state_dict(), "torch_rng": torch.get_rng_state()}
        if self.device.startswith("cuda"):
            state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_rank_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`rank_state` (after :meth:`load_state_dict` restored rank 0's full state)."""
        self.scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(state["torch_rng"])
        if "cuda_rng" in state and self.device.startswith("cuda"):
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)

    def parameter_digest(self) -> str:
        """SHA-256 (16 hex digits) of every parameter's bytes: equal on all processes when they stayed in sync."""
        digest = hashlib.sha256()
        for name, p in self.model.named_parameters():
            full = p.full_tensor() if self.sharded else p  # an FSDP2 shard: gathered (every process calls this)
            digest.update(name.encode())
            digest.update(full.detach().cpu().contiguous().numpy().tobytes())
        return digest.hexdigest()[:16]

    def describe(self) -> str:
        """One line about the model, and its scale points when adaptive (once the model has run)."""
        text = describe_model(self.model)
        if self.scaler.method == "adaptive":
            text += "\n" + self.scaler.describe()
        return text

    def peak_memory_bytes(self) -> int | None:
        """CUDA: peak allocated bytes; CPU: the process's peak resident set size."""
        if self.device.startswith("cuda"):
            return int(torch.cuda.max_memory_allocated(self.device))
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    def final_scale(self) -> float:
        """The global loss scale now (what the loss is multiplied by)."""
        return self.scaler.loss_scale


def _compile_notice(scaler: LossScaler, device: str) -> str | None:
    """What to tell the user before an adaptive run whose first steps compile (on CUDA by default)."""
    from adaloss.torch.modes.default import DefaultMode, compiles_by_default
    mode = scaler.state.mode if scaler.state is not None else None
    default_compiles = isinstance(mode, DefaultMode) and compiles_by_default(torch.device(device), warn=False)
    if mode is None or not (mode.name == "compiled" or default_compiles):
        return None
    return ("Note: the adaptive steps are compiled by Inductor: the first steps take a minute or more (ResNet-50 "
            "several); later runs of the same model and options load them from torch's compile caches in seconds "
            "(training.compile: false runs eager steps, about 3x slower per step on a GPU)")
