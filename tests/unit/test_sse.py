"""StreamAccountant: split-invariance properties and SSE framing edge cases."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate_agent.sidecar.reading import sse
from kvgate_agent.sidecar.reading.sse import StreamAccountant, Usage

# -- helpers -------------------------------------------------------------------------------------


def ev(obj: Any, eol: str = "\n") -> bytes:
    """One SSE event carrying ``obj`` as compact, non-ASCII-escaped JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}{eol}{eol}".encode()


DONE = b"data: [DONE]\n\n"


def chat_chunk(*contents: str) -> dict[str, Any]:
    return {
        "id": "c1",
        "object": "chat.completion.chunk",
        "choices": [
            {"index": i, "delta": {"content": c}, "finish_reason": None}
            for i, c in enumerate(contents)
        ],
    }


def usage_chunk(p: int, c: int) -> dict[str, Any]:
    return {
        "id": "c1",
        "choices": [],
        "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c},
    }


def run(data: bytes, cuts: list[int], strip: bool) -> tuple[StreamAccountant, bytes]:
    """Feed ``data`` split at ``cuts`` (sorted offsets); return the accountant and output."""
    acc = StreamAccountant(strip)
    out = bytearray()
    prev = 0
    for c in [*cuts, len(data)]:
        out += acc.feed(data[prev:c])
        prev = c
    out += acc.finish()
    return acc, bytes(out)


def one_byte(data: bytes, strip: bool) -> tuple[StreamAccountant, bytes]:
    return run(data, list(range(1, len(data))), strip)


def summary(acc: StreamAccountant) -> tuple[Usage | None, int, bool, Any]:
    return acc.openai.usage, acc.openai.content_deltas, acc.done, acc.openai.error


# -- generated streams ---------------------------------------------------------------------------

TEXT = st.text(
    alphabet=st.one_of(
        st.sampled_from(list('ab \n\t"\\:{}é😀🦀中文字の한')),
        st.characters(codec="utf-8"),
    ),
    max_size=12,
)


@dataclass
class Stream:
    data: bytes  # the full stream
    without_usage: bytes  # the stream minus the usage-only event
    usage: Usage | None
    deltas: int


@st.composite
def streams(draw: st.DrawFn) -> Stream:
    eol = draw(st.sampled_from(["\n", "\r\n"]))
    chat = draw(st.booleans())
    parts: list[bytes] = []
    kept: list[bytes] = []
    deltas = 0
    if draw(st.booleans()):
        comment = f": keep-alive{eol}{eol}".encode()
        parts.append(comment)
        kept.append(comment)
    for _ in range(draw(st.integers(0, 6))):
        texts = draw(st.lists(TEXT, min_size=1, max_size=3))
        deltas += sum(1 for t in texts if t)
        if chat:
            obj = chat_chunk(*texts)
        else:
            obj = {
                "id": "cmpl-1",
                "object": "text_completion",
                "choices": [
                    {"index": i, "text": t, "finish_reason": None} for i, t in enumerate(texts)
                ],
            }
        e = ev(obj, eol)
        parts.append(e)
        kept.append(e)
    usage = None
    if draw(st.booleans()):
        p, c = draw(st.integers(0, 10**6)), draw(st.integers(0, 10**6))
        usage = Usage(p, c)
        parts.append(ev(usage_chunk(p, c), eol))
    done = f"data: [DONE]{eol}{eol}".encode()
    parts.append(done)
    kept.append(done)
    return Stream(b"".join(parts), b"".join(kept), usage, deltas)


@st.composite
def stream_and_cuts(draw: st.DrawFn) -> tuple[Stream, list[int]]:
    s = draw(streams())
    n = len(s.data)
    if draw(st.integers(0, 9)) == 0:
        cuts = list(range(1, n))
    else:
        cuts = sorted(draw(st.sets(st.integers(1, max(1, n - 1)), max_size=12)))
    return s, cuts


SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(stream_and_cuts(), st.booleans())
def test_split_invariance(sc: tuple[Stream, list[int]], strip: bool) -> None:
    s, cuts = sc
    whole, whole_out = run(s.data, [], strip)
    split, split_out = run(s.data, cuts, strip)
    assert summary(split) == summary(whole)
    assert split.openai.usage == s.usage
    assert split.openai.content_deltas == s.deltas
    assert split.done
    assert split.openai.error is None
    assert split.completion_tokens_estimate == (s.usage.completion_tokens if s.usage else s.deltas)
    expected = s.without_usage if strip else s.data
    assert split_out == whole_out == expected


@settings(max_examples=60, deadline=None)
@given(streams(), st.booleans())
def test_one_byte_feeds(s: Stream, strip: bool) -> None:
    acc, out = one_byte(s.data, strip)
    assert (acc.openai.usage, acc.openai.content_deltas, acc.done) == (s.usage, s.deltas, True)
    assert out == (s.without_usage if strip else s.data)


@settings(max_examples=100, deadline=None)
@given(streams(), st.lists(st.integers(1, 7), max_size=200))
def test_strip_forwards_each_event_once_complete(s: Stream, sizes: list[int]) -> None:
    """Strip mode never forwards a partial event, and never holds a complete one back."""
    acc = StreamAccountant(True)
    fed = bytearray()
    out = bytearray()
    i = 0
    for size in [*sizes, len(s.data)]:
        chunk = s.data[i : i + size]
        i += size
        fed += chunk
        out += acc.feed(chunk)
        # everything fed up to the last "\n\n" (or "\r\n\r\n") is out, nothing beyond it
        end = max(fed.rfind(b"\n\n") + 2, fed.rfind(b"\r\n\r\n") + 4, 0)
        assert bytes(out) == _strip_usage(bytes(fed[:end]))
        if i >= len(s.data):
            break
    assert bytes(out) + acc.finish() == s.without_usage


def _strip_usage(stream: bytes) -> bytes:
    """Reference: drop usage-only events from complete, LF/CRLF-framed stream bytes."""
    sep = b"\r\n\r\n" if b"\r\n" in stream else b"\n\n"
    events = stream.split(sep)
    kept = []
    for e in events[:-1]:
        try:
            obj = json.loads(e.removeprefix(b"data: "))
        except ValueError:
            obj = None
        if isinstance(obj, dict) and obj.get("choices") == [] and obj.get("usage") is not None:
            continue
        kept.append(e + sep)
    return b"".join(kept)


# -- edge cases ----------------------------------------------------------------------------------


@pytest.mark.parametrize("strip", [False, True])
def test_event_cut_mid_json(strip: bool) -> None:
    e = ev(chat_chunk("hello"))
    acc = StreamAccountant(strip)
    out = acc.feed(e[:15])
    assert out == (e[:15] if not strip else b"")
    assert acc.openai.content_deltas == 0
    out += acc.feed(e[15:])
    assert out == e
    assert acc.openai.content_deltas == 1


@pytest.mark.parametrize("strip", [False, True])
def test_utf8_char_split_across_feeds(strip: bool) -> None:
    e = ev(chat_chunk("😀中")) + ev(usage_chunk(3, 2)) + DONE
    k = e.index("😀".encode()) + 2  # inside the 4-byte emoji
    acc, out = run(e, [k, k + 1, k + 3], strip)
    assert acc.openai.content_deltas == 1
    assert acc.openai.usage == Usage(3, 2)
    assert out == (e if not strip else ev(chat_chunk("😀中")) + DONE)


def test_blank_line_split_between_feeds() -> None:
    e = ev(chat_chunk("x"))
    acc = StreamAccountant(True)
    assert acc.feed(e[:-1]) == b""  # "\n" of the blank line not yet seen
    assert acc.openai.content_deltas == 0
    assert acc.feed(e[-1:]) == e
    assert acc.openai.content_deltas == 1


def test_crlf_and_cr_line_endings() -> None:
    for eol in ("\r\n", "\r"):
        u = ev(usage_chunk(5, 1), eol)
        data = ev(chat_chunk("a"), eol) + u + f"data: [DONE]{eol}{eol}".encode()
        for strip in (False, True):
            for acc, out in (run(data, [], strip), one_byte(data, strip)):
                assert (acc.openai.usage, acc.openai.content_deltas, acc.done) == (
                    Usage(5, 1),
                    1,
                    True,
                )
                assert out == (data if not strip else data.replace(u, b""))


def test_crlf_split_between_cr_and_lf_strips_exactly() -> None:
    u = ev(usage_chunk(1, 1), "\r\n")
    data = ev(chat_chunk("a"), "\r\n") + u + b"data: [DONE]\r\n\r\n"
    cut = len(ev(chat_chunk("a"), "\r\n")) + len(u) - 1  # between the final CR and LF of u
    acc, out = run(data, [cut], True)
    assert out == data.replace(u, b"")
    assert acc.openai.usage == Usage(1, 1)


def test_bare_cr_event_completes_on_next_byte_or_finish() -> None:
    e = b'data: {"choices":[{"index":0,"text":"hi"}]}\r\r'
    acc = StreamAccountant(True)
    assert acc.feed(e) == b""  # the last CR could still be half of a CRLF
    assert acc.feed(b"d") == e
    assert acc.openai.content_deltas == 1
    assert acc.finish() == b"d"


def test_mixed_line_endings() -> None:
    data = b'data: {"choices":[{"index":0,"text":"a"}]}\r\n\n' + b"data: [DONE]\n\r\n"
    for cuts in ([], list(range(1, len(data)))):
        acc, out = run(data, cuts, True)
        assert (acc.openai.content_deltas, acc.done, out) == (1, True, data)


def test_multiple_data_lines_are_joined_with_lf() -> None:
    data = b'data: {"choices":\ndata: [{"index":0,\ndata:"text":"a\\nb"}]}\n\n'
    acc, out = run(data, [], True)
    assert acc.openai.content_deltas == 1
    assert out == data


def test_multiline_usage_event_is_stripped() -> None:
    u = b'data: {"choices": [],\r\ndata: "usage": {"prompt_tokens": 7, "completion_tokens": 9}}'
    u += b"\r\n\r\n"
    data = ev(chat_chunk("a")) + u + DONE
    for acc, out in (run(data, [], True), one_byte(data, True)):
        assert acc.openai.usage == Usage(7, 9)
        assert out == ev(chat_chunk("a")) + DONE


def test_comments_and_other_fields_ignored_and_forwarded() -> None:
    data = b": ping\n\nevent: message\nid: 3\nretry: 10\n: note\n" + ev(chat_chunk("a")) + DONE
    for strip in (False, True):
        acc, out = run(data, [], strip)
        assert (acc.openai.content_deltas, acc.done, out) == (1, True, data)


def test_data_without_space_and_bare_data_field() -> None:
    data = b'data:{"choices":[{"index":0,"text":"a"}]}\n\ndata\n\ndata:[DONE]\n\n'
    acc, out = run(data, [], True)
    assert (acc.openai.content_deltas, acc.done, out) == (1, True, data)
    # exactly one space is dropped: "data:  x" has value " x"
    acc, _ = run(b'data:  {"choices":[{"index":0,"text":"b"}]}\n\n', [], False)
    assert acc.openai.content_deltas == 1  # JSON tolerates the extra leading space


@pytest.mark.parametrize("strip", [False, True])
def test_malformed_json_ignored_and_forwarded(strip: bool) -> None:
    bad = [
        b"data: {not json\n\n",
        b"data: [1, 2]\n\n",
        b'data: "str"\n\n',
        b"data: \xff\xfe\n\n",
        b"data: " + b"[" * 100_000 + b"\n\n",
        b'data: {"choices": "x", "usage": {"prompt_tokens": "1", "completion_tokens": 2}}\n\n',
        b'data: {"choices": [1, {"delta": "x"}, {"delta": {"content": ""}}]}\n\n',
        b'data: {"choices": [], "usage": {"prompt_tokens": true, "completion_tokens": 2}}\n\n',
    ]
    data = b"".join(bad) + DONE
    acc, out = run(data, [], strip)
    assert (acc.openai.usage, acc.openai.content_deltas, acc.done) == (None, 0, True)
    # the last bad event has choices [] and a non-null usage: stripped although unusable
    assert out == (data if not strip else data.replace(bad[-1], b""))


def test_reasoning_and_tool_call_deltas_count() -> None:
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"reasoning_content": "think"}}]},
        {"choices": [{"index": 0, "delta": {"reasoning": "think"}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "t"}]}}]},
        {"choices": [{"index": 0, "delta": {"content": "a"}}, {"index": 1, "delta": {}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    ]
    acc, _ = run(b"".join(ev(c) for c in chunks) + DONE, [], False)
    assert acc.openai.content_deltas == 4
    assert acc.openai.usage is None
    assert acc.completion_tokens_estimate == 4


def test_last_usage_wins_and_inline_usage_is_not_stripped() -> None:
    inline = {**chat_chunk("a"), "usage": {"prompt_tokens": 4, "completion_tokens": 1}}
    final = usage_chunk(4, 2)
    data = ev(inline) + ev(final) + DONE
    acc, out = run(data, [], True)
    assert acc.openai.usage == Usage(4, 2)
    assert acc.completion_tokens_estimate == 2
    assert out == ev(inline) + DONE
    # "usage": null with empty choices is not the usage chunk
    keep = ev({"choices": [], "usage": None})
    assert run(keep, [], True)[1] == keep


def test_mid_stream_error() -> None:
    err = {"error": {"message": "boom", "type": "BadRequestError", "code": 400}}
    data = ev(chat_chunk("a")) + ev(err) + DONE
    acc, out = run(data, [5, 50], True)
    assert acc.openai.error == err["error"]
    assert out == data


def test_finish_forwards_and_accounts_trailing_partial_event() -> None:
    acc = StreamAccountant(True)
    assert acc.feed(ev(chat_chunk("a")) + b"data: [DONE]") == ev(chat_chunk("a"))
    assert not acc.done
    assert acc.finish() == b"data: [DONE]"
    assert acc.done
    assert acc.finish() == b""
    with pytest.raises(RuntimeError):
        acc.feed(b"x")
    # an unterminated usage event is accounted but forwarded as is
    tail = ev(usage_chunk(2, 3)).rstrip(b"\n")
    acc, out = run(ev(chat_chunk("a")) + tail, [], True)
    assert acc.openai.usage == Usage(2, 3)
    assert out == ev(chat_chunk("a")) + tail


def test_passthrough_returns_input_object_immediately() -> None:
    acc = StreamAccountant(False)
    chunk = b'data: {"choi'
    assert acc.feed(chunk) is chunk
    assert acc.feed(b"") == b""
    assert acc.finish() == b""


def test_parsing_cost_is_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    """The terminator search never re-scans bytes of an incomplete event: line by line (CR
    framing, through ``_EOL``) and event by event (LF framing, resuming at the buffer's end)."""
    scanned = 0
    real = sse._EOL

    class Counting:
        def search(self, buf: bytearray, pos: int) -> Any:
            nonlocal scanned
            m = real.search(buf, pos)
            scanned += (m.start() if m else len(buf)) - pos
            return m

    monkeypatch.setattr(sse, "_EOL", Counting())
    for eol in ("\r\n", "\n"):
        scanned = 0
        big = ev(chat_chunk("x" * 20_000), eol) + ev(usage_chunk(1, 2), eol)
        big += f"data: [DONE]{eol}{eol}".encode()
        acc = StreamAccountant(True)
        out = bytearray()
        for i in range(len(big)):
            out += acc.feed(big[i : i + 1])
            # LF framing: the next search starts at the last byte held (a "\n\n" may begin there)
            assert eol == "\r\n" or acc._scan >= acc.pending_bytes - 1
        out += acc.finish()
        assert acc.openai.usage == Usage(1, 2)
        assert out == ev(chat_chunk("x" * 20_000), eol) + f"data: [DONE]{eol}{eol}".encode()
        assert scanned <= len(big)
        assert (scanned > 0) == (eol == "\r\n")
