"""Honest results (issue 32): a run that learned nothing is not "completed"; NaN lines are summarised and quiet with
--quiet; ms/step leaves out warm-up and recorded steps; a finished run can be made longer; --resume without a
checkpoint does not silently retrain; interrupted comparisons and sweeps are finished, not restarted."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from adaloss_cli.engine import FAULT_ENV
from adaloss_cli.verdict import learned_nothing, nonfinite_limit
from helpers import write_config

torch = pytest.importorskip("torch")


def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def meta_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "meta.json").read_text())


def error_lines(output: str) -> list[str]:
    assert "Traceback" not in output, output
    return [line for line in output.splitlines() if line.startswith("Error")]


# ------------------------------------------------------------------------------------------ learned nothing


def test_a_run_whose_every_step_overflowed_ends_diverged_with_its_reason(tmp_path, invoke):
    # A fixed scale of 1e30 overflows float16 at every step: the loss is finite, every step is skipped, and the
    # weights never move from their initial, chance-level guess.
    config = write_config(tmp_path / "c.yaml", precision={"dtype": "float16"},
                          loss_scaling={"method": "fixed", "fixed": {"scale": 1e30}}, training={"iterations": 12})
    run_dir = tmp_path / "run"
    result = invoke("train", "--config", config, "--out", run_dir, "--quiet")
    assert result.exit_code == 1
    [line] = error_lines(result.output)
    assert "learned nothing: 12 of 12 steps were skipped" in line and "at chance level" in line
    summary, meta = summary_of(run_dir), meta_of(run_dir)
    assert summary["status"] == meta["status"] == "diverged"
    assert summary["error"] == meta["error"] and summary["error"] in line
    assert summary["skipped_steps"] == 12 and summary["final_val_accuracy"] < 0.2
    report = invoke("report", run_dir, "--json")
    [row] = json.loads(report.stdout)[0]["rows"]
    assert (row["completed"], row["diverged"]) == (0, 1) and "learned nothing" in row["notes"][0]


def test_the_lr_1e30_run_of_the_issue_stops_diverged_long_before_its_end(tmp_path, invoke):
    config = write_config(tmp_path / "c.yaml", precision={"dtype": "float16"},
                          loss_scaling={"method": "dynamic"},
                          training={"iterations": 60, "optimizer": {"name": "sgd", "lr": 1e30}})
    run_dir = tmp_path / "run"
    result = invoke("train", "--config", config, "--out", run_dir, "--quiet")
    assert result.exit_code == 1
    [line] = error_lines(result.output)
    assert "not finite for 10 steps in a row" in line  # 10% of 60 steps, at least 10 (not 100)
    assert meta_of(run_dir)["status"] == "diverged"
    assert "step " not in result.stderr.replace(line, "")  # --quiet: no per-step NaN lines


def test_skipped_steps_alone_do_not_fail_a_run_that_learned():
    nan = float("nan")
    # a fixed scale that overflows often but learns; an honest short run of a hard task, at chance but training
    assert learned_nothing(100, 60, 0, {"loss": 0.3, "accuracy": 0.9}, chance=0.1) is None
    assert learned_nothing(100, 10, 0, {"loss": 2.3, "accuracy": 0.1}, chance=0.1) is None
    assert "60 of 100 steps were skipped" in learned_nothing(100, 60, 0, {"loss": 2.3, "accuracy": 0.11}, 0.1)
    assert "final validation loss is nan" in learned_nothing(100, 51, 0, {"loss": nan, "accuracy": 0.5}, 0.1)
    assert "not finite on the last 3 step(s)" in learned_nothing(100, 3, 3, {"loss": nan, "accuracy": 0.1}, 0.1)
    assert learned_nothing(100, 3, 3, {"loss": 0.5, "accuracy": 0.8}, 0.1) is None  # NaN steps, finite weights


def test_the_divergence_stop_scales_with_the_run_unless_set():
    assert [nonfinite_limit(None, n) for n in (6, 60, 500, 10**6)] == [10, 10, 50, 100]
    assert nonfinite_limit(3, 10**6) == 3


def test_nan_lines_are_summarised_and_silent_with_quiet(tmp_path, invoke, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, ",".join(str(i) for i in range(2, 40, 2)))  # every other step of 40
    config = write_config(tmp_path / "c.yaml", precision={"dtype": "float16"}, training={"iterations": 40})
    loud = invoke("train", "--config", config, "--out", tmp_path / "loud")
    assert loud.exit_code == 0, loud.output
    lines = [line for line in loud.stderr.splitlines() if "not finite" in line or "loss is nan" in line]
    assert 2 <= len(lines) <= 12, lines  # 19 NaN steps: the first, then at most one line per 10% of the run
    assert lines[0].startswith("step 2: loss is nan; the step was skipped")
    reported = sum(int(line.split(" on ")[1].split()[0]) for line in lines[1:])
    assert reported == 18  # every later one is counted in some line
    quiet = invoke("train", "--config", config, "--out", tmp_path / "quiet", "--quiet")
    assert quiet.exit_code == 0 and quiet.stderr == ""


def test_ms_per_step_leaves_out_warm_up_and_recorded_steps(tmp_path, invoke, monkeypatch):
    from adaloss_cli import engine

    times = []
    real_add = engine.Progress.add

    def add(self, outcome, seconds, steady):
        times.append((seconds, steady))
        return real_add(self, outcome, seconds, steady)

    monkeypatch.setattr(engine.Progress, "add", add)
    config = write_config(tmp_path / "c.yaml", training={"iterations": 30}, output={"record_every": 3})
    assert invoke("train", "--config", config, "--out", tmp_path / "run", "--quiet").exit_code == 0
    steady = [i for i, (_, is_steady) in enumerate(times) if is_steady]
    assert steady == [i for i in range(5, 29) if i % 3]  # past 5 warm-up steps, not recorded (nor the last)
    import statistics
    expected = statistics.median(times[i][0] for i in steady)
    assert summary_of(tmp_path / "run")["time_per_step_s"] == pytest.approx(expected)


# ------------------------------------------------------------------------------------------ resume and extend


def tiny_run(tmp_path: Path, invoke, name: str, **training) -> Path:
    config = write_config(tmp_path / f"{name}.yaml", training={"iterations": None, "epochs": 1, "batch_size": 64,
                                                               "lr_schedule": {"name": "constant"}, **training},
                          output={"record_every": 4, "checkpoint_every": 5})
    run_dir = tmp_path / name
    result = invoke("train", "--config", config, "--out", run_dir, "--quiet")
    assert result.exit_code == 0, result.output
    return run_dir


def test_a_completed_run_is_extended_to_the_run_it_would_have_been(tmp_path, invoke):
    extended = tiny_run(tmp_path, invoke, "extended")
    longer = tiny_run(tmp_path, invoke, "longer", epochs=3)
    result = invoke("train", "--resume", extended, "--set", "training.epochs=3", "--quiet")
    assert result.exit_code == 0, result.output
    assert meta_of(extended)["status"] == "completed"
    a, b = summary_of(extended), summary_of(longer)
    same = ("steps", "epochs", "final_val_accuracy", "final_val_loss", "final_train_loss", "skipped_steps")
    assert {k: a[k] for k in same} == {k: b[k] for k in same}
    assert a["steps"] == 3 * 22
    assert "epochs: 3" in (extended / "config.yaml").read_text()
    metrics = [row.rsplit(",", 1)[0] for row in (extended / "metrics.csv").read_text().splitlines()]
    assert metrics == [row.rsplit(",", 1)[0] for row in (longer / "metrics.csv").read_text().splitlines()]


@pytest.mark.parametrize("args,code,phrase", [
    ((), 2, "already completed; extend it with --set training.epochs=N"),
    (("--set", "training.epochs=1"), 2, "makes 22 steps, not more than the 22"),
    (("--set", "training.optimizer.lr=1"), 2, "--set may only make it longer"),
])
def test_resume_of_a_completed_run_without_a_longer_length_is_refused(tmp_path, invoke, args, code, phrase):
    run_dir = tiny_run(tmp_path, invoke, "done")
    before = (run_dir / "steps.jsonl").read_text()
    result = invoke("train", "--resume", run_dir, *args)
    assert result.exit_code == code and phrase in result.output, result.output
    assert (run_dir / "steps.jsonl").read_text() == before and meta_of(run_dir)["status"] == "completed"


def test_resume_without_a_checkpoint_refuses_to_retrain_lost_steps(tmp_path, invoke):
    import shutil

    run_dir = tiny_run(tmp_path, invoke, "lost")
    shutil.rmtree(run_dir / "checkpoints")  # killed before its first checkpoint
    (run_dir / "summary.json").unlink()
    meta = meta_of(run_dir)
    (run_dir / "meta.json").write_text(json.dumps({**meta, "status": "running"}))
    result = invoke("train", "--resume", run_dir, "--quiet")
    assert result.exit_code == 2
    [line] = error_lines(result.output)
    assert "has no checkpoint (it stopped after 22 steps, before its first checkpoint at step 5)" in line
    assert f"--out {run_dir} --overwrite" in line
    restart = line.split("start it again with ")[1].split()
    assert invoke(*restart[1:], "--quiet").exit_code == 0  # the printed command works
    assert meta_of(run_dir)["status"] == "completed"


# ------------------------------------------------------------------------------------------ empty config


@pytest.mark.parametrize("text", ["", "# nothing here\n"])
def test_an_empty_config_file_is_refused_naming_it(tmp_path, invoke, text):
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    result = invoke("train", "--config", path, "--set", "output.root=" + str(tmp_path / "runs"))
    assert result.exit_code == 2
    assert f"{path}: the file is empty" in result.output and len(error_lines(result.output)) == 1
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------------------------------ batch


def test_an_interrupted_sweep_continues_its_interrupted_run_from_the_checkpoint(tmp_path, invoke):
    write_config(tmp_path / "base.yaml", training={"iterations": 10}, output={"checkpoint_every": 3, "record_every": 2})
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(f"base: base.yaml\nout: {tmp_path / 'sweep'}\ngrid:\n  run.seed: [0, 1]\n")
    assert invoke("batch", sweep, "--quiet", "--no-plots").exit_code == 0
    reference = summary_of(tmp_path / "sweep/runs/seed=1")
    # As if Ctrl-C had stopped seed=1 after step 9's checkpoint (the older of the two kept).
    run_dir = tmp_path / "sweep/runs/seed=1"
    (run_dir / "checkpoints" / "step-00000010.ckpt").unlink()
    (run_dir / "summary.json").unlink()
    (run_dir / "meta.json").write_text(json.dumps({**meta_of(run_dir), "status": "interrupted"}))
    report = invoke("report", tmp_path / "sweep", "--no-plots")
    assert "incomplete: 1 interrupted, of 2 runs" in report.output and "1 failed" not in report.output
    assert "resume" in invoke("batch", sweep, "--dry-run").output
    again = invoke("batch", sweep, "--quiet", "--no-plots")
    assert again.exit_code == 0, again.output
    assert len(meta_of(run_dir)["resumed"]) == 1  # continued, not started again
    resumed = summary_of(run_dir)
    timing = ("wall_time_s", "time_per_step_s", "peak_memory_mb")
    assert {k: v for k, v in resumed.items() if k not in timing} == {
        k: v for k, v in reference.items() if k not in timing}


def test_a_signal_to_an_in_process_child_gives_the_parents_hint(tmp_path, invoke, monkeypatch):
    from adaloss_cli.errors import Interrupted
    from adaloss_cli import experiment

    def stopped(*args, **kwargs):
        raise Interrupted("stopped by SIGINT after step 3; a checkpoint was written: resume with adaloss train "
                          "--resume child", signal.SIGINT)

    monkeypatch.setattr(experiment, "run_experiment", stopped)
    config = write_config(tmp_path / "c.yaml")
    result = invoke("compare", "none", "dynamic", "--config", config, "--out", tmp_path / "cmp", "--quiet")
    assert result.exit_code == 130
    [line] = error_lines(result.output)
    assert f"adaloss compare --resume {tmp_path / 'cmp'}" in line and "train --resume" not in line

