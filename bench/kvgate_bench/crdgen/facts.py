"""What a pydantic model says of each node of a CRD's schema: its type, enum, bounds, length and
pattern, item counts, default and required fields, and its children (properties by alias, list
items, map values).

A :class:`Facts` tree is read from the model's JSON schema (pydantic, by alias, validation mode)
with ``$ref``, ``Optional`` (``anyOf: [X, null]``) and ``allOf: [X]`` resolved, in OpenAPI v3.0
terms (what a CRD's structural schema takes):

- ``exclusiveMinimum: x`` is ``minimum: x + 1`` on an integer, ``minimum: x`` and
  ``exclusiveMinimum: true`` on a number (the same for maxima); ``const`` is a one-value enum;
- a ``None`` default is no default;
- an object field whose default is a factory of a model class (``Field(default_factory=...)``,
  absent from the JSON schema) defaults to ``{}``: the API server then fills in that object's own
  defaults, as the model does;
- ``additionalProperties: false`` (extra fields forbidden) is left out: a CRD prunes unknown
  fields.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

#: Constraint keywords copied from the model as they are (the bounds are converted).
PLAIN_KEYS = ("format", "minLength", "maxLength", "pattern", "minItems", "maxItems")


@dataclass
class Facts:
    """One schema node as the model states it.

    Attributes:
        keys: the node's own keywords (``type``, ``enum``, bounds, ``default``, ``required``...)
            and their values, as a CRD writes them.
        properties: the object's properties by their alias (camelCase), in the model's order.
        items: a list's item node.
        values: a map's value node (``additionalProperties``).
    """

    keys: dict[str, Any] = field(default_factory=dict)
    properties: dict[str, Facts] = field(default_factory=dict)
    items: Facts | None = None
    values: Facts | None = None


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Follow ``$ref``, unwrap ``anyOf: [X, null]`` and ``allOf: [X]``, keeping the outer node's
    own keywords (its default, its bounds)."""
    node = dict(node)
    while True:
        if "$ref" in node:
            target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
            node = {**target, **node}
        elif "anyOf" in node:
            options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
            if len(options) != 1:
                raise ValueError(f"a union the CRD cannot state: {options}")
            node = {**options[0], **node}
        elif "allOf" in node:
            (only,) = node.pop("allOf")
            node = {**only, **node}
        else:
            return node


def _bounds(node: dict[str, Any]) -> dict[str, Any]:
    """The node's minimum and maximum in OpenAPI v3.0 terms (see the module docstring)."""
    out: dict[str, Any] = {}
    for bound, key in (("Minimum", "minimum"), ("Maximum", "maximum")):
        if key in node:
            out[key] = node[key]
        if f"exclusive{bound}" in node:
            value = node[f"exclusive{bound}"]
            if node.get("type") == "integer":
                out[key] = math.floor(value) + 1 if key == "minimum" else math.ceil(value) - 1
            else:
                out[key] = value
                out[f"exclusive{bound}"] = True
    return out


def _facts(node: dict[str, Any], defs: dict[str, Any], factory_default: bool) -> Facts:
    node = _resolve(node, defs)
    keys: dict[str, Any] = {"type": node["type"]}
    if "enum" in node:
        keys["enum"] = list(node["enum"])
    elif "const" in node:
        keys["enum"] = [node["const"]]
    keys |= _bounds(node)
    keys |= {k: node[k] for k in PLAIN_KEYS if k in node}
    if node.get("default") is not None:
        keys["default"] = node["default"]
    elif factory_default and "properties" in node:
        keys["default"] = {}
    if node.get("required"):
        keys["required"] = list(node["required"])
    facts = Facts(keys)
    required = set(node.get("required", ()))
    for name, sub in node.get("properties", {}).items():
        absent = name not in required and "default" not in sub
        facts.properties[name] = _facts(sub, defs, factory_default=absent)
    if "items" in node:
        facts.items = _facts(node["items"], defs, factory_default=False)
    if isinstance(node.get("additionalProperties"), dict):
        facts.values = _facts(node["additionalProperties"], defs, factory_default=False)
    return facts


def model_facts(model: type[BaseModel]) -> Facts:
    """The facts of ``model``'s schema, the model's own node first (an object)."""
    doc = model.model_json_schema(by_alias=True, mode="validation")
    return _facts(doc, doc.get("$defs", {}), factory_default=False)
