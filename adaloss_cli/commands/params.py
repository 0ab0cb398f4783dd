"""Command-line parameter types shared by the commands."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from click.shell_completion import CompletionItem

from adaloss_cli.configs import SUFFIX, is_name, resolve, shipped, shipped_configs, shipped_sweeps


def _did_you_mean(word: str, options: list[str]) -> str:
    from adaloss.fields import close_matches, did_you_mean

    return did_you_mean(close_matches(word, options))


class ConfigFile(click.ParamType):
    """A YAML file path, or the name of a shipped config or sweep (``digits``, ``sweeps/digits``); a file of that
    path wins. Converts to the :class:`~pathlib.Path` to read."""

    name = "file"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path:
        if isinstance(value, Path):
            return value
        text = str(value)
        path = resolve(text)
        if path.is_file() or path.exists():
            return path  # a folder: the reader's own error says what is wrong
        names = [*shipped_configs(), *shipped_sweeps()]
        if is_name(text):
            self.fail(f"no file '{text}' and no shipped config or sweep of that name; `adaloss configs` lists them"
                      f"{_did_you_mean(text, names)}", param, ctx)
        stem = text[:-len(SUFFIX)] if text.endswith(SUFFIX) else None
        if stem and shipped(stem) is not None:
            self.fail(f"no file '{text}'; the shipped one is named without {SUFFIX}: {stem}", param, ctx)
        return path  # a missing path: the reader reports it with the config's other problems

    def shell_complete(self, ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
        """Shipped names, then files."""
        names = [CompletionItem(n) for n in [*shipped_configs(), *shipped_sweeps()] if n.startswith(incomplete)]
        return [*names, CompletionItem(incomplete, type="file")]


CONFIG_FILE = ConfigFile()
