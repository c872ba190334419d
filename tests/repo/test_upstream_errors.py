"""The upstream room's errors are its own (issue 35): no exception class defined in
``sidecar/upstream/`` subclasses one of aiohttp's, they share one base (``UpstreamError``) on
the room's face, and ``UPSTREAM_FAILURES`` (what the forwarder and pass-through catch) covers
them, a timeout and aiohttp's client errors alike."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import aiohttp

import kvgate_agent.sidecar.upstream as upstream
from kvgate_agent.sidecar.upstream import (
    UPSTREAM_FAILURES,
    MalformedStream,
    UpstreamBroken,
    UpstreamConnectError,
    UpstreamError,
)


def _room_exceptions() -> list[type[BaseException]]:
    found: list[type[BaseException]] = []
    for info in pkgutil.iter_modules(upstream.__path__, f"{upstream.__name__}."):
        module = importlib.import_module(info.name)
        found.extend(
            obj
            for _, obj in inspect.getmembers(module, inspect.isclass)
            if issubclass(obj, BaseException) and obj.__module__ == module.__name__
        )
    return found


def test_no_upstream_error_subclasses_an_aiohttp_class() -> None:
    classes = _room_exceptions()
    assert {UpstreamError, UpstreamConnectError, UpstreamBroken, MalformedStream} <= set(classes)
    borrowed = [
        f"{cls.__module__}.{cls.__qualname__} <- {base.__module__}.{base.__qualname__}"
        for cls in classes
        for base in cls.__mro__
        if base.__module__.split(".")[0] in ("aiohttp", "yarl", "multidict")
    ]
    assert not borrowed, f"the upstream room's errors subclass its own base: {borrowed}"


def test_the_upstream_errors_share_one_base_and_are_caught() -> None:
    for cls in (UpstreamConnectError, UpstreamBroken, MalformedStream):
        assert issubclass(cls, UpstreamError)
        assert not issubclass(cls, aiohttp.ClientError)
    for exc in (
        UpstreamConnectError("refused"),
        UpstreamBroken("closed mid-answer"),
        MalformedStream("an event over the limit"),
        TimeoutError(),
        aiohttp.ClientPayloadError("aiohttp's client leg"),
        aiohttp.ClientConnectorError.__new__(aiohttp.ClientConnectorError),
    ):
        assert isinstance(exc, UPSTREAM_FAILURES), type(exc)
