"""The context per request: the policy's ``model.maxModelLen`` against the engine's own."""

from __future__ import annotations

import logging

import pytest

from kvgate_agent.sidecar.reading.engine_context import EngineContext, models_context
from kvgate_agent.sidecar.reading.tokens import output_within_context


def test_the_smaller_of_the_policys_and_the_engines_wins() -> None:
    ctx = EngineContext()
    assert ctx.per_request(None) is None
    assert ctx.per_request(8192) == 8192  # the engine's not read yet
    ctx.learn(4096, None)
    assert ctx.per_request(None) == 4096
    assert ctx.per_request(2048) == 2048
    assert ctx.per_request(8192) == 4096


def test_a_policy_stating_more_than_the_engine_has_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ctx = EngineContext()
    with caplog.at_level(logging.WARNING, logger="kvgate.sidecar"):
        ctx.learn(4096, 8192)
        for _ in range(3):
            assert ctx.per_request(8192) == 4096
        assert ctx.per_request(2048) == 2048
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "the policy's model.maxModelLen of 8192 tokens is above the engine's context of 4096 "
        "tokens: enforcing the engine's"
    ]


def test_models_context_reads_the_smallest_whole_context() -> None:
    assert models_context({"data": [{"max_model_len": 4096}, {"max_model_len": 2048}]}) == 2048
    assert models_context({"data": [{"meta": {"n_ctx": 2048}}]}) == 2048
    assert models_context({"data": [{"max_model_len": 0}]}) is None
    assert models_context({"data": "x"}) is None
    assert models_context([1, 2]) is None
    assert models_context(None) is None


def test_the_reservation_never_holds_more_than_the_context() -> None:
    assert output_within_context(4000, 16, 2048) == 2032
    assert output_within_context(200, 16, 2048) == 200
    assert output_within_context(200, 3000, 2048) == 1  # at least one output token
