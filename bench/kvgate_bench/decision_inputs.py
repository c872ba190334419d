"""The inputs the hot-path benchmarks and the compiled core's check share: the policy of one
Llama-3.1-8B pod whose limits admit every request (:data:`POLICY`, a RateLimitPolicy manifest as
a dict) and a typical streaming chat body (:func:`typical_chat_body`, JSON bytes).

Used by :mod:`kvgate_bench.bench_decision` (the decision's cost), :mod:`kvgate_bench.bench_hotpath`
(parse and chunk costs) and :mod:`kvgate_bench.compiled` (the compiled core's decision trace).
"""

from __future__ import annotations

import json

from kvgate_agent.contract.api import API_VERSION

#: The benchmark's policy: realistic for one Llama-3.1-8B pod, with limits generous enough that
#: every request is admitted (the admitted path is the hot path; refusals are rarer and cheaper).
POLICY = {
    "apiVersion": API_VERSION,
    "kind": "RateLimitPolicy",
    "metadata": {"name": "bench"},
    "spec": {
        "model": {
            "numLayers": 32,
            "numKVHeads": 8,
            "headDim": 128,
            "kvCacheDtype": "bf16",
            "blockSize": 16,
            "maxModelLen": 8192,
        },
        "capacity": {"kvCacheTokens": 1_000_000},
        "concurrency": {"maxRequests": 256},
        "tenants": {"defaultMaxTokens": 512, "maxTokensCap": 2048},
        "rateLimits": [
            {
                "name": "per-tenant",
                "per": "Tenant",
                "requestsPerMinute": 1_000_000,
                "tokensPerMinute": 1_000_000_000,
            },
            {"name": "pod", "per": "Pod", "tokensPerMinute": 1_000_000_000_000},
        ],
        "cost": {"perRequest": 16, "promptTokenWeight": 1, "outputTokenWeight": 1},
        "queue": {"maxLength": 64, "maxWaitSeconds": 10, "order": "ShortestFirst"},
        "overload": {"actions": ["Degrade", "Queue", "Reject"], "degrade": {"minMaxTokens": 128}},
    },
}


def typical_chat_body(target_bytes: int = 1024) -> bytes:
    """A streaming chat request of about ``target_bytes`` bytes: a system prompt, two turns of
    history and a question (English text)."""
    sentence = "Summarise the attached incident report and list the three most likely causes. "
    body = {
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "messages": [
            {"role": "system", "content": "You are a concise assistant for on-call engineers."},
            {"role": "user", "content": "What does a KV-cache preemption in vLLM mean?"},
            {
                "role": "assistant",
                "content": "The scheduler ran out of KV blocks and evicted a running sequence.",
            },
            {"role": "user", "content": ""},
        ],
        "max_tokens": 256,
        "temperature": 0.2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    base = len(json.dumps(body, separators=(",", ":")))
    reps = max(1, (target_bytes - base) // len(sentence))
    body["messages"][-1]["content"] = (sentence * reps).strip()  # type: ignore[index]
    return json.dumps(body, separators=(",", ":")).encode()
