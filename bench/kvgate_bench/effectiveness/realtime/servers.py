"""The real-time run's servers: kvgate-sim serving the virtual driver's engine
(:func:`sim_config`, :func:`sim_argv`; a subprocess or in this loop: :func:`sim_server`) and the
kvgate sidecar in front of it enforcing the arm's policy (:func:`arm_policy`,
:func:`policy_manifest`; in this loop on the modelled clock, :func:`sidecar_in_loop`, or as the
``kvgate-agent sidecar`` CLI, :func:`sidecar_child`), with the word-level tokenizer of chat
prompts (:func:`write_word_tokenizer`). See :mod:`kvgate_bench.effectiveness.realtime`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from kvgate_agent.contract.policy import parse_policy
from kvgate_agent.sidecar.app import Sidecar, SidecarSettings
from kvgate_agent.sidecar.server import SidecarServer
from kvgate_bench.effectiveness.arms.context import ArmContext
from kvgate_bench.effectiveness.arms.kvgate_arms import (
    KvgateMaxTokensArm,
    NoisyKvgateArm,
    OracleArm,
)
from kvgate_bench.effectiveness.arms.kvgate_defaults import KvgateDefaultsArm
from kvgate_bench.effectiveness.arms.registry import make_arm
from kvgate_bench.kit import processes
from kvgate_bench.kit.toolkit import free_port
from kvgate_bench.sim.config import SimConfig
from kvgate_bench.sim.engine import SimEngine
from kvgate_bench.sim.sequences import EngineConfig
from kvgate_bench.sim.server import SIM_KEY, start_sim

#: The model kvgate-sim serves and the client asks for.
MODEL = "kvgate-sim-model"


def sim_config(profile_name: str, config: EngineConfig, time_scale: float = 1.0) -> SimConfig:
    """The kvgate-sim configuration that runs ``config`` under profile ``profile_name``.

    Raises ``ValueError`` when kvgate-sim cannot run exactly ``config`` (a watermark other than
    its 0.01, or chunked prefill that differs from the profile's), or for a bad time scale.
    """
    sc = SimConfig(
        model=MODEL,
        kv_capacity_tokens=config.num_gpu_blocks * config.block_size,
        block_size=config.block_size,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        profile=profile_name,
        time_scale=time_scale,
    )
    if sc.engine_config() != config:
        raise ValueError(f"kvgate-sim cannot run {config} (it would run {sc.engine_config()})")
    return sc


def sim_argv(sc: SimConfig, port: int = 0) -> list[str]:
    """The ``kvgate-sim`` command line (``python -m kvgate_bench.sim.cli``) serving ``sc``."""
    argv = processes.sim_argv(
        "--port", str(port), "--model", sc.model, "--profile", sc.profile,
        "--kv-capacity-tokens", str(sc.kv_tokens), "--block-size", str(sc.block_size),
        "--max-model-len", str(sc.max_model_len), "--max-num-seqs", str(sc.max_num_seqs),
        "--time-scale", repr(sc.time_scale),
    )  # fmt: skip
    if sc.max_num_batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(sc.max_num_batched_tokens)]
    return argv


def policy_manifest(spec: dict[str, Any], name: str = "effectiveness") -> dict[str, Any]:
    """A RateLimitPolicy manifest around ``spec`` (what the sidecar's ``--policy`` reads)."""
    return {
        "apiVersion": "kvgate.io/v1alpha1",
        "kind": "RateLimitPolicy",
        "metadata": {"name": name},
        "spec": spec,
    }


def kvgate_arm(arm: str, ctx: ArmContext) -> KvgateMaxTokensArm | None:
    """The virtual-time arm ``arm`` stands for in real time (its policy, its clients'
    priorities); None for ``none``. Raises ``ValueError`` for an arm with no real-time
    counterpart (the baselines, the oracle, kvgate-noisy) or an unknown one."""
    if arm == "none":
        return None
    try:
        a = make_arm(arm, ctx, {})
    except KeyError:  # a baseline that needs its tuned parameters
        a = None
    if not isinstance(a, KvgateMaxTokensArm) or isinstance(a, OracleArm | NoisyKvgateArm):
        raise ValueError(
            f"arm {arm!r} has no real-time counterpart (none or a kvgate arm; the oracle's and "
            "kvgate-noisy's lengths exist in the virtual-time process only)"
        )
    return a


def arm_policy(arm: str, ctx: ArmContext) -> dict[str, Any] | None:
    """The kvgate policy ``spec`` arm ``arm`` enforces; None for ``none``. A day-one arm
    (``kvgate``, ``kvgate-slo-only``, ``kvgate-empty``) has what its sidecar would read from the
    engine (the KV pool, ``max_num_seqs``) written into its spec, as kvgate-sim does not report
    them: ``capacity.kvCacheTokens`` and, unless the spec sets one, ``concurrency.maxRequests``.
    Raises as :func:`kvgate_arm`."""
    a = kvgate_arm(arm, ctx)
    if a is None:
        return None
    spec = a.policy()
    if isinstance(a, KvgateDefaultsArm):
        cfg = a.controller.config
        spec = {
            **spec,
            "capacity": {**spec.get("capacity", {}), "kvCacheTokens": cfg.kv_capacity_tokens},
            "concurrency": {"maxRequests": cfg.max_concurrency, **spec.get("concurrency", {})},
        }
    return spec


def write_word_tokenizer(path: Path) -> None:
    """Write a Hugging Face ``tokenizer.json`` that makes every whitespace-separated word one
    token (a WordLevel model whose only entry is the unknown token)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    tok = Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.save(str(path))


@contextlib.asynccontextmanager
async def sim_server(
    sc: SimConfig, subprocess: bool, engines: list[SimEngine], tmp: Path
) -> AsyncIterator[str]:
    """kvgate-sim serving ``sc`` (a subprocess, its log in ``tmp``, or in this loop: its engine
    is appended to ``engines``); yields its base URL."""
    if not subprocess:
        runner, port = await start_sim(sc)
        engines.append(runner.app[SIM_KEY].loop.engine)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            await runner.cleanup()
        return
    port = free_port()
    proc = await asyncio.to_thread(
        processes.start,
        sim_argv(sc, port),
        tmp / "kvgate-sim.log",
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        url=f"http://127.0.0.1:{port}",
        ready="/health",
    )
    try:
        yield proc.url
    finally:
        await asyncio.to_thread(proc.stop)


@contextlib.asynccontextmanager
async def sidecar_in_loop(
    upstream: str, spec: dict[str, Any], time_scale: float, tokenizer: Path | None
) -> AsyncIterator[str]:
    """The kvgate sidecar enforcing ``spec`` in front of ``upstream``, in this loop, its
    admission clock in modelled seconds; yields its base URL."""
    settings = SidecarSettings(
        upstream=upstream,
        policy=parse_policy(policy_manifest(spec)),
        tokenizer_file=None if tokenizer is None else str(tokenizer),
        upstream_timeout=None,
    )
    clock: Callable[[], float] = time.monotonic
    if time_scale != 1.0:
        clock = lambda: time.monotonic() / time_scale  # noqa: E731
    server = SidecarServer(Sidecar(settings, clock))
    await server.start(("127.0.0.1", 0), None)
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        await server.cleanup()


@contextlib.asynccontextmanager
async def sidecar_child(
    upstream: str, spec: dict[str, Any], tmp: Path, tokenizer: Path | None
) -> AsyncIterator[str]:
    """The ``kvgate-agent sidecar`` CLI enforcing ``spec`` in front of ``upstream``, as a child
    process on the real clock; yields its base URL. Raises ``RuntimeError`` if it does not
    answer ``/healthz`` within 30 s (its log is in the message)."""
    policy = tmp / "policy.json"
    policy.write_text(json.dumps(policy_manifest(spec)))
    argv = ["--upstream-timeout", "3600"]
    if tokenizer is not None:
        argv += ["--tokenizer", str(tokenizer)]
    proc = await asyncio.to_thread(
        processes.start_sidecar, tmp / "sidecar.log", *argv, upstream=upstream, policy=policy
    )
    try:
        yield proc.url
    finally:
        await asyncio.to_thread(proc.stop)
