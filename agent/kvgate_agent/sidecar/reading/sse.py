"""Incremental accounting of an OpenAI-compatible streaming response (Server-Sent Events):
usage, content deltas, ``[DONE]`` and mid-stream errors, read from the raw bytes as they arrive.

Invariant: an event split anywhere across reads is accounted exactly once, when whole, so the
final usage is never lost to a split (https://github.com/envoyproxy/ai-gateway/issues/2162).
Framing follows the WHATWG event-stream grammar
(https://html.spec.whatwg.org/multipage/server-sent-events.html#parsing-an-event-stream).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kvgate_agent.sidecar.reading.usage import EventReader, decode_json, openai_cached

__all__ = ["OpenAiEvents", "StreamAccountant", "Usage"]

_EOL = re.compile(rb"\r\n|\r|\n")
_CR = 0x0D
_DONE = b"[DONE]"
_LF = 0x0A
_BLANK = b"\n\n"
_DATA_SP = b"data: "


@dataclass(frozen=True, slots=True)
class Usage:
    """Token usage reported by the server in a stream's ``usage`` object (units: tokens)."""

    prompt_tokens: int
    completion_tokens: int


class OpenAiEvents:
    """What an OpenAI stream's JSON events say (chat or completions chunks, as vLLM sends them).

    Holds :attr:`usage` (the last ``usage`` object with int ``prompt_tokens`` and
    ``completion_tokens``, or None), :attr:`content_deltas` (events' choices carrying output,
    counted once per choice per event), :attr:`cached_tokens` (the prompt tokens the engine
    reported found in its prefix cache: the last event's
    ``usage.prompt_tokens_details.cached_tokens``, else its llama.cpp ``timings.cache_n``, as
    :func:`~kvgate_agent.sidecar.reading.usage.openai_cached`; or None; the usage chunk the proxy
    asked for carries it too) and :attr:`error` (the last top-level ``error`` object of an event:
    vLLM's mid-stream errors; or None).

    A chat choice carries output when its ``delta`` has a non-empty ``content``,
    ``reasoning_content`` (or ``reasoning``) or ``tool_calls``; a completions choice when its
    ``text`` is non-empty. vLLM emits about one such delta per generated token, so
    :attr:`content_deltas` approximates output tokens.
    """

    __slots__ = ("cached_tokens", "content_deltas", "error", "usage")

    def __init__(self) -> None:
        self.usage: Usage | None = None
        self.cached_tokens: int | None = None
        self.content_deltas = 0
        self.error: dict[str, Any] | None = None

    @property
    def completion_tokens_estimate(self) -> int:
        """Output tokens: ``usage.completion_tokens`` when reported, else
        :attr:`content_deltas`."""
        return self.usage.completion_tokens if self.usage is not None else self.content_deltas

    def event(self, obj: dict[str, Any]) -> bool:
        """Account one event's JSON object; return False when it is the usage chunk the proxy
        asked for (``"choices": []`` with a ``usage``), True otherwise."""
        err = obj.get("error")
        if isinstance(err, dict):
            self.error = err
        usage = obj.get("usage")
        if isinstance(usage, dict):
            pt, ct = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if type(pt) is int and type(ct) is int:
                self.usage = Usage(pt, ct)
        if usage is not None or "timings" in obj:
            cached = openai_cached(obj)
            if cached is not None:
                self.cached_tokens = cached
        choices = obj.get("choices")
        if isinstance(choices, list):
            if not choices:
                return usage is None
            n = 0
            for c in choices:
                if not isinstance(c, dict):
                    continue
                delta = c.get("delta")
                if isinstance(delta, dict):
                    if (
                        delta.get("content")
                        or delta.get("reasoning_content")
                        or delta.get("reasoning")
                        or delta.get("tool_calls")
                    ):
                        n += 1
                elif c.get("text"):
                    n += 1
            self.content_deltas += n
        return True


class StreamAccountant:
    """Frames one streaming response into events, has each accounted (by :attr:`openai`, or
    by another API's reader) and optionally strips the proxy-requested usage chunk.

    The upstream (vLLM) streams ``data: {json}`` events separated by blank lines and ends with
    ``data: [DONE]``. Lines end with CRLF, LF or CR; a blank line dispatches the event; lines
    starting with ``:`` are comments; ``data`` values of one event are joined with LF; one space
    after ``field:`` is dropped. Cost is linear in the bytes fed: each byte is searched for a
    line terminator once, the buffer only holds the current, incomplete event, and nothing is
    decoded to ``str`` before an event is whole.

    Args:
        strip_usage_chunk: True when the proxy added ``stream_options.include_usage`` upstream
            although the client did not ask for it. Then complete events are forwarded as soon as
            their terminating blank line arrives, except the extra usage event (JSON with
            ``"choices": []`` and a non-null ``usage``), which is dropped; incomplete events are
            held back. When False, :meth:`feed` returns its input unchanged at once.

        reader: for another API's stream (TGI, SGLang, llama.cpp, Responses, Messages), that
            API's :class:`~kvgate_agent.sidecar.reading.usage.EventReader` (its
            :meth:`~kvgate_agent.sidecar.reading.apis.base.Api.event_reader`), which accounts its
            JSON events; usage, output count and end of stream then come from it (``[DONE]`` still
            counts as the end). Without one, :attr:`openai` accounts the events.

    An event that ends with a bare CR is only known to be complete when the next byte arrives
    (it might be the LF of a CRLF) or at :meth:`finish`. Malformed JSON is ignored for
    accounting and forwarded as is; nothing here raises on upstream content.
    """

    __slots__ = (
        "_buf",
        "_data",
        "_done",
        "_ev",
        "_finished",
        "_lines",
        "_pos",
        "_reader",
        "_scan",
        "_strip",
        "openai",
    )

    def __init__(self, strip_usage_chunk: bool, reader: EventReader | None = None) -> None:
        self._strip = strip_usage_chunk
        self._reader = reader
        self._buf = bytearray()  # bytes of the current, incomplete event (and its lines)
        self._ev = 0  # start of the current event in _buf
        self._pos = 0  # start of the current, unterminated line in _buf
        self._scan = 0  # where the search for the next line terminator resumes
        self._data: list[bytes] = []  # data-field values of the current event
        #: What the events said (an OpenAI stream, read without another API's reader).
        self.openai = OpenAiEvents()
        self._done = False
        self._finished = False
        self._lines = False  # a CR was seen: frame line by line (_process) from then on

    # -- results ---------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """True once the ``data: [DONE]`` event (or the reader's final event) has been seen."""
        return self._done or (self._reader is not None and self._reader.done)

    @property
    def prompt_tokens(self) -> int | None:
        """Prompt tokens the stream reported, or None."""
        if self._reader is not None:
            return self._reader.prompt_tokens
        usage = self.openai.usage
        return None if usage is None else usage.prompt_tokens

    @property
    def cached_tokens(self) -> int | None:
        """Prompt tokens the stream reported found in the engine's prefix cache, or None."""
        if self._reader is not None:
            return self._reader.cached_tokens
        return self.openai.cached_tokens

    @property
    def pending_bytes(self) -> int:
        """Bytes held for the current, incomplete event (what a malformed stream that never
        ends its event makes grow)."""
        return len(self._buf)

    @property
    def completion_tokens_estimate(self) -> int:
        """Output tokens: what the stream reported, else counted (by the reader, or
        :attr:`OpenAiEvents.completion_tokens_estimate`)."""
        if self._reader is not None:
            return self._reader.completion_tokens
        return self.openai.completion_tokens_estimate

    # -- feeding ---------------------------------------------------------------------------------

    def feed(self, data: bytes) -> bytes:
        """Consume the next upstream bytes; return the bytes to forward to the client now.

        Pass-through mode returns ``data`` itself. Strip mode returns the complete events that
        ended in ``data`` (minus the extra usage event), possibly ``b""``.

        Raises:
            RuntimeError: called after :meth:`finish`.
        """
        if self._finished:
            raise RuntimeError("StreamAccountant.feed() after finish()")
        if not data:
            return b""
        if not self._lines:
            if b"\r" not in data:
                out = self._feed_lf(data)
                return data if not self._strip else out
            self._lines = True  # the buffer holds one event's start, not yet read: re-read it
            self._scan = 0
        self._buf += data
        out = self._process(eof=False)
        return data if not self._strip else out

    def _feed_lf(self, data: bytes) -> bytes:
        """:meth:`feed` for a stream framed by LF alone (no CR so far, as vLLM, SGLang, TGI
        and llama.cpp send): events end at the first ``\\n\\n``, found by one byte search
        that resumes where the last one stopped; each event is read whole (:meth:`_event`).
        The buffer keeps only the current incomplete event, from its first byte."""
        buf = self._buf
        view: bytes | bytearray = data
        if buf:
            buf += data
            view = buf
        n = len(view)
        start, scan = 0, self._scan
        fwd = 0  # start of the not-yet-forwarded run of kept events
        parts: list[bytes | bytearray] = []
        strip = self._strip
        while True:
            while start < n and view[start] == _LF:  # a blank line between events: no event
                start += 1
            end = view.find(_BLANK, max(start, scan))
            if end < 0:
                break
            if not self._event(view[start:end]) and strip:
                if start > fwd:
                    parts.append(view[fwd:start])
                fwd = end + 2
            start = scan = end + 2
        out = b""
        if strip and start > fwd:
            if fwd == 0 and start == n and view is data:
                out = data
            else:
                parts.append(view[fwd:start])
        if parts:
            out = b"".join(parts)
        if view is buf:
            del buf[:start]
        elif start < n:
            buf += data[start:]
        self._scan = max(0, n - start - 1)  # a "\n\n" may begin at the last byte
        return out

    def _event(self, event: bytes | bytearray) -> bool:
        """Account one whole LF-framed event (its lines, no blank line); as :meth:`_dispatch`."""
        if event.startswith(_DATA_SP) and _LF not in event:  # one data line: the usual event
            return self._account(bytes(event[6:]))
        for line in bytes(event).split(b"\n"):
            self._field(line)
        return self._dispatch()

    def finish(self) -> bytes:
        """End of stream: account what is left and return any held-back bytes.

        A trailing event without its blank line is still parsed for accounting (so a ``usage``
        or ``[DONE]`` missing only its final newline is counted) and is forwarded as is.
        Idempotent: a second call returns ``b""``.
        """
        if self._finished:
            return b""
        self._finished = True
        buf = self._buf
        if not self._lines:  # an incomplete event's lines, none read yet
            for line in bytes(buf).split(b"\n"):
                if line:
                    self._field(line)
            self._pos = len(buf)
            out = b""
        else:
            out = self._process(eof=True)
        if self._pos < len(buf):  # unterminated last line
            self._field(bytes(buf[self._pos :]))
        if self._data:  # trailing incomplete event: account it, never strip it
            self._dispatch()
        if self._strip:
            out += bytes(buf[self._ev :])
        buf.clear()
        self._ev = self._pos = self._scan = 0
        return out

    # -- internals -------------------------------------------------------------------------------

    def _process(self, *, eof: bool) -> bytes:
        """Parse every complete line in the buffer; return the complete events to forward."""
        buf = self._buf
        end = len(buf)
        pos, ev = self._pos, self._ev
        fwd = ev  # start of the not-yet-forwarded run of kept events
        parts: list[bytes] = []
        search = _EOL.search
        scan = end
        m = search(buf, self._scan)
        while m is not None:
            s, e = m.span()
            if e == end and buf[s] == _CR and e - s == 1 and not eof:  # bare CR: maybe CRLF
                scan = s
                break
            if s == pos:  # blank line: dispatch the event
                pos = e
                if not self._dispatch() and self._strip:
                    if ev > fwd:
                        parts.append(bytes(buf[fwd:ev]))
                    fwd = pos
                ev = pos
            else:
                self._field(bytes(buf[pos:s]))
                pos = e
            m = search(buf, pos)
        self._scan = scan
        if self._strip and ev > fwd:
            parts.append(bytes(buf[fwd:ev]))
        if ev:  # drop the finished events; what remains arrived in this feed (linear cost)
            del buf[:ev]
            pos -= ev
            self._scan -= ev
            ev = 0
        self._pos, self._ev = pos, ev
        return b"".join(parts)

    def _field(self, line: bytes) -> None:
        """Record one non-blank line of the current event (only ``data`` fields matter)."""
        if line.startswith(b"data:"):
            value = line[5:]
            self._data.append(value[1:] if value[:1] == b" " else value)
        elif line == b"data":
            self._data.append(b"")

    def _dispatch(self) -> bool:
        """Account the current event; return False when it is the usage chunk to strip."""
        data = self._data
        if not data:
            return True
        self._data = []
        return self._account(data[0] if len(data) == 1 else b"\n".join(data))

    def _account(self, payload: bytes) -> bool:
        """Account one event's data; return False when it is the usage chunk to strip."""
        if payload.strip() == _DONE:
            self._done = True
            return True
        try:
            obj = decode_json(payload)
        except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
            return True
        if not isinstance(obj, dict):
            return True
        if self._reader is not None:
            self._reader.event(obj)
            return True
        return self.openai.event(obj)
