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
    content_keys,
)
from kvgate_bench.effectiveness.model.workloads import (
    CODE_OUTPUT,
    CODE_PROMPT,
    NOISY_MAX_TOKENS,
    SHARED_PREFIX_TOKENS,
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


def test_shared_prefix_prompts_start_with_their_applications_prefix() -> None:
    """``shared-prefix``: four applications of equal demand, each prompt its application's
    2,048-token prefix (named for the engine's prefix cache by the application, up to the
    prefix's last full block) plus the user's part; the other workloads carry no prefix."""
    s = generate("shared-prefix", 8.0, 600.0, 3, max_model_len=MML)
    apps = {r.tenant for r in s.requests}
    assert apps == {"app-0", "app-1", "app-2", "app-3"} == set(s.tenants)
    for r in s.requests:
        assert r.prefix_group == r.tenant and r.prefix_tokens == SHARED_PREFIX_TOKENS
        assert SHARED_PREFIX_TOKENS < r.prompt_tokens <= MML - PROMPT_HEADROOM
    user = [r.prompt_tokens - SHARED_PREFIX_TOKENS for r in s.requests]
    assert statistics.median(user) == pytest.approx(math.exp(CONVERSATION_PROMPT[0]), rel=0.1)
    a, b = [r for r in s.requests if r.tenant == "app-1"][:2]
    ka, kb = content_keys(a, 16), content_keys(b, 16)
    assert ka is not None and kb is not None
    full = SHARED_PREFIX_TOKENS // 16
    assert [ka(i) for i in range(full)] == [kb(i) for i in range(full)]
    assert ka(full) is None  # the user's part is the request's own
    other = next(r for r in s.requests if r.tenant == "app-2")
    assert content_keys(other, 16)(0) != ka(0)  # type: ignore[misc]
    conv = generate("conversation", 8.0, 60.0, 3)
    assert all(r.prefix_group is None and content_keys(r, 16) is None for r in conv.requests)


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        generate("chat", 1.0, 1.0, 0)
    with pytest.raises(ValueError):
        generate("code", 0.0, 1.0, 0)
