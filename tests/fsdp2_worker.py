"""The torchrun worker of ``test_fsdp2.py`` (no tests here): two processes shard a small MLP with FSDP2
(``fully_shard`` per Linear and at the root, gloo, float32 compute, and float16 autocast for adaptive) and train it with ``LossScaler`` through the
library API; each rank writes what the tests check to ``OUT/fsdp2-<rank>.json``, and a dynamic run is saved with
torch.distributed.checkpoint to ``OUT/dcp``.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/fsdp2_worker.py OUT
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard
from torch.profiler import ProfilerActivity, profile

from adaloss.errors import TransformError
from adaloss.torch import LossScaler

STEPS = 4
GLOBAL_BATCH = 16
SCALES = {"none": {}, "fixed": {"scale": 256.0}, "dynamic": {"init_scale": 2.0 ** 10}, "adaptive": {}}


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 5))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(GLOBAL_BATCH, 12, generator=generator),
             torch.randint(0, 5, (GLOBAL_BATCH,), generator=generator)) for _ in range(STEPS)]


def sharded(model: nn.Sequential) -> nn.Sequential:
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor, fp16: bool) -> torch.Tensor:
    """Cross-entropy in float32 compute, or under CPU autocast in float16."""
    with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
        logits = model(x)
    return F.cross_entropy(logits.float(), y)


def train(method: str, rank: int, world: int, checkpoint: Path | None = None, fp16: bool = False
          ) -> list[list[float]]:
    """STEPS steps of SGD on this rank's half of each global batch; the full parameters afterwards. With
    ``checkpoint``, model, optimizer and scaler are saved there with torch.distributed.checkpoint (the scaler as a
    Stateful: DCP calls its state_dict and load_state_dict)."""
    model = sharded(mlp())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9 if checkpoint else 0.0)
    scaler = LossScaler(model, method, **SCALES[method])
    per_rank = GLOBAL_BATCH // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    for x, y in batches():
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss_of(model, x[mine], y[mine], fp16)).backward()
        scaler.step(optimizer)
        scaler.update()
    if checkpoint is not None:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state, "scaler": scaler}, checkpoint_id=checkpoint)
    return [p.full_tensor().flatten().tolist() for p in model.parameters()]


def inf_on_one_rank(rank: int) -> dict:
    """An inf in one element of rank 1's local gradient shard only: both ranks must skip, with one collective."""
    model = sharded(mlp())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler(model, "dynamic", init_scale=2.0 ** 10)
    before = [p.detach().to_local().clone() for p in model.parameters()]
    x, y = batches()[0]
    scaler.scale(F.cross_entropy(model(x[:8] if rank == 0 else x[8:]), y[:8] if rank == 0 else y[8:])).backward()
    if rank == 1:
        model[4].weight.grad.to_local().view(-1)[0] = float("inf")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        scaler.step(optimizer)
        scaler.update()
    collectives = sum(e.name.startswith("gloo:") for e in prof.events())
    unchanged = all(torch.equal(b, p.detach().to_local()) for b, p in zip(before, model.parameters()))
    return {"skipped": scaler.step_was_skipped, "unchanged": unchanged, "scale": scaler.get_scale(),
            "collectives": collectives}


def adaptive_refusals() -> list[str]:
    """What adaptive scaling of an FSDP2 model refuses, by name: a scaler built before fully_shard (it captured the
    model whole), and parameters gathered in float16 (MixedPrecisionPolicy param_dtype)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    messages = []
    model = mlp()
    scaler = LossScaler(model, "adaptive")
    sharded(model)
    x, y = batches()[0]
    try:
        scaler.scale(F.cross_entropy(model(x[:8]), y[:8])).backward()
    except TransformError as err:
        messages.append(str(err))
    model = mlp()
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))
    scaler = LossScaler(model, "adaptive")
    try:
        scaler.scale(F.cross_entropy(model(x[:8]).float(), y[:8])).backward()
    except TransformError as err:
        messages.append(str(err))
    return messages


def recording_on_a_sharded_model() -> str:
    """Underflow measurement (start_recording) of a dynamic scaler on an FSDP2 model: one warning, and the step
    runs on the model itself."""
    import warnings

    model = sharded(mlp())
    scaler = LossScaler(model, "dynamic")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ran_with = scaler.start_recording(lambda m: (_ for _ in ()).throw(AssertionError("no reference pass")))
    return "" if ran_with is not model else " | ".join(str(w.message) for w in caught)


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {"params": {method: train(method, rank, world) for method in SCALES},
               "adaptive-fp16": train("adaptive", rank, world, fp16=True),
               "recording": recording_on_a_sharded_model(),
               "checkpointed": train("dynamic", rank, world, checkpoint=out / "dcp"),
               "inf": inf_on_one_rank(rank), "adaptive": adaptive_refusals()}
    (out / f"fsdp2-{rank}.json").write_text(json.dumps(results))
    dist.barrier()  # no rank tears gloo down while another still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    sys.stdout.flush()
    os._exit(0)  # past gloo's threads in the interpreter's teardown (see adaloss_cli.cli.main)
