"""Did-you-mean suggestions for keys of the experiment schema (a key under another section, a misspelt ``--set``
path). How values are shown and checked is the library's field schema (``adaloss.fields``)."""

from __future__ import annotations

from typing import Iterable, Sequence

from adaloss.fields import close_matches, join

from ._schema_info import all_key_paths, lookup

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
