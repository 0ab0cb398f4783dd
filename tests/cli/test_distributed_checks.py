"""Data-parallel training, the checks that need no processes: the torchrun environment parsed into a World, global
batches and the validation split sliced contiguously, the fault hook naming one rank, the launcher dropping only its
own option, and the refusals (a global batch that does not split evenly, torchrun together with --nproc-per-node)."""

from __future__ import annotations

import numpy as np
import pytest

from distributed_worker import method_config

torch = pytest.importorskip("torch")

from adaloss_cli.config import load_config  # noqa: E402
from adaloss_cli.distributed import World, check_world, without_option  # noqa: E402
from adaloss_cli.engine import FAULT_ENV, _fault_steps  # noqa: E402
from adaloss.errors import UserError  # noqa: E402


# -- without processes: parsing and checks ----------------------------------------------------------------------


def test_world_from_torchrun_environment():
    assert World.from_env({}) == World(0, 1, 0, 1) and not World.from_env({}).active
    world = World.from_env({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert (world.rank, world.world_size, world.local_rank, world.active, world.is_main) == (3, 4, 1, True, False)
    for bad in ({"WORLD_SIZE": "two"}, {"WORLD_SIZE": "2", "RANK": "2"}):
        with pytest.raises(UserError, match="torchrun"):
            World.from_env(bad)


def test_global_batches_and_the_validation_split_are_sliced_contiguously():
    x, y = np.arange(12 * 2).reshape(12, 2), np.arange(12)
    parts = [World(r, 3).shard((x, y)) for r in range(3)]
    assert [p[1].tolist() for p in parts] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert np.array_equal(np.concatenate([p[0] for p in parts]), x)
    val = [World(r, 4).eval_shard(x[:10], y[:10])[1].tolist() for r in range(4)]
    assert sum(val, []) == list(range(10)) and {len(v) for v in val} <= {2, 3}
    assert World().shard((x, y))[1] is y


def test_the_fault_hook_can_name_one_rank(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "2, 3@1, 5@0")
    assert _fault_steps(0) == {2, 5} and _fault_steps(1) == {2, 3}


def test_the_launcher_drops_only_its_own_option():
    argv = ["train", "--config", "c.yaml", "--nproc-per-node", "2", "--quiet", "--nproc-per-node=4"]
    assert without_option(argv, "--nproc-per-node") == ["train", "--config", "c.yaml", "--quiet"]


def test_a_global_batch_that_does_not_split_evenly_is_refused_before_any_process_starts(invoke, tmp_path):
    config = method_config(tmp_path, "none", "float32")
    with pytest.raises(UserError, match="multiple of 3"):
        check_world(load_config(config), 3)
    result = invoke("train", "--config", config, "--nproc-per-node", "3", "--quiet")
    assert result.exit_code == 2
    assert "training.batch_size 16 is the global batch" in result.output and "multiple of 3" in result.output
    assert not (tmp_path / "runs").exists()



def test_torchrun_and_nproc_per_node_together_are_refused(invoke, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    result = invoke("train", "--config", method_config(tmp_path, "none", "float32"), "--nproc-per-node", "2")
    assert result.exit_code == 2 and "already one of 2 started by torchrun" in result.output


@pytest.mark.parametrize("sets, refused", [
    (["loss_scaling.method=adaptive", "training.compile=true"], "runs eager steps"),
    (["backend=chainer"], "FSDP2 is PyTorch's"),
    (["training.cuda_graphs=true", "device=cuda"], "cuda_graphs"),
])
def test_fsdp2_refuses_what_it_cannot_shard_in_one_line_naming_the_key(invoke, sets, refused):
    args = ["train", "--config", "digits", "--set", "training.distributed=fsdp2"]
    for item in sets:
        args += ["--set", item]
    result = invoke(*args, "--nproc-per-node", "2")
    assert result.exit_code == 2, result.output
    assert "training.distributed" in result.output and refused in result.output
    assert "Traceback" not in result.output
