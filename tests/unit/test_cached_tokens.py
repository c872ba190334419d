"""The cached prompt tokens each API's usage reports, whole bodies
(:meth:`~kvgate_agent.sidecar.reading.apis.base.Api.body_usage`'s third figure) and streams
(:attr:`~kvgate_agent.sidecar.reading.sse.StreamAccountant.cached_tokens`): OpenAI's
``usage.prompt_tokens_details.cached_tokens`` else llama.cpp's ``timings.cache_n``, Responses'
``usage.input_tokens_details.cached_tokens``, Anthropic's ``cache_read_input_tokens``, SGLang's
``meta_info.cached_tokens``, llama.cpp's native ``timings.cache_n``; malformed content reads as
None, never raises. The shapes are the engines' own (llama.cpp's observed from llama-server)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvgate_agent.sidecar.reading.apis.base import Api
from kvgate_agent.sidecar.reading.apis.llamacpp import LLAMACPP
from kvgate_agent.sidecar.reading.apis.messages import MESSAGES
from kvgate_agent.sidecar.reading.apis.openai import CHAT, COMPLETIONS
from kvgate_agent.sidecar.reading.apis.responses import RESPONSES
from kvgate_agent.sidecar.reading.apis.sglang import SGLANG
from kvgate_agent.sidecar.reading.apis.tgi import TGI
from kvgate_agent.sidecar.reading.sse import StreamAccountant


def sse(*events: Any, done: bool = False) -> bytes:
    out = b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events)
    return out + (b"data: [DONE]\n\n" if done else b"")


def stream_cached(api: Api, data: bytes, strip: bool = False) -> tuple[int | None, bytes]:
    """(cached tokens, bytes forwarded) of ``data`` streamed through a StreamAccountant, fed
    one byte at a time (an event split anywhere is still read once)."""
    acct = StreamAccountant(strip, api.event_reader())
    out = b"".join(acct.feed(data[i : i + 1]) for i in range(len(data))) + acct.finish()
    return acct.cached_tokens, out


# llama-server's answer to /v1/chat/completions (abridged): both figures, as it sends them.
LLAMA_CHAT = {
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris"}}],
    "usage": {
        "completion_tokens": 8,
        "prompt_tokens": 65,
        "total_tokens": 73,
        "prompt_tokens_details": {"cached_tokens": 60},
    },
    "timings": {"cache_n": 60, "prompt_n": 5, "predicted_n": 8},
}


@pytest.mark.parametrize(
    ("api", "body", "want"),
    [
        (CHAT, LLAMA_CHAT, (65, 8, 60)),
        (
            CHAT,
            {"usage": {"prompt_tokens": 9, "completion_tokens": 2,
                       "prompt_tokens_details": {"cached_tokens": 0}}},
            (9, 2, 0),
        ),
        (CHAT, {"usage": {"prompt_tokens": 9, "completion_tokens": 2}}, (9, 2, None)),
        (  # an older llama.cpp: timings only
            COMPLETIONS,
            {"usage": {"prompt_tokens": 9, "completion_tokens": 2}, "timings": {"cache_n": 4}},
            (9, 2, 4),
        ),
        (
            RESPONSES,
            {"usage": {"input_tokens": 40, "output_tokens": 3,
                       "input_tokens_details": {"cached_tokens": 32}}},
            (40, 3, 32),
        ),
        (
            MESSAGES,
            {"usage": {"input_tokens": 8, "cache_read_input_tokens": 32,
                       "cache_creation_input_tokens": 0, "output_tokens": 3}},
            (40, 3, 32),
        ),
        (
            SGLANG,
            {"text": "x", "meta_info": {"prompt_tokens": 40, "completion_tokens": 3,
                                        "cached_tokens": 16}},
            (40, 3, 16),
        ),
        (
            SGLANG,
            [{"meta_info": {"prompt_tokens": 40, "completion_tokens": 3, "cached_tokens": 16}},
             {"meta_info": {"prompt_tokens": 40, "completion_tokens": 3, "cached_tokens": 32}},
             {"meta_info": {"prompt_tokens": 40, "completion_tokens": 3}}],
            (120, 9, 48),
        ),
        (  # llama-server's /completion (abridged): tokens_cached is the slot's, not the hit
            LLAMACPP,
            {"content": "x", "tokens_predicted": 4, "tokens_evaluated": 16, "tokens_cached": 19,
             "timings": {"cache_n": 11, "prompt_n": 5}},
            (16, 4, 11),
        ),
        (LLAMACPP, {"tokens_predicted": 4, "tokens_evaluated": 16, "tokens_cached": 19},
         (16, 4, None)),
        (TGI, {"generated_text": "x", "details": {"generated_tokens": 2}}, (None, 2, None)),
    ],
)  # fmt: skip
def test_whole_bodies(api: Api, body: Any, want: tuple[int | None, ...]) -> None:
    assert api.body_usage(json.dumps(body).encode()) == want


MALFORMED: list[Any] = [
    {"usage": {"prompt_tokens_details": {"cached_tokens": -1}}},
    {"usage": {"prompt_tokens_details": {"cached_tokens": "60"}}},
    {"usage": {"prompt_tokens_details": {"cached_tokens": 1.5}}},
    {"usage": {"prompt_tokens_details": {"cached_tokens": True}}},
    {"usage": {"prompt_tokens_details": [60]}},
    {"usage": {"prompt_tokens_details": None}, "timings": None},
    {"usage": {"input_tokens_details": "x", "cache_read_input_tokens": None}},
    {"usage": [1, 2]},
    {"timings": {"cache_n": -3}},
    {"timings": "cache_n"},
    {"meta_info": {"cached_tokens": {"n": 1}}},
    {"meta_info": 7},
    [None, 1, "x"],
    "text",
    None,
]


@pytest.mark.parametrize("api", [CHAT, COMPLETIONS, RESPONSES, MESSAGES, SGLANG, LLAMACPP, TGI])
def test_malformed_bodies_read_as_unknown(api: Api) -> None:
    for body in MALFORMED:
        assert api.body_usage(json.dumps(body).encode())[2] is None, body
    for raw in (b"", b"\xff\xfe", b"{", b"[" * 100_000, b'{"usage": NaN}'):
        assert api.body_usage(raw)[2] is None


def test_the_usage_chunk_the_proxy_asked_for_carries_the_cached_tokens() -> None:
    chunk = {"choices": [{"index": 0, "delta": {"content": "Par"}}]}
    usage = {
        "choices": [],
        "usage": {"prompt_tokens": 65, "completion_tokens": 8,
                  "prompt_tokens_details": {"cached_tokens": 60}},
        "timings": {"cache_n": 60},
    }  # fmt: skip
    data = sse(chunk, usage, done=True)
    cached, out = stream_cached(CHAT, data, strip=True)
    assert cached == 60
    assert out == sse(chunk, done=True)  # the chunk itself is dropped for the client
    cached, out = stream_cached(CHAT, data)
    assert cached == 60 and out == data


def test_a_stream_without_usage_reports_no_cached_tokens() -> None:
    chunk = {"choices": [{"index": 0, "delta": {"content": "Par"}}]}
    assert stream_cached(CHAT, sse(chunk, done=True))[0] is None
    # llama.cpp's last chunk has timings even without the usage chunk
    last = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
            "timings": {"cache_n": 12}}  # fmt: skip
    assert stream_cached(COMPLETIONS, sse(chunk, last, done=True))[0] == 12


def test_responses_stream() -> None:
    events: list[dict[str, Any]] = [
        {"type": "response.output_text.delta", "delta": "a"},
        {"type": "response.completed", "response": {"usage": {
            "input_tokens": 40, "output_tokens": 1,
            "input_tokens_details": {"cached_tokens": 32}}}},
    ]  # fmt: skip
    assert stream_cached(RESPONSES, sse(*events))[0] == 32
    events[1]["response"] = {"usage": {"input_tokens_details": {"cached_tokens": "32"}}}
    assert stream_cached(RESPONSES, sse(*events))[0] is None


def test_messages_stream() -> None:
    events: list[dict[str, Any]] = [
        {"type": "message_start", "message": {"usage": {
            "input_tokens": 8, "cache_read_input_tokens": 32, "output_tokens": 1}}},
        {"type": "content_block_delta", "delta": {"text": "a"}},
        {"type": "message_delta", "usage": {"output_tokens": 2}},
        {"type": "message_stop"},
    ]  # fmt: skip
    assert stream_cached(MESSAGES, sse(*events))[0] == 32
    events[0] = {"type": "message_start", "message": "nope"}
    assert stream_cached(MESSAGES, sse(*events))[0] is None


def test_sglang_stream_sums_the_sequences_once_each() -> None:
    def ev(index: int, out: int, cached: Any) -> dict[str, Any]:
        meta = {"prompt_tokens": 40, "completion_tokens": out, "cached_tokens": cached}
        return {"index": index, "text": "x" * out, "meta_info": meta}

    events = [ev(0, 1, 16), ev(1, 1, 32), ev(0, 2, 16), ev(1, 2, 32)]
    assert stream_cached(SGLANG, sse(*events, done=True))[0] == 48
    assert stream_cached(SGLANG, sse(ev(0, 1, -1), ev(0, 2, None), done=True))[0] is None


def test_llamacpp_native_stream() -> None:
    events: list[dict[str, Any]] = [
        {"index": 0, "content": "a", "stop": False},
        {"index": 0, "content": "", "stop": True, "tokens_evaluated": 16,
         "tokens_predicted": 4, "tokens_cached": 19, "timings": {"cache_n": 11}},
    ]  # fmt: skip
    assert stream_cached(LLAMACPP, sse(*events))[0] == 11
    events[1]["timings"] = {"cache_n": "11"}
    assert stream_cached(LLAMACPP, sse(*events))[0] is None


def test_tgi_reports_none() -> None:
    events = [{"token": {"text": "a"}}, {"token": {"text": "b"}, "generated_text": "ab",
                                        "details": {"generated_tokens": 2}}]  # fmt: skip
    assert stream_cached(TGI, sse(*events))[0] is None
