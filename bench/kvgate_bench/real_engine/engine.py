"""llama-server for the real-engine benchmark: found as the test command finds it, started
pinned, and its own gauges sampled while an arm runs.

* :func:`find_llama`: the server from ``$KVGATE_LLAMA_SERVER`` and the model from its variable
  (:data:`kvgate_bench.real_engine.prompts.MODELS`: ``$KVGATE_SMOLLM2_MODEL``,
  ``$KVGATE_LLAMA_MODEL`` for Gemma), else the newest in the cache (``$KVGATE_CACHE``, default
  ``~/.cache/kvgate``: ``bin/llama-server-*-*-*``, the model's file pattern), else
  ``scripts/build-llama`` builds and fetches them (its output lines: the server, Gemma,
  SmolLM2), as ``scripts/test`` does.
* :func:`pin_cpus`: llama-server on the last CPU, this process (and the sidecar) on the others.
* :func:`start_llama`: :func:`kvgate_bench.kit.llamaserver.llama_args` (``--parallel``, ``-c``,
  ``--no-kv-unified``, ``--metrics``, ``--slots``, the model's ``--alias``, ``-t THREADS``)
  with ``--cache-ram 0`` (the host-RAM prompt cache off, where the build has the flag:
  :func:`has_flag`) appended, under
  ``taskset -c CPUS`` when given; ready once ``/health`` answers 200
  (:func:`kvgate_bench.kit.llamaserver.wait_loaded`). The benchmark starts a fresh one for
  every arm's run, so that no arm inherits another's state or leftover requests.
* :class:`EngineSampler`: every ``interval_s`` seconds, ``/metrics`` (llama.cpp's
  ``llamacpp:requests_processing`` and ``llamacpp:requests_deferred`` gauges) and ``/slots``
  (each slot's ``n_ctx`` and the tokens it holds, ``n_past`` where reported, else
  ``next_token[0].n_decoded`` + the prompt) into means and maxima; the KV use is the held tokens
  over the slots' contexts. Both endpoints are in ``tools/server/server.cpp``
  (https://github.com/ggml-org/llama.cpp/tree/master/tools/server).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvgate_bench.kit.llamaserver import llama_args, wait_loaded
from kvgate_bench.kit.processes import Proc, spawn
from kvgate_bench.kit.toolkit import free_port, parse_samples, sample_sum
from kvgate_bench.real_engine.prompts import MODELS, Model

REPO = Path(__file__).resolve().parents[3]


def find_llama(model: Model = MODELS["smollm2"]) -> tuple[str, str]:
    """(llama-server binary, ``model``'s GGUF file): see the module docstring. Raises
    ``RuntimeError`` when neither the environment, the cache nor ``scripts/build-llama`` yields
    them."""
    cache = Path(os.environ.get("KVGATE_CACHE", Path.home() / ".cache" / "kvgate"))
    found: list[str | None] = []
    for var, pattern in (
        ("KVGATE_LLAMA_SERVER", "bin/llama-server-*-*-*"),
        (model.env, model.pattern),
    ):
        preset = os.environ.get(var)
        hits = sorted(cache.glob(pattern))
        found.append(preset or (str(hits[-1]) if hits else None))
    server, gguf = found
    if server is not None and gguf is not None:
        return server, gguf
    script = REPO / "scripts" / "build-llama"
    if not script.exists():
        raise RuntimeError("llama-server not found: set KVGATE_LLAMA_SERVER and KVGATE_LLAMA_MODEL")
    out = subprocess.run([str(script)], check=True, capture_output=True, text=True).stdout
    lines = out.strip().splitlines()
    if len(lines) <= model.build_line:
        raise RuntimeError(f"scripts/build-llama printed {out!r}, not a path for {model.key}")
    return lines[0], lines[model.build_line]


def has_flag(binary: str, flag: str) -> bool:
    """Whether ``binary --help`` lists ``flag`` (a llama-server too old for it would refuse to
    start with it)."""
    try:
        out = subprocess.run(
            [binary, "--help"], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return flag in (out.stdout + out.stderr).split()


def pin_cpus(no_pin: bool) -> tuple[str | None, str | None]:
    """Pin this process (the client; the sidecar runs on the same CPUs) to all CPUs but the last,
    which llama-server gets: (engine CPUs, client CPUs) as ``taskset -c`` lists. Nothing is
    pinned, and both are None, with ``no_pin`` or fewer than two CPUs."""
    ncpu = os.cpu_count() or 1
    pin = not no_pin and ncpu >= 2
    engine_cpus = str(ncpu - 1) if pin else None
    client_cpus = ",".join(str(c) for c in range(ncpu - 1)) if pin else None
    if pin:
        os.sched_setaffinity(0, set(range(ncpu - 1)))
    return engine_cpus, client_cpus


def taskset_prefix(cpus: str | None) -> list[str]:
    """``taskset -c CPUS`` when ``cpus`` is given and taskset exists, else nothing."""
    if cpus is None or shutil.which("taskset") is None:
        return []
    return ["taskset", "-c", cpus]


def start_llama(
    binary: str,
    model: str,
    log: Path,
    *,
    parallel: int,
    ctx: int,
    threads: int,
    alias: str,
    cache_ram_off: bool,
    cpus: str | None = None,
    timeout: float = 120.0,
) -> Proc:
    """llama-server with ``parallel`` slots of ``ctx / parallel`` tokens, ``threads`` threads,
    the model's ``alias``, ``--cache-ram 0`` when ``cache_ram_off``, pinned to ``cpus`` (module
    docstring); its output in ``log``. Raises
    :class:`kvgate_bench.kit.llamaserver.LlamaServerError` when it does not load."""
    port = free_port()
    extra = ["--cache-ram", "0"] if cache_ram_off else []
    argv = llama_args(binary, model, port, parallel, ctx, *extra, alias=alias, threads=threads)
    popen = spawn([*taskset_prefix(cpus), *argv], log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_loaded(popen, url, log, timeout)
    except BaseException:
        popen.kill()
        popen.wait()
        raise
    return Proc(popen, log, url)


@dataclass
class EngineStats:
    """Means and maxima of llama-server's own gauges over an arm's run (module docstring)."""

    samples: int = 0
    processing: list[float] = field(default_factory=list)
    deferred: list[float] = field(default_factory=list)
    kv_use: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, float | int | None]:
        """``{processing,deferred,kv_use}_{mean,max}`` and ``samples``; None without samples."""
        out: dict[str, float | int | None] = {"samples": self.samples}
        for name, xs in (
            ("processing", self.processing),
            ("deferred", self.deferred),
            ("kv_use", self.kv_use),
        ):
            out[f"{name}_mean"] = sum(xs) / len(xs) if xs else None
            out[f"{name}_max"] = max(xs) if xs else None
        return out


def slot_kv(slots: list[dict[str, Any]]) -> float | None:
    """Tokens held / context over llama-server's ``/slots`` answer (0..1); None when the
    answer carries no context sizes."""
    total = sum(int(s.get("n_ctx", 0)) for s in slots)
    if total <= 0:
        return None
    held = 0
    for s in slots:
        if not s.get("is_processing"):
            continue
        if "n_past" in s:
            held += int(s["n_past"])
        else:
            nt = s.get("next_token") or [{}]
            held += int(nt[0].get("n_decoded", 0)) + int(s.get("n_prompt_tokens", 0))
    return min(1.0, held / total)


class EngineSampler:
    """Samples llama-server's gauges every ``interval_s`` seconds until stopped."""

    def __init__(self, session: aiohttp.ClientSession, url: str, interval_s: float) -> None:
        self.session, self.url, self.interval_s = session, url, interval_s
        self.stats = EngineStats()
        self._task: asyncio.Task[None] | None = None

    async def sample(self) -> None:
        """One sample of ``/metrics`` and ``/slots``."""
        async with self.session.get(self.url + "/metrics") as r:
            samples = parse_samples(await r.text())
        self.stats.processing.append(sample_sum(samples, "llamacpp:requests_processing"))
        self.stats.deferred.append(sample_sum(samples, "llamacpp:requests_deferred"))
        async with self.session.get(self.url + "/slots") as r:
            kv = slot_kv(await r.json()) if r.status == 200 else None
        if kv is not None:
            self.stats.kv_use.append(kv)
        self.stats.samples += 1

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            with contextlib.suppress(aiohttp.ClientError, ValueError, asyncio.TimeoutError):
                await self.sample()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> EngineStats:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        return self.stats


async def metric_totals(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """llama-server's counters now: ``n_decode_total``, ``tokens_predicted_total``,
    ``tokens_predicted_seconds_total``, ``prompt_tokens_total``, ``prompt_seconds_total``."""
    async with session.get(url + "/metrics") as r:
        samples = parse_samples(await r.text())
    names = (
        "n_decode_total",
        "tokens_predicted_total",
        "tokens_predicted_seconds_total",
        "prompt_tokens_total",
        "prompt_seconds_total",
    )
    return {n: sample_sum(samples, "llamacpp:" + n) for n in names}


async def wait_idle(
    session: aiohttp.ClientSession, url: str, timeout_s: float = 180.0, interval_s: float = 0.5
) -> float:
    """Wait until llama-server at ``url`` has no request processing or deferred, so that each
    arm starts on an idle engine (the requests a previous arm's client cut at its deadline may
    still be running or queued there: llama-server notices a gone client only when it next
    writes to it). Returns the seconds waited.

    Raises:
        TimeoutError: still busy after ``timeout_s`` seconds.
    """
    loop = asyncio.get_running_loop()
    start = loop.time()
    while True:
        async with session.get(url + "/metrics") as r:
            samples = parse_samples(await r.text())
        busy = sample_sum(samples, "llamacpp:requests_processing") + sample_sum(
            samples, "llamacpp:requests_deferred"
        )
        waited = loop.time() - start
        if busy == 0:
            return waited
        if waited > timeout_s:
            raise TimeoutError(f"llama-server still busy ({busy:g} requests) after {waited:.0f} s")
        await asyncio.sleep(interval_s)
