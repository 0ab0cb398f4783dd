"""Checks one value against its schema key: type (with YAML's quirks), null, choices, range and list items.

PyYAML reads ``1e-3`` (no dot) as a string, so number keys accept strings that spell a number. Integer keys reject
floats, even ``3.0``, and booleans, so a typo cannot silently change a count.
"""

from __future__ import annotations

import math
import numbers
import re
from typing import Any

from ._messages import describe, did_you_mean, meant_choice, number, show
from ._schema_info import KeyInfo

Issue = tuple[str, str]
"""(key suffix: ``""`` for the key itself or ``"[i]"`` for a list item; message)."""

_NUMBER_TEXT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
_KIND_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
_PLURAL_WORDS = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}


def check_value(info: KeyInfo, value: Any) -> tuple[Any, list[Issue]]:
    """The value converted to its schema type (lists become tuples) and what is wrong with it (empty when valid)."""
    if value is None:
        if info.constraint("nullable"):
            return None, []
        return None, [("", f"got null; must be {allowed(info)}")]
    if info.value_type is tuple:
        return _check_list(info, value)
    converted, wrong, hint = _check_scalar(info.value_type, value, info)
    if wrong is not None:
        return None, [("", f"got {wrong}; must be {allowed(info)}{hint}")]
    return converted, []


def allowed(info: KeyInfo) -> str:
    """What a key accepts, in words: ``an integer >= 1``, ``one of: sgd, adam``, ``a list of 2 numbers``."""
    if info.value_type is tuple:
        item_type, length = info.constraint("item_type"), info.constraint("length")
        plural = _PLURAL_WORDS.get(item_type, "values")
        text = f"a list of {length} {plural}" if length is not None else f"a list of {plural}"
        bounds = _range_text(info)
        text += f", each {bounds}" if bounds else ""
    elif info.constraint("choices"):
        text = "one of: " + ", ".join(info.constraint("choices"))
    else:
        text = _item_allowed(info.value_type, info)
    return text + (", or null" if info.constraint("nullable") else "")


def _item_allowed(kind: type, info: KeyInfo) -> str:
    bounds = _range_text(info)
    return _KIND_WORDS.get(kind, kind.__name__) + (f" {bounds}" if bounds else "")


def _range_text(info: KeyInfo) -> str:
    low, high = info.constraint("min"), info.constraint("max")
    parts = []
    if low is not None:
        parts.append(f"{'>' if info.constraint('exclusive_min') else '>='} {number(low)}")
    if high is not None:
        parts.append(f"<= {number(high)}")
    return " and ".join(parts)


def _in_range(info: KeyInfo, x: float) -> bool:
    low, high = info.constraint("min"), info.constraint("max")
    if low is not None and (x < low or (info.constraint("exclusive_min") and x == low)):
        return False
    return high is None or x <= high


def _check_list(info: KeyInfo, value: Any) -> tuple[Any, list[Issue]]:
    if not isinstance(value, (list, tuple)):
        return None, [("", f"got {describe(value)}; must be {allowed(info)}")]
    issues: list[Issue] = []
    length = info.constraint("length")
    if length is not None and len(value) != length:
        issues.append(("", f"got {len(value)} item{'' if len(value) == 1 else 's'}; must be {allowed(info)}"))
    item_type = info.constraint("item_type")
    items = []
    for i, item in enumerate(value):
        converted, wrong, hint = (None, "null", "") if item is None else _check_scalar(item_type, item, info)
        if wrong is not None:
            issues.append((f"[{i}]", f"got {wrong}; must be {_item_allowed(item_type, info)}{hint}"))
        items.append(converted)
    return (None, issues) if issues else (tuple(items), [])


def _check_scalar(kind: type, value: Any, info: KeyInfo) -> tuple[Any, str | None, str]:
    """(converted, what was wrong or None, did-you-mean hint): the type first, then choices and range."""
    converted, wrong, hint = _convert(kind, value)
    if wrong is not None:
        whole = _whole_number(value) if kind is int else None
        return None, wrong, hint if whole is None or _in_range(info, whole) else ""
    choices = info.constraint("choices")
    if choices and converted not in choices:
        return None, show(converted), did_you_mean(meant_choice(converted, choices))
    if kind in (int, float) and not _in_range(info, converted):
        return None, show(converted), ""
    return converted, None, ""


def _convert(kind: type, value: Any) -> tuple[Any, str | None, str]:
    if kind is bool:
        return (value, None, "") if isinstance(value, bool) else (None, describe(value), "")
    if kind is int:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value), None, ""
        whole = _whole_number(value)
        return None, describe(value), "" if whole is None else f" (did you mean {whole}?)"
    if kind is float:
        return _convert_float(value)
    if kind is str:
        if isinstance(value, str):
            return value, None, ""
        quote = isinstance(value, numbers.Number) and not isinstance(value, bool)
        return None, describe(value), f" (quote it: \"{value}\")" if quote else ""
    raise TypeError(f"schema type {kind!r} has no checker")


def _convert_float(value: Any) -> tuple[Any, str | None, str]:
    if isinstance(value, str) and _NUMBER_TEXT.fullmatch(value.strip()):
        x = float(value)
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            x = float(value)
        except OverflowError:
            return None, f"{show(value)} (too large)", ""
    else:
        return None, describe(value), ""
    if not math.isfinite(x):
        return None, f"{show(value)} (not a finite number)", ""
    return x, None, ""


def _whole_number(value: Any) -> int | None:
    """The integer a float or number string spells exactly (3.0, '1e3'), else None."""
    if isinstance(value, str) and _NUMBER_TEXT.fullmatch(value.strip()):
        value = float(value)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None
