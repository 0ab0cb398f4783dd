"""Data-parallel training across processes: which process this is, the few collectives the engine needs, and the
launcher behind ``adaloss train --nproc-per-node``.

torchrun (or ``adaloss train --nproc-per-node N``, which launches through torch's own elastic launcher) starts one
process per device and tells each its place in WORLD_SIZE, RANK and LOCAL_RANK. Every process trains the same model
on its contiguous slice of each global batch, DistributedDataParallel averages the gradients, and only rank 0 writes
the run directory. One process is a :class:`World` of size 1 whose collectives return their input, so the engine
calls them without an ``if``.

torch is imported only inside the methods that communicate, so ``adaloss --help`` stays fast.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TypeVar

import numpy as np

from adaloss.errors import AdalossError, UserError

T = TypeVar("T")
Batch = tuple[np.ndarray, np.ndarray]

#: Set by the launcher for its workers: the command line the user typed (JSON), recorded in meta.json.
COMMAND_ENV = "ADALOSS_LAUNCH_COMMAND"


class PeerFailed(AdalossError):
    """Another process of the run failed with an adaloss error; rank 0 reports it, the others exit quietly."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _env_int(environ: dict[str, str], name: str, default: int) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise UserError(f"environment variable {name}={raw!r} is not an integer; adaloss reads WORLD_SIZE, RANK and "
                        "LOCAL_RANK as torchrun sets them: launch with torchrun or adaloss train --nproc-per-node N"
                        ) from None


@dataclass(frozen=True)
class World:
    """This process's place among the training processes (rank 0 of 1 when not launched by torchrun)."""
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "World":
        """Read torchrun's WORLD_SIZE, RANK, LOCAL_RANK and LOCAL_WORLD_SIZE (a single process without them)."""
        env = dict(os.environ if environ is None else environ)
        world_size = _env_int(env, "WORLD_SIZE", 1)
        rank = _env_int(env, "RANK", 0)
        local_rank = _env_int(env, "LOCAL_RANK", 0)
        local_world_size = _env_int(env, "LOCAL_WORLD_SIZE", world_size)
        if world_size < 1 or not 0 <= rank < world_size or local_rank < 0:
            raise UserError(f"inconsistent torchrun environment: WORLD_SIZE={world_size}, RANK={rank}, "
                            f"LOCAL_RANK={local_rank}; launch with torchrun or adaloss train --nproc-per-node N")
        return cls(rank, world_size, local_rank, local_world_size)

    @property
    def active(self) -> bool:
        """Whether there is more than one process (and so anything to communicate)."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that writes the run directory and prints."""
        return self.rank == 0

    # -- lifetime ------------------------------------------------------------------------------------------------

    @contextmanager
    def session(self) -> Iterator["World"]:
        """Join the process group for the body (gloo for CPU tensors, NCCL for CUDA ones), and leave it after.

        The process group is set up before the config is even read (``--resume`` reads it on rank 0 only), so it
        serves both devices: ``cpu:gloo,cuda:nccl`` where CUDA is available, ``gloo`` otherwise. Process ``r`` of a
        node uses ``cuda:LOCAL_RANK``.
        """
        if not self.active:
            yield self
            return
        import torch
        import torch.distributed as dist

        if dist.is_initialized():  # set up by the caller (library use): use it as it is
            yield self
            return
        cuda = torch.cuda.is_available() and dist.is_nccl_available()
        if cuda and self.local_rank < torch.cuda.device_count():
            torch.cuda.set_device(self.local_rank)
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
        try:
            yield self
        except BaseException:
            dist.destroy_process_group()  # no barrier: the other ranks may never reach one
            raise
        # Every rank finishes its collectives before any tears the group down: a rank leaving while another's
        # gloo thread still talks to it was seen once in ~35 runs to abort at exit ("terminate called ...").
        dist.barrier()
        dist.destroy_process_group()

    def device(self, resolved: str) -> str:
        """The device of this process: ``cuda:LOCAL_RANK`` when training on CUDA with several processes."""
        if not self.active or resolved != "cuda":
            return resolved
        import torch

        count = torch.cuda.device_count()
        if self.local_rank >= count:
            raise UserError(f"process {self.rank} has LOCAL_RANK {self.local_rank} but this node has {count} CUDA "
                            f"device(s); start at most {count} processes per node (--nproc-per-node)")
        return f"cuda:{self.local_rank}"

    # -- agreement and collectives -------------------------------------------------------------------------------

    def agree(self, action: Callable[[], T], main_only: bool = False) -> T:
        """Run ``action`` on every process (``main_only``: on rank 0, whose result every process receives) and fail
        together: if it raised an adaloss error anywhere, rank 0 raises it (naming the rank when it was another's)
        and the other processes raise :class:`PeerFailed`, which they do not print.
        """
        if not self.active:
            return action()
        import torch.distributed as dist

        value, error = None, None
        if self.is_main or not main_only:
            try:
                value = action()
            except AdalossError as err:
                error = err
        report = None if error is None else (error.exit_code, str(error))
        if main_only:
            box = [(report, value if report is None else None)]
            dist.broadcast_object_list(box, src=0)
            reports, value = [box[0][0]], box[0][1]
        else:
            reports = [None] * self.world_size
            dist.all_gather_object(reports, report)
        failed = [(rank, r) for rank, r in enumerate(reports) if r is not None]
        if not failed:
            return value  # type: ignore[return-value]
        if self.is_main and error is not None:
            raise error
        rank, (code, message) = failed[0]
        raise PeerFailed(message if rank == 0 else f"process {rank}: {message}", code)

    def gather(self, value: T) -> list[T] | None:
        """Every process's ``value`` in rank order on rank 0; None on the others."""
        if not self.active:
            return [value]
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.world_size if self.is_main else None
        dist.gather_object(value, out, dst=0)
        return out

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sums over all processes (in float64, through the CPU backend)."""
        if not self.active:
            return [float(v) for v in values]
        import torch
        import torch.distributed as dist

        tensor = torch.tensor([float(v) for v in values], dtype=torch.float64)
        dist.all_reduce(tensor)
        return tensor.tolist()

    # -- data ----------------------------------------------------------------------------------------------------

    def shard(self, batch: Batch) -> Batch:
        """This process's contiguous slice of a global training batch (every slice has the same size)."""
        if not self.active:
            return batch
        x, y = batch
        size = len(y) // self.world_size
        part = slice(self.rank * size, (self.rank + 1) * size)
        return x[part], y[part]

    def eval_shard(self, x: np.ndarray, y: np.ndarray) -> Batch:
        """This process's contiguous share of the validation split (sizes differ by at most one)."""
        if not self.active:
            return x, y
        bounds = np.linspace(0, len(y), self.world_size + 1).round().astype(int)
        part = slice(bounds[self.rank], bounds[self.rank + 1])
        return x[part], y[part]


SINGLE = World()


def check_world(config: Any, world_size: int) -> None:
    """What a config must satisfy to train on ``world_size`` processes; a UserError naming the fix otherwise."""
    if world_size <= 1:
        return
    from adaloss_cli.backends import get_backend

    if not getattr(get_backend(config.backend), "supports_distributed", False):
        raise UserError(f"backend '{config.backend}' does not support training on several processes; use "
                        "backend: torch, or train in one process (no torchrun, no --nproc-per-node)")
    batch = config.training.batch_size
    if batch % world_size:
        raise UserError(f"training.batch_size {batch} is the global batch, split evenly across the {world_size} "
                        f"processes; choose a multiple of {world_size} (e.g. {batch - batch % world_size or world_size})")


class StopVote:
    """Agreement on a stop signal: every process stops after the same step, even if only one got the signal.

    Each step posts this process's signal number (0 for none) to an asynchronous MAX all-reduce on the CPU backend
    and reads the result posted one step before, so the vote costs no waiting; a signal thus stops all processes
    one step after it arrived. One process reads its own flag at once.
    """

    def __init__(self, world: World) -> None:
        self.world = world
        self._pending: Any = None
        self._box: Any = None

    def __enter__(self) -> "StopVote":
        return self

    def __call__(self, signum: int | None) -> int | None:
        """Post ``signum``; return the signal every process agreed to stop on (None: go on)."""
        if not self.world.active:
            return signum
        import torch
        import torch.distributed as dist

        agreed = None
        if self._pending is not None:
            self._pending.wait()
            agreed = int(self._box.item()) or None
        self._box = torch.tensor([signum or 0], dtype=torch.int64)
        self._pending = dist.all_reduce(self._box, op=dist.ReduceOp.MAX, async_op=True)
        return agreed

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if self._pending is not None and exc_type is None:  # every process posted it: it completes
            self._pending.wait()
        self._pending = None


class SilentWriter:
    """What a process other than rank 0 writes into the run directory: nothing (the RunWriter's interface)."""

    def __init__(self, run_dir: Path | None) -> None:
        self.run_dir = run_dir

    def set_meta(self, **fields: Any) -> None:
        """Nothing."""

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Nothing."""

    def epoch(self, row: dict[str, Any]) -> None:
        """Nothing."""

    def offsets(self) -> dict[str, int]:
        """No logs."""
        return {}

    def finish(self, *args: Any, **kwargs: Any) -> None:
        """Nothing."""


# -- launcher --------------------------------------------------------------------------------------------------


def without_option(argv: Sequence[str], name: str) -> list[str]:
    """``argv`` without ``name VALUE`` / ``name=VALUE`` (the launcher's own option)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == name:
            skip = True
        elif not arg.startswith(name + "="):
            out.append(arg)
    return out


def launch(argv: Sequence[str], nproc_per_node: int,
           command: Sequence[str] | None = None) -> tuple[int, str | None]:
    """Run ``adaloss ARGV`` in ``nproc_per_node`` processes on this machine through torch's elastic launcher, as
    ``torchrun --standalone --nproc-per-node N`` does (a free local port, no restarts). The processes run this same
    adaloss whatever their working directory holds (:mod:`adaloss_cli.self_command`).

    Returns 0, or the exit code of the process that failed first (128 + N when the launcher itself was stopped by
    signal N), and, when a process died without a word (killed by a signal), a line saying which. Without
    OMP_NUM_THREADS set, each process gets an equal share of the CPU cores (torchrun would give it one).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from adaloss_cli.self_command import python_args

    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc_per_node)))
    if command is not None:
        os.environ[COMMAND_ENV] = json.dumps(list(command))
    # Failures come back as exit codes, and the processes print their own errors: the agent's report is noise.
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if name.startswith("torch.distributed.elastic") and isinstance(logger, logging.Logger):
            logger.setLevel(logging.CRITICAL)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc_per_node, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1)
    try:
        elastic_launch(config, sys.executable)(*python_args(), *argv)
    except ChildFailedError as err:
        # The process that failed first: the agent stops the others with SIGTERM after it.
        rank = err.get_first_failure()[0]
        code = err.failures[rank].exitcode
        if code < 0:
            return 128 - code, f"process {rank} was killed by {err.failures[rank].signal_name()}"
        return code, None
    except SignalException as err:
        return 128 + int(err.sigval), None
    return 0, None


def launch_command() -> list[str] | None:
    """The command line the user typed, when this process was started by ``adaloss train --nproc-per-node``."""
    raw = os.environ.get(COMMAND_ENV)
    return json.loads(raw) if raw else None
