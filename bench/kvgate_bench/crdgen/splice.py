"""A CRD's text from its source and a model's facts: each fact written into the source's schema
node it belongs to, at its place among the keys the source writes, the source's own lines kept
as they are (their wrapping, their quoting, their comments).

The source is a CRD without what the model states (:mod:`kvgate_bench.crdgen.facts`): below a
model's root it writes each property with its description, the CEL rules and the constraints
only the CRD has, never a keyword the model gives (that is an error, as a property missing from
either side is). A node's keywords, the source's and the model's together, follow
:data:`ORDER`; a list's items or a map's values that need no description (``type: string`` and
the model's constraints) may be left out of the source whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import yaml

from kvgate_bench.crdgen.facts import Facts
from kvgate_bench.crdgen.scalars import key_lines

#: The keywords of a schema node in the order the CRDs write them. ``default`` comes second on an
#: object (``default: {}``) and after the enum on any other node.
ORDER = (
    "type",
    "default@object",
    "x-kubernetes-map-type",
    "description",
    "required",
    "format",
    "minimum",
    "exclusiveMinimum",
    "maximum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "maxProperties",
    "enum",
    "default",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "x-kubernetes-validations",
    "items",
    "properties",
    "additionalProperties",
)

#: Text another CRD supplies for a node of this one: ``(path, name, indent) -> lines`` for the
#: property or keyword ``name`` of the node at ``path``, its first line at ``indent`` columns;
#: None when it supplies none.
Borrow = Callable[[str, str, int], "list[str] | None"]


class SourceError(ValueError):
    """The source and the model disagree (each line of the message names a path)."""


def _rank(key: str, node_type: object) -> int:
    if key == "default" and node_type == "object":
        key = "default@object"
    if key not in ORDER:
        raise KeyError(key)
    return ORDER.index(key)


def child(node: yaml.MappingNode, key: str) -> yaml.Node | None:
    """The value of ``key`` in a mapping node, None when absent."""
    for k, v in node.value:
        if k.value == key:
            found: yaml.Node = v
            return found
    return None


@dataclass
class Splice:
    """The source's lines and what goes between them; :meth:`text` is the result."""

    lines: list[str]
    #: (line index, lines): inserted before that source line, in the order given.
    inserts: list[tuple[int, list[str]]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def last_line(self, node: yaml.Node) -> int:
        """The last source line of ``node`` (its comments and blank lines after it excluded)."""
        end = node.end_mark
        line = end.line if self.lines[end.line][: end.column].strip() else end.line - 1
        while not self.lines[line].strip() or self.lines[line].lstrip().startswith("#"):
            line -= 1
        return line

    def node(self, src: yaml.MappingNode, facts: Facts, path: str, borrow: Borrow) -> None:
        """Write ``facts`` into the source node ``src`` (at ``path``), its children too."""
        node_type = facts.keys.get("type")
        keys = [(k.value, k, v) for k, v in src.value]
        indent = src.value[0][0].start_mark.column if src.value else 0
        for name, _, _ in keys:
            if name in facts.keys:
                self.errors.append(f"{path}.{name}: the model gives it; drop it from the source")
            elif name not in ORDER:
                self.errors.append(f"{path}.{name}: not a schema keyword the CRDs use")
        ranks = [_rank(name, node_type) for name, _, _ in keys if name in ORDER]
        if ranks != sorted(ranks):
            self.errors.append(f"{path}: keywords out of order ({[k for k, _, _ in keys]})")
        pending: list[tuple[int, list[str]]] = [
            (_rank(k, node_type), key_lines(k, v, indent)) for k, v in facts.keys.items()
        ]
        rules = borrow(path, "x-kubernetes-validations", indent)
        if rules is not None:
            pending.append((_rank("x-kubernetes-validations", node_type), rules))
        self._children(src, facts, path, indent, pending, borrow)
        for rank, text in sorted(pending, key=lambda p: p[0]):
            after = [k for name, k, _ in keys if name in ORDER and _rank(name, node_type) > rank]
            at = after[0].start_mark.line if after else self.last_line(src) + 1
            self.inserts.append((at, text))

    def _children(
        self,
        src: yaml.MappingNode,
        facts: Facts,
        path: str,
        indent: int,
        pending: list[tuple[int, list[str]]],
        borrow: Borrow,
    ) -> None:
        for key, sub, suffix in (
            ("items", facts.items, "[]"),
            ("additionalProperties", facts.values, "{}"),
        ):
            given = child(src, key)
            if sub is None:
                if given is not None:
                    self.errors.append(f"{path}.{key}: in the source, not in the model")
            elif isinstance(given, yaml.MappingNode):
                self.node(given, sub, path + suffix, borrow)
            elif sub.properties:
                self.errors.append(f"{path}{suffix}: its properties need the source's descriptions")
            else:
                lines = [f"{' ' * indent}{key}:"]
                kind = sub.keys["type"]
                for k, v in sorted(sub.keys.items(), key=lambda kv: _rank(kv[0], kind)):
                    lines += key_lines(k, v, indent + 2)
                pending.append((_rank(key, None), lines))
        given = child(src, "properties")
        if not facts.properties:
            if given is not None:
                self.errors.append(f"{path}.properties: in the source, not in the model")
            return
        if not isinstance(given, yaml.MappingNode):
            self.errors.append(f"{path}.properties: missing from the source")
            return
        names = {k.value for k, _ in given.value}
        for extra in sorted(names - set(facts.properties)):
            self.errors.append(f"{path}.{extra}: in the source, not in the model")
        prop_indent = given.value[0][0].start_mark.column
        borrowed: list[str] = []
        for name, sub in facts.properties.items():
            node = child(given, name)
            if isinstance(node, yaml.MappingNode):
                self.node(node, sub, f"{path}.{name}", borrow)
                continue
            text = borrow(path, name, prop_indent)
            if text is None:
                self.errors.append(f"{path}.{name}: in the model, missing from the source")
            else:
                borrowed += text
        if borrowed:
            self.inserts.append((self.last_line(given) + 1, borrowed))

    def text(self) -> str:
        """The source with every insertion made (those at one line in the order made)."""
        at_line: dict[int, list[str]] = {}
        for at, text in self.inserts:
            at_line.setdefault(at, []).extend(text)
        out = list(self.lines)
        for at in sorted(at_line, reverse=True):
            out[at:at] = at_line[at]
        return "\n".join(out)
