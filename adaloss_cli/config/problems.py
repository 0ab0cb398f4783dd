"""What a config problem is, and how every problem of one config is collected and reported at once.

A problem points at the file line of its key, or at ``--set`` when the offending value came from a command-line
override, so users fix the right place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping, Sequence

from adaloss.errors import UserError

OVERRIDE_SOURCE = "--set"


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a config: where (file and 1-based line, or ``--set``), which key, and what to do.

    ``key`` is a dotted path (list items as ``milestones[1]``), or ``""`` for the file as a whole (malformed YAML).
    ``message`` reads "<what is wrong>; <what is allowed> (did you mean '<x>'?)".
    """

    file: str
    line: int | None
    key: str
    message: str

    @property
    def location(self) -> str:
        """``file:line``, or just the file (or ``--set``) when there is no line."""
        return f"{self.file}:{self.line}" if self.line is not None else self.file

    def __str__(self) -> str:
        parts = [self.location, self.key, self.message] if self.key else [self.location, self.message]
        return ": ".join(parts)


class ConfigError(UserError):
    """A config with one or more problems; ``str()`` lists all of them under one header line."""

    def __init__(self, source: str, problems: Sequence[Problem]):
        self.source = source
        # File problems in line order, then the command-line overrides in the order given.
        self.problems = sorted(problems, key=lambda p: (p.file == OVERRIDE_SOURCE, p.line or 0))
        super().__init__(self.render())

    def render(self) -> str:
        """The header line followed by one indented line per problem."""
        count = len(self.problems)
        header = f"Invalid config {self.source} ({count} problem{'' if count == 1 else 's'}):"
        return "\n".join([header, *(f"  {problem}" for problem in self.problems)])

    def __str__(self) -> str:
        return self.render()


def ancestors(key: str) -> Iterator[str]:
    """``a.b[1].c``, ``a.b[1]``, ``a.b``, ``a``, then ``""`` (the top level)."""
    while key:
        yield key
        cut = max(key.rfind("."), key.rfind("["))
        key = key[:cut] if cut > 0 else ""
    yield ""


class ProblemCollector:
    """Collects the problems of one config, locating each key path in the file or in the ``--set`` overrides.

    Args:
        source: the file name shown in messages.
        lines: 1-based line of each key path (``a.b``, list items as ``a.b[0]``; ``""`` is the document start).
        override_keys: key paths whose values were set by ``--set``.
    """

    def __init__(self, source: str, lines: Mapping[str, int] | None = None, override_keys: Iterable[str] = ()):
        self.source = source
        self.lines = dict(lines or {})
        self.override_keys = set(override_keys)
        self.problems: list[Problem] = []

    def add(self, key: str, message: str, *, at: str | None = None) -> None:
        """Record a problem on ``key``, located at the line of ``at`` (default: ``key``) or its nearest parent."""
        where = key if at is None else at
        if self.from_override(where):
            self.problems.append(Problem(OVERRIDE_SOURCE, None, key, message))
        else:
            self.problems.append(Problem(self.source, self.line_of(where), key, message))

    def add_override(self, key: str, message: str) -> None:
        """Record a problem with a ``--set`` argument itself."""
        self.problems.append(Problem(OVERRIDE_SOURCE, None, key, message))

    def from_override(self, key: str) -> bool:
        """Whether the value at ``key`` came from ``--set`` (it, a parent, or only its children were set there)."""
        if any(parent in self.override_keys for parent in ancestors(key)):
            return True
        if not key or key in self.lines:
            return False
        return any(k.startswith((key + ".", key + "[")) for k in self.override_keys)

    def line_of(self, key: str) -> int | None:
        """The line of ``key``, else of its nearest parent present in the file."""
        for parent in ancestors(key):
            if parent in self.lines:
                return self.lines[parent]
        return None

    def raise_if_any(self) -> None:
        """Raise a :class:`ConfigError` listing every problem collected so far."""
        if self.problems:
            raise ConfigError(self.source, self.problems)
