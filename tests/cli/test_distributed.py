"""Data-parallel training on CPU (gloo, loopback): ranks stay identical, match one process, skip together, resume.

Two processes are launched three times for the whole file (each launch costs seconds on a small machine): once with
``distributed_worker.py`` as the torchrun worker script (DDP gradient checks, the scaler's all-reduced skip decision,
and runs of every method through ``run_experiment``), once through ``adaloss train --nproc-per-node 2`` (stopped by a
SIGTERM sent to rank 1 only) and once through ``python -m torch.distributed.run ... -m adaloss_cli train --resume``.
The checks that need no processes are in ``test_distributed_checks.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from distributed_worker import (EXTRA_RUNS, ITERATIONS, METHODS, NAN_ON_RANK_1, RESUME_ITERATIONS, method_config,
                                resume_config)

torch = pytest.importorskip("torch")

from adaloss_cli.config import load_config  # noqa: E402
from adaloss_cli.engine import FAULT_ENV  # noqa: E402
from adaloss_cli.experiment import run_experiment  # noqa: E402
from adaloss_cli.results.checkpoints import read_checkpoint  # noqa: E402

TIMING_KEYS = {"wall_time_s", "time_per_step_s", "peak_memory_mb", "ranks"}


# -- helpers on the test side ----------------------------------------------------------------------------------


def dist_env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop(FAULT_ENV, None)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    if Path("/sys/class/net/lo").exists():
        env["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    return env


def torchrun(*args: str) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node 2 ARGS`` (a free port on localhost)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]


def final_checkpoint(run_dir: Path) -> dict:
    return read_checkpoint(sorted((run_dir / "checkpoints").glob("step-*.ckpt"))[-1])


def steps(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k != "elapsed_s"}
            for line in (run_dir / "steps.jsonl").read_text().splitlines()]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def children_of(pid: int) -> list[int]:
    """Process ids whose parent is ``pid`` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def rank_of(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(item[5:]) for item in environ if item.startswith(b"RANK=")]
    return ranks[0] if ranks else None


def signal_rank_1_when(config: Path, run_dir: Path, ready, signum: int, env: dict, cwd: Path
                       ) -> tuple[int, str, str]:
    """Start ``adaloss train --config CONFIG --out RUN_DIR --nproc-per-node 2``, wait until ``ready()``, send
    ``signum`` to the process of rank 1 only; the launcher's exit code, stdout and stderr once it ended."""
    launcher = subprocess.Popen([sys.executable, "-m", "adaloss_cli", "train", "--config", str(config), "--out",
                                 str(run_dir), "--quiet", "--nproc-per-node", "2"], env=env, cwd=cwd,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not ready():
        assert launcher.poll() is None and time.time() < deadline, launcher.communicate()
        time.sleep(0.01)
    rank_1 = [pid for pid in children_of(launcher.pid) if rank_of(pid) == 1]
    assert len(rank_1) == 1
    os.kill(rank_1[0], signum)
    stdout, stderr = launcher.communicate(timeout=120)
    return launcher.returncode, stdout, stderr


@pytest.fixture(scope="module")
def worker(tmp_path_factory) -> dict:
    """Launch distributed_worker.py as a 2-process torchrun worker once; its results per rank and its output folder."""
    out = tmp_path_factory.mktemp("dist")
    started = time.perf_counter()
    script = Path(__file__).resolve().parents[1] / "distributed_worker.py"
    proc = subprocess.run(torchrun(str(script), "--worker", str(out)), env=dist_env(),
                          capture_output=True, text=True, timeout=300, cwd=out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [json.loads((out / f"worker-{r}.json").read_text()) for r in range(2)]
    return {"out": out, "ranks": results, "seconds": time.perf_counter() - started}


# -- DDP and the scaler ----------------------------------------------------------------------------------------


def test_ddp_averages_the_unscaled_gradients_of_ranks_with_different_per_layer_scales(worker):
    r0, r1 = (r["ddp"] for r in worker["ranks"])
    assert r0["tables"] == [[2.0, 2.0, 2.0], [8.0, 8.0, 8.0]], "the ranks must run with different per-layer scales"
    assert r0["ranks_differ"] > 1e-2  # the ranks' true gradients differ, so the mean is not either one
    for r in (r0, r1):
        # The transform's hooks ran before DDP's: the reducer was handed this rank's true (unscaled) gradients ...
        assert r["bucket_vs_local_true"] < 1e-5
        assert len(r["bucketed"]) == 6
        # ... and the reduced gradient is the mean of both ranks' true gradients (rtol 1e-5).
        assert r["reduced_vs_mean"] < 1e-5


def test_an_overflow_on_one_rank_makes_every_rank_skip_the_step(worker):
    for r in worker["ranks"]:
        skip = r["skip"]
        assert skip["stepped"] is False and skip["unchanged"] is True
        assert skip["scale"] == 512.0  # both backed off from 1024
        assert skip["loss"] == pytest.approx(skip["expected_loss"], rel=1e-6)  # the mean of the ranks' losses


# -- every method, distributed -----------------------------------------------------------------------------------


@pytest.mark.parametrize("method", [*METHODS, "accumulate"])
def test_every_method_keeps_the_ranks_identical_and_equals_one_process_in_float32(worker, tmp_path, method):
    name, options = (method, EXTRA_RUNS[method]) if method in EXTRA_RUNS else (None, {"method": method,
                                                                                       "dtype": "float32"})
    distributed = worker["out"] / "runs" / (name or f"{method}-float32")
    single = tmp_path / "single"
    run_experiment(load_config(method_config(tmp_path, name=name, **options)), out=single, progress=False)
    s_dist, s_single = summary(distributed), summary(single)
    assert s_dist["status"] == "completed" and s_dist["world_size"] == 2 and s_single["world_size"] == 1
    ranks = s_dist["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["params_sha256"] == ranks[1]["params_sha256"]
    assert ranks[0]["skipped_steps"] == ranks[1]["skipped_steps"] == s_dist["skipped_steps"]
    assert all(r["time_per_step_s"] > 0 for r in ranks)
    # Global batch 16 split 8 + 8 gives the single-process batch of 16: same losses, same weights (rtol 1e-5).
    a, b = steps(distributed), steps(single)
    assert [s["skipped"] for s in a] == [s["skipped"] for s in b]
    np.testing.assert_allclose([s["loss"] for s in a], [s["loss"] for s in b], rtol=1e-5)
    dist_model, single_model = final_checkpoint(distributed)["backend"]["model"], final_checkpoint(single)["backend"][
        "model"]
    assert dist_model.keys() == single_model.keys()
    for key in single_model:
        torch.testing.assert_close(dist_model[key], single_model[key], rtol=1e-5, atol=1e-6, msg=key)
    assert s_dist["final_val_accuracy"] == s_single["final_val_accuracy"]
    assert s_dist["final_val_loss"] == pytest.approx(s_single["final_val_loss"], rel=1e-5)
    assert json.loads((distributed / "meta.json").read_text())["world_size"] == 2


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_trains_distributed_in_float16(worker, method):
    run_dir = worker["out"] / "runs" / f"{method}-float16"
    s = summary(run_dir)
    assert s["status"] == "completed" and s["steps"] == ITERATIONS
    assert s["ranks"][0]["params_sha256"] == s["ranks"][1]["params_sha256"]
    assert s["ranks"][0]["skipped_steps"] == s["ranks"][1]["skipped_steps"]
    assert s["final_val_loss"] is not None
    checkpoint = final_checkpoint(run_dir)
    assert checkpoint["world_size"] == 2 and len(checkpoint["ranks"]) == 2
    assert all(torch.isfinite(t).all() for t in checkpoint["backend"]["model"].values())
    if method == "adaptive":  # scales.csv holds rank 0's scale points
        assert (run_dir / "scales.csv").read_text().count("\n") > 1


def test_nnabla_retries_run_the_same_global_batch_again_on_every_rank(worker):
    s = summary(worker["out"] / "runs" / "retry")
    assert s["status"] == "completed" and s["retries"] >= 1 and s["final_scale"] < 2.0**40
    assert s["ranks"][0]["params_sha256"] == s["ranks"][1]["params_sha256"]


def test_only_rank_0_writes_the_run_directories(worker):
    runs = worker["out"] / "runs"
    expected = {f"{m}-{d}" for m in METHODS for d in ("float32", "float16")} | {"resume-reference", *EXTRA_RUNS}
    assert {p.name for p in runs.iterdir()} == expected
    # The launch's working directory holds only what the test put there: no rank wrote anything else.
    assert {p.name for p in worker["out"].iterdir()} == (
        {"runs", "resume.yaml", "worker-0.json", "worker-1.json"} | {f"{name}.yaml" for name in expected
                                                                     if name != "resume-reference"})


# -- the command line: a signal on one rank, then --resume through torchrun ------------------------------------


def test_sigterm_to_one_rank_stops_both_at_the_same_step_and_torchrun_resume_ends_exactly(worker, tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    config = resume_config(tmp_path)
    run_dir = tmp_path / "runs" / "stopped"
    env = {**dist_env(), FAULT_ENV: NAN_ON_RANK_1}
    log = run_dir / "steps.jsonl"
    code, stdout, stderr = signal_rank_1_when(
        config, run_dir, lambda: log.exists() and log.read_text().count("\n") >= 6, signal.SIGTERM, env, cwd)
    assert code == 128 + signal.SIGTERM, stdout + stderr
    assert "SIGTERM" in stderr and "--resume" in stderr and "Traceback" not in stderr
    assert stderr.count("stopped by SIGTERM") == 1  # rank 0 reports; rank 1 exits quietly
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["status"] == "interrupted" and meta["world_size"] == 2
    assert meta["command"][-2:] == ["--nproc-per-node", "2"]  # what the user typed
    done = log.read_text().count("\n")
    assert done < RESUME_ITERATIONS
    checkpoint = final_checkpoint(run_dir)
    assert checkpoint["step"] == done and len(checkpoint["ranks"]) == 2

    resumed = subprocess.run(torchrun("-m", "adaloss_cli", "train", "--resume", str(run_dir), "--quiet"),
                             env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert resumed.stdout.strip().splitlines()[-1] == str(run_dir)  # printed once, by rank 0

    reference = worker["out"] / "runs" / "resume-reference"
    a, b = summary(reference), summary(run_dir)
    assert {k: v for k, v in a.items() if k not in TIMING_KEYS} == {k: v for k, v in b.items()
                                                                     if k not in TIMING_KEYS}
    assert [(r["params_sha256"], r["skipped_steps"]) for r in a["ranks"]] == [
        (r["params_sha256"], r["skipped_steps"]) for r in b["ranks"]]
    assert steps(reference) == steps(run_dir)
    assert (reference / "scales.csv").read_text() == (run_dir / "scales.csv").read_text()
    ca, cb = final_checkpoint(reference), final_checkpoint(run_dir)
    for key in ca["backend"]["model"]:
        assert torch.equal(ca["backend"]["model"][key], cb["backend"]["model"][key]), key
    for r in range(2):  # each rank's own per-layer scales
        assert repr(ca["ranks"][r]["backend"]["scaler"]) == repr(cb["ranks"][r]["backend"]["scaler"])
    # ... and own dropout masks: the ranks' random streams differ.
    assert not torch.equal(ca["ranks"][0]["backend"]["torch_rng"], ca["ranks"][1]["backend"]["torch_rng"])

    # The NaN on rank 1 at step 3 was skipped by both ranks (one log line, both ranks' counts agree).
    step_3 = steps(run_dir)[3]
    assert step_3["skipped"] is True and step_3["loss"] is None
    assert b["ranks"][0]["skipped_steps"] == b["ranks"][1]["skipped_steps"] >= 1
    # Rank 1 created nothing: one run directory, an untouched working directory.
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["stopped"]
    assert list(cwd.iterdir()) == []

def test_resume_with_another_number_of_processes_is_refused(worker, invoke):
    run_dir = worker["out"] / "runs" / "none-float32"
    meta = json.loads((run_dir / "meta.json").read_text())
    (run_dir / "meta.json").write_text(json.dumps({**meta, "status": "interrupted"}))
    try:
        result = invoke("train", "--resume", run_dir, "--nproc-per-node", "1")
    finally:
        (run_dir / "meta.json").write_text(json.dumps(meta))
    assert result.exit_code == 2
    assert "trained on 2 process(es), this is 1" in result.output and "--nproc-per-node 2" in result.output
