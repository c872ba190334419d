"""Flags derived from settings dataclasses, and the argument types shared by the
``kvgate-agent`` roles.

A settings field that is also a flag carries :func:`flag` metadata: its default is written once,
in the field, and :func:`add_flags` derives the flag from it (``--field-name`` unless named,
``KVGATE_<FLAG_NAME>`` unless named, the field's default unless the environment gives one).
Every flag also reads its ``KVGATE_*`` variable, and a bad value (flag or environment) is
reported by argparse like any bad flag: string defaults go through the flag's type.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import logging
import math
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

#: The key of :class:`Flag` in a dataclass field's metadata.
FLAG_KEY = "kvgate.flag"

T = TypeVar("T")


def env(name: str, default: str | None = None) -> str | None:
    """``$KVGATE_<name>``, or ``default``."""
    return os.environ.get("KVGATE_" + name, default)


def hostport(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 in brackets; an empty host is ``0.0.0.0``) → (host, port).

    Raises:
        argparse.ArgumentTypeError: no port, or a port outside 0..65535.
    """
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return (host.strip("[]") or "0.0.0.0"), int(port)


#: The values ``--log-level`` takes (any case).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def add_log_level(parser: argparse.ArgumentParser) -> None:
    """``--log-level`` (``KVGATE_LOG_LEVEL``, default INFO). A variable outside
    :data:`LOG_LEVELS` exits 2 with one line, as a bad flag does (argparse checks a flag's
    value against its choices, not a default's)."""
    from_env = env("LOG_LEVEL")
    if from_env is not None and from_env.upper() not in LOG_LEVELS:
        print(f"KVGATE_LOG_LEVEL={from_env!r}: expected one of {', '.join(LOG_LEVELS)}",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
    parser.add_argument(
        "--log-level",
        type=str.upper,
        default=(from_env or "INFO").upper(),
        choices=LOG_LEVELS,
        help="[KVGATE_LOG_LEVEL]",
    )


def configure_logging(level: str) -> None:
    """One log format for every role: time, level, logger, message."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    """An argparse type: a number of ``kind`` above 0.

    Raises (from the returned parser):
        argparse.ArgumentTypeError: not a number, or not above 0.
    """

    def parse(value: str) -> int | float:
        try:
            v = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
        if not 0 < v < math.inf:
            raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {value!r}")
        return v

    parse.__name__ = kind.__name__
    return parse


def url(value: str) -> str:
    """An argparse type: an ``http://`` or ``https://`` URL.

    Raises:
        argparse.ArgumentTypeError: another scheme, or too short to hold a host.
    """
    if not value.startswith(("http://", "https://")) or len(value) < 10:
        raise argparse.ArgumentTypeError(f"expected an http:// or https:// URL, got {value!r}")
    return value


def non_negative_seconds(value: str) -> float:
    """An argparse type: finite seconds >= 0 (0 usually disables).

    Raises:
        argparse.ArgumentTypeError: not a number, negative or infinite.
    """
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {value!r}")
    return seconds


def hostport_text(value: tuple[str, int]) -> str:
    """``(host, port)`` as :func:`hostport` reads it: ``HOST:PORT``."""
    return f"{value[0]}:{value[1]}"


@dataclasses.dataclass(frozen=True, slots=True)
class Flag:
    """How a settings field is given on the command line (see :func:`flag`)."""

    help: str
    """What the flag sets, for ``--help`` (the variable's name and the default are added)."""
    name: str | None = None
    """The flag, e.g. ``--agent-url``; None: ``--`` and the field's name with dashes."""
    env: str | None = None
    """The environment variable after ``KVGATE_``; None: the flag's name in upper case."""
    parse: Callable[[str], Any] | None = None
    """The argparse type reading the flag's (and the variable's) string; None: the string."""
    choices: Sequence[str] | None = None
    """The values allowed (after ``parse``)."""
    required: bool = False
    """argparse requires the flag unless its variable is set."""
    repeat: bool = False
    """Repeatable (``action="append"``); the variable holds comma-separated values."""
    text: Callable[[Any], str] | None = None
    """The field's default as the string the flag would take; None: :func:`default_text`."""
    to_field: Callable[[Any], Any] | None = None
    """The parsed value as the field holds it (e.g. an enum); None: as parsed."""

    def flag_name(self, field: dataclasses.Field[Any]) -> str:
        """The flag of ``field``."""
        return self.name or "--" + field.name.replace("_", "-")

    def env_name(self, field: dataclasses.Field[Any]) -> str:
        """The environment variable of ``field``, ``KVGATE_`` included."""
        return "KVGATE_" + (self.env or self.flag_name(field)[2:].upper().replace("-", "_"))

    def dest(self, field: dataclasses.Field[Any]) -> str:
        """The attribute of the parsed arguments holding the flag's value."""
        return self.flag_name(field)[2:].replace("-", "_")


def flag(
    help: str,
    *,
    name: str | None = None,
    env: str | None = None,
    parse: Callable[[str], Any] | None = None,
    choices: Sequence[str] | None = None,
    required: bool = False,
    repeat: bool = False,
    text: Callable[[Any], str] | None = None,
    to_field: Callable[[Any], Any] | None = None,
) -> Mapping[str, Flag]:
    """The ``metadata`` of a settings field that is also a flag: ``field(default=...,
    metadata=flag("what it sets", parse=...))``. See :class:`Flag` for each argument."""
    return {FLAG_KEY: Flag(help, name, env, parse, choices, required, repeat, text, to_field)}


def default_text(value: Any) -> str | None:
    """A field's default as the flag's string: None stays None, an enum gives its value, a
    float its shortest form (``600``, ``0.25``), anything else ``str``."""
    if value is None:
        return None
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def flag_fields(cls: type[Any]) -> Iterator[tuple[dataclasses.Field[Any], Flag]]:
    """The fields of the settings dataclass ``cls`` that are flags, in order, with their flag."""
    for f in dataclasses.fields(cls):
        meta = f.metadata.get(FLAG_KEY)
        if isinstance(meta, Flag):
            yield f, meta


def field_default(f: dataclasses.Field[Any]) -> Any:
    """The default of ``f`` (its factory's product), or ``dataclasses.MISSING``."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def add_flags(parser: argparse._ActionsContainer, cls: type[Any]) -> None:
    """Add a flag to ``parser`` (or an argument group) for each :func:`flag` field of ``cls``.

    Its default is ``$KVGATE_<ENV>`` when set, else the field's default as a string
    (:attr:`Flag.text`), which argparse passes through the flag's type; a repeatable flag's
    default is the variable's comma-separated entries (not checked by argparse)."""
    for f, meta in flag_fields(cls):
        env_name = meta.env_name(f)
        from_env = os.environ.get(env_name)
        kwargs: dict[str, Any] = {
            "type": meta.parse,
            "help": f"{meta.help} [{env_name}]",
        }
        if meta.repeat:
            kwargs["action"] = "append"
            kwargs["default"] = [p for p in (from_env or "").split(",") if p.strip()]
        else:
            default = field_default(f)
            if from_env is not None:
                kwargs["default"] = from_env
            elif default is dataclasses.MISSING or default is None:
                kwargs["default"] = None
            else:
                kwargs["default"] = (meta.text or default_text)(default)
            kwargs["required"] = meta.required and from_env is None
        if meta.choices is not None:
            kwargs["choices"] = list(meta.choices)
            if from_env is not None and not meta.repeat:
                given = from_env if meta.parse is None else meta.parse(from_env)
                if given not in meta.choices:  # argparse checks a flag's value, not a default
                    print(
                        f"{env_name}={from_env!r}: expected one of {', '.join(meta.choices)}",
                        file=sys.stderr,
                    )
                    raise SystemExit(2)
        parser.add_argument(meta.flag_name(f), **kwargs)


def from_args(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """``cls`` from parsed arguments: each :func:`flag` field from its flag (a repeated one as a
    tuple), the other fields from ``overrides`` or their defaults."""
    values: dict[str, Any] = {}
    for f, meta in flag_fields(cls):
        value = getattr(args, meta.dest(f))
        if meta.repeat:
            value = tuple(value)
        elif meta.to_field is not None and value is not None:
            value = meta.to_field(value)
        values[f.name] = value
    values.update(overrides)
    return cls(**values)
