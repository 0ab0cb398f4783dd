"""`adaloss report`: tables and plots rebuilt from copied directories, byte for byte, without training."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from adaloss_cli.cli import cli

from helpers import write_config

torch = pytest.importorskip("torch")

PNGS = ("training.png", "loss_scale.png", "underflow.png")


def run_cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def copy_without_outputs(source: Path, target: Path, outputs: tuple[str, ...]) -> Path:
    shutil.copytree(source, target)
    for name in outputs:
        (target / name).unlink(missing_ok=True)
    return target


def test_report_on_a_copied_comparison_reproduces_it(tmp_path):
    config = write_config(tmp_path / "c.yaml", precision={"dtype": "float16"})
    out = tmp_path / "cmp"
    result = run_cli("compare", "fp32", "dynamic", "adaptive", "--config", config, "--device", "cpu", "--out", out)
    assert result.exit_code == 0, result.output
    assert (out / "comparison.md").read_text().split("\n\n")[1] in result.stdout  # the table printed is the file's

    copy = copy_without_outputs(out, tmp_path / "elsewhere" / "copy", ("comparison.csv", "comparison.md", *PNGS))
    result = run_cli("report", copy)
    assert result.exit_code == 0, result.output
    for name in ("comparison.csv", "comparison.md"):
        assert (copy / name).read_bytes() == (out / name).read_bytes(), name
    for name in PNGS:
        data = (copy / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert "| adaptive" in result.stdout and "Δ vs fp32" in result.stdout

    listed = json.loads(run_cli("report", copy, "--json", "--no-plots").stdout)
    assert [row["method"] for row in listed[0]["rows"]] == ["fp32", "dynamic", "adaptive"]
    assert listed[0]["kind"] == "compare"


def test_report_on_a_copied_sweep_reproduces_its_summary(tmp_path):
    write_config(tmp_path / "base.yaml", training={"iterations": 4})
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"base": "base.yaml", "out": str(tmp_path / "sw"),
                                     "grid": {"training.optimizer.lr": [0.05, 0.1]}}))
    assert run_cli("batch", sweep, "--quiet", "--no-plots").exit_code == 0
    copy = copy_without_outputs(tmp_path / "sw", tmp_path / "copy", ("summary.csv", "summary.md"))
    result = run_cli("report", copy, "--no-plots", "--quiet")
    assert result.exit_code == 0 and result.stdout.strip() == str(copy)
    for name in ("summary.csv", "summary.md"):
        assert (copy / name).read_bytes() == (tmp_path / "sw" / name).read_bytes(), name


def test_report_groups_plain_run_directories_by_method(tmp_path):
    config = write_config(tmp_path / "c.yaml", training={"iterations": 3}, precision={"dtype": "float16"})
    runs = []
    for method, seed in (("none", 0), ("none", 1), ("fixed", 0)):
        run = tmp_path / f"{method}-{seed}"
        result = run_cli("train", "--config", config, "--set", f"loss_scaling.method={method}", "--set",
                         f"run.seed={seed}", "--device", "cpu", "--out", run, "--quiet")
        assert result.exit_code == 0, result.output
        runs.append(run)
    for run in runs:  # train drew each run's own plots; report draws them again
        for name in ("training.png", "loss_scale.png", "underflow.png"):
            (run / name).unlink(missing_ok=True)
    result = run_cli("report", *runs)
    assert result.exit_code == 0, result.output
    assert "--out" in result.stdout and not (tmp_path / "none-0" / "comparison.csv").exists()
    listed = result.stdout.split("Plots:\n", 1)[1].split()
    assert listed == [str(run / name) for run in runs for name in ("training.png", "loss_scale.png", "underflow.png")
                      if run.name == "fixed-0" or name != "loss_scale.png"]  # method none has no loss scale
    assert all(Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for path in listed)
    quiet = run_cli("report", *runs, "--quiet")
    assert quiet.stdout.split() == [str(run) for run in runs]
    out = tmp_path / "table"
    result = run_cli("report", *runs, "--out", out, "--json")
    rows = json.loads(result.stdout)[0]["rows"]
    assert [(row["method"], row["completed"]) for row in rows] == [("none", 2), ("fixed", 1)]
    assert (out / "comparison.csv").is_file() and (out / "training.png").is_file()


def test_report_rejects_a_directory_that_holds_no_results(tmp_path):
    (tmp_path / "empty").mkdir()
    result = run_cli("report", tmp_path / "empty")
    assert result.exit_code == 2 and "not a run, comparison or sweep directory" in result.stderr
