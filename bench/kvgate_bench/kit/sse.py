"""A model server's streamed answers read as their JSON events (Server-Sent Events).

A streaming ``/v1/chat/completions`` answer is a run of ``data: {json}`` events, each ended by a
blank line, the last ``data: [DONE]``. :func:`sse_json` reads the body in whole reads
(``iter_any``: one await per read, not per line), splits them into events and yields each
``data:`` event's JSON object in order; ``[DONE]``, other events and a trailing event without its
blank line are skipped. The benchmarks' streaming clients use it: the real-engine calibration's
lone requests (:func:`kvgate_bench.real_engine.calibration_run.one_request`), its arms' client
(:mod:`kvgate_bench.real_engine.client`) and the real-time run's client
(:mod:`kvgate_bench.effectiveness.realtime`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp


async def sse_json(content: aiohttp.StreamReader) -> AsyncIterator[Any]:
    """Each ``data:`` event's JSON object of the stream ``content`` (module docstring).

    Raises:
        ValueError: an event's data is not JSON (``json.JSONDecodeError``).
    """
    buf = b""
    async for data in content.iter_any():
        buf += data
        *events, buf = buf.split(b"\n\n")
        for event in events:
            if not event.startswith(b"data: "):
                continue
            payload = event[6:].strip()
            if payload == b"[DONE]":
                continue
            yield json.loads(payload)
