"""YAML as kvgate reads its files (a policy, a keys file): PyYAML's safe loader, refusing a
mapping that repeats a key.

YAML 1.2 says the keys of a mapping are unique (https://yaml.org/spec/1.2.2/#mapping), but
PyYAML keeps the last value of a repeated key without a word
(https://github.com/yaml/pyyaml/issues/165): a policy with two ``rateLimits:`` would enforce the
second and silently drop the first. :class:`UniqueKeyLoader` refuses it instead, naming the key
and both lines. A merge key (``<<: *anchor``) may still be overridden by the mapping's own keys,
as YAML's merge type says (https://yaml.org/type/merge.html).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Any

import yaml
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode

__all__ = ["DuplicateKeyError", "UniqueKeyLoader", "load_all", "load_one"]

_MERGE_TAG = "tag:yaml.org,2002:merge"


class DuplicateKeyError(ConstructorError):
    """A mapping repeats a key; one line: ``line 9: the key 'rateLimits' is given twice (first
    on line 7); a mapping's keys are unique``."""

    def __str__(self) -> str:
        mark = self.problem_mark
        where = f"line {mark.line + 1}: " if mark is not None else ""
        return f"{where}{self.problem}; a mapping's keys are unique"


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that raises :class:`DuplicateKeyError` on a mapping with a repeated
    key, at the repeated key's line."""

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        first: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                line = first.get(key)
            except TypeError:  # an unhashable key: the base class says so
                continue
            if line is not None:
                raise DuplicateKeyError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"the key {key!r} is given twice (first on line {line})",
                    key_node.start_mark,
                )
            first[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def load_one(data: str | bytes) -> Any:
    """The one YAML document of ``data`` (None when empty).

    Raises:
        yaml.YAMLError: not YAML, several documents, or a mapping that repeats a key.
    """
    return yaml.load(data, Loader=UniqueKeyLoader)  # a SafeLoader


def load_all(data: str | bytes) -> Iterator[Any]:
    """Each YAML document of ``data``, in order.

    Raises (while iterating):
        yaml.YAMLError: not YAML, or a mapping that repeats a key.
    """
    return yaml.load_all(data, Loader=UniqueKeyLoader)  # a SafeLoader
