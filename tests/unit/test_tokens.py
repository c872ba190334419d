"""PromptCounter: exact counts with a tokenizer, conservative estimates without, calibration."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from kvgate_agent.sidecar.reading.tokens import (
    DEFAULT_BYTES_PER_TOKEN,
    NON_TEXT_PART_TOKENS,
    REPLY_PRIMER_TOKENS,
    TOKENS_PER_MESSAGE,
    PromptCount,
    PromptCounter,
)

ENGLISH = (
    "The quick brown fox jumps over the lazy dog. Admission control keeps the model server's "
    "KV cache from overflowing: each request reserves room for its prompt and the tokens it may "
    "generate, and requests that do not fit wait in a queue until earlier ones finish. This "
    "paragraph is ordinary English prose, with punctuation, numbers like 2048 and 4096, and "
    "words of typical length, so a word-level tokenizer splits it much like a BPE vocabulary "
    "would split common words into single tokens."
)
FRAMING = REPLY_PRIMER_TOKENS  # per request
MSG = TOKENS_PER_MESSAGE  # per message


def words(text: str) -> list[str]:
    """What the Whitespace pre-tokenizer splits: runs of word chars, runs of punctuation."""
    return re.findall(r"\w+|[^\w\s]+", text)


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    vocab = {"[UNK]": 0, "<s>": 1}
    for w in words(ENGLISH + " hello world tool get_weather"):
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # a BOS token, added only with add_special_tokens=True (completions prompts)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


@pytest.fixture
def exact(tokenizer_file: str) -> PromptCounter:
    return PromptCounter(tokenizer_file)


def chat(*contents: object) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": c} for c in contents]}


# -- exact ---------------------------------------------------------------------------------------


def test_exact_chat_counts(exact: PromptCounter) -> None:
    assert exact.exact
    c = exact.count(chat("hello world"))
    assert c == PromptCount(2 + MSG + FRAMING, 11, True, MSG + FRAMING)
    c = exact.count(chat("hello", "hello world !", ""))
    assert c.tokens == 1 + 3 + 0 + 3 * MSG + FRAMING
    assert c.text_bytes == 5 + 13


def test_exact_chat_parts_name_tool_calls(exact: PromptCounter) -> None:
    parts = [
        {"type": "text", "text": "hello world"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "text", "text": "hello"},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    ]
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "hello"},
            {"role": "user", "content": parts, "name": "world"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]},
            "not a message",
        ],
    }
    c = exact.count(body)
    tool_calls_tokens = len(words(json.dumps([{"id": "x"}], separators=(",", ":"))))
    overhead = 4 * MSG + FRAMING + 2 * NON_TEXT_PART_TOKENS
    assert c.overhead_tokens == overhead
    assert c.tokens == 1 + 2 + 1 + 1 + tool_calls_tokens + overhead
    assert c.exact


def test_exact_completions_adds_special_tokens(exact: PromptCounter) -> None:
    assert exact.count({"prompt": "hello world"}).tokens == 3  # <s> hello world
    assert exact.count({"prompt": ["hello", "hello world"]}).tokens == 2 + 3
    assert exact.count({"prompt": [5, 6, 7]}) == PromptCount(3, 0, True, 0)
    assert exact.count({"prompt": [[5, 6], [7], []]}).tokens == 3


def test_exact_tools_count_as_json(exact: PromptCounter) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    text = json.dumps(tools, separators=(",", ":"))
    with_tools = exact.count({**chat("hello"), "tools": tools})
    without = exact.count(chat("hello"))
    assert with_tools.tokens - without.tokens == len(words(text))
    assert with_tools.text_bytes - without.text_bytes == len(text)
    legacy = exact.count({**chat("hello"), "functions": tools})
    assert legacy.tokens == with_tools.tokens


def test_exact_survives_lone_surrogate(exact: PromptCounter) -> None:
    c = exact.count(chat("hello \ud800 world"))
    assert c.tokens >= 2 + MSG + FRAMING


# -- estimates -----------------------------------------------------------------------------------


def test_estimate_formula() -> None:
    est = PromptCounter()
    assert not est.exact
    assert est.bytes_per_token == DEFAULT_BYTES_PER_TOKEN
    c = est.count(chat("héllo wörld 😀"))  # 18 UTF-8 bytes
    assert c == PromptCount(math.ceil(18 / 3.0) + MSG + FRAMING, 18, False, MSG + FRAMING)
    assert est.count({"prompt": "abcdefg"}).tokens == 3
    assert est.count({"prompt": [1, 2, 3, 4]}) == PromptCount(4, 0, True, 0)
    assert est.count({"prompt": ["ab", [1, 2]]}).tokens == 1 + 2
    assert est.count({}) == PromptCount(0, 0, True, 0)


def test_fields_a_chat_template_renders_are_counted() -> None:
    """RAG ``documents``, a client's ``chat_template``, its ``chat_template_kwargs`` and an
    assistant turn's ``reasoning_content`` reach the prompt through the template: a prompt
    hidden there must not reserve a handful of tokens."""
    est = PromptCounter()
    big = "word " * 3000  # 15,000 bytes: 5,000 estimated tokens
    base = est.count(chat("hi")).tokens
    hidden = [
        {**chat("hi"), "documents": [{"title": "t", "text": big}]},
        {**chat("hi"), "chat_template": big},
        {**chat("hi"), "chat_template_kwargs": {"extra": big}},
        {"messages": [{"role": "user", "content": "hi"}], "documents": [big]},
    ]
    for body in hidden:
        assert est.count(body).tokens >= base + 5000, body.keys()
    turn = {"role": "assistant", "content": "", "reasoning_content": big}
    two = {"messages": [{"role": "user", "content": "hi"}, turn]}
    assert est.count(two).tokens >= 5000
    assert (
        est.count(
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {**turn, "reasoning_content": None, "reasoning": big},
                ]
            }
        ).tokens
        >= 5000
    )


def test_every_text_bearing_content_part_is_counted() -> None:
    """vLLM renders ``input_text``, ``output_text``, ``refusal`` and ``thinking`` parts (and
    bare strings) as text: a prompt in them must not cost the fixed price of an image."""
    est = PromptCounter()
    big = "word " * 3000  # 15,000 bytes: 5,000 estimated tokens
    parts: list[object] = [
        {"type": "input_text", "text": big},
        {"type": "output_text", "text": big},
        {"type": "refusal", "refusal": big},
        {"type": "thinking", "thinking": big},
        {"text": big},
        big,
    ]
    for part in parts:
        body = {"messages": [{"role": "user", "content": [part]}]}
        assert est.count(body).tokens >= 5000, repr(part)[:40]
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}
    assert est.count(image).overhead_tokens == MSG + FRAMING + NON_TEXT_PART_TOKENS


def test_estimate_over_counts_english(exact: PromptCounter) -> None:
    est = PromptCounter()
    for body in (chat(ENGLISH), {"prompt": ENGLISH}, chat(*ENGLISH.split(". "))):
        assert est.count(body).tokens >= exact.count(body).tokens
    # the word-level vocabulary sees ~5 bytes per token here, like English BPE (~4)
    assert len(ENGLISH) / len(words(ENGLISH)) > 4


def test_observe_moves_toward_reality() -> None:
    est = PromptCounter()
    before = est.count({"prompt": ENGLISH}).tokens
    for _ in range(100):
        est.observe(4000, 1000)  # the server sees 4 bytes/token
    assert est.bytes_per_token == pytest.approx(0.9 * 4.0, rel=1e-3)
    after = est.count({"prompt": ENGLISH}).tokens
    assert after < before
    assert after >= math.ceil(len(ENGLISH) / 4.0)  # still over-counts the observed ratio


def test_observe_moves_gradually_and_subtracts_overhead() -> None:
    est = PromptCounter()
    est.observe(5000, 1000)
    assert DEFAULT_BYTES_PER_TOKEN < est.bytes_per_token < 0.9 * 5.0
    a, b = PromptCounter(), PromptCounter()
    a.observe(1000, 500, overhead_tokens=250)  # 1000 bytes / 250 text tokens = 4
    b.observe(1000, 500)  # 2 bytes/token
    assert a.bytes_per_token > b.bytes_per_token


def test_observe_clamps_and_ignores_noise() -> None:
    est = PromptCounter()
    for _ in range(200):
        est.observe(1000, 10_000)  # 0.1 bytes/token
    assert est.bytes_per_token == 1.0
    for _ in range(200):
        est.observe(100_000, 10)  # 10k bytes/token
    assert est.bytes_per_token == 6.0
    est = PromptCounter()
    est.observe(10, 1)  # too small to tell
    est.observe(1000, 0)
    est.observe(1000, 5, overhead_tokens=7)
    assert est.bytes_per_token == DEFAULT_BYTES_PER_TOKEN


def test_tokenizer_file_errors_propagate(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{}")
    with pytest.raises(Exception):  # noqa: B017 - tokenizers raises a plain Exception
        PromptCounter(str(bad))
