"""``training.distributed: fsdp2`` from the command line on CPU (gloo, 2 processes): an FSDP2 run equals the DDP run
and one process on the same global batch, survives kill -9 of one process, and resumes from its checkpoint on 2
processes (exactly the uninterrupted run) and on 1 (the same run up to float16 rounding of each process's
gradients).

Six launches for the whole file plus two resumes: about a minute and a half here.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from test_distributed import dist_env, final_checkpoint, signal_rank_1_when, steps, summary

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")

ITERATIONS = 24
CHECKPOINT_EVERY = 4


def fsdp2_config(folder: Path, distributed: str = "fsdp2", dtype: str = "float16", mode: str = "autocast",
                 method: str = "dynamic") -> Path:
    """An MLP on digits with ``method`` (dynamic by default) and no dropout: the processes' random streams do not matter, so one
    process on the global batch is the same computation. 25% held out: 449 examples, shares of 225 and 224, so
    that with 75 per evaluation batch one process runs a batch more than the other."""
    config = {"model": {"name": "mlp", "hidden_sizes": [32, 32]},
              "data": {"name": "digits", "val_fraction": 0.25},
              "precision": {"dtype": dtype, "mode": mode},
              "loss_scaling": {"method": method, "dynamic": {"init_scale": 1024.0}},
              "training": {"iterations": ITERATIONS, "batch_size": 32, "eval_batch_size": 75,
                           "eval_every_epochs": 1, "distributed": distributed,
                           "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}},
              "output": {"checkpoint_every": CHECKPOINT_EVERY, "record_every": 5}}
    path = folder / f"{distributed}-{dtype}-{mode}-{method}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _train_command(config: Path, out: Path, *extra: str, nproc: int | None = 2) -> list[str]:
    launch = ["--nproc-per-node", str(nproc)] if nproc else []
    return [sys.executable, "-m", "adaloss_cli", "train", "--config", str(config), "--out", str(out), "--quiet",
            *launch, *extra]


def train(config: Path, out: Path, *extra: str, nproc: int | None = 2) -> subprocess.CompletedProcess:
    return subprocess.run(_train_command(config, out, *extra, nproc=nproc), env=dist_env(), capture_output=True,
                          text=True, timeout=300, cwd=out.parent)


def model_of(run_dir: Path) -> dict[str, torch.Tensor]:
    return final_checkpoint(run_dir)["backend"]["model"]


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The same adaptive experiment with FSDP2 on 2 processes and in one process (float32, where power-of-two
    factors are exact), adaptive scaling with FSDP2 and DDP on 2 processes in float16 autocast, and FSDP2 in pure
    float16 (dynamic scaling)."""
    folder = tmp_path_factory.mktemp("fsdp2")
    launches = {"fsdp2": (fsdp2_config(folder, dtype="float32", method="adaptive"), 2),
                "one": (fsdp2_config(folder, dtype="float32", method="adaptive"), None),
                "fsdp2-adaptive": (fsdp2_config(folder, method="adaptive"), 2),
                "ddp-adaptive": (fsdp2_config(folder, "ddp", method="adaptive"), 2),
                "fsdp2-pure": (fsdp2_config(folder, mode="pure"), 2)}
    # All at once (each launcher picks a free port): most of each run is starting Python and torch, which the
    # runs overlap (suite time).
    started = {name: subprocess.Popen(_train_command(config, folder / name, nproc=nproc), env=dist_env(),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=folder)
               for name, (config, nproc) in launches.items()}
    done = {}
    try:
        for name, proc in started.items():
            stdout, stderr = proc.communicate(timeout=300)
            assert proc.returncode == 0, (name, stdout[-3000:] + stderr[-3000:])
            done[name] = folder / name
    finally:  # a failed or hung run must not leave the others running past the test
        for proc in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    done["config"] = launches["fsdp2"][0]
    return done


def test_an_fsdp2_run_equals_one_process_on_the_global_batch_in_float32(runs):
    fsdp2, one = summary(runs["fsdp2"]), summary(runs["one"])
    assert fsdp2["status"] == "completed" and fsdp2["world_size"] == 2 and fsdp2["steps"] == ITERATIONS
    # Every rank ends with the same full parameters (the digest gathers the shards).
    assert fsdp2["ranks"][0]["params_sha256"] == fsdp2["ranks"][1]["params_sha256"]
    # The checkpoint holds full tensors, named as one process names them; the values are one process's up to the
    # order of float32 sums (two half-batch gradients reduce-scattered instead of one whole-batch sum).
    sharded, single = model_of(runs["fsdp2"]), model_of(runs["one"])
    assert sharded.keys() == single.keys()
    for key in single:
        torch.testing.assert_close(sharded[key], single[key], rtol=1e-5, atol=1e-6)
    # Validation covered the whole split though the shares needed different numbers of batches.
    assert fsdp2["final_val_accuracy"] == one["final_val_accuracy"]
    assert fsdp2["final_val_loss"] == pytest.approx(one["final_val_loss"], rel=1e-5)


def test_adaptive_scaling_with_fsdp2_equals_ddp_and_pure_mode_uses_fsdp2s_mixed_precision_policy(runs):
    adaptive, ddp, pure = (model_of(runs[name]) for name in ("fsdp2-adaptive", "ddp-adaptive", "fsdp2-pure"))
    single = model_of(runs["one"])
    assert summary(runs["fsdp2-adaptive"])["skipped_steps"] == summary(runs["ddp-adaptive"])["skipped_steps"] == 0
    for key in ddp:
        # Each process's per-layer scales and float16 gradients are the same under DDP (whole model captured) and
        # FSDP2 (each sharded block captured below its hooks); only the float32 reduction differs.
        torch.testing.assert_close(adaptive[key], ddp[key], rtol=1e-5, atol=1e-6)
        # Pure mode gathers float16 parameters (FSDP2's MixedPrecisionPolicy) and computes every activation in
        # float16; the float32 masters stay within float16's rounding of float32 training's.
        assert pure[key].dtype == torch.float32
        assert relative_difference(pure[key], single[key]) < 1e-2, key
    assert summary(runs["fsdp2-pure"])["status"] == "completed"


def test_kill_9_of_one_process_then_resume_on_2_and_on_1_process(runs, tmp_path):
    killed = tmp_path / "killed"
    wanted = killed / "checkpoints" / f"step-{2 * CHECKPOINT_EVERY:08d}.ckpt"
    code, stdout, stderr = signal_rank_1_when(runs["config"], killed, wanted.exists, signal.SIGKILL, dist_env(),
                                              tmp_path)
    assert code != 0, stdout + stderr
    saved = final_checkpoint(killed)
    assert CHECKPOINT_EVERY * 2 <= saved["step"] < ITERATIONS and saved["world_size"] == 2
    on_one = tmp_path / "on-one"
    shutil.copytree(killed, on_one)

    resumed = subprocess.run([sys.executable, "-m", "adaloss_cli", "train", "--resume", str(killed), "--quiet",
                              "--nproc-per-node", "2"], env=dist_env(), capture_output=True, text=True, timeout=300,
                             cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    # From the checkpoint on (each rank's own per-layer scales restored), the resumed run is the uninterrupted one,
    # bit for bit.
    reference = model_of(runs["fsdp2"])
    for key, value in model_of(killed).items():
        assert torch.equal(value, reference[key]), key
    assert steps(killed) == steps(runs["fsdp2"])

    single = subprocess.run([sys.executable, "-m", "adaloss_cli", "train", "--resume", str(on_one), "--quiet",
                             "--nproc-per-node", "1"],
                            env=dist_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert single.returncode == 0, single.stdout[-3000:] + single.stderr[-3000:]
    done = summary(on_one)
    assert done["status"] == "completed" and done["world_size"] == 1 and done["steps"] == ITERATIONS
    for key, value in model_of(on_one).items():  # up to the order of float32 sums, as in the first test
        torch.testing.assert_close(value, reference[key], rtol=1e-5, atol=1e-6)
    meta = json.loads((on_one / "meta.json").read_text())
    assert meta["world_size"] == 1


def test_compare_trains_every_method_sharded_and_tabulates_them(tmp_path):
    config = fsdp2_config(tmp_path)
    out = tmp_path / "cmp"
    proc = subprocess.run([sys.executable, "-m", "adaloss_cli", "compare", "dynamic", "adaptive", "--config",
                           str(config), "--set", "training.iterations=6", "--out", str(out), "--quiet", "--json",
                           "--nproc-per-node", "2"], env=dist_env(), capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {row["method"]: row for row in json.loads(proc.stdout)["rows"]}
    assert set(rows) == {"dynamic", "adaptive"} and all(row["completed"] == 1 for row in rows.values())
    for method in rows:
        done = summary(out / "runs" / f"{method}-seed0")
        assert done["world_size"] == 2 and done["steps"] == 6 and done["status"] == "completed"
