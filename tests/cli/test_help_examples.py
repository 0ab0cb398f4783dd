"""Every example in every ``--help`` works after a plain ``pip install``: run from an empty folder, each one parses,
and what it names (shipped configs and sweeps, overrides, methods) validates; commands that only read run as
written. Examples that name a run directory of the user's (``--resume``, ``report``) are only parsed."""

from __future__ import annotations

import shlex

import click
import pytest

from adaloss_cli.cli import COMMANDS, cli
from adaloss_cli.config import load_config
from adaloss_cli.runs.methods import parse_methods
from adaloss_cli.runs.sweep import load_sweep

SHELL_OPERATORS = {">", ">>", "|", "&&", ";"}


def help_text(invoke, command: str | None) -> str:
    result = invoke(*([command] if command else []), "--help")
    assert result.exit_code == 0, result.output
    return result.stdout


def examples(text: str) -> list[list[str]]:
    """The ``adaloss ...`` arguments of every example line (torchrun's ``-m adaloss_cli ...`` too), without shell
    redirections and comments."""
    found = []
    for line in text.splitlines():
        if not line.strip().startswith(("adaloss ", "torchrun ")):
            continue
        words = shlex.split(line.strip(), comments=True)
        if words[:1] == ["torchrun"] and "adaloss_cli" in words:
            words = ["adaloss", *words[words.index("adaloss_cli") + 1:]]
        if words[:1] != ["adaloss"]:
            continue
        cut = next((i for i, word in enumerate(words) if word in SHELL_OPERATORS), len(words))
        found.append(words[1:cut])
    return found


def all_examples(invoke) -> list[list[str]]:
    return [args for command in [None, *COMMANDS] for args in examples(help_text(invoke, command))]


def parse(args: list[str]) -> tuple[str, dict]:
    """Parse ``adaloss ARGS`` as click would (parameter types included); the subcommand and its parameters."""
    name, *rest = args
    command = cli.get_command(click.Context(cli), name)
    assert command is not None, args
    with command.make_context(name, rest, parent=click.Context(cli, info_name="adaloss", obj={})) as sub:
        return name, dict(sub.params)


def check(invoke, args: list[str]) -> None:
    name, params = parse(args)
    if name in ("validate", "configs", "env"):  # read-only: run it as written
        result = invoke(*args)
        assert result.exit_code == 0, (args, result.output)
    elif name == "batch":
        load_sweep(params["sweep_file"], params["out"], params["overrides"])
    elif name in ("train", "compare") and params.get("config_path") is not None:
        common = list(params["overrides"]) + ([f"device={params['device']}"] if params.get("device") else [])
        specs = parse_methods(params["methods"]) if name == "compare" else [None]
        for spec in specs:
            load_config(params["config_path"], common + (list(spec.overrides) if spec else []))


def test_every_command_shows_examples_and_they_use_shipped_names(invoke):
    assert {args[0] for args in all_examples(invoke) if args} >= set(COMMANDS)
    for args in all_examples(invoke):
        assert not any("configs/" in arg or arg.endswith(".yaml") for arg in args if not arg.startswith("runs/")), \
            args  # a path in the source tree, which a pip install does not have


def test_every_help_example_parses_and_validates_from_an_empty_folder(invoke, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    every = all_examples(invoke)
    assert len(every) >= 20
    for args in every:
        try:
            check(invoke, args)
        except click.ClickException as err:
            pytest.fail(f"adaloss {shlex.join(args)}: {err.format_message()}")
    assert list(tmp_path.iterdir()) == []  # nothing ran for real

