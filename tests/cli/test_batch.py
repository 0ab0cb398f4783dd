"""`adaloss batch`: sweep validation, runs, resume, failures, the aggregated summary, parallel jobs."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from adaloss_cli.cli import cli
from adaloss_cli.runs.sweep import load_sweep, point_name, short_keys, yaml_value

from helpers import write_config

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def write_sweep(folder: Path, **body) -> Path:
    """A sweep file next to a tiny fp16 base config (4 iterations)."""
    write_config(folder / "base.yaml", precision={"dtype": "float16"}, training={"iterations": 4})
    path = folder / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": "base.yaml", "out": str(folder / "sweep"), **body}, sort_keys=False))
    return path


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_grid_runs_every_combination_and_aggregates_over_seeds(tmp_path):
    sweep = write_sweep(tmp_path, grid={"loss_scaling.method": ["none", "fixed"], "run.seed": [0, 1]})
    result = run_cli("batch", sweep, "--quiet", "--no-plots")
    assert result.exit_code == 0, result.output
    out = tmp_path / "sweep"
    assert result.stdout.strip() == str(out)
    names = ["method=none,seed=0", "method=none,seed=1", "method=fixed,seed=0", "method=fixed,seed=1"]
    index = json.loads((out / "index.json").read_text())
    assert index["kind"] == "sweep" and index["swept"] == ["loss_scaling.method", "run.seed"]
    assert [entry["name"] for entry in index["runs"]] == names
    assert all(entry["status"] == "completed" for entry in index["runs"])
    assert index["runs"][1]["overrides"] == {"loss_scaling.method": "none", "run.seed": 1}
    for name in names:
        summary = summary_of(out / "runs" / name)
        assert (summary["method"], summary["seed"]) == (name.split(",")[0][7:], int(name[-1]))
    rows = read_csv(out / "summary.csv")
    assert [row["loss_scaling.method"] for row in rows] == ["none", "fixed"]
    for row in rows:
        accs = [summary_of(out / "runs" / f"method={row['loss_scaling.method']},seed={s}")["final_val_accuracy"]
                for s in (0, 1)]
        assert float(row["final_val_accuracy_mean"]) == pytest.approx(statistics.mean(accs), rel=1e-12)
        assert float(row["final_val_accuracy_std"]) == pytest.approx(statistics.stdev(accs), rel=1e-12)
        assert row["completed"] == "2"
    assert "| loss_scaling.method |" in (out / "summary.md").read_text()


def test_second_invocation_skips_finished_runs_and_reruns_a_failed_one(tmp_path):
    sweep = write_sweep(tmp_path, grid={"training.optimizer.lr": [0.05, 0.1]})
    assert run_cli("batch", sweep, "--quiet", "--no-plots").exit_code == 0
    runs = tmp_path / "sweep" / "runs"
    done, failed = runs / "lr=0.05", runs / "lr=0.1"
    before = (done / "summary.json").stat().st_mtime_ns, (done / "meta.json").read_text()
    meta = json.loads((failed / "meta.json").read_text())
    (failed / "summary.json").unlink()
    (failed / "meta.json").write_text(json.dumps({**meta, "status": "failed", "error": "made up"}))
    (failed / "marker").write_text("left by the failed run")

    result = run_cli("batch", sweep, "--no-plots")
    assert result.exit_code == 0, result.output
    assert "Skipping 1 finished runs of 2" in result.stderr
    assert ((done / "summary.json").stat().st_mtime_ns, (done / "meta.json").read_text()) == before
    assert not (failed / "marker").exists()  # the failed run's directory was started afresh
    assert json.loads((failed / "meta.json").read_text())["status"] == "completed"
    assert summary_of(failed)["steps"] == 4

    # A finished run made with other settings is never silently reused.
    sweep.write_text(sweep.read_text() + "set: {training.batch_size: 8}\n")
    result = run_cli("batch", sweep, "--no-plots")
    assert result.exit_code == 2 and "made with other settings" in result.stderr
    assert "training.batch_size: 16 -> 8" in result.stderr


# batch_size 5000 passes validation but exceeds the 1,437 training examples: a failure at run time.
FAILING = [{"training.optimizer.lr": 0.05}, {"training.batch_size": 5000}, {"training.optimizer.lr": 0.1}]


def test_first_failure_stops_the_sweep_after_writing_what_finished(tmp_path):
    sweep = write_sweep(tmp_path, list=FAILING)
    result = run_cli("batch", sweep, "--quiet", "--no-plots")
    assert result.exit_code == 1
    assert "batch_size=5000" in result.stderr and "1 runs not started" in result.stderr
    out = tmp_path / "sweep"
    statuses = [entry["status"] for entry in json.loads((out / "index.json").read_text())["runs"]]
    assert statuses == ["completed", "missing", "pending"]
    assert "batch_size" in json.loads((out / "index.json").read_text())["runs"][1]["error"]
    rows = read_csv(out / "summary.csv")
    assert [(row["completed"], row["not_run"]) for row in rows] == [("1", "0"), ("0", "1"), ("0", "1")]
    assert rows[1]["final_val_accuracy_mean"] == ""  # nothing invented for a run that did not complete


def test_continue_on_error_runs_the_others(tmp_path):
    sweep = write_sweep(tmp_path, list=FAILING)
    result = run_cli("batch", sweep, "--continue-on-error", "--no-plots", "--json")
    assert result.exit_code == 1
    assert "1 of 3 runs failed" in result.stderr
    rows = json.loads(result.stdout)["rows"]
    assert [row["completed"] for row in rows] == [1, 0, 1]
    runs = tmp_path / "sweep" / "runs"
    assert (runs / "lr=0.05" / "summary.json").is_file() and (runs / "lr=0.1" / "summary.json").is_file()


def test_invalid_sweep_reports_every_problem_before_running(tmp_path):
    sweep = write_sweep(tmp_path, sett={"training.epochs": 2}, set={"training.epoch": 2},
                        grid={"loss_scaling.metod": ["none"], "training.optimizer.lr": [0.1, -1], "run.seed": 3})
    result = run_cli("batch", sweep)
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert lines[0].startswith("Error: Invalid sweep file") and "(5 problems)" in lines[0]
    for key in ("sett:", "grid.run.seed:", "set.training.epoch:", "grid.loss_scaling.metod:",
                "grid.training.optimizer.lr: got -1"):
        assert sum(key in line for line in lines) == 1, (key, result.stderr)
    assert not (tmp_path / "sweep").exists()


def test_jobs_run_children_as_parallel_processes(tmp_path, monkeypatch):
    sweep = write_sweep(tmp_path, grid={"loss_scaling.method": ["none", "dynamic"]})
    # Children run this adaloss even where `python -m adaloss_cli` would import another (a source tree's root).
    (tmp_path / "cwd" / "adaloss_cli").mkdir(parents=True)
    (tmp_path / "cwd" / "adaloss_cli" / "__init__.py").write_text("raise SystemExit('wrong adaloss_cli')\n")
    monkeypatch.chdir(tmp_path / "cwd")
    result = run_cli("batch", sweep, "--jobs", "2", "--quiet", "--no-plots")
    assert result.exit_code == 0, result.output
    runs = tmp_path / "sweep" / "runs"
    for name in ("method=none", "method=dynamic"):
        meta = json.loads((runs / name / "meta.json").read_text())
        assert meta["status"] == "completed"
        assert meta["command"][:2] == ["adaloss", "train"]  # its own `train` process, not this one
        assert summary_of(runs / name)["steps"] == 4


def test_shipped_sweep_example_is_valid_and_runs_by_name(tmp_path, monkeypatch):
    path = REPO / "configs" / "sweeps" / "digits.yaml"
    sweep = load_sweep(path)
    assert len(sweep.points) == 12 and sweep.out == Path("runs/sweep-digits")
    monkeypatch.chdir(tmp_path)
    result = run_cli("batch", "sweeps/digits", "--dry-run")
    assert result.exit_code == 0 and result.stdout.count("method=") == 12


def test_set_overrides_every_run_but_not_a_swept_key(tmp_path):
    sweep = write_sweep(tmp_path, grid={"loss_scaling.method": ["none"]})
    result = run_cli("batch", sweep, "--set", "training.iterations=2", "--quiet", "--no-plots")
    assert result.exit_code == 0, result.output
    assert summary_of(tmp_path / "sweep" / "runs" / "method=none")["steps"] == 2
    assert json.loads((tmp_path / "sweep" / "index.json").read_text())["overrides"] == ["training.iterations=2"]
    result = run_cli("batch", sweep, "--set", "loss_scaling.method=fixed", "--dry-run")
    assert result.exit_code == 2
    assert f"{sweep}: --set: loss_scaling.method is swept by this file" in result.stderr


def test_validate_checks_a_sweep_as_a_sweep_and_batch_refuses_an_experiment_config(tmp_path):
    sweep = write_sweep(tmp_path, grid={"training.optimizer.lr": [0.1, -1]})
    result = run_cli("validate", sweep)
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [f"Invalid sweep file {sweep} (1 problem):",
                                          f"  {sweep}: grid.training.optimizer.lr: got -1.0; must be a number > 0"
                                          " (in lr=-1)"]
    result = run_cli("batch", tmp_path / "base.yaml")
    assert result.exit_code == 2 and "is an experiment config, not a sweep file" in result.stderr


def test_run_names_and_override_values():
    keys = ["loss_scaling.method", "training.optimizer.lr", "run.seed", "loss_scaling.fixed.scale",
            "loss_scaling.dynamic.init_scale", "loss_scaling.adaptive.init_scale"]
    short = short_keys(keys)
    assert short["training.optimizer.lr"] == "lr" and short["loss_scaling.fixed.scale"] == "scale"
    assert short["loss_scaling.dynamic.init_scale"] == "dynamic.init_scale"
    assert point_name({"loss_scaling.method": "none", "run.seed": 0, "training.optimizer.lr": 0.05}, short) == \
        "method=none,seed=0,lr=0.05"
    assert point_name({"data.root": "/data/x y"}, {"data.root": "root"}) == "root=_data_x_y"
    assert len(point_name({"model.hidden_sizes": list(range(100))}, {"model.hidden_sizes": "h"})) <= 120
    for value in (1e-05, 1e20, 0.1, -3, True, None, "none", "a: b", [64, 64], {"lr": 1e-3}, float("inf")):
        assert yaml.safe_load(yaml_value(value)) == value
