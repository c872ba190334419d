"""What ``--tokenizer engine`` asks the engine for a prompt (pure: no HTTP)."""

from __future__ import annotations

from typing import Any

import pytest

from kvgate_agent.sidecar.engine.engine_tokens import EngineTokenizer, tokenize_query
from kvgate_agent.sidecar.reading.tokens import PromptCounter

MSGS: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]


def test_a_chat_is_asked_with_the_fields_its_template_renders() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    q = tokenize_query({"model": "m", "messages": MSGS, "tools": tools, "max_tokens": 3})
    assert q is not None and q.prompt is None
    assert q.chat == {"messages": MSGS, "tools": tools}
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}]}]
    assert tokenize_query({"messages": parts}) is not None
    kept = tokenize_query({"messages": MSGS, "add_generation_prompt": False})
    assert kept is not None and kept.chat == {"messages": MSGS, "add_generation_prompt": False}


def test_a_completion_string_is_asked_as_is() -> None:
    q = tokenize_query({"model": "m", "prompt": "def f(): pass"})
    assert q is not None and (q.prompt, q.chat) == ("def f(): pass", None)
    # llama.cpp's /completion, /completions and /infill are parsed as a list of prompts: one
    # string among them is still one string to count.
    one = tokenize_query({"prompt": ["def f(): pass"]})
    assert one is not None and (one.prompt, one.chat) == ("def f(): pass", None)


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": ["a", "b"]},
        {"prompt": [1, 2, 3]},
        {"prompt": [[1], [2]]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        {"messages": [{"role": "user", "content": [{"type": "input_text", "text": "a"}]}]},
        {"messages": MSGS, "documents": [{"text": "doc"}]},
        {"messages": MSGS, "functions": [{"name": "f"}]},
        {"messages": []},
        {},
    ],
)
def test_prompts_the_engine_cannot_count_exactly_are_estimated(body: dict[str, Any]) -> None:
    assert tokenize_query(body) is None


def test_the_cache_key_is_the_prompt_not_the_rest_of_the_request() -> None:
    a = tokenize_query({"model": "a", "messages": MSGS, "max_tokens": 5, "stream": True})
    b = tokenize_query({"model": "b", "messages": [{"content": "hi", "role": "user"}]})
    c = tokenize_query({"messages": [{"role": "user", "content": "hi!"}]})
    d = tokenize_query({"prompt": "hi"})
    assert a is not None and b is not None and c is not None and d is not None
    assert a.key == b.key and len(a.key) == 32
    assert len({a.key, c.key, d.key}) == 3


@pytest.mark.parametrize("kw", [{"timeout": 0}, {"cache_size": 0}, {"max_in_flight": 0}])
def test_bad_settings_are_refused(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        EngineTokenizer("http://x", PromptCounter(), **kw)


async def test_without_a_session_every_count_is_the_estimate() -> None:
    counter = PromptCounter()
    et = EngineTokenizer("http://127.0.0.1:9", counter)
    estimate = counter.count({"messages": MSGS})
    assert await et.count({"messages": MSGS}, estimate) is estimate
    assert et.answered == {"cache": 0, "engine": 0, "estimate": 1, "unsupported": 0}
