"""OpenAI chat and completions parsing (apis/openai.py), ParsedRequest.upstream_body, OpenAI
error bodies."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate_agent.sidecar.reading.apis import openai
from kvgate_agent.sidecar.reading.jsonbody import _decode_strict, decode_object
from kvgate_agent.sidecar.reading.openai_errors import (
    RATE_LIMIT_ERROR,
    RATE_LIMIT_EXCEEDED,
    RequestError,
    error_body,
)
from kvgate_agent.sidecar.reading.request import ParsedRequest

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
CMPL: dict[str, Any] = {"model": "m", "prompt": "hi"}


def parse(
    body: Any,
    kind: str = "chat",
    *,
    default: int = 256,
    cap: int | None = 1024,
    max_len: int | None = 4096,
) -> ParsedRequest:
    raw = body if isinstance(body, bytes) else json.dumps(body, ensure_ascii=False).encode()
    api = openai.CHAT if kind == "chat" else openai.COMPLETIONS
    return api.parse(raw, default_max_tokens=default, max_tokens_cap=cap, max_model_len=max_len)


def rejected(body: Any, kind: str = "chat", **kw: Any) -> RequestError:
    with pytest.raises(RequestError) as ei:
        parse(body, kind, **kw)
    err = ei.value
    assert err.status == 400
    assert err.type == "invalid_request_error"
    assert json.loads(err.body())["error"]["param"] == err.param
    return err


# -- errors --------------------------------------------------------------------------------------


def test_error_body_shape() -> None:
    raw = error_body("too many", RATE_LIMIT_ERROR, code=RATE_LIMIT_EXCEEDED)
    assert raw == (
        b'{"error":{"message":"too many","type":"rate_limit_error","param":null,'
        b'"code":"rate_limit_exceeded"}}'
    )
    assert json.loads(error_body("é \ud800", "x"))["error"]["message"] == "é \ud800"
    assert "é".encode() in error_body("é", "x")
    e = RequestError(413, "big", param="messages")
    assert (e.status, e.type, str(e)) == (413, "invalid_request_error", "big")
    assert json.loads(e.body()) == {
        "error": {
            "message": "big",
            "type": "invalid_request_error",
            "param": "messages",
            "code": None,
        }
    }


# -- rejections ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [b"", b"{", b"not json", b'{"a": NaN}', b'{"a": Infinity}', b"[" * 100_000, b"\xef\xbb\xbf{}"],
)
def test_rejects_invalid_json(raw: bytes) -> None:
    assert rejected(raw).param is None


MSG = b'{"model":"m","messages":[{"role":"user","content":"x"}],'


@pytest.mark.parametrize(
    "raw",
    [
        MSG + b'"max_tokens":900,"temperature":1e400}',
        MSG + b'"temperature":-1E+400}',
        MSG + b'"logit_bias":{"5":[2.5e999]}}',
    ],
)
def test_rejects_numbers_past_a_double(raw: bytes) -> None:
    # Python's json reads them as infinity, which msgspec re-encodes as null: both decode paths
    # refuse them with the same 400 (the fast path hands them to the reference)
    err = rejected(raw)
    assert err.param is None
    assert "not a finite" in err.message
    assert _outcome(decode_object, raw) == _outcome(_decode_strict, raw)
    assert _outcome(_decode_strict, raw)[0] == "err"
    assert parse(raw.replace(b"400", b"300").replace(b"999", b"9")).max_tokens > 0


def test_rejects_non_utf8() -> None:
    err = rejected(b'{"model": "\xff"}')
    assert err.param is None
    assert "UTF-8" in err.message
    assert rejected('{"model":"m"}'.encode("utf-16")).param is None


@pytest.mark.parametrize("body", [[], "s", 1, None, True])
def test_rejects_non_object(body: Any) -> None:
    assert rejected(body).param is None


@pytest.mark.parametrize("model", [None, 1, ["m"], {"m": 1}])
def test_rejects_model(model: Any) -> None:
    body = {k: v for k, v in CHAT.items() if k != "model"}
    assert rejected(body).param == "model"
    assert rejected({**CHAT, "model": model}).param == "model"
    assert rejected({**CMPL, "model": model}, "completions").param == "model"


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        (None, "messages"),
        ("hi", "messages"),
        ([], "messages"),
        ({"role": "user"}, "messages"),
        (["hi"], "messages[0]"),
        ([{"role": "user", "content": "a"}, {"content": "b"}], "messages[1].role"),
        ([{"role": 1, "content": "a"}], "messages[0].role"),
    ],
)
def test_rejects_messages(messages: Any, param: str) -> None:
    assert rejected({**CHAT, "messages": messages}).param == param
    body = {k: v for k, v in CHAT.items() if k != "messages"}
    assert rejected(body).param == "messages"


@pytest.mark.parametrize(
    "prompt", [None, 1, [], [[]], [1, "a"], [True], [-1], [[1], 2], [[1.5]], {"a": 1}, [None]]
)
def test_rejects_prompt(prompt: Any) -> None:
    assert rejected({**CMPL, "prompt": prompt}, "completions").param == "prompt"
    assert rejected({"model": "m"}, "completions").param == "prompt"


@pytest.mark.parametrize("prompt", ["", "hi", ["a", "b"], [1, 2, 0], [[1], [2, 3]]])
def test_accepts_prompt_shapes(prompt: Any) -> None:
    assert parse({**CMPL, "prompt": prompt}, "completions").body["prompt"] == prompt


@pytest.mark.parametrize("value", [0, -1, 1.0, 1.5, "10", True, False, [1]])
@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", "n"])
def test_rejects_counts(field: str, value: Any) -> None:
    assert rejected({**CHAT, field: value}).param == field
    if field != "max_completion_tokens":
        assert rejected({**CMPL, field: value}, "completions").param == field


def test_rejects_max_tokens_beyond_context() -> None:
    assert rejected({**CHAT, "max_tokens": 4097}).param == "max_tokens"
    assert rejected({**CMPL, "max_tokens": 4097}, "completions").param == "max_tokens"
    err = rejected({**CHAT, "max_completion_tokens": 5000})
    assert err.param == "max_completion_tokens"
    assert parse({**CHAT, "max_tokens": 4096}).max_tokens == 1024  # fits; clamped to the cap
    assert parse({**CHAT, "max_tokens": 10**6}, max_len=None).max_tokens == 1024


@pytest.mark.parametrize("value", [1, "true", [], {}])
def test_rejects_stream(value: Any) -> None:
    assert rejected({**CHAT, "stream": value}).param == "stream"


@pytest.mark.parametrize(
    ("opts", "param"),
    [
        ("x", "stream_options"),
        ([], "stream_options"),
        (True, "stream_options"),
        ({"include_usage": 1}, "stream_options.include_usage"),
        ({"include_usage": "true"}, "stream_options.include_usage"),
    ],
)
def test_rejects_stream_options(opts: Any, param: str) -> None:
    assert rejected({**CHAT, "stream": True, "stream_options": opts}).param == param


# -- accepted requests ---------------------------------------------------------------------------


def test_defaults() -> None:
    p = parse(CHAT)
    assert p.body == CHAT
    assert (p.model, p.api.name, p.stream, p.client_wants_usage, p.n) == (
        "m",
        "chat",
        False,
        False,
        1,
    )
    assert (p.max_tokens, p.max_tokens_defaulted, p.max_tokens_clamped) == (256, True, False)
    assert (p.client_max_tokens, p.max_tokens_field) == (None, "max_tokens")
    nulls = {**CHAT, "max_tokens": None, "stream": None, "stream_options": None, "n": None}
    q = parse(nulls)
    assert (q.max_tokens, q.max_tokens_defaulted, q.stream, q.n) == (256, True, False, 1)
    # the default is bounded by the cap and the context length
    assert parse(CHAT, default=5000, cap=None).max_tokens == 4096
    assert parse(CHAT, default=5000, cap=2000).max_tokens == 2000
    assert parse(CHAT, default=5000, cap=None, max_len=None).max_tokens == 5000


def test_fields() -> None:
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}, "n": 3}
    p = parse({**body, "max_tokens": 100})
    assert (p.stream, p.client_wants_usage, p.n) == (True, True, 3)
    assert (p.max_tokens, p.max_tokens_defaulted, p.max_tokens_clamped) == (100, False, False)
    p = parse({**body, "max_tokens": 2000})
    assert (p.max_tokens, p.client_max_tokens, p.max_tokens_clamped) == (1024, 2000, True)
    p = parse({**CHAT, "max_tokens": 2000}, cap=None)
    assert (p.max_tokens, p.max_tokens_clamped) == (2000, False)
    p = parse({**CHAT, "stream_options": {"include_usage": False}})
    assert not p.client_wants_usage


def test_max_completion_tokens_wins_in_chat() -> None:
    p = parse({**CHAT, "max_tokens": 50, "max_completion_tokens": 60})
    assert (p.max_tokens, p.max_tokens_field) == (60, "max_completion_tokens")
    # completions has no max_completion_tokens: it is neither read nor checked
    p = parse({**CMPL, "max_completion_tokens": "x"}, "completions")
    assert (p.max_tokens, p.max_tokens_field) == (256, "max_tokens")


# -- upstream_body -------------------------------------------------------------------------------


def up(body: dict[str, Any], kind: str = "chat", **kw: Any) -> dict[str, Any] | None:
    raw = parse(body, kind).upstream_body(**kw)
    return None if raw is None else json.loads(raw)


def test_upstream_unchanged_is_none() -> None:
    assert up({**CHAT, "max_tokens": 100}) is None
    assert up({**CHAT, "max_tokens": 100}, max_tokens=100, model="m") is None
    stream = {**CHAT, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 9}
    assert up(stream, include_usage=True) is None
    # a non-streaming request never gets stream_options (vLLM rejects them without stream)
    assert up({**CHAT, "max_tokens": 9}, include_usage=True) is None


def test_upstream_sets_defaulted_and_clamped_limit() -> None:
    assert up(CHAT) == {**CHAT, "max_tokens": 256}
    assert up(CMPL, "completions") == {**CMPL, "max_tokens": 256}
    assert up({**CHAT, "max_tokens": None}) == {**CHAT, "max_tokens": 256}
    assert up({**CHAT, "max_tokens": 2000}) == {**CHAT, "max_tokens": 1024}
    assert up({**CHAT, "max_completion_tokens": 2000}) == {**CHAT, "max_completion_tokens": 1024}


def test_upstream_degraded_limit() -> None:
    assert up({**CHAT, "max_tokens": 100}, max_tokens=40) == {**CHAT, "max_tokens": 40}
    both = {**CHAT, "max_tokens": 50, "max_completion_tokens": 100}
    assert up(both, max_tokens=40) == {**both, "max_tokens": 40, "max_completion_tokens": 40}
    mct = {**CHAT, "max_completion_tokens": 100}
    assert up(mct, max_tokens=40) == {**CHAT, "max_completion_tokens": 40}
    with pytest.raises(ValueError):
        parse(CHAT).upstream_body(max_tokens=0)


def test_upstream_never_carries_a_clients_engine_priority() -> None:
    """vLLM (``--scheduling-policy priority``) and SGLang order their queue by a body
    ``priority``: a client's own would jump the engine's queue around kvgate's priority."""
    assert up({**CHAT, "max_tokens": 5, "priority": -1000000}) == {**CHAT, "max_tokens": 5}
    assert up({**CMPL, "priority": 3}, "completions") == {**CMPL, "max_tokens": 256}


def test_upstream_carries_kvgates_engine_priority_in_place_of_the_clients() -> None:
    assert up({**CHAT, "max_tokens": 5, "priority": 99}, priority=-3) == {
        **CHAT,
        "max_tokens": 5,
        "priority": -3,
    }
    assert up({**CHAT, "max_tokens": 5}, priority=0) == {**CHAT, "max_tokens": 5, "priority": 0}
    assert up({**CHAT, "max_tokens": 5}, priority=None) is None  # forwardTo None: unchanged


def test_upstream_model_rewrite() -> None:
    assert up({**CHAT, "max_tokens": 5}, model="served") == {
        **CHAT,
        "max_tokens": 5,
        "model": "served",
    }


def test_upstream_include_usage_keeps_other_options() -> None:
    s = {**CHAT, "stream": True, "max_tokens": 5}
    assert up(s, include_usage=True) == {**s, "stream_options": {"include_usage": True}}
    s2 = {**s, "stream_options": {"continuous_usage_stats": True, "include_usage": False}}
    assert up(s2, include_usage=True) == {
        **s2,
        "stream_options": {"continuous_usage_stats": True, "include_usage": True},
    }
    s3 = {**s, "stream_options": None}
    assert up(s3, include_usage=True) == {**s3, "stream_options": {"include_usage": True}}


def test_upstream_serialization_and_original_untouched() -> None:
    body = {**CHAT, "messages": [{"role": "user", "content": "héllo 😀 中文"}], "max_tokens": 5}
    p = parse(body)
    raw = p.upstream_body(model="x")
    assert raw is not None
    assert "héllo 😀 中文".encode() in raw
    assert b": " not in raw and b", " not in raw
    assert p.body == body  # the parsed body is not mutated
    # a lone surrogate (legal as a JSON escape) still serializes to valid JSON
    q = parse(b'{"model":"m","messages":[{"role":"user","content":"\\ud800"}]}')
    raw = q.upstream_body()
    assert raw is not None
    assert json.loads(raw)["messages"][0]["content"] == "\ud800"


# -- sequences: n, best_of, list prompts ---------------------------------------------------------


def test_sequences_count_best_of_and_every_prompt_of_a_list() -> None:
    assert parse({**CMPL, "n": 2, "best_of": 5}, "completions").n == 5
    assert parse({**CMPL, "n": 3, "best_of": None}, "completions").n == 3
    assert parse({**CHAT, "n": 2, "best_of": 4}).n == 4  # vLLM's chat extension
    assert parse({**CMPL, "prompt": ["a", "b", "c"], "n": 2}, "completions").n == 6
    assert parse({**CMPL, "prompt": [[1, 2], [3]], "best_of": 3}, "completions").n == 6
    assert parse({**CMPL, "prompt": [1, 2, 3], "n": 2}, "completions").n == 2  # one prompt of ids
    assert parse({**CMPL, "use_beam_search": True, "n": 4}, "completions").n == 4


@pytest.mark.parametrize(
    ("body", "kind", "param"),
    [
        ({**CMPL, "best_of": 1000000}, "completions", "best_of"),
        ({**CMPL, "n": 129}, "completions", "n"),
        ({**CHAT, "n": 10**9}, "chat", "n"),
        ({**CMPL, "prompt": ["x"] * 2049}, "completions", "prompt"),
        ({**CMPL, "prompt": ["x"] * 100, "n": 21}, "completions", "prompt"),
        ({**CMPL, "best_of": 0}, "completions", "best_of"),
        ({**CMPL, "best_of": 2.5}, "completions", "best_of"),
    ],
)
def test_absurd_sequence_counts_are_refused(body: Any, kind: str, param: str) -> None:
    assert rejected(body, kind).param == param


def test_a_repeated_key_is_refused_at_any_depth() -> None:
    assert rejected(
        b'{"model":"m","prompt":"x","max_tokens":5,"max_tokens":9}', "completions"
    ).param == ("max_tokens")
    raw = b'{"model":"m","messages":[{"role":"user","role":"system","content":"x"}]}'
    assert rejected(raw).param == "role"


# -- llama.cpp's own fields on its OpenAI routes -------------------------------------------------


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_llamacpp_n_predict_is_charged_and_rewritten_on_openai_paths(kind: str) -> None:
    base = CHAT if kind == "chat" else CMPL
    # llama.cpp lets n_predict override max_tokens: -1 is unbounded, so the default is charged
    unbounded = parse({**base, "max_tokens": 1, "n_predict": -1}, kind)
    assert (unbounded.max_tokens, unbounded.max_tokens_defaulted) == (256, True)
    sent = up({**base, "max_tokens": 1, "n_predict": -1}, kind)
    assert sent is not None and sent["n_predict"] == 256 and sent["max_tokens"] <= 256
    larger = parse({**base, "max_tokens": 5, "n_predict": 50}, kind)
    assert larger.max_tokens == 50
    # an engine that ignores n_predict (vLLM) gets the limit in its own field too
    alone = up({**base, "n_predict": 5}, kind)
    assert alone is not None and (alone["n_predict"], alone["max_tokens"]) == (5, 5)
    # clamped to the cap, and degraded: no field the engine may read exceeds the reservation
    clamped = up({**base, "max_tokens": 5, "n_predict": 2000}, kind)
    assert clamped is not None and (clamped["n_predict"], clamped["max_tokens"]) == (1024, 1024)
    degraded = up({**base, "max_tokens": 100, "n_predict": 100}, kind, max_tokens=40)
    assert degraded is not None and (degraded["n_predict"], degraded["max_tokens"]) == (40, 40)
    for bad_value in (-2, "5", 1.5, True, [1]):
        assert rejected({**base, "n_predict": bad_value}, kind).param == "n_predict"
    assert rejected({**base, "n_predict": 5000}, kind, cap=None, max_len=4096).param == "n_predict"


def test_llamacpp_n_cmpl_multiplies_sequences_on_openai_paths() -> None:
    assert parse({**CHAT, "n_cmpl": 4}).n == 4
    assert parse({**CMPL, "prompt": ["a", "b"], "n": 2, "n_cmpl": 3}, "completions").n == 6
    assert rejected({**CHAT, "n_cmpl": 129}).param == "n_cmpl"
    assert rejected({**CHAT, "n_cmpl": 0}).param == "n_cmpl"


# -- the fast decoder (msgspec) against the reference (Python's json) ---------------------------

JSON_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**80), 2**80),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(alphabet=st.sampled_from(list('ab"\\:{},[] \n\té😀')), max_size=6),
)
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda kids: (
        st.lists(kids, max_size=3)
        | st.dictionaries(st.sampled_from(["a", "b", 'q"', "é"]), kids, max_size=3)
    ),
    max_leaves=8,
)


def _outcome(fn: Any, raw: bytes) -> Any:
    try:
        return ("ok", fn(raw))
    except RequestError as exc:
        return ("err", exc.message, exc.param)


def _texts(obj: Any) -> list[bytes]:
    """``obj`` as JSON text written the ways clients write it."""
    return [
        json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode(),
        json.dumps(obj).encode(),  # spaces, \\u escapes
        json.dumps(obj, indent=1).encode(),
    ]


@settings(max_examples=60, deadline=None)
@given(
    st.dictionaries(st.sampled_from(["model", "a", "é"]), JSON_VALUES, max_size=4), st.booleans()
)
def test_fast_decode_agrees_with_the_reference(body: dict[str, Any], quote: bool) -> None:
    for raw in _texts(body):
        assert _outcome(decode_object, raw) == _outcome(_decode_strict, raw) == ("ok", body)
        # a key repeated at the top or nested: the same 400, naming the key
        at = raw.index(b"{") + 1
        value = b'"\\u0022"' if quote else b"2"
        rest = raw[at:]
        sep = b"" if rest.lstrip()[:1] == b"}" else b","
        top = raw[:at] + b'"k":1,"\\u006b":' + value + sep + rest
        for dup in (top, b'{"model":"m","w":[' + top + b"]}"):
            got = _outcome(decode_object, dup)
            assert got == _outcome(_decode_strict, dup)
            assert got[0] == "err" and got[2] == "k", dup


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a":"\\ud800"}',  # a lone surrogate escape: the reference accepts it
        b'{"a":1e400}',  # infinity
        b'{"a":' + b"9" * 40 + b"}",  # an integer past 64 bits stays exact
        b'{"a":' + b"9" * 4301 + b"}",  # past Python's digit limit: refused as by the reference
        b'{"a":"\\\\u0022","a":1}',  # "\\u0022" that is no escape
        b'{"\\u0022":1,"\\"":2}',  # the same key written two ways
        b'{"a":"\xed\xa0\x80"}',  # UTF-8 of a surrogate
        b'{"a":[' + b"[" * 2000 + b"]" * 2000 + b"]}",
        b" \n{}\t",
    ],
)
def test_fast_decode_agrees_on_the_edges(raw: bytes) -> None:
    assert _outcome(decode_object, raw) == _outcome(_decode_strict, raw)


def test_upstream_body_inserts_added_fields_into_the_client_bytes() -> None:
    raw = b' {"model": "m",  "messages": [{"role": "user", "content": "x"}], "stream": true}'
    p = parse(raw)
    sent = p.upstream_body(include_usage=True)
    assert sent is not None
    assert sent.endswith(raw[2:])  # the client's bytes, spaces and all, after the new fields
    assert json.loads(sent) == {
        **json.loads(raw),
        "max_tokens": 256,
        "stream_options": {"include_usage": True},
    }
    # a field the body has is rewritten by re-encoding (never a second copy of the key)
    q = parse({**json.loads(raw), "max_tokens": 4000})
    out = q.upstream_body(include_usage=True)
    assert out is not None and out.count(b'"max_tokens"') == 1
    assert json.loads(out)["max_tokens"] == 1024
