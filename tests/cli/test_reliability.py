"""Crash safety: kill-and-resume equivalence, signals, non-finite losses, divergence, bad input, concurrency."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from adaloss_cli.engine import FAULT_ENV
from adaloss_cli.results.checkpoint_format import save_checkpoint
from adaloss_cli.results.checkpoints import read_checkpoint
from helpers import write_config

METHOD_OPTIONS = {
    "none": {},
    "fixed": {"fixed": {"scale": 256}},
    "dynamic": {"dynamic": {"preset": "pytorch", "init_scale": 2**20, "growth_interval": 3}},
    "adaptive": {"adaptive": {"loss_scale_method": "approx_range", "update_per_n_iteration": 2}},
}


def resumable_config(tmp_path: Path, method: str, iterations: int = 30, backend: str = "torch") -> Path:
    """A float16 run with dropout (so RNG state matters), frequent checkpoints and per-layer records."""
    return write_config(
        tmp_path / f"{method}.yaml", backend=backend,
        model={"name": "mlp", "hidden_sizes": [32, 32], "dropout": 0.2},
        precision={"dtype": "float16"},
        loss_scaling={"method": method, **METHOD_OPTIONS[method]},
        training={"iterations": iterations, "batch_size": 16, "eval_batch_size": 512,
                  "optimizer": {"name": "sgd", "lr": 0.05}},
        output={"root": str(tmp_path / "runs"), "record_every": 3, "progress": False, "checkpoint_every": 4},
    )


def adaloss(*args: str, env: dict | None = None, **kwargs) -> subprocess.Popen:
    """Start `python -m adaloss_cli ARGS` (a real process, so it can be killed), with SIGINT at its default as in
    a terminal: a suite run as a shell's background job ignores SIGINT, and its children would inherit that."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    kwargs.setdefault("preexec_fn", _default_sigint)
    return subprocess.Popen([sys.executable, "-m", "adaloss_cli", *args], env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_for_steps(run_dir: Path, steps: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    """Block until steps.jsonl holds at least ``steps`` lines."""
    deadline = time.time() + timeout
    log = run_dir / "steps.jsonl"
    while time.time() < deadline:
        if log.exists() and log.read_text().count("\n") >= steps:
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended early: {proc.communicate()}")
        time.sleep(0.05)
    raise AssertionError("timed out waiting for steps")


def comparable_steps(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k != "elapsed_s"}
            for line in (run_dir / "steps.jsonl").read_text().splitlines()]


def final_state(run_dir: Path) -> dict:
    return read_checkpoint(sorted((run_dir / "checkpoints").glob("step-*.ckpt"))[-1])["backend"]


TIMING_KEYS = {"wall_time_s", "time_per_step_s", "peak_memory_mb"}


def assert_same_run(a: Path, b: Path) -> None:
    """Same summary (timings aside), same step log, same per-layer records, same parameters and scaler state."""
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    assert {k: v for k, v in sa.items() if k not in TIMING_KEYS} == {k: v for k, v in sb.items()
                                                                     if k not in TIMING_KEYS}
    assert comparable_steps(a) == comparable_steps(b)
    assert (a / "scales.csv").read_text() == (b / "scales.csv").read_text()
    metrics = [line.rsplit(",", 1)[0] for line in (a / "metrics.csv").read_text().splitlines()]
    assert metrics == [line.rsplit(",", 1)[0] for line in (b / "metrics.csv").read_text().splitlines()]
    ma, mb = final_state(a), final_state(b)
    assert ma["model"].keys() == mb["model"].keys()
    for key in ma["model"]:  # torch tensors, or the Chainer backend's NumPy arrays
        assert np.array_equal(np.asarray(ma["model"][key]), np.asarray(mb["model"][key])), key
    assert repr(ma["scaler"]) == repr(mb["scaler"])


def chainer_or_skip() -> None:
    from adaloss.chainer.compat import is_chainer_available

    if not is_chainer_available():
        pytest.skip("Chainer is not installed")


KILLED_RUNS = [(method, "torch") for method in METHOD_OPTIONS] + [("adaptive", "chainer")]


@pytest.mark.parametrize("method,backend", KILLED_RUNS, ids=[f"{b}-{m}" for m, b in KILLED_RUNS])
def test_a_run_killed_with_sigkill_and_resumed_ends_exactly_like_an_uninterrupted_one(tmp_path, invoke, method,
                                                                                      backend):
    if backend == "chainer":
        chainer_or_skip()
    # 80 steps: well past the kill point, even on an idle machine
    config = resumable_config(tmp_path, method, iterations=80, backend=backend)
    reference = tmp_path / "reference"
    assert invoke("train", "--config", config, "--out", reference, "--quiet").exit_code == 0
    killed = tmp_path / "killed"
    proc = adaloss("train", "--config", str(config), "--out", str(killed), "--quiet")
    wait_for_steps(killed, random.Random(method).randint(5, 25), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert json.loads((killed / "meta.json").read_text())["status"] == "running"  # died without a word
    result = invoke("train", "--resume", killed, "--quiet")
    assert result.exit_code == 0, result.output
    meta = json.loads((killed / "meta.json").read_text())
    assert meta["status"] == "completed" and len(meta["resumed"]) == 1
    assert_same_run(reference, killed)


def test_sigterm_stops_cleanly_with_a_checkpoint_and_the_run_resumes(tmp_path, invoke):
    config = resumable_config(tmp_path, "dynamic", iterations=400)
    run_dir = tmp_path / "stopped"
    proc = adaloss("train", "--config", str(config), "--out", str(run_dir), "--quiet")
    wait_for_steps(run_dir, 6, proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "SIGTERM" in stderr and "--resume" in stderr and "Traceback" not in stderr
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["status"] == "interrupted"
    steps_done = (run_dir / "steps.jsonl").read_text().count("\n")
    assert (run_dir / "checkpoints" / f"step-{steps_done:08d}.ckpt").exists()
    assert not (run_dir / "summary.json").exists()
    assert invoke("train", "--resume", run_dir, "--quiet").exit_code == 0
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 400


def test_injected_nan_losses_skip_those_steps_and_training_goes_on(tmp_path, invoke, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "2,3,7")
    for method in METHOD_OPTIONS:
        config = resumable_config(tmp_path, method, iterations=10)
        run_dir = tmp_path / f"nan-{method}"
        result = invoke("train", "--config", config, "--out", run_dir, "--quiet")
        assert result.exit_code == 0, result.output
        steps = comparable_steps(run_dir)
        skipped = {s["step"] for s in steps if s["skipped"]}
        assert {2, 3, 7} <= skipped, method
        assert all(s["loss"] is None for s in steps if s["step"] in (2, 3, 7))
        # Any other skip is a genuine fp16 overflow of a large dynamic scale, with a finite loss.
        assert all(s["loss"] is not None for s in steps if s["step"] not in (2, 3, 7))
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["skipped_steps"] == len(skipped) and summary["status"] == "completed"
        model = final_state(run_dir)["model"]
        assert all(torch.isfinite(t).all() for t in model.values()), f"{method}: NaN reached the weights"
        assert summary["final_val_loss"] is not None  # evaluation saw finite weights


def test_a_loss_that_stays_nonfinite_stops_the_run_as_diverged(tmp_path, invoke, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, ",".join(str(i) for i in range(4, 30)))
    config = resumable_config(tmp_path, "dynamic", iterations=30)
    run_dir = tmp_path / "diverged"
    result = invoke("train", "--config", config, "--out", run_dir, "--quiet",
                    "--set", "training.max_consecutive_nonfinite=5")
    assert result.exit_code == 1
    assert "not finite for 5 steps in a row (up to step 8)" in result.output
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["status"] == "diverged"
    assert (run_dir / "steps.jsonl").read_text().count("\n") == 9


def test_the_fault_hook_is_not_reachable_from_a_config(tmp_path, invoke):
    config = resumable_config(tmp_path, "none")
    result = invoke("validate", config, "--set", "training.inject_nan=true")
    assert result.exit_code == 2


def test_resume_refuses_a_completed_a_foreign_and_an_incompatible_directory(tmp_path, invoke):
    config = resumable_config(tmp_path, "none", iterations=4)
    done = tmp_path / "done"
    assert invoke("train", "--config", config, "--out", done, "--quiet").exit_code == 0
    result = invoke("train", "--resume", done)
    assert result.exit_code == 2 and "already completed" in result.output
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not a run")
    result = invoke("train", "--resume", foreign)
    assert result.exit_code == 2 and "not an adaloss run directory" in result.output
    meta = json.loads((done / "meta.json").read_text())
    (done / "meta.json").write_text(json.dumps({**meta, "status": "interrupted"}))
    newest = sorted((done / "checkpoints").glob("*.ckpt"))[-1]
    record = read_checkpoint(newest)
    with open(newest, "wb") as handle:
        save_checkpoint(handle, {**record, "format": 999, "adaloss": "9.9"})
    result = invoke("train", "--resume", done)
    assert result.exit_code == 2 and "incompatible adaloss version" in result.output
    assert "Traceback" not in result.output


def test_a_torn_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, invoke):
    config = resumable_config(tmp_path, "adaptive", iterations=12)
    reference, damaged = tmp_path / "reference", tmp_path / "damaged"
    for run_dir in (reference, damaged):
        assert invoke("train", "--config", config, "--out", run_dir, "--quiet").exit_code == 0
    checkpoints = sorted((damaged / "checkpoints").glob("*.ckpt"))
    checkpoints[-1].write_bytes(checkpoints[-1].read_bytes()[:100])  # torn write of the final checkpoint
    meta = json.loads((damaged / "meta.json").read_text())
    (damaged / "meta.json").write_text(json.dumps({**meta, "status": "failed"}))
    assert invoke("train", "--resume", damaged, "--quiet").exit_code == 0
    assert_same_run(reference, damaged)


def test_two_concurrent_runs_into_one_output_root_never_share_a_directory(tmp_path):
    config = resumable_config(tmp_path, "none", iterations=6)
    procs = [adaloss("train", "--config", str(config), "--quiet") for _ in range(2)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    run_dirs = sorted((tmp_path / "runs").iterdir())
    assert len(run_dirs) == 2
    for run_dir in run_dirs:
        assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
        assert (run_dir / "steps.jsonl").read_text().count("\n") == 6


BAD_INPUTS = [
    # (what, extra CLI args or config edit, expected exit code, phrase)
    ("malformed YAML", {"text": "run: [unclosed\n"}, 2, "tiny.yaml:"),
    ("wrong type", {"set": ["training.batch_size=abc"]}, 2, "training.batch_size"),
    ("out of range", {"set": ["training.optimizer.lr=-1"]}, 2, "must be a number > 0"),
    ("unknown key", {"set": ["training.optimzer.lr=0.1"]}, 2, "did you mean"),
    ("unknown model", {"set": ["model.name=resnet9000"]}, 2, "model.name"),
    ("unknown dataset", {"set": ["data.name=imagenet"]}, 2, "data.name"),
    ("unknown method", {"set": ["loss_scaling.method=magic"]}, 2, "loss_scaling.method"),
    ("missing dataset folder", {"set": ["data.name=cifar10", "data.root=/nonexistent/cifar"]}, 2,
     "/nonexistent/cifar"),
    ("corrupt dataset", {"corrupt_mnist": True}, 2, "train-images-idx3-ubyte"),
    ("missing config file", {"config": "/nonexistent/config.yaml"}, 2, "/nonexistent/config.yaml"),
    ("cuda without cuda", {"args": ["--device", "cuda"]}, 2, "cuda"),
    ("backend not available", {"set": ["backend=tensorflow"]}, 2, "backend"),
    ("unwritable output", {"set": ["output.root=/proc/adaloss-runs"]}, 2, "/proc/adaloss-runs"),
    ("existing run directory", {"existing_out": True}, 2, "--overwrite"),
    ("resume and config together", {"args": ["--resume", "/tmp"]}, 2, "exactly one of"),
    # issue 19: user mistakes that were internal errors, runs without end or allocations without end
    ("huge fixed scale", {"set": ["loss_scaling.method=fixed", "loss_scaling.fixed.scale=1e300"]}, 2,
     "fixed.scale: got 1e+300; must be a number > 0 and <= 1e+38"),
    ("huge dynamic scale", {"set": ["loss_scaling.dynamic.init_scale=1e300"]}, 2, "<= 1e+38"),
    ("NUL in run.name", {"set": ['run.name="a\\0b"']}, 2, "must not contain control characters"),
    ("raw NUL in --set", {"set": ["run.name=a\0b"]}, 2, "special characters are not allowed"),
    ("run.name is a path", {"set": ["run.name=../x"]}, 2, "must be one folder name"),
    ("NUL in output.root", {"set": ['output.root="runs\\0x"']}, 2, "cannot contain a NUL character"),
    ("output.root is a file", {"root_file": True}, 2, "is not a directory; set output.root to a folder"),
    ("output.root is /dev/null", {"set": ["output.root=/dev/null"]}, 2, "'/dev/null' is not a directory"),
    ("layer too wide", {"set": ["model.hidden_sizes=[1000000000]"]}, 2, "<= 1048576"),
    ("model too large", {"set": ["model.hidden_sizes=[1000000, 1000000]"]}, 2, "parameters, more than the limit"),
    ("endless iterations", {"set": ["training.iterations=100000000000000000000"]}, 2, "<= 1000000000"),
    ("endless epochs", {"set": ["training.iterations=null", "training.epochs=1000000000"]}, 2,
     "optimizer steps (89 per epoch), more than the limit"),
    ("unreadable data.root", {"unreadable_root": True}, 2, "the folder cannot be read (permission denied)"),
]


@pytest.mark.parametrize("what,case,code,phrase", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gets_one_clean_error_and_writes_nothing(tmp_path, invoke, monkeypatch, what, case, code,
                                                          phrase):
    if what == "cuda without cuda" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    config = write_config(tmp_path / "tiny.yaml")
    if "text" in case:
        config.write_text(case["text"])
    args = ["train", "--config", case.get("config", config)]
    for item in case.get("set", []):
        args += ["--set", item]
    if case.get("corrupt_mnist"):
        mnist = tmp_path / "mnist"
        mnist.mkdir()
        for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                     "t10k-labels-idx1-ubyte"):
            (mnist / name).write_bytes(b"\x00\x00\x08\x03garbage")
        args += ["--set", "data.name=mnist", "--set", f"data.root={mnist}"]
    if case.get("root_file"):
        (tmp_path / "afile").write_text("not a folder")
        args += ["--set", f"output.root={tmp_path / 'afile'}"]
    if case.get("unreadable_root"):  # chmod cannot take read access from root, who runs the tests here
        import adaloss_cli.data.readers as readers

        (tmp_path / "mnist").mkdir()
        monkeypatch.setattr(readers.os, "access", lambda path, mode: Path(path) != tmp_path / "mnist")
        args += ["--set", "data.name=mnist", "--set", f"data.root={tmp_path / 'mnist'}"]
    if case.get("existing_out"):
        out = tmp_path / "existing"
        out.mkdir()
        (out / "keep.txt").write_text("precious")
        args += ["--out", out]
    args += case.get("args", [])
    result = invoke(*args)
    assert result.exit_code == code, result.output
    error_lines = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(error_lines) == 1 and phrase in result.output, result.output
    assert "Traceback" not in result.output
    runs = tmp_path / "runs"
    assert not runs.exists() or not any(runs.iterdir()), "a run directory was left behind"
    if case.get("existing_out"):
        assert (tmp_path / "existing" / "keep.txt").read_text() == "precious"


def test_a_full_disk_during_a_checkpoint_is_a_runtime_error_with_the_fix(tmp_path, invoke, monkeypatch):
    import adaloss_cli.results.checkpoints as checkpoints

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoints, "save_checkpoint", full_disk)
    config = resumable_config(tmp_path, "none", iterations=6)
    run_dir = tmp_path / "full"
    result = invoke("train", "--config", config, "--out", run_dir, "--quiet")
    assert result.exit_code == 1
    assert "No space left on device" in result.output and "free disk space" in result.output
    assert json.loads((run_dir / "meta.json").read_text())["status"] == "failed"
    assert not list((run_dir / "checkpoints").glob("*.tmp"))
