"""The effectiveness benchmark's generated workloads match their parameters (seeded, no I/O)."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest

from kvgate_bench.effectiveness.model.schedule import (
    BATCH,
    CONVERSATION_OUTPUT,
    CONVERSATION_PROMPT,
    INTERACTIVE,
    MAX_TOKENS_CHOICES,
    PROMPT_HEADROOM,
    Schedule,
)
from kvgate_bench.effectiveness.model.workloads import (
    CODE_OUTPUT,
    CODE_PROMPT,
    NOISY_MAX_TOKENS,
    generate,
)

MML = 8192


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def cv(xs: list[float]) -> float:
    return statistics.pstdev(xs) / statistics.fmean(xs)


def check_lengths(s: Schedule, prompt: tuple[float, float], output: tuple[float, float]) -> None:
    prompts = [r.prompt_tokens for r in s.requests]
    outputs = [r.output_tokens for r in s.requests]
    # Medians of a lognormal are e^mu (clipping at the top does not move them).
    assert statistics.median(prompts) == pytest.approx(math.exp(prompt[0]), rel=0.06)
    assert statistics.median(outputs) == pytest.approx(math.exp(output[0]), rel=0.08)
    # About 84.1 % of draws lie below e^(mu + sigma).
    below = sum(1 for p in prompts if p <= math.exp(prompt[0] + prompt[1])) / len(prompts)
    assert below == pytest.approx(0.841, abs=0.02)
    for r in s.requests:
        assert 1 <= r.prompt_tokens <= MML - PROMPT_HEADROOM
        assert 1 <= r.output_tokens <= MML - r.prompt_tokens
        assert r.max_tokens is None or 1 <= r.max_tokens <= MML - r.prompt_tokens


def test_seeded_and_sorted() -> None:
    a = generate("multi-tenant", 20.0, 30.0, 3)
    assert a == generate("multi-tenant", 20.0, 30.0, 3)
    assert a.requests != generate("multi-tenant", 20.0, 30.0, 4).requests
    times = [r.arrival_s for r in a.requests]
    assert times == sorted(times) and times[0] >= 0 and times[-1] < 30.0
    assert len({r.rid for r in a.requests}) == len(a.requests)


def test_conversation_lengths_poisson_and_max_tokens() -> None:
    s = generate("conversation", 100.0, 100.0, 1)
    assert len(s.requests) == pytest.approx(10_000, rel=0.05)
    check_lengths(s, CONVERSATION_PROMPT, CONVERSATION_OUTPUT)
    assert all(r.tier == INTERACTIVE for r in s.requests) and len(s.tenants) == 8
    # A superposition of Poisson processes: exponential gaps, CV 1.
    assert cv(gaps([r.arrival_s for r in s.requests])) == pytest.approx(1.0, abs=0.05)
    unset = sum(1 for r in s.requests if r.max_tokens is None) / len(s.requests)
    assert unset == pytest.approx(1 / len(MAX_TOKENS_CHOICES), abs=0.02)
    small = [r.max_tokens for r in s.requests if r.max_tokens is not None and r.max_tokens < 4096]
    assert set(small) >= {256, 512, 1024}


def test_code_lengths_and_bursts() -> None:
    s = generate("code", 5.0, 3000.0, 2)
    assert len(s.requests) / 3000.0 == pytest.approx(5.0, rel=0.12)
    check_lengths(s, CODE_PROMPT, CODE_OUTPUT)
    # ON/OFF bursts: per tenant, gaps far more variable than Poisson's.
    one = [r.arrival_s for r in s.requests if r.tenant == "code-0"]
    assert cv(gaps(one)) > 1.4


def test_multi_tenant_shares_tiers_and_gamma_arrivals() -> None:
    s = generate("multi-tenant", 18.0, 1500.0, 5)
    by: dict[str, list[float]] = {}
    for r in s.requests:
        by.setdefault(r.tenant, []).append(r.arrival_s)
    n = len(s.requests)
    # Shares 1 : 1 : 1 : 1 (batch) : 5 (noisy) of 9.
    assert len(by["noisy"]) / n == pytest.approx(5 / 9, abs=0.03)
    assert len(by["batch"]) / n == pytest.approx(1 / 9, abs=0.02)
    assert cv(gaps(by["chat-a"])) == pytest.approx(2.0, abs=0.3)
    assert s.tenants["batch"].tier == BATCH and s.tenants["noisy"].tier == INTERACTIVE
    assert all(t.weight == 1.0 for t in s.tenants.values())
    noisy = [r for r in s.requests if r.tenant == "noisy"]
    assert all(r.max_tokens == min(NOISY_MAX_TOKENS, MML - r.prompt_tokens) for r in noisy)
    assert {r.tier for r in s.requests if r.tenant == "batch"} == {BATCH}


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        generate("chat", 1.0, 1.0, 0)
    with pytest.raises(ValueError):
        generate("code", 0.0, 1.0, 0)
