"""PyYAML's safe loader with limits on nesting depth and on the number of values after alias expansion.

PyYAML composes nested collections recursively (100,000 levels of ``[`` end in a RecursionError) and shares an
anchored value between its aliases, so nine levels of nine aliases (a "billion laughs") compose instantly but
become a billion values for anything that walks them: the validator, a deep copy, an error message. This loader
counts as it composes and stops at the first value past a limit, so such a file is refused in milliseconds.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.composer import ComposerError
from yaml.events import AliasEvent

from adaloss_cli.limits import MAX_YAML_DEPTH, MAX_YAML_NODES


class YamlLimitError(ComposerError):
    """A YAML document over a depth or size limit, or with a recursive alias; carries the line it was found on."""


class BoundedSafeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses documents nested deeper than ``max_depth`` levels, with more than
    ``max_nodes`` values once aliases are expanded, or with an alias inside its own anchor (a cycle)."""

    def __init__(self, stream: Any, max_depth: int = MAX_YAML_DEPTH, max_nodes: int = MAX_YAML_NODES) -> None:
        super().__init__(stream)
        self.max_depth, self.max_nodes = max_depth, max_nodes
        self._depth = 0
        self._count = 0  # values composed so far, aliases counted as the values they repeat
        self._sizes: dict[int, int] = {}  # id(node) -> its value count with aliases expanded
        self._open_anchors: set[str] = set()

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(AliasEvent):
            event = self.peek_event()
            if event.anchor in self._open_anchors:
                raise YamlLimitError(None, None, f"the alias *{event.anchor} is inside its own anchor "
                                     f"&{event.anchor} (a cycle); aliases may only repeat finished values",
                                     event.start_mark)
            node = super().compose_node(parent, index)
            self._add(self._sizes.get(id(node), 1), event.start_mark)
            return node
        event = self.peek_event()
        self._depth += 1
        if self._depth > self.max_depth:
            raise YamlLimitError(None, None, f"values are nested more than {self.max_depth} levels deep, the limit "
                                 "for adaloss files", event.start_mark)
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            self._open_anchors.add(anchor)
        before = self._count
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
            self._open_anchors.discard(anchor)
        self._add(1, event.start_mark)
        self._sizes[id(node)] = self._count - before
        return node

    def _add(self, count: int, mark: Any) -> None:
        self._count += count
        if self._count > self.max_nodes:
            raise YamlLimitError(None, None, f"the document holds more than {self.max_nodes:,} values once its "
                                 "aliases (*name) are expanded, the limit for adaloss files", mark)


def safe_load_bounded(text: str) -> Any:
    """``yaml.safe_load`` within the limits; raises ``yaml.YAMLError`` (``YamlLimitError`` for a limit)."""
    loader = BoundedSafeLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()
