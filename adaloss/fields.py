"""The field schema of adaloss's frozen option dataclasses: how a field states its help text and constraints
(:func:`option`, :func:`section`), how a value is checked against them (:func:`check_value`), and the wording of
every problem (:func:`show`, :func:`allowed`, did-you-mean).

Written once for the library's options (``adaloss.options``, checked where they are built) and the app's YAML
schema, whose validator walks whole config files with the same checks and words, so a key has one set of rules
wherever it is set.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import numbers
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, Sequence

from adaloss.errors import OptionError

__all__ = ["SYNONYMS", "CheckedOptions", "Issue", "KeyInfo", "allowed", "check_value", "close_matches", "describe", "did_you_mean",
           "field_default", "is_section", "join", "keys_of", "meant_choice", "number", "option", "section", "show"]


# -- declaring fields ---------------------------------------------------------------------------------------------

def option(default: Any, help: str, *, choices: tuple | None = None, min: float | None = None,
           max: float | None = None, exclusive_min: bool = False, item_type: type | None = None,
           length: int | None = None, nullable: bool = False, default_factory: Any = None) -> Any:
    """A config field with its help text and constraints, read by the validator and the docs generator.

    For list fields (``item_type`` set), ``min``/``max`` bound each item and ``length`` is the required item count.
    A field is nullable when asked, or when its default is None (a factory-made default does not count).
    """
    meta = {"help": help, "choices": choices, "min": min, "max": max, "exclusive_min": exclusive_min,
            "item_type": item_type, "length": length,
            "nullable": nullable or (default is None and default_factory is None)}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def section(cls: type, help: str) -> Any:
    """A nested config section."""
    return field(default_factory=cls, metadata={"help": help, "section": True})


def is_section(f: dataclasses.Field) -> bool:
    """Whether a dataclass field is a nested section rather than a value."""
    return bool(f.metadata.get("section"))


def field_default(f: dataclasses.Field) -> Any:
    """The default value of a leaf field."""
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc]


# -- reading a dataclass's fields ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class KeyInfo:
    """One key of a section: a value of ``value_type`` (bool, int, float, str or tuple), or a nested ``section``."""

    name: str
    field: dataclasses.Field
    value_type: type | None
    section: type | None

    def constraint(self, name: str) -> Any:
        """A constraint from the field's metadata (``choices``, ``min``, ``item_type``...), None when unset."""
        return self.field.metadata.get(name)

    @property
    def default(self) -> Any:
        """The schema default of a value key."""
        return field_default(self.field)


def _strip_optional(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


@functools.cache
def keys_of(cls: type) -> dict[str, KeyInfo]:
    """The keys of one section dataclass, in declaration order."""
    hints = typing.get_type_hints(cls)
    keys = {}
    for f in dataclasses.fields(cls):
        kind = _strip_optional(hints[f.name])
        keys[f.name] = KeyInfo(f.name, f, None, kind) if is_section(f) else KeyInfo(f.name, f, kind, None)
    return keys


def join(path: str, key: str) -> str:
    """``path.key``, or ``key`` at the top level."""
    return f"{path}.{key}" if path else key


# -- checking a value ---------------------------------------------------------------------------------------------

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


# -- options checked where they are built ---------------------------------------------------------------------

class CheckedOptions:
    """Base of a frozen options dataclass whose fields were declared with :func:`option`: building one checks
    every value against its field (converting a number written as text, a list to a tuple) and the
    :attr:`ordered` pairs, and raises :class:`~adaloss.errors.OptionError` listing every problem by key path
    (``loss_scaling.dynamic.growth_factor: got 0.5; must be a number >= 1, or null``): the words a config file's
    validator uses for the same key. Nested sections check themselves when they are built."""

    #: Where this section sits in a config file (``loss_scaling.dynamic``), for the messages.
    section_path: ClassVar[str] = ""
    #: (low key, high key, strict): when both are set, low must be below (strict) or at most high.
    ordered: ClassVar[tuple] = ()

    def __post_init__(self) -> None:
        problems = []
        values = {}
        for name, info in keys_of(type(self)).items():
            if info.section is not None:
                continue
            value, issues = check_value(info, getattr(self, name))
            problems += [f"{join(self.section_path, name)}{suffix}: {message}" for suffix, message in issues]
            if not issues:
                values[name] = value
                object.__setattr__(self, name, value)
        problems += [join(self.section_path, key) + ": " + message
                     for key, message in ordered_problems(values, self.ordered, self.section_path)]
        if problems:
            raise OptionError.listing(f"invalid {self.section_path or type(self).__name__} options", problems)


def ordered_problems(values: Any, pairs: Iterable[tuple[str, str, bool]], path: str = "") -> list[tuple[str, str]]:
    """(key, message) for each (low, high, strict) pair of ``values`` (a mapping of key to value) whose low value is
    not below (strict) or at most its high one; a pair with a value missing or None passes."""
    problems = []
    for low_key, high_key, strict in pairs:
        low, high = values.get(low_key), values.get(high_key)
        if low is None or high is None or low < high or (low == high and not strict):
            continue
        problems.append((low_key, f"got {show(low)} with {high_key} {show(high)}; must be {'<' if strict else '<='} "
                                  f"{join(path, high_key)}"))
    return problems


# -- wording ------------------------------------------------------------------------------------------------------

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
