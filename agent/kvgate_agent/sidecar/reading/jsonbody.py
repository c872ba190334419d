"""A request body as a JSON object, fast, with the reference's answers: msgspec decodes it, and
a cheap proof that no key was repeated stands in for Python's ``object_pairs_hook``; whatever
the fast path declines is decided by Python's :mod:`json`, the reference, so both paths refuse
and accept the same bodies with the same errors. Pure byte/JSON logic: no HTTP framework.
"""

from __future__ import annotations

import json
import math
from typing import Any, NoReturn

import msgspec

from kvgate_agent.sidecar.reading.openai_errors import RequestError

__all__ = ["decode_object", "encode"]


def _bad(message: str, param: str | None) -> RequestError:
    return RequestError(400, message, param=param)


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not valid JSON")


class _Refused(ValueError):
    """A body refused for a reason the 400 names: ``message``, and the key at fault (``param``).

    One class for every such reason, caught by one ``except``: compiled by mypyc, a chain of
    ``except`` clauses for several ValueError subclasses of this module checked the first
    clause's class against the second's exception (``_DuplicateKey object expected; got
    _NotFinite``), so ``1e400`` answered 500 in the compiled image instead of 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def _finite_float(text: str) -> float:
    """A JSON number with a fraction or exponent as a float; one past a double's range (such as
    ``1e400``, which Python's :mod:`json` reads as infinity) is refused: re-encoded it would
    become ``null`` (msgspec), sent as written the engine reads it its own way."""
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(
            f"The request body has a number out of range ({text[:32]} is not a finite 64-bit float)"
        )
    return value


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _Refused(f"The request body repeats the key {k[:64]!r}", k[:64])
            seen.add(k)
    return obj


_fast_decode = msgspec.json.Decoder().decode
encode = msgspec.json.Encoder().encode
"""Compact UTF-8 JSON of a decoded body (msgspec); raises UnicodeEncodeError for a lone
surrogate."""
_QUOTE = b'"'
_QUOTE_ESCAPE = b"\\u0022"


def decode_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object (constants such as ``NaN`` and numbers past a double's range,
    such as ``1e400``, refused).

    A key repeated in one object is refused: JSON parsers disagree on which value wins
    (Python's keeps the last, serde-based servers such as TGI refuse it; RFC 8259 §4 leaves it
    open), so the limit kvgate read could differ from the one the engine applies.

    Fast path: msgspec decodes the bytes (integers of any size stay exact), and
    :func:`_no_repeated_key` proves no key was repeated. Anything it declines (invalid JSON,
    a lone surrogate escape, ``1e400``, a repeated key, nesting past msgspec's limit) is decided
    by :func:`_decode_strict`, the reference (Python's :mod:`json`), so errors and accepted
    values are the same on both paths.

    Raises:
        RequestError: 400 for a body that is not UTF-8, not JSON, not an object or that has a
            number that is not finite (``param`` None), or that repeats a key (``param`` the
            key).
    """
    try:
        body = _fast_decode(raw)
    except (ValueError, RecursionError):  # msgspec.DecodeError, UnicodeDecodeError
        return _decode_strict(raw)
    if type(body) is not dict:
        raise _bad("The request body must be a JSON object", None)
    if not _no_repeated_key(raw, body):
        return _decode_strict(raw)
    return body


def _no_repeated_key(raw: bytes, body: dict[str, Any]) -> bool:
    """True when ``raw`` (valid JSON that decoded to ``body``) repeats no key in any object;
    False means "maybe" (the reference decides).

    ``body`` re-encoded compactly has exactly the strings of ``raw`` less those of every
    dropped duplicate (its key at least). A ``"`` occurs in JSON text only around a string or
    escaped inside one (``\\"`` or ``\\u0022``; the encoder writes ``\\"``), so without a
    duplicate the re-encoded text has as many ``"`` as ``raw`` plus one per ``\\u0022`` escape,
    and with one at least two fewer. Counting every ``\\u0022`` byte sequence, escaped or not,
    only errs towards "maybe". Equal bytes (the client wrote compact JSON, as most SDKs do)
    need no count. Cost: one encode and at most three byte scans, no Python per key.
    """
    try:
        canonical = encode(body)
    except (TypeError, ValueError, RecursionError):  # pragma: no cover - decoded JSON encodes
        return False
    if canonical == raw:
        return True
    return canonical.count(_QUOTE) == raw.count(_QUOTE) + raw.count(_QUOTE_ESCAPE)


def _decode_strict(raw: bytes) -> dict[str, Any]:
    """:func:`decode_object` by Python's :mod:`json`, the reference: each object's pairs are
    checked for a repeated key, which is named in the 400, and every float for a finite value."""
    try:
        body = json.loads(
            raw.decode("utf-8"),
            parse_constant=_reject_constant,
            parse_float=_finite_float,
            object_pairs_hook=_unique,
        )
    except UnicodeDecodeError:
        raise _bad("The request body is not valid UTF-8", None) from None
    except _Refused as exc:
        raise _bad(exc.message, exc.param) from None
    except (ValueError, RecursionError):
        raise _bad("The request body is not valid JSON", None) from None
    if not isinstance(body, dict):
        raise _bad("The request body must be a JSON object", None)
    return body
