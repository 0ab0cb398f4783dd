"""Hostile and careless use (issue 19): no code runs from data, nothing outside a run directory is touched, a
second writer is refused, inputs past a limit are refused at once, signals stop everything with 128 + N."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from helpers import write_config
from test_data import write_cifar10
from test_reliability import adaloss, resumable_config, wait_for_steps

torch = pytest.importorskip("torch")


class Payload:
    """Runs ``touch MARKER`` when unpickled: the tests check that the marker never appears."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (links not followed) and a digest of its content."""
    return {str(p.relative_to(folder)): hashlib.sha1(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(folder.rglob("*")) if not p.is_symlink()}


def one_error_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("Error")]
    assert len(lines) == 1 and "Traceback" not in output and "internal error" not in output, output
    return lines[0]


def interrupted_run(tmp_path: Path, invoke, name: str = "run") -> Path:
    """A finished tiny run whose meta.json says it was interrupted, so that --resume accepts it."""
    run_dir = tmp_path / name
    config = write_config(tmp_path / f"{name}.yaml", training={"iterations": 4},
                          output={"root": str(tmp_path / "runs"), "checkpoint_every": 2})
    assert invoke("train", "--config", config, "--out", run_dir, "--quiet").exit_code == 0
    meta = json.loads((run_dir / "meta.json").read_text())
    (run_dir / "meta.json").write_text(json.dumps({**meta, "status": "interrupted"}))
    return run_dir


# -- no code runs from data ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("form,phrase", [("torch.save", "was not read: it asks for GLOBAL"),
                                         ("plain pickle", "is not in checkpoint format 2")])
def test_a_crafted_checkpoint_does_not_run_on_resume(tmp_path, invoke, form, phrase):
    run_dir = interrupted_run(tmp_path, invoke)
    marker = tmp_path / "marker"
    for checkpoint in (run_dir / "checkpoints").glob("*.ckpt"):
        if form == "torch.save":
            torch.save({"format": 2, "evil": Payload(marker)}, checkpoint)
        else:
            checkpoint.write_bytes(pickle.dumps({"format": 1, "evil": Payload(marker)}))
    before = snapshot(run_dir)
    result = invoke("train", "--resume", run_dir)
    assert result.exit_code == 2
    assert phrase in one_error_line(result.output)
    assert not marker.exists()
    assert snapshot(run_dir) == before


def test_a_crafted_cifar_batch_does_not_run(tmp_path, invoke):
    write_cifar10(tmp_path / "cifar")
    marker = tmp_path / "marker"
    (tmp_path / "cifar" / "data_batch_1").write_bytes(pickle.dumps({b"data": Payload(marker)}, protocol=2))
    config = write_config(tmp_path / "c.yaml", data={"name": "cifar10", "root": str(tmp_path / "cifar")})
    result = invoke("train", "--config", config)
    assert result.exit_code == 2
    line = one_error_line(result.output)
    assert "data_batch_1" in line and "system, which a CIFAR batch never holds" in line
    assert not marker.exists() and not (tmp_path / "runs").exists()


# -- nothing outside a run directory ------------------------------------------------------------------------------

def test_overwrite_replaces_only_a_run_directory_adaloss_made(tmp_path, invoke, monkeypatch):
    config = write_config(tmp_path / "c.yaml")
    real = tmp_path / "real"
    assert invoke("train", "--config", config, "--out", real, "--quiet").exit_code == 0
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "meta.json").write_text("{}")
    (project / "src" / "main.py").write_text("print('years of work')")
    (tmp_path / "link").symlink_to(real)
    (tmp_path / "planted").mkdir()
    (tmp_path / "planted" / ".lock").symlink_to(project / "src" / "main.py")  # must not be truncated
    cases = [  # (--out, directory to run from, phrase)
        (tmp_path / "planted", tmp_path, "its .lock is a symbolic link"),
        (project, tmp_path, "not an adaloss run directory"),
        (tmp_path / "link", tmp_path, "is a symbolic link"),
        (Path("."), real, "is the current directory"),
        (Path(".."), real / "checkpoints", "is the current directory or holds it"),
    ]
    before = snapshot(tmp_path)
    for out, cwd, phrase in cases:
        monkeypatch.chdir(cwd)
        result = invoke("train", "--config", config, "--out", out, "--overwrite", "--quiet")
        assert result.exit_code == 2, (out, result.output)
        assert phrase in one_error_line(result.output), out
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("name", ["../x", "/tmp/adaloss-x", "a/b", "a\\b", "..", ".", " ", "nul\0byte", "new\nline",
                                  "x" * 101])
def test_a_run_name_is_one_folder_name(tmp_path, invoke, name):
    config = write_config(tmp_path / "c.yaml", run={"name": name})
    for command in (["validate", config], ["train", "--config", config]):
        result = invoke(*command)
        assert result.exit_code == 2 and "run.name" in result.output, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]


# -- limits -------------------------------------------------------------------------------------------------------

def alias_bomb(leaf: str) -> str:
    """Nine levels of nine aliases: 9^9 values once expanded, under ``leaf``."""
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    return "\n".join(lines) + f"\n{leaf}\n"


def flow_alias_bomb() -> str:
    """The same bomb on one line, as a ``--set`` value: ``[&a0 [x, ...], &a1 [*a0, ...], ...]``."""
    levels = ["&a0 [" + ", ".join(["x"] * 9) + "]"]
    levels += [f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    return "[" + ", ".join(levels) + "]"


LIMITS = [  # (what, file text or None for /dev/zero, extra arguments, phrase)
    ("endless file", None, [], "larger than 1 MiB"),
    ("file over 1 MiB", "#" * (2 << 20), [], "larger than 1 MiB"),
    ("100k-deep nesting", "run: " + "[" * 100_000 + "]" * 100_000, [], "nested more than 32 levels"),
    ("alias bomb in a list", alias_bomb("lst: *a9"), [], "more than 100,000 values"),
    ("alias bomb under a known key", alias_bomb("model: {hidden_sizes: *a9}"), [], "more than 100,000 values"),
    ("recursive alias", "model: &m {hidden_sizes: [*m]}", [], "a cycle"),
    ("alias bomb in --set", "", ["--set", "model.hidden_sizes=" + flow_alias_bomb()], "more than 100,000 values"),
]


@pytest.mark.parametrize("what,text,extra,phrase", LIMITS, ids=[c[0] for c in LIMITS])
def test_config_files_past_a_limit_are_refused(tmp_path, invoke, what, text, extra, phrase):
    path = Path("/dev/zero") if text is None else tmp_path / "c.yaml"
    if text is not None:
        path.write_text(text)
    result = invoke("validate", path, *extra)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert phrase in result.output


def test_expansions_past_the_run_limit_are_refused(tmp_path, invoke):
    config = write_config(tmp_path / "c.yaml")
    result = invoke("compare", "none", "fixed", "--config", config, "--seeds", "0-100000000")
    assert result.exit_code == 2 and "more than 10,000 seeds" in result.output
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"base": "c.yaml", "grid": {"run.seed": list(range(100)),
                                                                "training.optimizer.lr": [0.1] * 100,
                                                                "training.batch_size": list(range(1, 101)),
                                                                "training.iterations": list(range(1, 101))}}))
    result = invoke("batch", sweep, "--dry-run")
    assert result.exit_code == 2 and "makes 100,000,000 runs, more than the limit of 10,000" in result.output


def test_outputs_that_are_not_folders_are_refused(tmp_path, invoke):
    config = write_config(tmp_path / "c.yaml")
    run_dir = tmp_path / "run"
    assert invoke("train", "--config", config, "--out", run_dir, "--quiet").exit_code == 0
    (tmp_path / "afile").write_text("a file")
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"base": "c.yaml", "out": "/dev/null", "grid": {"run.seed": [0]}}))
    cases = [  # (arguments, phrase)
        (["batch", sweep], "'/dev/null' exists and is not a directory"),
        (["train", "--config", config, "--out", "/dev/null"], "'/dev/null' exists and is not a directory"),
        (["train", "--config", config, "--out", tmp_path / "afile" / "run"], "is not a directory"),
        (["report", run_dir, "--out", "/dev/null"], "into '/dev/null': it is not a directory"),
        (["report", run_dir, "--out", tmp_path / "afile" / "x"], "Not a directory"),
    ]
    for args, phrase in cases:
        result = invoke(*args)
        assert result.exit_code == 2, (args, result.output)
        assert phrase in one_error_line(result.output), args
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "c.yaml", "run", "sweep.yaml"]


# -- one writer per directory -------------------------------------------------------------------------------------

def test_a_second_writer_is_refused_naming_the_holder_and_the_lock_dies_with_it(tmp_path, invoke):
    config = resumable_config(tmp_path, "none", iterations=3000)
    live = tmp_path / "live"
    proc = adaloss("train", "--config", str(config), "--out", str(live), "--quiet")
    try:
        wait_for_steps(live, 3, proc)
        for args in (["--resume", live], ["--config", config, "--out", live, "--overwrite"]):
            result = invoke("train", *args, "--quiet")
            assert result.exit_code == 2
            assert f"is in use by process {proc.pid}" in one_error_line(result.output)
        assert (live / "config.yaml").exists() and json.loads((live / "meta.json").read_text())["status"] == "running"
    finally:
        proc.kill()
        proc.wait()
    # SIGKILL released the lock: the directory can be replaced now.
    result = invoke("train", "--config", config, "--out", live, "--overwrite", "--quiet",
                    "--set", "training.iterations=4")
    assert result.exit_code == 0, result.output
    assert json.loads((live / "summary.json").read_text())["steps"] == 4


def test_four_trains_into_one_new_out_one_wins_the_others_are_told_why(tmp_path):
    config = write_config(tmp_path / "c.yaml", training={"iterations": 6})
    out = tmp_path / "shared"
    procs = [adaloss("train", "--config", str(config), "--out", str(out), "--quiet") for _ in range(4)]
    results = [(p.wait(timeout=300), p.communicate()[1]) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2, 2, 2], results
    for code, stderr in results:
        if code == 2:
            assert one_error_line(stderr).startswith("Error: --out"), stderr
            assert "FileExistsError" not in stderr
    assert json.loads((out / "summary.json").read_text())["steps"] == 6


# -- signals ------------------------------------------------------------------------------------------------------

def wait_until_importing_torch(proc: subprocess.Popen) -> None:
    """Block until the process has loaded torch's library (it is inside the command, past Python's start)."""
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        try:
            if "libtorch" in Path(f"/proc/{proc.pid}/maps").read_text():
                return
        except OSError:
            pass
        time.sleep(0.01)
    raise AssertionError("the process never loaded torch")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_a_framework_loads_is_raised_after_the_load(signum):
    """torch's C initialisation clears exceptions raised in the Python it runs, so a Ctrl-C there was lost and
    training started anyway. Held signals are delivered when the load ends, whatever swallowed them meanwhile."""
    from adaloss_cli.signals import Terminated, signals_held, sigterm_raises

    finished = False
    # Python's own Ctrl-C handler, whatever this process inherited (a shell's background job ignores SIGINT).
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with sigterm_raises(), pytest.raises(KeyboardInterrupt) as raised:
            with signals_held():
                signal.raise_signal(signum)
                try:  # what the C initialisation does with an exception
                    time.sleep(0.01)
                except BaseException:
                    pytest.fail("the signal was delivered inside the block")
                finished = True
        assert finished and isinstance(raised.value, Terminated) == (signum == signal.SIGTERM)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        # An ignored signal stays ignored: held or not, it never interrupts.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with signals_held():
            signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, inherited)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_start_up_exits_128_plus_n_without_a_traceback(tmp_path, signum):
    # Long enough that the run cannot finish first: on a loaded machine the signal may land a few seconds late
    # (the 6-step default then exited 0), where the training loop's own handler must give the same exit.
    config = write_config(tmp_path / "c.yaml", training={"iterations": 100000})
    proc = adaloss("train", "--config", str(config), "--quiet")
    wait_until_importing_torch(proc)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, stderr
    assert signal.Signals(signum).name in one_error_line(stderr) and "Aborted!" not in stderr


def test_sigterm_to_batch_with_jobs_stops_its_children_too(tmp_path):
    write_config(tmp_path / "base.yaml", training={"iterations": 5000}, output={"checkpoint_every": 1000})
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"base": "base.yaml", "out": str(tmp_path / "sweep"),
                                     "grid": {"run.seed": [0, 1]}}))
    proc = adaloss("batch", str(sweep), "--jobs", "2", "--quiet", "--no-plots")
    children = [tmp_path / "sweep" / "runs" / f"seed={seed}" for seed in (0, 1)]
    for child in children:
        wait_for_steps(child, 2, proc, timeout=120)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "SIGTERM" in one_error_line(stderr)
    for child in children:
        assert json.loads((child / "meta.json").read_text())["status"] == "interrupted"
        pid = int((child / ".lock").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
