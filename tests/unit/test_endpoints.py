"""The engines' generation APIs parsed into admission inputs (each route's parse,
sidecar/reading/apis), their upstream rewrites, the pass-through allowlist, and the usage each API
reports."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvgate_agent.sidecar.reading.apis.base import Api, Route
from kvgate_agent.sidecar.reading.apis.generate import GENERATE
from kvgate_agent.sidecar.reading.apis.llamacpp import LLAMACPP
from kvgate_agent.sidecar.reading.apis.messages import MESSAGES
from kvgate_agent.sidecar.reading.apis.openai import CHAT, COMPLETIONS
from kvgate_agent.sidecar.reading.apis.responses import RESPONSES
from kvgate_agent.sidecar.reading.apis.sglang import SGLANG
from kvgate_agent.sidecar.reading.apis.tgi import TGI, TGI_STREAM
from kvgate_agent.sidecar.reading.endpoints import Passthrough
from kvgate_agent.sidecar.reading.openai_errors import RequestError
from kvgate_agent.sidecar.reading.request import ParsedRequest
from kvgate_agent.sidecar.reading.sse import StreamAccountant
from kvgate_agent.sidecar.reading.tokens import NON_TEXT_PART_TOKENS, PromptCounter

#: Each route by the name the cases below use (``tgi_stream``: ``/generate_stream``).
ROUTES: dict[str, Route] = {
    "chat": CHAT,
    "completions": COMPLETIONS,
    "responses": RESPONSES,
    "messages": MESSAGES,
    "generate": GENERATE,
    "tgi_stream": TGI_STREAM,
    "llamacpp": LLAMACPP,
}
#: Each API by its name.
APIS: dict[str, Api] = {
    a.name: a for a in (CHAT, COMPLETIONS, RESPONSES, MESSAGES, TGI, SGLANG, LLAMACPP)
}


def parse(
    body: Any, route: str, *, default: int = 256, cap: int | None = 1024, mml: int | None = 4096
) -> ParsedRequest:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return ROUTES[route].parse(
        raw, default_max_tokens=default, max_tokens_cap=cap, max_model_len=mml
    )


def refused(body: Any, route: str, **kw: Any) -> str | None:
    with pytest.raises(RequestError) as info:
        parse(body, route, **kw)
    assert info.value.status == 400
    return info.value.param


def counted(p: ParsedRequest) -> int:
    return PromptCounter().count(p.body if p.count_body is None else p.count_body).tokens


# ---------------------------------------------------------------- each API's fields


def test_responses_reads_max_output_tokens_input_and_instructions() -> None:
    p = parse({"model": "m", "input": "hello", "max_output_tokens": 30}, "responses")
    assert (p.api.name, p.max_tokens, p.n, p.max_tokens_field, p.model) == (
        "responses", 30, 1, "max_output_tokens", "m",
    )  # fmt: skip
    items = {
        "model": "m",
        "instructions": "sys " * 10,
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "a " * 20}]},
            {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]},
            {"type": "function_call_output", "call_id": "c", "output": "result"},
        ],
    }
    q = parse(items, "responses")
    assert q.max_tokens_defaulted and q.max_tokens == 256
    assert counted(q) > NON_TEXT_PART_TOKENS + 10  # text, an image part and the tool output
    assert refused({"model": "m"}, "responses") == "input"
    assert refused({"model": "m", "input": []}, "responses") == "input"
    assert refused({"model": "m", "input": [1]}, "responses") == "input[0]"
    assert refused({"model": "m", "input": "x", "background": True}, "responses") == "background"
    assert refused({"model": "m", "input": "x", "max_output_tokens": 0}, "responses") == (
        "max_output_tokens"
    )
    assert refused({"model": "m", "input": "x", "max_output_tokens": 5000}, "responses") == (
        "max_output_tokens"
    )


def test_messages_require_max_tokens_and_count_system_and_blocks() -> None:
    body = {
        "model": "m",
        "max_tokens": 64,
        "system": [{"type": "text", "text": "be brief " * 10}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "q " * 10}, {"type": "image"}]},
            {"role": "assistant", "content": [{"type": "tool_use", "input": {"a": "b" * 30}}]},
            {"role": "user", "content": [{"type": "tool_result", "content": "r" * 30}]},
        ],
    }
    p = parse(body, "messages")
    assert (p.api.name, p.max_tokens, p.n) == ("messages", 64, 1)
    assert counted(p) > NON_TEXT_PART_TOKENS + 30
    assert refused({**body, "max_tokens": None}, "messages") == "max_tokens"
    assert refused({**body, "messages": []}, "messages") == "messages"
    assert refused({**body, "stream": "yes"}, "messages") == "stream"


def test_tgi_generate_reads_parameters_and_best_of() -> None:
    p = parse({"inputs": "hi", "parameters": {"max_new_tokens": 20, "best_of": 3}}, "generate")
    assert (p.api.name, p.max_tokens, p.n, p.stream, p.model_field) == ("tgi", 20, 3, False, False)
    s = parse({"inputs": "hi"}, "tgi_stream")
    assert s.stream and s.max_tokens_defaulted and s.n == 1
    assert refused({"inputs": 5}, "generate") == "inputs"
    assert refused({"inputs": "x", "parameters": []}, "generate") == "parameters"
    for bad in (0, -1, "2", 2.0, True, 129, 10**6):
        assert refused({"inputs": "x", "parameters": {"best_of": bad}}, "generate") == (
            "parameters.best_of"
        )
    huge = b'{"inputs": "x", "parameters": {"max_new_tokens": 1e300}}'  # a float, not an int
    assert refused(huge, "tgi_stream") == "parameters.max_new_tokens"


def test_sglang_generate_reads_sampling_params_batches_and_n() -> None:
    p = parse({"text": "hi", "sampling_params": {"max_new_tokens": 9, "n": 4}}, "generate")
    assert (p.api.name, p.max_tokens, p.n) == ("sglang", 9, 4)
    batch = {
        "text": ["a", "b", "c"],
        "sampling_params": [{"max_new_tokens": 5}, {"max_new_tokens": 50, "n": 2}, {}],
    }
    b = parse(batch, "generate")
    assert (b.max_tokens, b.n) == (256, 4)  # one has no limit: the default is the largest
    sent = json.loads(b.upstream_body() or b"")["sampling_params"]
    assert [s.get("max_new_tokens") for s in sent] == [5, 50, 256]
    # only the missing limit is filled: an explicit one above the default stays, and is charged
    above = parse(
        {"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 500}, {}]}, "generate"
    )
    assert above.max_tokens == 500 and not above.max_tokens_clamped
    sent = json.loads(above.upstream_body() or b"")["sampling_params"]
    assert [s["max_new_tokens"] for s in sent] == [500, 256]
    sent = json.loads(above.upstream_body(max_tokens=100) or b"")["sampling_params"]
    assert [s["max_new_tokens"] for s in sent] == [100, 100]  # degraded: both within it
    ids = parse({"input_ids": [[1, 2, 3], [4]], "sampling_params": {"n": 2}}, "generate")
    assert (ids.n, counted(ids)) == (4, 4)
    assert refused({"text": ["a", "b"], "sampling_params": [{}]}, "generate") == "sampling_params"
    assert refused({"text": "a", "sampling_params": {"n": 129}}, "generate") == "sampling_params.n"
    assert refused({"text": ["a"] * 100, "sampling_params": {"n": 100}}, "generate") == (
        "sampling_params.n"
    )
    assert refused({"text": 3}, "generate") == "text"
    assert refused({"input_ids": [[1], []]}, "generate") == "input_ids"
    assert refused({"inputs": "a", "text": "b"}, "generate") == "inputs"  # ambiguous
    assert refused({"prompt": "a"}, "generate") == "inputs"


def test_llamacpp_n_predict_minus_one_is_unbounded_and_prompts_multiply() -> None:
    p = parse({"prompt": "hi", "n_predict": -1}, "llamacpp")
    assert (p.api.name, p.max_tokens, p.max_tokens_defaulted) == ("llamacpp", 256, True)
    assert json.loads(p.upstream_body() or b"")["n_predict"] == 256  # bounded upstream
    zero = parse({"prompt": "hi", "n_predict": 0}, "llamacpp")
    assert zero.max_tokens == 1  # prompt only: n_predict 0 kept (it wins over max_tokens)
    assert json.loads(zero.upstream_body() or b"")["n_predict"] == 0
    alias = parse({"prompt": "hi", "max_tokens": 7}, "llamacpp")
    assert (alias.max_tokens, alias.max_tokens_field) == (7, "max_tokens")
    multi = parse({"prompt": ["a", [1, 2], {"prompt_string": "b"}], "n_predict": 4}, "llamacpp")
    assert multi.n == 3
    mixed = parse({"prompt": [12, 34, "text", 56]}, "llamacpp")  # one mixed prompt
    assert mixed.n == 1 and counted(mixed) >= 4
    infill = parse({"input_prefix": "def f(", "input_suffix": "):", "n_predict": 5}, "llamacpp")
    assert infill.n == 1 and counted(infill) > 0
    for bad in (-2, "5", 1.5, False):
        assert refused({"prompt": "x", "n_predict": bad}, "llamacpp") == "n_predict"
    both = parse({"prompt": "hi", "max_tokens": 3, "n_predict": -1}, "llamacpp")
    assert both.max_tokens == 256  # n_predict wins in llama.cpp: -1 is unbounded
    assert json.loads(both.upstream_body() or b"") == {"prompt": "hi", "max_tokens": 256,
                                                        "n_predict": 256}  # fmt: skip
    # n_cmpl (alias n): completions per prompt, for every prompt of a list
    assert parse({"prompt": ["a", "b"], "n_cmpl": 3}, "llamacpp").n == 6
    assert parse({"prompt": "a", "n": 2}, "llamacpp").n == 2
    assert refused({"prompt": "a", "n_cmpl": 200}, "llamacpp") == "n_cmpl"
    assert refused({"prompt": []}, "llamacpp") == "prompt"
    assert refused({"prompt": [[1], 2.5]}, "llamacpp") == "prompt"
    assert refused({"prompt": ["x"] * 3000}, "llamacpp") == "prompt"


@pytest.mark.parametrize("route", ["responses", "messages"])
def test_llamacpp_n_predict_is_charged_on_every_top_level_limit(route: str) -> None:
    body: dict[str, Any] = {"model": "m", "max_tokens": 1, "max_output_tokens": 1, "n_predict": -1}
    msgs = [{"role": "user", "content": "hi"}]
    body |= {"input": "hi"} if route == "responses" else {"messages": msgs}
    p = parse(body, route)
    assert p.max_tokens == 256
    assert json.loads(p.upstream_body() or b"")["n_predict"] == 256
    assert refused({**body, "n_predict": "x"}, route) == "n_predict"


@pytest.mark.parametrize("route", ["responses", "messages", "generate", "tgi_stream", "llamacpp"])
@pytest.mark.parametrize(
    "raw", [b"{", b"[]", b"\xff", b'{"a": NaN}', b'{"a": 1, "a": 2}', b"[" * 5000 + b"]" * 5000]
)
def test_malformed_bodies_are_400_on_every_route(route: str, raw: bytes) -> None:
    refused(raw, route)


# ---------------------------------------------------------------- upstream rewrites


def test_nested_limits_are_written_where_each_api_reads_them() -> None:
    tgi = parse({"inputs": "hi"}, "generate")
    assert json.loads(tgi.upstream_body() or b"") == {
        "inputs": "hi",
        "parameters": {"max_new_tokens": 256},
    }
    t2 = parse({"inputs": "hi", "parameters": {"max_new_tokens": 900, "seed": 1}}, "generate")
    assert json.loads(t2.upstream_body(max_tokens=100) or b"")["parameters"] == {
        "max_new_tokens": 100,
        "seed": 1,
    }
    assert t2.upstream_body(model="small") is None  # no model field to rewrite
    sg = parse(
        {"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 500}, {"max_new_tokens": 8}]},
        "generate",
    )
    assert [
        s["max_new_tokens"]
        for s in json.loads(sg.upstream_body(max_tokens=40) or b"")["sampling_params"]
    ] == [40, 8]
    r = parse({"model": "m", "input": "x", "max_output_tokens": 30}, "responses")
    assert r.upstream_body() is None
    assert json.loads(r.upstream_body(model="small", include_usage=True) or b"") == {
        "model": "small",
        "input": "x",
        "max_output_tokens": 30,
    }  # no stream_options outside OpenAI chat and completions


# ---------------------------------------------------------------- the allowlist


def test_passthrough_allowlist() -> None:
    p = Passthrough.of(["/v1/embeddings", "/admin/*"])
    assert p.allows("/tokenize") and p.allows("/v1/embeddings") and p.allows("/admin/x/y")
    assert not p.allows("/v1/embeddings/x") and not p.allows("/sleep") and not p.allows("/")
    with pytest.raises(ValueError, match="must start with"):
        Passthrough.of(["v1/x"])
    # TGI's chat template tokenizer and vLLM's cancel of a stored response are defaults
    assert p.allows("/chat_tokenize") and p.allows("/v1/responses/resp_1/cancel")
    assert not p.allows("/v1/responses/resp_1") and not p.allows("/v1/responses/a/b/cancel")
    segment = Passthrough.of(["/v1/models/*/load"])
    assert segment.allows("/v1/models/m/load") and not segment.allows("/v1/models/m/unload")


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        ("/v1/x?a=1", "no query"),
        ("/v1/chat/completions", "generation path"),
        ("/generate", "generation path"),
        ("/a//b", "canonical"),
        ("/a/../b", "canonical"),
        ("/a/./b", "canonical"),
        ("/x/", "canonical"),
        ("/v1/%65mbeddings", "canonical"),
        ("/a*b/c", "whole segment"),
    ],
)
def test_passthrough_entries_that_can_never_match_are_refused(entry: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        Passthrough.of([entry])


# ---------------------------------------------------------------- reported usage


@pytest.mark.parametrize(
    ("kind", "body", "want"),
    [
        ("responses", {"usage": {"input_tokens": 5, "output_tokens": 7}}, (5, 7, None)),
        (
            "messages",
            {"usage": {"input_tokens": 5, "cache_read_input_tokens": 10, "output_tokens": 7}},
            (15, 7, 10),
        ),
        ("tgi", {"details": {"generated_tokens": 7}}, (None, 7, None)),
        (
            "tgi",
            {
                "details": {
                    "generated_tokens": 7,
                    "best_of_sequences": [{"generated_tokens": 3}, {"generated_tokens": 4}],
                }
            },
            (None, 14, None),
        ),
        ("tgi", [{"generated_text": "x"}], (None, None, None)),
        ("sglang", [{"meta_info": {"prompt_tokens": 2, "completion_tokens": 3}}] * 2, (4, 6, None)),
        ("llamacpp", {"tokens_evaluated": 5, "tokens_predicted": 7}, (5, 7, None)),
        ("llamacpp", {"tokens_evaluated": -5, "tokens_predicted": "7"}, (None, None, None)),
        ("chat", {"usage": {"prompt_tokens": 5, "completion_tokens": 7}}, (5, 7, None)),
    ],
)
def test_body_usage(kind: str, body: Any, want: tuple[int | None, int | None, int | None]) -> None:
    assert APIS[kind].body_usage(json.dumps(body).encode()) == want
    assert APIS[kind].body_usage(b"\xff not json") == (None, None, None)


def _events(events: list[Any], named: bool = False, done: bool = False) -> bytes:
    out = b""
    for e in events:
        if named:
            out += b"event: " + str(e.get("type")).encode() + b"\n"
        out += b"data: " + json.dumps(e).encode() + b"\n\n"
    return out + (b"data: [DONE]\n\n" if done else b"")


STREAMS: list[tuple[str, bytes, int | None, int]] = [
    (
        "responses",
        _events(
            [{"type": "response.output_text.delta", "delta": "a"}] * 3
            + [
                {
                    "type": "response.completed",
                    "response": {"usage": {"input_tokens": 4, "output_tokens": 5}},
                }
            ],
            named=True,
        ),
        4,
        5,
    ),
    (
        "messages",
        _events(
            [
                {
                    "type": "message_start",
                    "message": {"usage": {"input_tokens": 6, "output_tokens": 1}},
                }
            ]
            + [{"type": "content_block_delta", "delta": {"text": "a"}}] * 3
            + [{"type": "message_delta", "usage": {"output_tokens": 3}}, {"type": "message_stop"}],
            named=True,
        ),
        6,
        3,
    ),
    (
        "tgi",
        _events(
            [{"token": {"id": 1, "text": "a"}, "generated_text": None}] * 2
            + [{"token": {"id": 2}, "generated_text": "aa", "details": {"generated_tokens": 3}}]
        ),
        None,
        3,
    ),
    (
        "sglang",
        _events(
            [
                {
                    "text": "a",
                    "index": 0,
                    "meta_info": {"prompt_tokens": 2, "completion_tokens": 1},
                },
                {
                    "text": "b",
                    "index": 1,
                    "meta_info": {"prompt_tokens": 2, "completion_tokens": 1},
                },
                {
                    "text": "ab",
                    "index": 0,
                    "meta_info": {"prompt_tokens": 2, "completion_tokens": 2},
                },
            ],
            done=True,
        ),
        2,
        3,
    ),
    (
        "llamacpp",
        _events(
            [{"content": "a", "stop": False}] * 4
            + [{"content": "", "stop": True, "tokens_predicted": 4, "tokens_evaluated": 9}]
        ),
        9,
        4,
    ),
    ("llamacpp", _events([{"content": "a", "stop": False}] * 4), None, 4),  # cut short: counted
]


@pytest.mark.parametrize(("kind", "stream", "prompt", "completion"), STREAMS)
@pytest.mark.parametrize("split", [1, 7, 10**6])
def test_each_apis_stream_settles_its_usage_split_anywhere(
    kind: str, stream: bytes, prompt: int | None, completion: int, split: int
) -> None:
    acct = StreamAccountant(False, APIS[kind].event_reader())
    out = b"".join(acct.feed(stream[i : i + split]) for i in range(0, len(stream), split))
    out += acct.finish()
    assert out == stream  # relayed unchanged
    assert (acct.prompt_tokens, acct.completion_tokens_estimate) == (prompt, completion)
    finished = kind != "llamacpp" or b'"stop": true' in stream
    assert acct.done is finished


def test_a_zero_limit_evaluates_the_prompt_only_and_is_never_raised() -> None:
    z = parse({"text": "a", "sampling_params": {"max_new_tokens": 0}}, "generate")
    assert z.max_tokens == 1 and z.upstream_body() is None
    batch = {
        "text": ["a", "b"],
        "sampling_params": [{"max_new_tokens": 0}, {"max_new_tokens": 900}],
    }
    b = parse(batch, "generate")
    assert b.upstream_body() is None  # within the cap 1024: unchanged
    assert [
        s["max_new_tokens"]
        for s in json.loads(b.upstream_body(max_tokens=50) or b"")["sampling_params"]
    ] == [0, 50]
    assert refused({"text": "a", "sampling_params": {"max_new_tokens": -1}}, "generate") == (
        "sampling_params.max_new_tokens"
    )
