"""Wording shared by all config problems: how a given value is shown, and did-you-mean suggestions."""

from __future__ import annotations

import difflib
from typing import Any, Iterable, Sequence

from ._schema_info import all_key_paths, join, lookup

_MAX_SHOWN = 60
_TYPE_WORDS = {bool: "a boolean", int: "an integer", float: "a float", str: "a string", list: "a list",
               tuple: "a list", dict: "a mapping"}


def show(value: Any) -> str:
    """A value as the user wrote it in YAML (null, true, 'text'), shortened when long."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a mapping"
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[:_MAX_SHOWN - 3] + "..."


def describe(value: Any) -> str:
    """A value and its type, for type problems: ``'abc' (a string)``."""
    if value is None or isinstance(value, dict):
        return show(value)
    word = _TYPE_WORDS.get(type(value), type(value).__name__)
    return f"{show(value)} ({word})"


def number(x: float) -> str:
    """A bound as people write it: 0, 0.5, 1e-08, 1000000000 (integers exactly, up to 1e15)."""
    if isinstance(x, int) and abs(x) < 10**15:
        return str(x)
    return f"{x:g}"


def did_you_mean(options: Sequence[Any]) -> str:
    """`` (did you mean 'a'?)``, `` (did you mean 'a' or 'b'?)``, or nothing."""
    if not options:
        return ""
    quoted = [f"'{option}'" for option in options]
    listed = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]
    return f" (did you mean {listed}?)"


#: Other names people give an allowed value (other frameworks' spellings). A synonym is never accepted: it only
#: becomes the did-you-mean, so every config spells each value one way.
SYNONYMS = {
    "fp16": "float16", "f16": "float16", "half": "float16",
    "fp32": "float32", "f32": "float32", "float": "float32", "single": "float32",
    "bf16": "bfloat16", "brain_float16": "bfloat16",
    "static": "fixed", "constant": "fixed", "off": "none", "disabled": "none",
    "gpu": "cuda", "host": "cpu",
}


def meant_choice(value: object, choices: Iterable[str]) -> list[str]:
    """The allowed value a wrong one was probably meant as: its synonym if allowed, else the closest choices."""
    choices = list(choices)
    synonym = SYNONYMS.get(str(value).strip().lower())
    if synonym in choices:
        return [synonym]
    return close_matches(str(value), choices)


def close_matches(word: str, options: Iterable[str], n: int = 1) -> list[str]:
    """The options closest to ``word`` (case-insensitive), best first."""
    options = list(options)
    lowered = {option.lower(): option for option in options}
    return [lowered[m] for m in difflib.get_close_matches(word.lower(), list(lowered), n=n, cutoff=0.6)]


def _last(path: str) -> str:
    return path.rsplit(".", 1)[-1]


def suggest_key(key: str, section_path: str, valid_here: Iterable[str], full_paths: bool = False) -> list[str]:
    """Keys the user may have meant by an unknown ``key`` in section ``section_path``.

    A close key of the same section comes first (as a bare name, or a full path with ``full_paths``); otherwise the
    same or a close name in another section, as a full path (``lr`` under ``training`` -> ``training.optimizer.lr``).
    """
    local = close_matches(key, valid_here)
    if local:
        return [join(section_path, local[0]) if full_paths else local[0]]
    here = join(section_path, key)
    elsewhere = [path for path in all_key_paths() if _last(path) == key and path != here]
    if not elsewhere:
        near = close_matches(key, {_last(path) for path in all_key_paths()})
        elsewhere = [path for path in all_key_paths() if near and _last(path) == near[0]]
    return elsewhere[:3]


def suggest_path(segments: Sequence[str], bad_index: int, valid_here: Iterable[str]) -> list[str]:
    """Full key paths the user may have meant by a ``--set`` path whose segment ``bad_index`` is unknown.

    The segments after the bad one are kept when the result is a real key (``training.optimzer.lr`` ->
    ``training.optimizer.lr``).
    """
    section_path = ".".join(segments[:bad_index])
    rest = ".".join(segments[bad_index + 1:])
    suggestions = []
    for path in suggest_key(segments[bad_index], section_path, valid_here, full_paths=True):
        longer = join(path, rest) if rest else path
        suggestions.append(longer if rest and lookup(longer) is not None else path)
    return suggestions
