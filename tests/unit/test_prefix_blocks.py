"""The prompt's leading full-block chained hashes
(:mod:`kvgate_agent.sidecar.reading.prefix_blocks`):
same prefix, same hashes; a divergence ends the shared run at its block; the model and the
template fields seed separate chains; token ids are cut into blocks of ``B`` ids, text into
blocks of ``4B`` bytes; the number of blocks is capped; and the gate names nothing until the
engine reported cached tokens."""

from __future__ import annotations

from typing import Any

import pytest

from kvgate_agent.sidecar.reading.prefix_blocks import (
    BYTES_PER_TOKEN,
    MAX_BLOCKS,
    PrefixNaming,
    canonical_text,
    prefix_blocks,
    prompt_ids,
)

B = 16
STEP = B * BYTES_PER_TOKEN  # text bytes per block


def shared_run(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def chat(*contents: str, **extra: Any) -> dict[str, Any]:
    roles = ["system", "user", "assistant", "user", "assistant", "user"]
    return {
        "messages": [{"role": roles[i], "content": c} for i, c in enumerate(contents)],
        **extra,
    }


SYSTEM = "You are a careful assistant. " * 20  # 580 bytes: 9 full text blocks alone
QUESTION = "What is the capital of France, and why did it become the capital? " * 3


def test_the_same_prompt_names_the_same_blocks() -> None:
    body = chat(SYSTEM, QUESTION)
    a = prefix_blocks(body, "m", B)
    assert a is not None and len(a) == len(canonical_text(body, 10**9) or "") // STEP
    assert a == prefix_blocks(chat(SYSTEM, QUESTION), "m", B)
    assert len(set(a)) == len(a)  # chained: equal block texts still hash apart


def test_a_next_turn_shares_every_block_of_the_earlier_turn() -> None:
    turn1 = chat(SYSTEM, QUESTION)
    turn2 = chat(SYSTEM, QUESTION, "Paris, because of history.", "Tell me more.")
    a, b = prefix_blocks(turn1, "m", B), prefix_blocks(turn2, "m", B)
    assert a is not None and b is not None
    assert len(b) > len(a)
    assert b[: len(a)] == a


def test_a_divergence_ends_the_shared_run_at_its_block() -> None:
    base = "x" * (10 * STEP)
    changed = base[: 4 * STEP + 7] + "y" + base[4 * STEP + 8 :]  # a byte of block 4 differs
    a = prefix_blocks({"prompt": base}, "m", B)
    b = prefix_blocks({"prompt": changed}, "m", B)
    assert a is not None and b is not None and len(a) == len(b) == 10
    assert shared_run(a, b) == 4
    assert all(x != y for x, y in zip(a[4:], b[4:], strict=True))  # never shared again


def test_the_model_and_the_tools_seed_separate_chains() -> None:
    body = chat(SYSTEM, QUESTION)
    a = prefix_blocks(body, "model-a", B)
    b = prefix_blocks(body, "model-b", B)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    c = prefix_blocks({**body, "tools": tools}, "model-a", B)
    d = prefix_blocks({**body, "chat_template_kwargs": {"enable_thinking": False}}, "model-a", B)
    assert a and b and c and d
    for other in (b, c, d):
        assert shared_run(a, other) == 0
    assert prefix_blocks({**body, "tools": None}, "model-a", B) == a  # null: no tools


def test_message_key_order_and_empty_fields_do_not_change_the_blocks() -> None:
    answer = {"role": "assistant", "content": "Paris " * 40}
    resent: dict[str, Any] = {
        "content": "Paris " * 40,
        "refusal": None,
        "tool_calls": [],
        "role": "assistant",
    }
    a = prefix_blocks({"messages": [answer]}, "m", B)
    b = prefix_blocks({"messages": [resent]}, "m", B)
    assert a and a == b


def test_token_ids_are_cut_into_blocks_of_the_block_size() -> None:
    ids = list(range(5 * B + 3))
    a = prefix_blocks({"prompt": ids}, "m", B)
    assert a is not None and len(a) == 5  # the partial last block is never named
    assert prefix_blocks({"prompt": [ids]}, "m", B) == a  # one prompt in a list
    longer = prefix_blocks({"prompt": [*ids, 7, 7, 7, 7]}, "m", B)
    assert longer is not None and longer[:5] == a
    other = [*ids]
    other[2 * B] = 999_999
    b = prefix_blocks({"prompt": other}, "m", B)
    assert b is not None and shared_run(a, b) == 2
    # ids never share a chain with text, nor across block sizes
    assert shared_run(a, prefix_blocks({"prompt": ",".join(map(str, ids))}, "m", B) or []) == 0
    assert shared_run(a, prefix_blocks({"prompt": ids}, "m", 8) or []) == 0


def test_a_prompt_shorter_than_a_block_names_none() -> None:
    assert prefix_blocks({"prompt": "short"}, "m", B) == []
    assert prefix_blocks({"prompt": list(range(B - 1))}, "m", B) == []


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": ["a" * 500, "b" * 500]},  # a batch
        {"prompt": [[1] * 40, [2] * 40]},
        {"prompt": ["text", 1, 2, 3]},  # mixed strings and ids
        {"prompt": []},
        {"prompt": 12},
        {"input_embeds": [[0.1, 0.2]]},
        {},
    ],
)
def test_prompts_that_cannot_be_named(body: dict[str, Any]) -> None:
    assert prefix_blocks(body, "m", B) is None


def test_prompt_ids() -> None:
    assert prompt_ids({"prompt": [1, 2]}) == [1, 2]
    assert prompt_ids({"prompt": [[1, 2]]}) == [1, 2]
    assert prompt_ids({"prompt": [[]]}) is None
    assert prompt_ids({"prompt": [1, -2]}) is None
    assert prompt_ids({"prompt": [True, 1]}) is None  # JSON true is not a token id
    assert prompt_ids({"prompt": "x"}) is None


def test_the_number_of_blocks_is_capped() -> None:
    text = "z" * (50 * STEP)
    assert len(prefix_blocks({"prompt": text}, "m", B, max_blocks=7) or []) == 7
    assert prefix_blocks({"prompt": text}, "m", B, max_blocks=0) == []
    ids = list(range(50 * B))
    capped = prefix_blocks({"prompt": ids}, "m", B, max_blocks=3)
    assert capped == (prefix_blocks({"prompt": ids}, "m", B) or [])[:3]
    huge = prefix_blocks({"prompt": "q" * ((MAX_BLOCKS + 10) * STEP)}, "m", B)
    assert huge is not None and len(huge) == MAX_BLOCKS
    # a long conversation is serialized only as far as the cap needs
    many = chat(*["m" * 1000] * 6)
    assert len(canonical_text(many, 1500) or "") < 3000


def test_non_ascii_and_lone_surrogates_are_hashed_without_error() -> None:
    a = prefix_blocks({"prompt": "é" * 200 + "\ud800" + "ü" * 200}, "m", B)
    b = prefix_blocks(chat("日本語のテキスト" * 30, "\udfff" * 10), "m", B)
    assert a and b


def test_the_gate_names_blocks_only_after_a_positive_report() -> None:
    gate = PrefixNaming()
    body = {"prompt": "p" * (10 * STEP)}
    assert gate.blocks(body, "m", B, None) is None
    gate.observe(None)
    gate.observe(0)  # an engine that reports 0 may have no prefix cache at all
    assert not gate.reported and gate.blocks(body, "m", B, None) is None
    gate.observe(32)
    assert gate.reported
    assert gate.blocks(body, "m", B, None) == prefix_blocks(body, "m", B)
    assert len(gate.blocks(body, "m", B, 4 * B + 5) or []) == 4  # at most the context's blocks
    gate.observe(0)
    assert gate.reported  # open for good
