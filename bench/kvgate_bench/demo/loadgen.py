"""An asyncio load generator for OpenAI-compatible streaming chat completions.

Each request is a ``POST /v1/chat/completions`` with ``stream: true`` (and
``stream_options.include_usage``), sent at a scheduled offset with a named tenant header. For
every request it records what a client sees: HTTP status, time to first token, completion tokens
received, the sidecar's ``x-kvgate-*`` headers and ``Retry-After``. Refused requests are not
retried: the point is to count what the server did with the offered load.

The summaries at the bottom (:func:`summarize`) are pure; their percentiles are
:func:`kvgate_bench.kit.toolkit.percentile`.

Units: times are seconds (floats, ``time.perf_counter``), token counts are model tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import aiohttp

from kvgate_bench.kit.toolkit import percentile

__all__ = [
    "LoadRun",
    "RequestResult",
    "RequestSpec",
    "TenantSummary",
    "chat_body",
    "prompt_text",
    "run_load",
    "summarize",
]

TENANT_HEADER = "x-kvgate-tenant"
#: Words prompts are built from: 2.95 letters + a space per word on average, i.e. ~4 bytes per
#: token as with English BPE vocabularies ("1 token ~= 4 chars"); kvgate-sim counts one token per
#: whitespace word.
_PROMPT_WORDS = (
    "the", "kv", "map", "of", "a", "gpu", "can", "hold", "key", "and",
    "value", "rows", "for", "each", "new", "token", "in", "one", "big", "pool",
)  # fmt: skip
#: Chat framing kvgate-sim adds to a one-message request's word count: 4 per message + 2.
SIM_CHAT_OVERHEAD_TOKENS = 6


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of a load schedule.

    Attributes:
        at: send time, seconds after the run starts.
        tenant: value of the tenant header.
        prompt_tokens: prompt size in tokens as kvgate-sim counts them (words + chat framing).
        max_tokens: the request's ``max_tokens``, tokens.
    """

    at: float
    tenant: str
    prompt_tokens: int
    max_tokens: int


@dataclass(slots=True)
class RequestResult:
    """What the client observed for one request.

    Attributes:
        tenant: the tenant header sent.
        status: HTTP status; 0 when no response arrived (connection error, timeout, or cut off
            at the end of the run).
        started: send time, seconds after the run started.
        ttft: seconds from sending to the first non-empty content delta; None if none arrived.
        latency: seconds from sending to the end of the response (or the failure).
        completion_tokens: output tokens received: ``usage.completion_tokens`` when reported,
            else the number of content deltas.
        complete: the stream ended with ``data: [DONE]`` (a 200 that finished).
        decision: the ``x-kvgate-decision`` header (None when talking to the server directly).
        reason: the ``x-kvgate-reason`` header, if any.
        degraded: the sidecar degraded the request (``x-kvgate-decision: degraded``).
        granted_max_tokens: max_tokens after degradation (from ``x-kvgate-degraded``), else the
            requested value.
        queue_wait: ``x-kvgate-queue-wait-ms`` converted to seconds, if present.
        retry_after: the ``Retry-After`` header, seconds, if present.
        error: a short description when ``status`` is 0 or the stream broke.
    """

    tenant: str
    status: int
    started: float
    ttft: float | None = None
    latency: float = 0.0
    completion_tokens: int = 0
    complete: bool = False
    decision: str | None = None
    reason: str | None = None
    degraded: bool = False
    granted_max_tokens: int = 0
    queue_wait: float | None = None
    retry_after: float | None = None
    error: str | None = None

    @property
    def queued(self) -> bool:
        """The request waited in the sidecar's admission queue before being admitted."""
        return self.decision == "queued" or (self.queue_wait is not None and self.queue_wait > 0)


def prompt_text(prompt_tokens: int) -> str:
    """A prompt of ``prompt_tokens - SIM_CHAT_OVERHEAD_TOKENS`` words (at least one), so a
    one-message chat request counts as ``prompt_tokens`` tokens on kvgate-sim."""
    words = max(1, prompt_tokens - SIM_CHAT_OVERHEAD_TOKENS)
    reps = -(-words // len(_PROMPT_WORDS))
    return " ".join((_PROMPT_WORDS * reps)[:words])


def chat_body(model: str, prompt_tokens: int, max_tokens: int) -> bytes:
    """JSON body of a streaming one-message chat request (``include_usage`` on)."""
    return json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": prompt_text(prompt_tokens)}],
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        separators=(",", ":"),
    ).encode()


def _float_header(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        f = float(value)
    except ValueError:
        return None
    return f if math.isfinite(f) else None


def _granted(header: str | None, requested: int) -> int:
    if header and header.startswith("max_tokens="):
        with contextlib.suppress(ValueError):
            return int(header.removeprefix("max_tokens="))
    return requested


@dataclass(slots=True)
class _StreamSeen:
    """What one response stream has shown so far: content deltas, and whether a usage chunk
    came (then its ``completion_tokens`` count, not the deltas)."""

    content_deltas: int = 0
    usage: bool = False


def _account_event(data: bytes, res: RequestResult, t0: float, seen: _StreamSeen) -> bool:
    """Account one SSE ``data`` payload; returns True on ``[DONE]``."""
    if data == b"[DONE]":
        return True
    try:
        obj = json.loads(data)
    except ValueError:
        return False
    if not isinstance(obj, dict):
        return False
    usage = obj.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        res.completion_tokens = usage["completion_tokens"]
        seen.usage = True
    for choice in obj.get("choices") or ():
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if isinstance(delta, dict) and delta.get("content"):
            seen.content_deltas += 1
            if res.ttft is None:
                res.ttft = time.perf_counter() - t0
    return False


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    spec: RequestSpec,
    run_start: float,
    limit_s: float,
) -> RequestResult:
    body = chat_body(model, spec.prompt_tokens, spec.max_tokens)
    t0 = time.perf_counter()
    res = RequestResult(spec.tenant, 0, t0 - run_start, granted_max_tokens=spec.max_tokens)
    seen = _StreamSeen()
    try:
        async with asyncio.timeout(limit_s):
            async with session.post(
                url,
                data=body,
                headers={TENANT_HEADER: spec.tenant, "Content-Type": "application/json"},
            ) as resp:
                res.status = resp.status
                h = resp.headers
                res.decision = h.get("x-kvgate-decision")
                res.reason = h.get("x-kvgate-reason")
                res.degraded = res.decision == "degraded"
                res.granted_max_tokens = _granted(h.get("x-kvgate-degraded"), spec.max_tokens)
                wait_ms = _float_header(h.get("x-kvgate-queue-wait-ms"))
                res.queue_wait = None if wait_ms is None else wait_ms / 1000.0
                res.retry_after = _float_header(h.get("Retry-After"))
                if resp.status != 200:
                    await resp.read()
                else:
                    buf = b""
                    async for chunk in resp.content.iter_any():
                        buf += chunk
                        while True:
                            end = buf.find(b"\n\n")
                            if end < 0:
                                break
                            event, buf = buf[:end], buf[end + 2 :]
                            for line in event.split(b"\n"):
                                if line.startswith(b"data:") and _account_event(
                                    line[5:].strip(), res, t0, seen
                                ):
                                    res.complete = True
                    if not res.complete:
                        res.error = "stream ended without [DONE]"
    except TimeoutError:
        res.error = f"timed out after {limit_s:g}s"
    except asyncio.CancelledError:
        # Only run_load cancels these tasks (drain deadline): keep what was observed so far and
        # return it as a failed request rather than losing the record.
        res.error = "cut off at the end of the run"
    except (aiohttp.ClientError, OSError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    if not seen.usage:
        res.completion_tokens = seen.content_deltas
    res.latency = time.perf_counter() - t0
    return res


@dataclass(slots=True)
class LoadRun:
    """Progress of a running load, readable while it runs (for a progress display).

    Attributes:
        total: requests in the schedule.
        sent: requests sent so far.
        done: requests finished (any outcome).
        started: ``time.perf_counter()`` at the start of the run, seconds.
    """

    total: int
    sent: int = 0
    done: int = 0
    started: float = field(default_factory=time.perf_counter)

    @property
    def elapsed(self) -> float:
        """Seconds since the run started."""
        return time.perf_counter() - self.started


async def run_load(
    base_url: str,
    schedule: Sequence[RequestSpec],
    *,
    model: str,
    drain_timeout: float = 30.0,
    request_timeout: float = 120.0,
    progress: LoadRun | None = None,
    on_done: Callable[[RequestResult], None] | None = None,
) -> list[RequestResult]:
    """Send ``schedule`` (open loop: each request at its ``at`` offset, whatever the previous
    ones are doing) to ``base_url`` and wait for every response.

    Args:
        base_url: server or sidecar base URL, e.g. ``http://127.0.0.1:8080``.
        schedule: requests sorted by ``at`` (seconds).
        model: ``model`` field of every request.
        drain_timeout: after the last request is sent, seconds to wait for the outstanding ones;
            those still running are then cancelled and reported with status 0.
        request_timeout: per-request limit, seconds.
        progress: updated in place while the load runs.
        on_done: called with each result as it completes.

    Returns:
        One :class:`RequestResult` per scheduled request, in schedule order.
    """
    url = base_url.rstrip("/") + "/v1/chat/completions"
    prog = progress if progress is not None else LoadRun(len(schedule))
    prog.total = len(schedule)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None)
    tasks: list[asyncio.Task[RequestResult]] = []

    def finished(task: asyncio.Task[RequestResult]) -> None:
        prog.done += 1
        if on_done is not None and not task.cancelled() and task.exception() is None:
            on_done(task.result())

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        prog.started = start = time.perf_counter()
        for spec in schedule:
            delay = start + spec.at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(_one(session, url, model, spec, start, request_timeout))
            task.add_done_callback(finished)
            tasks.append(task)
            prog.sent += 1
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=drain_timeout)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending)
    return [t.result() for t in tasks]


# ---------------------------------------------------------------------- summaries (pure)


@dataclass(frozen=True, slots=True)
class TenantSummary:
    """Aggregates of one tenant's requests (or all of them, tenant ``"*"``).

    Attributes:
        tenant: the tenant, or ``"*"`` for the total.
        requests: requests sent.
        completed: 200 responses that streamed to ``[DONE]``.
        rejected_429: 429 responses.
        rejected_other: other HTTP errors (4xx except 429, 5xx).
        failed: no response or a broken stream (status 0, or 200 without ``[DONE]``).
        degraded: admitted with a lower max_tokens (or another model) by the sidecar.
        queued: waited in the sidecar's admission queue before being admitted.
        completion_tokens: output tokens received in completed requests, tokens.
        ttft_p50, ttft_p99: time to first token over completed requests, seconds (None if none).
        queue_wait_p99: queue wait over queued requests, seconds (None if none).
        retry_after_max: largest Retry-After seen, seconds (None if none).
    """

    tenant: str
    requests: int
    completed: int
    rejected_429: int
    rejected_other: int
    failed: int
    degraded: int
    queued: int
    completion_tokens: int
    ttft_p50: float | None
    ttft_p99: float | None
    queue_wait_p99: float | None
    retry_after_max: float | None

    @property
    def accounted(self) -> bool:
        """Every request is in exactly one of completed / 429 / other HTTP error / failed."""
        return self.completed + self.rejected_429 + self.rejected_other + self.failed == (
            self.requests
        )


def summarize_one(tenant: str, results: Iterable[RequestResult]) -> TenantSummary:
    """Aggregate ``results`` (all attributed to ``tenant``) into a :class:`TenantSummary`."""
    rs = list(results)
    done = [r for r in rs if r.status == 200 and r.complete]
    ttfts = [r.ttft for r in done if r.ttft is not None]
    waits = [r.queue_wait for r in rs if r.queued and r.queue_wait is not None]
    retry = [r.retry_after for r in rs if r.retry_after is not None]
    return TenantSummary(
        tenant=tenant,
        requests=len(rs),
        completed=len(done),
        rejected_429=sum(r.status == 429 for r in rs),
        rejected_other=sum(r.status not in (0, 200, 429) for r in rs),
        failed=sum(r.status == 0 or (r.status == 200 and not r.complete) for r in rs),
        degraded=sum(r.degraded for r in rs),
        queued=sum(r.queued for r in rs),
        completion_tokens=sum(r.completion_tokens for r in done),
        ttft_p50=percentile(ttfts, 50),
        ttft_p99=percentile(ttfts, 99),
        queue_wait_p99=percentile(waits, 99),
        retry_after_max=max(retry) if retry else None,
    )


def summarize(
    results: Iterable[RequestResult], tenants: Sequence[str] | None = None
) -> dict[str, TenantSummary]:
    """Per-tenant summaries plus the total under key ``"*"``.

    Args:
        results: request results.
        tenants: tenants to report, in this order (a tenant without results gets zeros); by
            default every tenant seen, in order of first appearance.

    Returns:
        ``{tenant: TenantSummary, ..., "*": total}`` (dicts keep insertion order).
    """
    rs = list(results)
    names = list(tenants) if tenants is not None else list(dict.fromkeys(r.tenant for r in rs))
    out = {t: summarize_one(t, (r for r in rs if r.tenant == t)) for t in names}
    out["*"] = summarize_one("*", rs)
    return out
