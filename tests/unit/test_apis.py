"""The generation APIs behind one protocol (sidecar/reading/apis/) and the one route table
(endpoints.GENERATION_PATHS): every path the string-keyed table had, on the same API, and every
API object the protocol's whole."""

from __future__ import annotations

import json

import pytest

from kvgate_agent.sidecar.reading.apis.base import Api, Route
from kvgate_agent.sidecar.reading.apis.generate import GENERATE
from kvgate_agent.sidecar.reading.apis.llamacpp import LLAMACPP
from kvgate_agent.sidecar.reading.apis.messages import MESSAGES
from kvgate_agent.sidecar.reading.apis.openai import CHAT, COMPLETIONS
from kvgate_agent.sidecar.reading.apis.responses import RESPONSES
from kvgate_agent.sidecar.reading.apis.sglang import SGLANG
from kvgate_agent.sidecar.reading.apis.tgi import TGI, TGI_STREAM
from kvgate_agent.sidecar.reading.endpoints import GENERATION_PATHS
from kvgate_agent.sidecar.reading.request import ParsedRequest
from kvgate_agent.sidecar.reading.sse import StreamAccountant
from kvgate_agent.sidecar.reading.usage import EventReader

#: The table as it was keyed by strings (``generate``: TGI's or SGLang's by the body;
#: ``tgi_stream``: TGI's, always streaming).
OLD_TABLE = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/chat/completions": "chat",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
    "/generate": "generate",
    "/generate_stream": "tgi_stream",
    "/completion": "llamacpp",
    "/completions": "llamacpp",
    "/infill": "llamacpp",
}
#: The old string dispatch's per-kind fields: (PROMPT_PARAM, LIMIT_PARAM, usage chunk injected).
OLD_FIELDS = {
    "chat": ("messages", "max_tokens", True),
    "completions": ("prompt", "max_tokens", True),
    "responses": ("input", "max_output_tokens", False),
    "messages": ("messages", "max_tokens", False),
    "tgi": ("inputs", "parameters.max_new_tokens", False),
    "sglang": ("text", "sampling_params.max_new_tokens", False),
    "llamacpp": ("prompt", "n_predict", False),
}
APIS: list[Api] = [CHAT, COMPLETIONS, RESPONSES, MESSAGES, TGI, TGI_STREAM, SGLANG, LLAMACPP]


def test_the_route_table_has_every_old_path_on_the_same_api() -> None:
    assert set(GENERATION_PATHS) == set(OLD_TABLE)
    names = {p: r.name for p, r in GENERATION_PATHS.items()}
    want = {p: "tgi" if k == "tgi_stream" else k for p, k in OLD_TABLE.items()}
    assert names == want
    assert GENERATION_PATHS["/generate"] is GENERATE
    assert GENERATION_PATHS["/generate_stream"] is TGI_STREAM
    assert {r.name for r in GENERATION_PATHS.values() if isinstance(r, Api)} | {
        "tgi",
        "sglang",
    } == (set(OLD_FIELDS))


@pytest.mark.parametrize("route", list(GENERATION_PATHS.values()), ids=repr)
def test_every_route_is_a_route_and_every_route_but_generate_an_api(route: Route) -> None:
    assert isinstance(route, Route)
    assert isinstance(route, Api) is (route is not GENERATE)


@pytest.mark.parametrize("api", APIS, ids=repr)
def test_each_api_satisfies_the_protocol_with_the_old_fields(api: Api) -> None:
    assert isinstance(api, Api)
    prompt, limit, injected = OLD_FIELDS[api.name]
    assert (api.prompt_param, api.limit_param, api.stream_usage_option) == (
        prompt,
        limit,
        injected,
    )
    reader = api.event_reader()
    assert (reader is None) is injected  # OpenAI's streams are read by StreamAccountant itself
    if reader is not None:
        assert isinstance(reader, EventReader)
        assert api.event_reader() is not reader  # one per stream
        acct = StreamAccountant(False, reader)
        assert acct.feed(b"data: {}\n\n") == b"data: {}\n\n"
    assert api.body_usage(b"") == (None, None, None)
    assert api.body_usage(b"null") == (None, None, None)


def parse(route: Route, body: object) -> ParsedRequest:
    raw = json.dumps(body).encode()
    return route.parse(raw, default_max_tokens=256, max_tokens_cap=1024, max_model_len=4096)


def test_generate_picks_the_api_by_the_body_and_the_request_carries_it() -> None:
    assert parse(GENERATE, {"inputs": "hi"}).api is TGI
    assert parse(GENERATE, {"text": "hi"}).api is SGLANG
    stream = parse(TGI_STREAM, {"inputs": "hi"})
    assert (stream.api.name, stream.stream) == ("tgi", True)
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "prompt": "x"}
    for api in (CHAT, COMPLETIONS, LLAMACPP):
        assert parse(api, body).api is api
