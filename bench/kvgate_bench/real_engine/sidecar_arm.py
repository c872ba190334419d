"""The real sidecar of the ``kvgate`` and ``kvgate-empty`` arms of the real-engine benchmark:
its policy and its process (:func:`start_sidecar`), in front of llama-server.

``kvgate`` enforces the README's recommended policy (:func:`kvgate_policy`); ``kvgate-empty``
an empty spec (every default: what a platform engineer gets with no configuration). Each
sidecar serves its ``/metrics`` on an admin port of its own too, which
:mod:`kvgate_bench.real_engine.limit_trace` polls.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from kvgate_bench.effectiveness.arms.context import ArmContext
from kvgate_bench.effectiveness.arms.kvgate_defaults import recommended_policy
from kvgate_bench.effectiveness.realtime.servers import policy_manifest
from kvgate_bench.kit import processes
from kvgate_bench.kit.toolkit import free_port
from kvgate_bench.real_engine.engine import taskset_prefix
from kvgate_bench.real_engine.plan import KVGATE


def kvgate_policy(ctx: ArmContext) -> dict[str, Any]:
    """The ``kvgate`` arm's spec: the README's recommended policy
    (:func:`kvgate_bench.effectiveness.arms.kvgate_defaults.recommended_policy`: the SLO of
    ``ctx.slo``, tenant classes, a ShortestFirst queue with Degrade) with the KV capacity read
    from the engine (``capacity.fromEngineMetrics``, as ``examples/ratelimitpolicy-minimal.yaml``
    writes it)."""
    spec = recommended_policy(ctx)
    return {**spec, "capacity": {"fromEngineMetrics": True}}


async def start_sidecar(
    engine_url: str, arm: str, ctx: ArmContext, workdir: Path, client_cpus: str | None
) -> tuple[processes.Proc, str]:
    """The sidecar of a ``kvgate`` arm in front of ``engine_url`` (``kvgate``: the recommended
    policy; ``kvgate-empty``: an empty spec), with an admin port; (its process, its admin
    ``/metrics`` URL)."""
    spec = kvgate_policy(ctx) if arm == KVGATE else {}
    policy = workdir / f"policy-{arm}.json"
    policy.write_text(json.dumps(policy_manifest(spec, "real-engine")))
    port, admin = free_port(), free_port()
    argv = processes.sidecar_argv(
        "--upstream-timeout",
        "3600",
        "--admin-listen",
        f"127.0.0.1:{admin}",
        upstream=engine_url,
        policy=policy,
        port=port,
    )
    proc = await asyncio.to_thread(
        processes.start,
        [*taskset_prefix(client_cpus), *argv],
        workdir / f"sidecar-{arm}.log",
        url=f"http://127.0.0.1:{port}",
        ready="/healthz",
        status=200,
        what="kvgate-agent sidecar",
    )
    return proc, f"http://127.0.0.1:{admin}/metrics"
