"""Argument types shared by the ``kvgate-agent`` roles: every flag also reads ``KVGATE_<FLAG>``,
and a bad value (flag or environment) is reported by argparse like any bad flag."""

from __future__ import annotations

import argparse
import logging
import math
import os
from collections.abc import Callable


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


def add_log_level(parser: argparse.ArgumentParser) -> None:
    """``--log-level`` (``KVGATE_LOG_LEVEL``, default INFO)."""
    parser.add_argument(
        "--log-level",
        type=str.upper,
        default=env("LOG_LEVEL", "INFO"),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
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
