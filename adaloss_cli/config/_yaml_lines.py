"""Reads YAML text into plain data plus the 1-based line of every key path, so problems can name their line.

Key paths are dotted (``training.optimizer.lr``); list items are ``milestones[0]``; ``""`` is the document start.
Keys written twice in one mapping are reported: PyYAML would silently keep the last one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from .bounded_yaml import BoundedSafeLoader, YamlLimitError
from .problems import Problem

_MERGE_TAG = "tag:yaml.org,2002:merge"


@dataclass
class ParsedYaml:
    """The loaded data, the line of each key path, and keys repeated in a mapping as (path, first, again)."""

    data: Any
    lines: dict[str, int] = field(default_factory=dict)
    duplicates: list[tuple[str, int, int]] = field(default_factory=list)


def parse_yaml(text: str) -> ParsedYaml:
    """Load one YAML document with the safe loader, within adaloss's depth and size limits; raises
    ``yaml.YAMLError`` (``YamlLimitError`` past a limit) or ``ValueError`` when malformed."""
    loader = BoundedSafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return ParsedYaml(None)
        parsed = ParsedYaml(None, {"": node.start_mark.line + 1})
        # Walk before constructing: construction flattens `<<` merges in place, which would fake duplicates.
        _walk(node, "", parsed, loader, set())
        parsed.data = loader.construct_document(node)
        return parsed
    finally:
        loader.dispose()


def _walk(node: Node, path: str, parsed: ParsedYaml, loader: yaml.SafeLoader, seen: set[int]) -> None:
    if id(node) in seen:  # an alias met again (possibly a cycle): its lines are already known
        return
    seen.add(id(node))
    if isinstance(node, MappingNode):
        first_lines: dict[str, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key_path = f"{path}.{_key_text(key_node, loader)}" if path else _key_text(key_node, loader)
            line = key_node.start_mark.line + 1
            if key_path in first_lines:
                parsed.duplicates.append((key_path, first_lines[key_path], line))
            else:
                first_lines[key_path] = line
            parsed.lines[key_path] = line
            _walk(value_node, key_path, parsed, loader, seen)
    elif isinstance(node, SequenceNode):
        for i, item in enumerate(node.value):
            item_path = f"{path}[{i}]"
            parsed.lines[item_path] = item.start_mark.line + 1
            _walk(item, item_path, parsed, loader, seen)


def _key_text(key_node: Node, loader: yaml.SafeLoader) -> str:
    """The key as the validator will see it: ``str()`` of the constructed key (so ``on:`` is ``True``)."""
    if not isinstance(key_node, ScalarNode):
        return "?"  # a list or mapping as a key: construction reports it as unhashable
    return str(loader.construct_object(key_node))


def yaml_problem(error: Exception, source: str) -> Problem:
    """The problem for a YAML file that could not be parsed, at the line PyYAML points to."""
    mark = getattr(error, "problem_mark", None)
    what = getattr(error, "problem", None) or str(error)
    if isinstance(error, YamlLimitError):
        return Problem(source, None if mark is None else mark.line + 1, "", what)
    context, context_mark = getattr(error, "context", None), getattr(error, "context_mark", None)
    if context:  # PyYAML words it as "<context> ..., <problem>": "while parsing a block mapping ..., expected ..."
        where = f" (line {context_mark.line + 1})" if context_mark is not None else ""
        what = f"{context}{where}, {what}"
    return Problem(source, None if mark is None else mark.line + 1, "",
                   f"malformed YAML: {what}; check the indentation, the ': ' after each key and the quotes")
