"""A model's values written as the CRDs write them: one ``key: value`` per line, lists in flow
style (``[a, b]``) where the line stays within :data:`WIDTH` columns, else one item a line.

Strings are plain unless a YAML reader could take them for something else (``True``, a number,
the empty string, or a word some readers take for a null or a boolean: ``None``, ``yes``, ``off``:
double quotes) or their characters need quoting (a backslash, a colon, a quote, a brace, a
leading bracket: single quotes, as the CRDs write patterns). A list quotes all its strings or
none. A whole number held as a float is written as an integer (``1``, not ``1.0``), other floats
as Python writes them.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

#: The widest line a flow list may make, columns.
WIDTH = 100
#: Strings that stay plain: letters, digits and the marks a plain YAML scalar carries anywhere
#: without quotes (patterns of names and headers included).
_PLAIN = re.compile(r"^[A-Za-z0-9^][A-Za-z0-9 ^$+*?.,/_()|\[\]-]*$")
#: Words YAML 1.1, YAML 1.2 or Python readers take for a null or a boolean.
_AMBIGUOUS = frozenset({"none", "null", "true", "false", "yes", "no", "on", "off", "y", "n"})


def _needs_double_quotes(text: str) -> bool:
    """A reader could take ``text`` written plain for a non-string (a null, a boolean, a
    number) or for nothing."""
    return text.lower() in _AMBIGUOUS or not isinstance(yaml.safe_load(text or "~"), str)


def scalar(value: Any, quote: bool = False) -> str:
    """``value`` (a bool, int, float or str) as one YAML scalar; ``quote``: a string in double
    quotes whatever it holds."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, str):
        if quote or _needs_double_quotes(value):
            return '"' + value + '"'
        if _PLAIN.match(value) and not value.endswith(" "):
            return value
        return "'" + value.replace("'", "''") + "'"
    raise TypeError(f"not a CRD scalar: {value!r}")


def key_lines(key: str, value: Any, indent: int) -> list[str]:
    """``key: value`` at ``indent`` columns: a scalar, ``{}`` for an empty object, or a list
    (flow style when it fits in :data:`WIDTH` columns, else one ``- item`` a line)."""
    pad = " " * indent
    if isinstance(value, dict):
        if value:
            raise TypeError(f"{key}: only an empty object is written as a value")
        return [f"{pad}{key}: {{}}"]
    if isinstance(value, list):
        quote = any(isinstance(v, str) and _needs_double_quotes(v) for v in value)
        items = [scalar(v, quote) for v in value]
        flow = f"{pad}{key}: [{', '.join(items)}]"
        if len(flow) <= WIDTH:
            return [flow]
        return [f"{pad}{key}:", *(f"{pad}  - {item}" for item in items)]
    return [f"{pad}{key}: {scalar(value)}"]
