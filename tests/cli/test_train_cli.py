"""`adaloss train`, `validate`, `env` and `--help` end to end through click: exit codes, messages, run directories."""

from __future__ import annotations

import csv
import datetime as dt
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from adaloss_cli.cli import COMMANDS
from adaloss_cli.config import load_config, load_config_dict
from adaloss_cli.experiment import resolved_config_dict
from adaloss_cli.results.run_writer import METRICS_COLUMNS, SCALES_COLUMNS
from adaloss_cli.results.locks import LOCK_FILE
from adaloss_cli.results.rundir import MARKER, RUN_FILES

from helpers import write_config

torch = pytest.importorskip("torch")

ITERATIONS = 6
REQUIRED_FILES = {"config.yaml", "meta.json", "steps.jsonl", "metrics.csv", "summary.json"}
STEP_KEYS = {"step", "epoch", "loss", "scale", "overflow", "skipped", "retries", "lr", "elapsed_s"}
SUMMARY_KEYS = {"status", "final_val_accuracy", "best_val_accuracy", "final_val_loss", "final_train_loss", "steps",
                "skipped_steps", "final_scale", "wall_time_s", "time_per_step_s", "peak_memory_mb"}
# The scale of every step of a 6-step run: no method grows or backs off that early.
EXPECTED_SCALE = {"none": 1.0, "fixed": 128.0, "dynamic": 2.0 ** 16}


def train(invoke, config: Path, out: Path, *extra: str):
    """`adaloss train --config CONFIG --out OUT --quiet --device cpu EXTRA...`."""
    return invoke("train", "--config", config, "--out", out, "--quiet", "--device", "cpu", *extra)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("method", ["none", "fixed", "dynamic"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_train_writes_every_file_of_the_run_directory(invoke, tmp_path, method, dtype):
    config = write_config(tmp_path / "c.yaml", precision={"dtype": dtype}, loss_scaling={"method": method})
    out = tmp_path / "run"
    result = train(invoke, config, out)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(out)
    written = {p.name for p in out.iterdir()}
    assert REQUIRED_FILES <= written <= {*RUN_FILES, MARKER, LOCK_FILE}, written
    if "scales.csv" in written:  # per-layer records of the recorded steps (every record_every = 2 steps)
        with open(out / "scales.csv", newline="") as handle:
            reader = csv.DictReader(handle)
            assert tuple(reader.fieldnames) == SCALES_COLUMNS
            assert {int(row["step"]) for row in reader} <= {0, 2, 4, 5}

    steps = read_jsonl(out / "steps.jsonl")
    assert [s["step"] for s in steps] == list(range(ITERATIONS))
    for s in steps:
        assert set(s) == STEP_KEYS
        assert s["scale"] == EXPECTED_SCALE[method]
        assert s["overflow"] is False and s["skipped"] is False and s["retries"] == 0
        assert isinstance(s["loss"], float) and 0 < s["loss"] < 10

    with open(out / "metrics.csv", newline="") as handle:
        reader = csv.DictReader(handle)
        rows = list(reader)
    assert tuple(reader.fieldnames) == METRICS_COLUMNS
    assert len(rows) == 1  # 6 steps of 16 stay inside the first epoch of digits
    assert (rows[0]["epoch"], rows[0]["step"], rows[0]["skipped_steps"]) == ("1", str(ITERATIONS), "0")

    summary = json.loads((out / "summary.json").read_text())
    assert SUMMARY_KEYS <= set(summary)
    assert summary["status"] == "completed"
    assert (summary["method"], summary["precision"], summary["device"]) == (method, dtype, "cpu")
    assert summary["steps"] == ITERATIONS and summary["skipped_steps"] == 0
    assert summary["final_scale"] == EXPECTED_SCALE[method]
    assert 0.0 <= summary["final_val_accuracy"] <= 1.0
    assert summary["best_val_accuracy"] == summary["final_val_accuracy"]
    assert float(rows[0]["val_accuracy"]) == pytest.approx(summary["final_val_accuracy"])
    assert float(rows[0]["train_loss"]) == pytest.approx(summary["final_train_loss"])
    assert summary["final_train_loss"] == pytest.approx(sum(s["loss"] for s in steps) / ITERATIONS)
    assert summary["time_per_step_s"] > 0 and summary["wall_time_s"] >= 0 and summary["peak_memory_mb"] > 0

    meta = json.loads((out / "meta.json").read_text())
    assert meta["status"] == "completed"
    assert meta["device"] == "cpu" and meta["backend"] == "torch"
    assert meta["versions"]["torch"] == torch.__version__
    assert {"adaloss", "python", "numpy"} <= set(meta["versions"])
    assert meta["command"] == ["adaloss", "train", "--config", str(config), "--out", str(out), "--quiet",
                               "--device", "cpu"]
    assert dt.datetime.fromisoformat(meta["started"]) <= dt.datetime.fromisoformat(meta["finished"])

    # config.yaml is the config as run: it reloads to the same experiment, and writing that again changes nothing.
    ran = load_config(config, ["device=cpu"])
    reloaded = load_config(out / "config.yaml")
    assert reloaded == load_config_dict(resolved_config_dict(ran))
    assert reloaded.loss_scaling.dynamic.resolved() == ran.loss_scaling.dynamic.resolved()
    for name in ("run", "backend", "device", "model", "data", "training", "precision", "output"):
        assert getattr(reloaded, name) == getattr(ran, name), name
    assert reloaded.loss_scaling.method == method and reloaded.loss_scaling.fixed == ran.loss_scaling.fixed
    assert resolved_config_dict(reloaded) == yaml.safe_load((out / "config.yaml").read_text())


def test_default_run_directory_is_new_under_output_root_and_named_by_method(invoke, tiny_config):
    first = invoke("train", "--config", tiny_config, "--quiet", "--device", "cpu", "--set", "training.iterations=2")
    second = invoke("train", "--config", tiny_config, "--quiet", "--device", "cpu", "--set", "training.iterations=2")
    assert first.exit_code == 0 and second.exit_code == 0, first.output + second.output
    dirs = [Path(r.stdout.strip()) for r in (first, second)]
    assert dirs[0] != dirs[1]
    for run_dir in dirs:
        assert run_dir.parent == tiny_config.parent / "runs"
        assert run_dir.name.startswith("t-dynamic-")
        assert (run_dir / "summary.json").is_file()


def test_checkpoint_every_null_writes_only_the_final_checkpoint(invoke, tiny_config, tmp_path):
    # The key's help says "null: only at the end"; the config used to refuse null.
    out = tmp_path / "run"
    result = train(invoke, tiny_config, out, "--set", "training.iterations=3", "--set", "output.checkpoint_every=null")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000003.ckpt"]


def test_train_without_quiet_prints_the_summary(invoke, tiny_config, tmp_path):
    result = invoke("train", "--config", tiny_config, "--out", tmp_path / "run", "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert "val accuracy" in result.stdout
    assert f"Run directory: {tmp_path / 'run'}" in result.stdout


def test_train_json_prints_the_summary_alone_on_stdout(invoke, tiny_config, tmp_path):
    result = invoke("train", "--config", tiny_config, "--out", tmp_path / "run", "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert printed == {"kind": "run", "dir": str(tmp_path / "run"),
                       "summary": json.loads((tmp_path / "run" / "summary.json").read_text())}


def test_progress_on_a_redirected_stderr_is_plain_lines_showing_the_layer_scales(invoke, tmp_path):
    config = write_config(tmp_path / "c.yaml", precision={"dtype": "float16"}, loss_scaling={"method": "adaptive"},
                          output={"progress": True})
    result = invoke("train", "--config", config, "--out", tmp_path / "run", "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert "\r" not in result.stderr and "\x1b" not in result.stderr  # no bar drawn into a log
    progress = [line for line in result.stderr.splitlines() if line.startswith("t: ")]
    assert [line.split(" steps")[0] for line in progress] == [f"t: {n}/{ITERATIONS}" for n in range(1, 7)]
    assert all(re.search(r", scales=2\^-?\d+(\.\.2\^-?\d+ \(median 2\^-?\d+\))?, skipped=0", line)
               for line in progress), progress


def test_existing_out_is_refused_without_overwrite_and_replaced_with_it(invoke, tiny_config, tmp_path):
    out = tmp_path / "run"
    assert train(invoke, tiny_config, out).exit_code == 0
    (out / "keep.txt").write_text("mine")
    summary_before = (out / "summary.json").read_text()

    refused = train(invoke, tiny_config, out)
    assert refused.exit_code == 2
    assert "--overwrite" in refused.stderr and str(out) in refused.stderr
    assert (out / "keep.txt").read_text() == "mine"
    assert (out / "summary.json").read_text() == summary_before

    replaced = train(invoke, tiny_config, out, "--overwrite")
    assert replaced.exit_code == 0, replaced.output
    assert not (out / "keep.txt").exists()
    assert json.loads((out / "meta.json").read_text())["status"] == "completed"


def test_empty_existing_out_is_used_as_is(invoke, tiny_config, tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    assert train(invoke, tiny_config, out).exit_code == 0
    assert (out / "summary.json").is_file()


def assert_nothing_written(tmp_path: Path) -> None:
    assert not (tmp_path / "runs").exists()
    assert not (tmp_path / "run").exists()


def test_bad_config_exits_2_naming_both_problems_and_writes_nothing(invoke, tmp_path):
    config = write_config(tmp_path / "c.yaml", traning={"iterations": 3}, model={"name": "mlpp"})
    result = train(invoke, config, tmp_path / "run")
    assert result.exit_code == 2
    assert "traning" in result.stderr and "mlpp" in result.stderr
    assert "Traceback" not in result.output
    assert_nothing_written(tmp_path)


def test_missing_config_file_exits_2_naming_it(invoke, tmp_path):
    result = invoke("train", "--config", tmp_path / "nope.yaml", "--out", tmp_path / "run")
    assert result.exit_code == 2
    assert "nope.yaml" in result.stderr and "cannot read" in result.stderr
    assert_nothing_written(tmp_path)


def test_bad_override_exits_2_and_writes_nothing(invoke, tiny_config, tmp_path):
    result = invoke("train", "--config", tiny_config, "--set", "training.optimizer.lr=-1")
    assert result.exit_code == 2
    assert "training.optimizer.lr" in result.stderr and "--set" in result.stderr
    assert_nothing_written(tmp_path)


def test_missing_cifar_folder_exits_2_naming_it_and_leaves_no_run_directory(invoke, tmp_path):
    missing = tmp_path / "nonexistent"
    config = write_config(tmp_path / "c.yaml", data={"name": "cifar10", "root": str(missing)})
    for out in ([], ["--out", tmp_path / "run"]):
        result = invoke("train", "--config", config, "--quiet", "--device", "cpu", *out)
        assert result.exit_code == 2
        assert str(missing) in result.stderr
        assert_nothing_written(tmp_path)


@pytest.mark.parametrize("overrides, fragment", [
    (["training.batch_size=5000"], "training.batch_size 5000"),
    (["training.batch_size=800", "training.grad_accum_steps=2"], "grad_accum_steps"),
])
def test_batch_too_large_for_the_data_exits_2_and_leaves_no_run_directory(invoke, tiny_config, tmp_path,
                                                                         overrides, fragment):
    sets = [arg for o in overrides for arg in ("--set", o)]
    result = invoke("train", "--config", tiny_config, "--quiet", "--device", "cpu", *sets)
    assert result.exit_code == 2
    assert fragment in result.stderr
    assert_nothing_written(tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_exits_2(invoke, tiny_config, tmp_path):
    result = invoke("train", "--config", tiny_config, "--device", "cuda", "--out", tmp_path / "run")
    assert result.exit_code == 2
    assert "cuda" in result.stderr and "--device cpu" in result.stderr
    assert_nothing_written(tmp_path)


def test_a_backend_that_is_not_installed_is_refused_clearly(invoke, tiny_config, tmp_path, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "chainer" else real_find_spec(name, *a))
    result = invoke("train", "--config", tiny_config, "--set", "backend=chainer")
    assert result.exit_code == 2
    assert "needs the 'chainer' package" in result.stderr and "make install-chainer" in result.stderr
    assert_nothing_written(tmp_path)


def test_divergence_at_the_floor_exits_1_and_marks_the_run_diverged(invoke, tiny_config, tmp_path):
    # fp16 overflows at 2**40 whatever the floor, so deepspeed's on_floor: raise stops the run on its third step.
    out = tmp_path / "run"
    result = train(invoke, tiny_config, out, "--set", "precision.dtype=float16",
                   "--set", "loss_scaling.dynamic.preset=deepspeed",
                   "--set", "loss_scaling.dynamic.init_scale=1099511627776",
                   "--set", "loss_scaling.dynamic.min_scale=549755813888")
    assert result.exit_code == 1
    assert "floor" in result.stderr and "Traceback" not in result.output
    meta = json.loads((out / "meta.json").read_text())
    assert meta["status"] == "diverged" and "floor" in meta["error"]
    assert meta["finished"] is not None
    assert not (out / "summary.json").exists()
    steps = read_jsonl(out / "steps.jsonl")
    assert len(steps) == 2 and all(s["skipped"] and s["overflow"] for s in steps)


def test_python_dash_m_runs_the_cli():
    result = subprocess.run([sys.executable, "-m", "adaloss_cli", "--help"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert "Usage: adaloss" in result.stdout


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_every_help_exits_0_with_an_example(invoke, command):
    result = invoke(*([command] if command else []), "--help")
    assert result.exit_code == 0
    assert "Example" in result.stdout


def test_help_and_validate_do_not_import_torch(tiny_config):
    script = f"""
import sys
from click.testing import CliRunner
from adaloss_cli.cli import COMMANDS, cli
for args in [['--help'], *[[name, '--help'] for name in COMMANDS], ['validate', {str(tiny_config)!r}]]:
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, (args, result.output)
    assert 'torch' not in sys.modules, args
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_env_prints_versions_and_backends(invoke):
    result = invoke("env")
    assert result.exit_code == 0
    assert f"torch: {torch.__version__}" in result.stdout
    assert "backend torch: installed" in result.stdout


def test_env_json_and_the_install_command_of_a_missing_backend(invoke, monkeypatch):
    data = json.loads(invoke("env", "--json").stdout)
    assert data["packages"]["torch"] == torch.__version__ and data["backends"]["torch"]["installed"] is True
    assert data["backends"]["torch"]["devices"][0] == "cpu"
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "chainer" else real_find_spec(name, *a))
    lines = invoke("env").stdout.splitlines()
    assert "backend chainer: not installed; install it with: pip install 'setuptools>=77,<81' && pip install " \
           "--no-build-isolation 'adaloss[chainer]' (in a checkout: make install-chainer)" in lines


@pytest.mark.parametrize("command", [["env"], ["configs"], ["validate", "digits"]])
def test_a_closed_stdout_stops_the_command_quietly_as_a_unix_tool(command):
    from adaloss_cli.self_command import adaloss_command

    # `adaloss env | head -1`: the reader goes away; here it is gone before the first line is written.
    proc = subprocess.Popen([*adaloss_command(), *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    stderr = proc.communicate(timeout=60)[1].decode()
    assert (proc.returncode, stderr) == (128 + 13, "")  # 128 + SIGPIPE, no "internal error BrokenPipeError"


def test_validate_good_file_exits_0(invoke, tiny_config):
    result = invoke("validate", tiny_config)
    assert result.exit_code == 0
    assert result.stdout.strip() == f"{tiny_config}: ok"


def test_validate_reports_a_misspelled_key_and_a_bad_value_on_two_lines(invoke, tmp_path, tiny_config):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: {name: t}\ntraning: {iterations: 3}\nmodel: {name: mlpp}\n")
    result = invoke("validate", tiny_config, bad)
    assert result.exit_code == 2
    assert f"{tiny_config}: ok" in result.stdout
    problems = [line.strip() for line in result.stderr.splitlines() if line.startswith("  ")]
    assert len(problems) == 2, result.stderr
    assert problems[0].startswith(f"{bad}:2: traning: unknown key") and "did you mean 'training'" in problems[0]
    assert problems[1].startswith(f"{bad}:3: model.name: got 'mlpp'") and "did you mean 'mlp'" in problems[1]
    assert f"Invalid config {bad} (2 problems):" in result.stderr


def test_validate_missing_file_exits_2(invoke, tmp_path):
    result = invoke("validate", tmp_path / "nope.yaml")
    assert result.exit_code == 2
    assert "nope.yaml" in result.stderr


def test_overwrite_refuses_a_directory_that_is_not_a_run(invoke, tiny_config, tmp_path):
    out = tmp_path / "my-project"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    result = train(invoke, tiny_config, out, "--overwrite")
    assert result.exit_code == 2
    assert "not an adaloss run directory" in result.stderr
    assert (out / "thesis.tex").read_text() == "years of work"
