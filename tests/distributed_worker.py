"""The torchrun worker of ``test_distributed.py`` (no tests here): what each of the two processes runs, once for the
whole of that file (DDP gradient checks, the scaler's all-reduced skip decision, and runs of every method through
``run_experiment``), and the configs it trains, which the tests also train in one process to compare.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/distributed_worker.py --worker OUT
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from helpers import write_config

torch = pytest.importorskip("torch")

from adaloss_cli.config import load_config  # noqa: E402
from adaloss_cli.distributed import World  # noqa: E402
from adaloss_cli.engine import FAULT_ENV  # noqa: E402
from adaloss_cli.experiment import run_experiment  # noqa: E402

METHODS = {
    "none": {},
    "fixed": {"fixed": {"scale": 256}},
    "dynamic": {"dynamic": {"preset": "pytorch", "init_scale": 2**10, "growth_interval": 3}},
    "adaptive": {"adaptive": {"loss_scale_method": "approx_range", "update_per_n_iteration": 2}},
}
ITERATIONS = 8
RESUME_ITERATIONS = 100
NAN_ON_RANK_1 = "3@1"  # the loss of step 3 is NaN on rank 1 only


def method_config(folder: Path, method: str, dtype: str, name: str | None = None, scaling: dict | None = None,
                  **training) -> Path:
    """8 steps of an MLP without dropout or batch norm on digits; global batch 16 (8 per process)."""
    return write_config(folder / f"{name or f'{method}-{dtype}'}.yaml", model={"name": "mlp", "hidden_sizes": [32, 32]},
                        precision={"dtype": dtype},
                        loss_scaling={"method": method, **(METHODS[method] if scaling is None else scaling)},
                        training={"iterations": ITERATIONS, "batch_size": 16, "eval_batch_size": 100,
                                  "optimizer": {"name": "sgd", "lr": 0.05}, **training},
                        output={"root": str(folder / "runs"), "record_every": 3, "progress": False})


# Runs beyond one per method and dtype: gradient accumulation (DDP's no_sync), nnabla's retry of the same batch.
EXTRA_RUNS = {
    "accumulate": dict(method="none", dtype="float32", grad_accum_steps=2),
    "retry": dict(method="dynamic", dtype="float16",
                  scaling={"dynamic": {"preset": "nnabla", "init_scale": 2.0**40}}),
}


def resume_config(folder: Path) -> Path:
    """float16 adaptive with dropout (per-process random streams and scales matter), frequent checkpoints."""
    return write_config(folder / "resume.yaml", model={"name": "mlp", "hidden_sizes": [32, 32], "dropout": 0.2},
                        precision={"dtype": "float16"}, loss_scaling={"method": "adaptive", **METHODS["adaptive"]},
                        training={"iterations": RESUME_ITERATIONS, "batch_size": 16, "eval_batch_size": 100,
                                  "optimizer": {"name": "sgd", "lr": 0.05}},
                        output={"root": str(folder / "runs"), "record_every": 3, "progress": False,
                                "checkpoint_every": 4})

# -- the torchrun worker (this file run as a script) -----------------------------------------------------------


def _ddp_gradient_check(world: World) -> dict:
    """Adaptive models whose per-layer scales differ between the two ranks, wrapped as the backend wraps them."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from adaloss.torch import LossScaler, MixedPrecisionForward
    from adaloss_cli.backends.torch.distributed import DataParallelForward

    torch.manual_seed(0)
    base = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, 8, 1, 8, 8, generator=gen), torch.randint(0, 10, (2, 8), generator=gen)
    true = []  # plain autograd on the untransformed model, for each rank's slice
    for r in range(2):
        base.zero_grad()
        F.cross_entropy(base(x[r]), y[r]).backward()
        true.append({n: p.grad.clone() for n, p in base.named_parameters()})
    base.zero_grad(set_to_none=True)  # the scaler transforms base itself: start its step from no gradients
    # Different constant per-layer factors and loss-side scales on the two ranks: 2 vs 8 per layer.
    scaler = LossScaler(base, "adaptive", loss_scale_method="fixed", fixed_loss_scale=[2.0, 8.0][world.rank],
                        init_scale=[1.0, 1024.0][world.rank], exact_bounds=False, process_group=dist.group.WORLD)
    model = scaler.model
    forward = DataParallelForward(model, MixedPrecisionForward(model, "float32"))
    names = {id(p): n for n, p in model.named_parameters()}
    seen: dict[str, torch.Tensor] = {}

    def spy(state, bucket):  # what DDP's reducer hands to the all-reduce: this rank's gradients
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            seen[names[id(p)]] = g.clone()
        return allreduce_hook(state, bucket)

    forward.ddp.register_comm_hook(None, spy)
    scaler.scale(F.cross_entropy(forward(model, x[world.rank]), y[world.rank])).backward()
    tables = [None, None]
    state = scaler.state
    dist.all_gather_object(tables, state.arrays["factor"][:len(state.names)].tolist())

    def worst(a: dict, b: dict) -> float:
        return max(float(((a[n] - b[n]).abs() / (b[n].abs() + 1e-6)).max()) for n in b)

    mean = {n: (true[0][n] + true[1][n]) / 2 for n in true[0]}
    reduced = {n: p.grad for n, p in model.named_parameters()}
    return {"reduced_vs_mean": worst(reduced, mean), "bucket_vs_local_true": worst(seen, true[world.rank]),
            "ranks_differ": worst(true[0], true[1]), "tables": tables, "bucketed": sorted(seen)}


def _skip_decision_check(world: World) -> dict:
    """No DDP: only rank 1's gradient overflows; the all-reduced flag must make both ranks skip."""
    import torch.distributed as dist
    from torch import nn

    from adaloss.torch import LossScaler

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler(model, "dynamic", init_scale=1024.0, process_group=dist.group.WORLD)
    base = model(torch.ones(3, 4)).sum()
    loss = base * (world.rank + 1)
    scaler.scale(loss).backward()
    if world.rank == 1:
        model.weight.grad[0, 0] = float("inf")
    before = model.weight.detach().clone()
    scaler.step(optimizer, loss=loss)
    stepped = scaler.stepped
    scaler.update()
    return {"stepped": stepped, "scale": scaler.get_scale(), "loss": scaler.last_loss,
            "expected_loss": float(base) * 1.5, "unchanged": bool(torch.equal(model.weight, before))}


def _worker(out: Path) -> None:
    world = World.from_env()
    with world.session():
        results = {"ddp": _ddp_gradient_check(world), "skip": _skip_decision_check(world)}
        for method in METHODS:
            for dtype in ("float32", "float16"):
                config = load_config(method_config(out, method, dtype))
                run_experiment(config, out=out / "runs" / f"{method}-{dtype}", progress=False, world=world)
        for name, options in EXTRA_RUNS.items():
            config = load_config(method_config(out, name=name, **options))
            run_experiment(config, out=out / "runs" / name, progress=False, world=world)
        os.environ[FAULT_ENV] = NAN_ON_RANK_1
        run_experiment(load_config(resume_config(out)), out=out / "runs" / "resume-reference", progress=False,
                       world=world)
        (out / f"worker-{world.rank}.json").write_text(json.dumps(results))



if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(Path(sys.argv[2]))
