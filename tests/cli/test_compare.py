"""`adaloss compare` end to end with tiny real runs: the comparison directory, its numbers, its plots, bad input."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

import pytest
from click.testing import CliRunner

from adaloss_cli.cli import cli
from adaloss_cli.commands.compare import expand_seeds, parse_seeds
from adaloss_cli.runs.methods import parse_method

from helpers import write_config

torch = pytest.importorskip("torch")

METHODS = ["fp32", "none", "fixed:1", "adaptive"]
SEEDS = [0, 1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run_cli(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    return result


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def check_png(path: Path) -> None:
    """A real, non-trivial PNG image."""
    from matplotlib.image import imread

    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    assert len(data) > 5000, (path, len(data))
    height, width = imread(path).shape[:2]
    assert height > 200 and width > 400, (path, width, height)


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
    """One fp16 comparison of four methods over two seeds (eight 6-step runs); (directory, --json output)."""
    folder = tmp_path_factory.mktemp("compare")
    config = write_config(folder / "c.yaml", precision={"dtype": "float16"})
    out = folder / "cmp"
    result = run_cli("compare", *METHODS, "--config", config, "--seeds", *SEEDS, "--device", "cpu", "--out", out,
                     "--quiet", "--json")
    assert result.exit_code == 0, result.output
    return out, json.loads(result.stdout)


def test_comparison_directory_holds_index_table_plots_and_children(comparison):
    out, _ = comparison
    names = {p.name for p in out.iterdir()}
    assert {"index.json", "comparison.csv", "comparison.md", "training.png", "loss_scale.png", "underflow.png",
            "runs"} <= names
    index = json.loads((out / "index.json").read_text())
    assert index["kind"] == "compare" and index["methods"] == METHODS and index["seeds"] == SEEDS
    assert index["baseline"] == "fp32"
    dirs = sorted(entry["dir"] for entry in index["runs"])
    assert dirs == sorted(f"runs/{m.replace(':', '-')}-seed{s}" for m in METHODS for s in SEEDS)
    for entry in index["runs"]:
        assert entry["status"] == "completed"
        summary = json.loads((out / entry["dir"] / "summary.json").read_text())
        assert summary["seed"] == entry["seed"]
        assert summary["precision"] == ("float32" if entry["method"] == "fp32" else "float16")


def test_table_numbers_are_the_childrens_summaries(comparison):
    out, printed = comparison
    rows = read_csv(out / "comparison.csv")
    assert [row["method"] for row in rows] == METHODS
    assert printed["kind"] == "compare" and [r["method"] for r in printed["rows"]] == METHODS
    fp32_mean = None
    for row, json_row in zip(rows, printed["rows"]):
        summaries = [json.loads((out / "runs" / f"{row['method'].replace(':', '-')}-seed{s}" / "summary.json")
                                .read_text()) for s in SEEDS]
        for key in ("final_val_accuracy", "best_val_accuracy"):
            values = [s[key] for s in summaries]
            assert float(row[f"{key}_mean"]) == pytest.approx(statistics.mean(values), rel=1e-12)
            assert float(row[f"{key}_std"]) == pytest.approx(statistics.stdev(values), rel=1e-12)
            assert json_row[f"{key}_mean"] == pytest.approx(statistics.mean(values), rel=1e-12)
        for key in ("final_train_loss", "final_val_loss", "skipped_steps", "overflow_steps", "time_per_step_s"):
            assert float(row[f"{key}_mean"]) == pytest.approx(statistics.mean(s[key] for s in summaries))
        assert float(row["underflow_mean"]) == pytest.approx(statistics.mean(s["underflow_mean"] for s in summaries))
        assert float(row["underflow_worst"]) == max(s["underflow_worst"] for s in summaries)
        assert float(row["peak_memory_mb_max"]) == max(s["peak_memory_mb"] for s in summaries)
        assert (row["completed"], row["failed"], row["diverged"]) == ("2", "0", "0")
        if row["method"] == "fp32":
            fp32_mean = statistics.mean(s["final_val_accuracy"] for s in summaries)
        gap = statistics.mean(s["final_val_accuracy"] for s in summaries) - fp32_mean
        assert float(row["final_val_accuracy_gap"]) == pytest.approx(gap, abs=1e-12)
    md = (out / "comparison.md").read_text()
    assert "| fp32 " in md and "baseline" in md and "Δ vs fp32" in md
    acc = statistics.mean(json.loads((out / f"runs/none-seed{s}/summary.json").read_text())["final_val_accuracy"]
                          for s in SEEDS)
    assert f"{acc * 100:.2f}" in md


def test_plots_are_real_images(comparison):
    out, _ = comparison
    for name in ("training.png", "loss_scale.png", "underflow.png"):
        check_png(out / name)


def test_same_seed_gives_every_method_the_same_start(tmp_path):
    # Same seed: same initial weights and data order. In float32 a loss scale of 1 changes nothing at all.
    config = write_config(tmp_path / "c.yaml")
    out = tmp_path / "cmp"
    result = run_cli("compare", "none", "fixed:1", "--config", config, "--set", "precision.dtype=float32",
                     "--device", "cpu", "--out", out, "--no-plots", "--quiet")
    assert result.exit_code == 0, result.output
    assert "float32" in result.stderr  # the warning that loss scaling changes nothing in float32
    losses = {}
    for name in ("none-seed0", "fixed-1-seed0"):
        lines = (out / "runs" / name / "steps.jsonl").read_text().splitlines()
        losses[name] = [json.loads(line)["loss"] for line in lines]
    assert losses["none-seed0"][0] == losses["fixed-1-seed0"][0]
    assert losses["none-seed0"] == losses["fixed-1-seed0"]


def test_default_out_is_a_new_directory_under_output_root(tmp_path):
    config = write_config(tmp_path / "c.yaml", training={"iterations": 2})
    first = run_cli("compare", "none", "--config", config, "--device", "cpu", "--no-plots", "--quiet")
    second = run_cli("compare", "none", "--config", config, "--device", "cpu", "--no-plots", "--quiet")
    assert first.exit_code == 0 and second.exit_code == 0, first.output + second.output
    dirs = [Path(r.stdout.strip()) for r in (first, second)]
    assert dirs[0] != dirs[1]
    for folder in dirs:
        assert folder.parent == tmp_path / "runs" and folder.name.startswith("compare-t-")
        assert (folder / "runs/none-seed0/summary.json").is_file()


def test_an_existing_out_directory_is_never_reused(tmp_path):
    config = write_config(tmp_path / "c.yaml")
    out = tmp_path / "cmp"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    result = run_cli("compare", "none", "--config", config, "--out", out)
    assert result.exit_code == 2 and "already holds files" in result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


@pytest.mark.parametrize("spec", ["fixd", "fixed:abc", "fixed:-1", "dynamic:foo", "adaptive:bogus", "none:1",
                                  "fp32:x", "1"])
def test_unknown_method_spec_is_exit_2_naming_it_and_the_allowed_forms(tmp_path, spec):
    config = write_config(tmp_path / "c.yaml")
    result = run_cli("compare", "none", spec, "--config", config, "--out", tmp_path / "cmp")
    assert result.exit_code == 2, result.output
    assert f"method '{spec}'" in result.stderr and "allowed forms" in result.stderr
    assert "dynamic:<preset>" in result.stderr and "fp32" in result.stderr
    assert not (tmp_path / "cmp").exists()


def test_method_given_twice_is_exit_2(tmp_path):
    config = write_config(tmp_path / "c.yaml")
    result = run_cli("compare", "fixed:128.0", "fixed:128", "--config", config)
    assert result.exit_code == 2 and "given twice" in result.stderr
    # fixed is fixed:128 when the config's scale is 128: the same runs twice
    result = run_cli("compare", "fixed", "fixed:128", "--config", config)
    assert result.exit_code == 2 and "run the same config" in result.stderr
    assert not (tmp_path / "runs").exists()


def test_config_problems_stop_compare_before_any_run(tmp_path):
    config = write_config(tmp_path / "c.yaml")
    result = run_cli("compare", "none", "fixed", "--config", config, "--set", "training.optimizer.lr=-1",
                     "--set", "training.epoch=2", "--out", tmp_path / "cmp")
    assert result.exit_code == 2
    assert "training.optimizer.lr" in result.stderr and "training.epoch" in result.stderr
    assert result.stderr.count("training.optimizer.lr: got") == 1  # reported once, not once per method
    assert not (tmp_path / "cmp").exists()


def test_help_lists_every_method_form():
    from adaloss.options import ADAPTIVE_METHODS, DYNAMIC_PRESETS

    text = run_cli("compare", "--help").stdout
    assert all(name in text for name in (*DYNAMIC_PRESETS, *ADAPTIVE_METHODS, "fp32", "fixed:SCALE", "Example"))


def test_method_specs_become_overrides():
    assert parse_method("fp32").overrides == ("precision.dtype=float32", "loss_scaling.method=none")
    assert parse_method("fixed:128.0").label == "fixed:128"
    assert parse_method("fixed:1e3").overrides[-1] == "loss_scaling.fixed.scale=1000"
    assert parse_method("dynamic:deepspeed").overrides[-1] == "loss_scaling.dynamic.preset=deepspeed"
    assert parse_method("adaptive:abs_range").overrides[-1] == "loss_scaling.adaptive.loss_scale_method=abs_range"
    assert parse_method("adaptive:abs_range").dir_name == "adaptive-abs_range"


def test_seeds_take_several_values():
    assert expand_seeds(["none", "--seeds", "0", "1", "2", "fixed"]) == [
        "none", "--seeds", "0", "--seeds", "1", "--seeds", "2", "fixed"]
    assert expand_seeds(["--seeds", "0", "--config", "x"]) == ["--seeds", "0", "--config", "x"]
    assert parse_seeds(("0", "1")) == [0, 1]
    assert parse_seeds(("0,2", "3-4")) == [0, 2, 3, 4]
    with pytest.raises(Exception, match="twice"):
        parse_seeds(("0", "0"))
    with pytest.raises(Exception, match="integers"):
        parse_seeds(("a",))


def test_a_diverged_method_keeps_its_row_without_invented_numbers(tmp_path, monkeypatch):
    from adaloss_cli import engine

    fault_env = getattr(engine, "FAULT_ENV", None)
    if fault_env is None:
        pytest.skip("the engine has no NaN fault hook")
    monkeypatch.setenv(fault_env, "0,1,2")  # every run's first steps are NaN: each diverges after 2
    config = write_config(tmp_path / "c.yaml", precision={"dtype": "float16"},
                          training={"max_consecutive_nonfinite": 2})
    out = tmp_path / "cmp"
    result = run_cli("compare", "none", "dynamic", "--config", config, "--device", "cpu", "--out", out,
                     "--no-plots", "--quiet")
    assert result.exit_code == 0, result.output  # divergence is a result, not a failure of compare
    rows = read_csv(out / "comparison.csv")
    assert [(r["method"], r["completed"], r["diverged"], r["failed"]) for r in rows] == [
        ("none", "0", "1", "0"), ("dynamic", "0", "1", "0")]
    assert all(r["final_val_accuracy_mean"] == "" and r["precision"] == "" for r in rows)
    index = json.loads((out / "index.json").read_text())
    assert [e["status"] for e in index["runs"]] == ["diverged", "diverged"]
    assert "0/1 (1 diverged)" in (out / "comparison.md").read_text()



def without_timings(run_dir: Path) -> tuple[dict, list[dict], str | None]:
    """A run's summary and steps without the wall-clock fields, and its scales.csv."""
    summary = {k: v for k, v in json.loads((run_dir / "summary.json").read_text()).items()
               if k not in ("wall_time_s", "time_per_step_s", "peak_memory_mb")}
    steps = [{k: v for k, v in json.loads(line).items() if k != "elapsed_s"}
             for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    scales = run_dir / "scales.csv"
    return summary, steps, scales.read_text() if scales.exists() else None


def test_jobs_run_the_same_children_in_parallel_processes_with_the_same_results(comparison):
    out, _ = comparison
    parallel = out.parent / "cmp-jobs"
    result = run_cli("compare", "none", "adaptive", "--config", out.parent / "c.yaml", "--seeds", "1", "--device",
                     "cpu", "--out", parallel, "--jobs", "2", "--quiet", "--no-plots")
    assert result.exit_code == 0, result.output
    for name in ("none-seed1", "adaptive-seed1"):
        ran = parallel / "runs" / name
        assert json.loads((ran / "meta.json").read_text())["command"][:2] == ["adaloss", "train"]  # its own process
        assert without_timings(ran) == without_timings(out / "runs" / name)


# ------------------------------------------------------------------------------- interrupted and resumed (issue 32)

TIMING_COLUMNS = ("time_per_step_s_mean", "peak_memory_mb_max")


def without_timing_columns(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    return [{k: v for k, v in row.items() if k not in TIMING_COLUMNS} for row in rows]


@pytest.mark.usefixtures("one_thread")  # the reference runs here, the stopped comparison in a 1-thread process:
def test_a_comparison_stopped_by_sigint_resumes_to_the_uninterrupted_table(tmp_path):  # same sums, same bits
    import os
    import signal
    import subprocess
    import sys
    import time

    config = write_config(tmp_path / "c.yaml", precision={"dtype": "float16"}, training={"iterations": 60},
                          output={"checkpoint_every": 5, "record_every": 4, "root": str(tmp_path / "runs")})
    methods = ["fp32", "dynamic", "adaptive"]
    reference = tmp_path / "reference"
    assert run_cli("compare", *methods, "--config", config, "--device", "cpu", "--out", reference, "--quiet",
                   "--no-plots").exit_code == 0
    stopped = tmp_path / "stopped"
    proc = subprocess.Popen([sys.executable, "-m", "adaloss_cli", "compare", *methods, "--config", str(config),
                             "--device", "cpu", "--out", str(stopped), "--quiet", "--no-plots"],
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    log = stopped / "runs" / "dynamic-seed0" / "steps.jsonl"  # the second run, well inside it
    deadline = time.time() + 120
    while not (log.exists() and log.read_text().count("\n") >= 12):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert f"adaloss compare --resume {stopped}" in stderr and "train --resume" not in stderr
    index = json.loads((stopped / "index.json").read_text())
    assert [e["status"] for e in index["runs"]] == ["completed", "interrupted", "pending"]

    report = run_cli("report", stopped, "--no-plots")
    assert "incomplete: 1 interrupted, 1 not run, of 3 runs" in report.stdout
    assert "failed" not in report.stdout and "0/1 (1 interrupted)" in report.stdout

    again = run_cli("compare", *methods, "--config", config, "--device", "cpu", "--out", stopped)
    assert again.exit_code == 2 and f"adaloss compare --resume {stopped}" in again.stderr

    resumed = run_cli("compare", "--resume", stopped, "--quiet", "--no-plots")
    assert resumed.exit_code == 0, resumed.output
    got, want = without_timing_columns(read_csv(stopped / "comparison.csv")), without_timing_columns(
        read_csv(reference / "comparison.csv"))
    assert got == want
    dynamic = json.loads((stopped / "runs/dynamic-seed0/meta.json").read_text())
    assert len(dynamic["resumed"]) == 1  # continued from its checkpoint, not started again
    index = json.loads((stopped / "index.json").read_text())
    assert [e["status"] for e in index["runs"]] == ["completed"] * 3 and len(index["resumed"]) == 1


def test_resume_takes_no_new_settings_and_needs_a_comparison(tmp_path):
    result = run_cli("compare", "--resume", tmp_path, "--set", "training.epochs=2")
    assert result.exit_code == 2 and "cannot be combined" in result.stderr
    result = run_cli("compare", "--resume", tmp_path)
    assert result.exit_code == 2 and "is not a comparison directory" in result.stderr
    result = run_cli("compare", "none")
    assert result.exit_code == 2 and "--resume DIR" in result.stderr


def test_ms_per_step_does_not_depend_on_the_order_of_the_methods(tmp_path):
    config = write_config(tmp_path / "c.yaml", precision={"dtype": "float16"}, training={"iterations": 60},
                          output={"record_every": 10, "root": str(tmp_path / "runs")})
    ms = {}
    for order in (("fixed", "dynamic"), ("dynamic", "fixed")):
        out = tmp_path / "-".join(order)
        assert run_cli("compare", *order, "--config", config, "--device", "cpu", "--out", out, "--quiet",
                       "--no-plots").exit_code == 0
        ms[order] = {row["method"]: float(row["time_per_step_s_mean"]) for row in read_csv(out / "comparison.csv")}
    for method in ("fixed", "dynamic"):
        first, second = ms[("fixed", "dynamic")][method], ms[("dynamic", "fixed")][method]
        assert max(first, second) < 2 * min(first, second), ms  # the first listed paid the warm-up: 3x before
