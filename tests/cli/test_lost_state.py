"""Lost or stuck state (issue 19): half-created run directories, stale temporary files, unreadable checkpoints, an
edited config.yaml, a full disk, a killed report, and the modes of the files a run writes."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from adaloss_cli.results import files
from adaloss_cli.results.rundir import MARKER
from helpers import write_config

torch = pytest.importorskip("torch")


def tiny_run(tmp_path: Path, invoke, name: str = "run", iterations: int = 4) -> tuple[Path, Path]:
    """A finished run with a checkpoint every 2 steps; returns (run directory, config)."""
    config = write_config(tmp_path / f"{name}.yaml", training={"iterations": iterations},
                          output={"root": str(tmp_path / "runs"), "checkpoint_every": 2})
    run_dir = tmp_path / name
    result = invoke("train", "--config", config, "--out", run_dir, "--quiet")
    assert result.exit_code == 0, result.output
    return run_dir, config


def set_status(run_dir: Path, status: str) -> None:
    meta = json.loads((run_dir / "meta.json").read_text())
    (run_dir / "meta.json").write_text(json.dumps({**meta, "status": status}))


def error_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("Error")]
    assert len(lines) == 1 and "Traceback" not in output, output
    return lines[0]


@pytest.mark.parametrize("left", ["marker and config.yaml", "marker only"])
def test_a_run_killed_before_its_meta_json_can_be_resumed_or_replaced(tmp_path, invoke, left):
    run_dir, config = tiny_run(tmp_path, invoke)
    keep = {MARKER, ".lock"} | ({"config.yaml"} if left == "marker and config.yaml" else set())
    for entry in run_dir.iterdir():  # what a SIGKILL right after writing config.yaml (or the marker) leaves
        if entry.name not in keep:
            entry.unlink() if entry.is_file() else shutil.rmtree(entry)
    resumed = invoke("train", "--resume", run_dir, "--quiet")
    if left == "marker only":
        assert resumed.exit_code == 2 and "--overwrite" in error_line(resumed.output)
    else:
        assert resumed.exit_code == 0, resumed.output
        assert json.loads((run_dir / "summary.json").read_text())["steps"] == 4
    replaced = invoke("train", "--config", config, "--out", run_dir, "--overwrite", "--quiet")
    assert replaced.exit_code == 0, replaced.output
    assert json.loads((run_dir / "meta.json").read_text())["status"] == "completed"


def test_stale_temporary_files_are_removed_when_a_run_opens(tmp_path, invoke):
    run_dir, _ = tiny_run(tmp_path, invoke)
    set_status(run_dir, "interrupted")
    stale = [run_dir / "checkpoints" / ".step-00000004.ckpt.0badc0de.tmp", run_dir / ".meta.json.0badc0de.tmp"]
    for path in stale:
        path.write_bytes(b"half a file")
    assert invoke("train", "--resume", run_dir, "--quiet").exit_code == 0
    assert not any(path.exists() for path in stale)


@pytest.mark.parametrize("damage", ["all truncated", "all empty"])
def test_every_checkpoint_unreadable_refuses_instead_of_restarting_from_step_0(tmp_path, invoke, damage):
    run_dir, _ = tiny_run(tmp_path, invoke)
    set_status(run_dir, "interrupted")
    for checkpoint in (run_dir / "checkpoints").glob("*.ckpt"):
        checkpoint.write_bytes(checkpoint.read_bytes()[:200] if damage == "all truncated" else b"")
    steps = (run_dir / "steps.jsonl").read_text()
    result = invoke("train", "--resume", run_dir, "--quiet")
    assert result.exit_code == 2
    assert "no checkpoint" in error_line(result.output) and "step-00000004.ckpt" in result.output
    assert (run_dir / "steps.jsonl").read_text() == steps  # nothing restarted


EDITS = [  # (key path in config.yaml, new value, resumes)
    (("training", "iterations"), 2, False),
    (("model", "hidden_sizes"), [16, 16], False),
    (("loss_scaling", "method"), "fixed", False),
    (("output", "progress"), True, True),
    (("output", "keep_checkpoints"), 5, True),
]


@pytest.mark.parametrize("key,value,resumes", EDITS, ids=[".".join(e[0]) for e in EDITS])
def test_config_edited_after_a_checkpoint(tmp_path, invoke, key, value, resumes):
    import yaml

    run_dir, _ = tiny_run(tmp_path, invoke, iterations=6)
    (run_dir / "checkpoints" / "step-00000006.ckpt").unlink()  # as if killed after step 4's checkpoint
    set_status(run_dir, "interrupted")
    data = yaml.safe_load((run_dir / "config.yaml").read_text())
    data[key[0]][key[1]] = value
    (run_dir / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    result = invoke("train", "--resume", run_dir, "--quiet")
    if resumes:
        assert result.exit_code == 0, result.output
    else:
        assert result.exit_code == 2
        assert f"{'.'.join(key)}:" in error_line(result.output) and "edited after the checkpoint" in result.output


def test_a_full_disk_while_appending_logs_ends_failed_with_one_line(tmp_path, invoke, monkeypatch):
    config = write_config(tmp_path / "c.yaml", training={"iterations": 6})
    real_open = open

    class FillingUp:
        """A log file on a disk that fills up after a few lines."""

        def __init__(self, handle):
            self.handle, self.lines = handle, 0

        def write(self, text):
            self.lines += 1
            if self.lines > 3:
                raise OSError(28, "No space left on device")
            return self.handle.write(text)

        def __getattr__(self, name):
            return getattr(self.handle, name)

    def opener(path, *args, **kwargs):
        handle = real_open(path, *args, **kwargs)
        return FillingUp(handle) if str(path).endswith("steps.jsonl") else handle

    monkeypatch.setattr(files, "open", opener, raising=False)
    run_dir = tmp_path / "full"
    result = invoke("train", "--config", config, "--out", run_dir, "--quiet")
    assert result.exit_code == 1
    assert "steps.jsonl': No space left on device; free disk space" in error_line(result.output)
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["status"] == "failed" and "No space left" in meta["error"]


def test_a_report_killed_while_drawing_leaves_the_old_plot_whole(tmp_path, invoke, monkeypatch):
    from matplotlib.figure import Figure

    config = write_config(tmp_path / "c.yaml", training={"iterations": 4})
    out = tmp_path / "cmp"
    assert invoke("compare", "none", "fixed", "--config", config, "--out", out, "--quiet").exit_code == 0
    before = (out / "training.png").read_bytes()

    def dies_half_way(self, handle, **kwargs):
        handle.write(b"\x89PNG half")
        raise KeyboardInterrupt  # the closest an in-process test gets to SIGKILL

    monkeypatch.setattr(Figure, "savefig", dies_half_way)
    result = invoke("report", out)
    assert result.exit_code == 130
    assert (out / "training.png").read_bytes() == before
    monkeypatch.undo()
    (out / ".training.png.0badc0de.tmp").write_bytes(b"")  # what a real SIGKILL leaves behind
    assert invoke("report", out, "--quiet").exit_code == 0
    assert not list(out.glob(".*.tmp"))


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_files_and_folders_follow_the_umask(tmp_path, invoke, umask):
    previous = os.umask(umask)
    try:
        run_dir, _ = tiny_run(tmp_path, invoke)
    finally:
        os.umask(previous)
    for path in [run_dir, *run_dir.rglob("*")]:
        expected = (0o777 if path.is_dir() else 0o666) & ~umask
        assert stat.S_IMODE(path.stat().st_mode) == expected, path
