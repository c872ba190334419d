"""Tenant classes (``tenants.classes``) and the priority header's trust (``priority.trusted``)
through the sidecar over real HTTP, against a recording upstream: the class's priority reaches
the engine's ``priority`` body field, an untrusted header only lowers it, and the admission
request carries the class's weight and TTFT SLO."""

from __future__ import annotations

import math

import aiohttp
import pytest

from kvgate_agent.admission import AdmissionRequest, Decision
from tests.conftest import SidecarFactory
from tests.upstream import CHAT, Upstream

CLASSES = {
    "classes": [
        {
            "name": "interactive",
            "match": {"tenants": ["alice"], "prefixes": ["chat-"]},
            "weight": 2,
            "priority": 7,
            "slo": {"ttftSeconds": 0.5, "tpotSeconds": 0.05},
        },
        {"name": "batch", "match": {"prefixes": ["batch-"]}, "priority": 0, "batch": True},
    ]
}

#: (tenant, priority header or None, priority the engine gets untrusted, and trusted), with
#: ``forwardTo: SGLang`` (kvgate's priority as is).
CASES = [
    ("alice", None, 7, 7),  # the class's priority
    ("alice", "100", 7, 100),  # untrusted: cannot raise it
    ("alice", "3", 3, 3),  # may lower it
    ("alice", "-1", -1, -1),  # ... down to sheddable
    ("chat-7", None, 7, 7),  # by prefix
    ("bob", "5", 0, 5),  # the implicit default class: priority 0
    ("bob", None, 0, 0),
    ("batch-1", "2", 0, 2),
]


@pytest.mark.parametrize("trusted", [False, True], ids=["untrusted", "trusted"])
async def test_class_priority_reaches_the_engine_and_an_untrusted_header_only_lowers_it(
    upstream: Upstream,
    sidecar_factory: SidecarFactory,
    client: aiohttp.ClientSession,
    trusted: bool,
) -> None:
    url, _ = await sidecar_factory(
        upstream.url,
        {"tenants": CLASSES, "priority": {"forwardTo": "SGLang", "trusted": trusted}},
    )
    for tenant, header, _, _ in CASES:
        headers = {"x-kvgate-tenant": tenant}
        if header is not None:
            headers["x-kvgate-priority"] = header
        body = {**CHAT, "max_tokens": 4, "priority": 999}  # the client's own never passes
        async with client.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == 200, await r.text()
    want = [trusted_p if trusted else untrusted_p for _, _, untrusted_p, trusted_p in CASES]
    assert [b["priority"] for b in upstream.bodies] == want


async def test_admission_gets_the_class_weight_and_ttft_slo(
    upstream: Upstream,
    sidecar_factory: SidecarFactory,
    client: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What ``_completion`` hands the admission core: the class's weight, its TTFT SLO
    (``math.inf`` for a batch class, None for the implicit default class: the policy's rule)
    and priority; a declared default class (``defaultClass``) takes the unmatched tenants."""
    url, sc = await sidecar_factory(
        upstream.url, {"tenants": CLASSES, "slo": {"ttftSeconds": 3, "tpotSeconds": 0.2}}
    )
    seen: list[AdmissionRequest] = []
    admit = sc.admission.admit

    async def spy(req: AdmissionRequest) -> Decision:
        seen.append(req)
        return await admit(req)

    monkeypatch.setattr(sc.admission, "admit", spy)
    for tenant in ("alice", "batch-9", "bob"):
        headers = {"x-kvgate-tenant": tenant}
        async with client.post(url + "/v1/chat/completions", json=CHAT, headers=headers) as r:
            assert r.status == 200
    assert [(q.tenant, q.weight, q.ttft_slo_seconds, q.priority) for q in seen] == [
        ("alice", 2.0, 0.5, 7),
        ("batch-9", 1.0, math.inf, 0),
        ("bob", 1.0, None, 0),
    ]
    # One adaptive concurrency limit per pod: the tightest TPOT target of policy and classes.
    assert sc.admission.config.tpot_slo_seconds == 0.05
