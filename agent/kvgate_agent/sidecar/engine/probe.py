"""The sidecar's own reads of its model server: KV capacity (``/metrics``; llama.cpp: ``/props``
and ``/slots``), the requests it serves at once (llama.cpp's slots), context length
(``/v1/models``; llama.cpp: the slot's context), liveness (``/health``) and, every
``usage_seconds``, the KV tokens in use and the engine's own queue
(:mod:`kvgate_agent.sidecar.engine.engine_load`); and what one request reads of it
(:class:`PromptReads`: its context per request, its prompt's count).

Invariant: an implausible or unreadable KV capacity is never enforced; until one is read,
``failureMode`` decides (FailOpen admits under the policy's explicit figure, FailClosed answers
503 with a one-second Retry-After).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp

from kvgate_agent.admission import AsyncAdmission, Reason
from kvgate_agent.contract.policy import FailureMode, RateLimitPolicySpec
from kvgate_agent.contract.sync import MAX_REPORTED
from kvgate_agent.engines.llamacpp import LayoutError, SlotLayout, parse_props
from kvgate_agent.engines.scrape import KV_CAPACITY, parse_engine_metrics
from kvgate_agent.sidecar.engine.engine_health import EngineHealth, Flag
from kvgate_agent.sidecar.engine.engine_load import EngineLoadPoll
from kvgate_agent.sidecar.engine.engine_reads import PROBE_TIMEOUT, EngineReads
from kvgate_agent.sidecar.engine.engine_tokens import EngineTokenizer
from kvgate_agent.sidecar.reading import (
    EngineContext,
    PromptCount,
    PromptCounter,
    models_context,
)
from kvgate_agent.sidecar.upstream import ModelServer
from kvgate_agent.tasks import cancel_and_wait

log = logging.getLogger("kvgate.sidecar")

#: Hold key on admission while the KV capacity is unknown under FailClosed.
HOLD_ENGINE_CAPACITY = "engine_capacity"


class EngineProbe:
    """Reads the model server (``server``'s probe client) for the sidecar.

    Attributes:
        kv_tokens: KV capacity the engine reported (tokens), once read.
        context: the engine's context per request (``/v1/models``, or llama.cpp's slot context
            from ``/props``), once read, and with the policy's ``model.maxModelLen`` the context
            per request (:meth:`context_tokens`).
        engine_name: the engine whose KV capacity was read (``vllm``, ``llamacpp``, ...).
        capacity_problem: why the engine's KV capacity is not known although it answers
            (an unknown engine), None otherwise; shown by ``/readyz``.
        capacity_known: the KV capacity admission enforces is known (read, explicit, or not
            asked from the engine).

    Args:
        spec: the policy spec enforced now (it changes with the node agent's thresholds).
        upstream_ok: set on each ``/health`` check (``kvgate_upstream_up``).
        poll_seconds: how often the KV capacity is re-read once known.
        usage_seconds: how often the KV tokens in use are read while a KV capacity is
            enforced (0: never).
        unknown_engine: set while :attr:`capacity_problem` is (``kvgate_engine_capacity_unknown``).
        initial: the policy spec enforced at start (``spec()`` may not answer before the
            probe's owner is built): the KV capacity is known from the start unless it asks
            for the engine's.
    """

    def __init__(
        self,
        server: ModelServer,
        admission: AsyncAdmission,
        spec: Callable[[], RateLimitPolicySpec],
        upstream_ok: Flag,
        poll_seconds: float,
        usage_seconds: float = 0.0,
        unknown_engine: Flag | None = None,
        *,
        initial: RateLimitPolicySpec,
    ) -> None:
        self.server = server
        self.admission = admission
        self.spec = spec
        self.upstream_ok = upstream_ok
        self.poll_seconds = poll_seconds
        self.kv_tokens: int | None = None
        self.context = EngineContext()
        self.engine_name: str | None = None
        self.capacity_problem: str | None = None
        self.unknown_engine = Flag(False) if unknown_engine is None else unknown_engine
        self.capacity_known = not initial.capacity.from_engine_metrics
        #: GET the model server's ``/health``, cached (:meth:`EngineHealth.healthy`).
        self.healthy = EngineHealth(server, upstream_ok).healthy
        self._reads = EngineReads(server)  # its failures logged on change, with a count
        self._paused = False  # a stall: new work waits (see pause)
        self._slots_before: int | None = None  # the engine's slots while paused
        self._no_props = False  # /props answered, but not as llama.cpp: not asked again
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self.usage = (
            EngineLoadPoll(server.url, admission, usage_seconds) if usage_seconds > 0 else None
        )

    async def start(self, *, poll: bool) -> None:
        """Read the KV capacity once (when the spec asks for it), then, with ``poll``, keep
        polling the engine in the background. The KV usage poll (``usage_seconds`` > 0) runs
        regardless: a capacity may be enforced later (new thresholds). The model server's
        connections must be open (:meth:`ModelServer.open`)."""
        self._wake = asyncio.Event()
        await self.refresh_max_model_len()
        if self.spec().capacity.from_engine_metrics:
            await self.refresh_capacity()
        else:
            await self.refresh_slots()
        if poll:
            self._task = asyncio.create_task(self._poll())
        if self.usage is not None:
            self.usage.start(self.server.probe())

    def ensure_polling(self) -> None:
        """Keep polling the engine in the background from now on (a policy that asks for the
        engine's KV capacity replaced one that did not), if :meth:`start` did not already."""
        if self._task is None and self._wake is not None:
            self._task = asyncio.create_task(self._poll())

    async def stop(self) -> None:
        """Stop polling (both polls)."""
        if self.usage is not None:
            await self.usage.stop()
        await cancel_and_wait(self._task)

    def set_capacity_known(self, known: bool) -> None:
        """After new thresholds: whether their KV capacity is known; if not, read the engine's
        now rather than in a poll interval."""
        self.capacity_known = known
        if known:
            self.admission.lift(HOLD_ENGINE_CAPACITY)
        elif self._wake is not None:
            self._wake.set()

    async def refresh_capacity(self) -> None:
        """Read the engine's KV capacity (:meth:`read_capacity`). On failure the last known value
        stays; if none was ever read, ``failureMode`` decides: FailOpen enforces the policy's
        explicit ``kvCacheTokens`` (or no KV cap), FailClosed answers 503 until it is read."""
        tokens = await self.read_capacity()
        spec = self.spec()
        mml = self.context_tokens(spec)
        if tokens is not None and (tokens > MAX_REPORTED or (mml is not None and tokens < mml)):
            # vLLM refuses to start unless its KV cache holds one max_model_len sequence; a
            # figure below that (or absurdly large) is a broken report: never enforce it.
            log.warning("ignoring the engine's implausible KV capacity of %d tokens", tokens)
            tokens = None
        a = self.admission
        if tokens is not None:
            if tokens != a.config.kv_capacity_tokens:
                log.info("KV capacity from engine metrics: %d tokens", tokens)
            self.kv_tokens = tokens
            a.set_kv_capacity(tokens)
            a.lift(HOLD_ENGINE_CAPACITY)
            self.capacity_known = True
        elif not self.capacity_known and spec.failure_mode is FailureMode.FAIL_CLOSED:
            # The next attempt is in a second (see _poll): say so, honestly.
            a.hold(
                Reason.FAIL_CLOSED,
                key=HOLD_ENGINE_CAPACITY,
                retry_after=1.0,
                until=a.clock() + 1.0,
                message="the model server's KV capacity is not known yet and failureMode is "
                "FailClosed",
            )

    async def read_capacity(self) -> int | None:
        """The KV capacity (tokens) the engine reports: vLLM, SGLang and trtllm-serve in
        ``/metrics`` (:func:`parse_engine_metrics`), llama.cpp in ``/props`` and ``/slots``
        (:func:`parse_props`: slots × slot context; the slot context is also the engine's
        context per request, :attr:`context`). None when unreadable (the engine does not
        answer: logged) or not reported (an unknown engine: :meth:`_unknown`)."""
        got = await self._reads.get("/metrics")
        if got is None:
            return None
        status, body = got
        sample = parse_engine_metrics(body.decode("utf-8", "replace")) if status == 200 else None
        if sample is not None and sample.kv_capacity_tokens is not None:
            self._recognised(sample.engine)
            return sample.kv_capacity_tokens
        layout = await self._slot_layout()
        if isinstance(layout, SlotLayout):
            self._recognised("llamacpp")
            self.context.learn(layout.slot_tokens, self.spec().model.max_model_len)
            self._engine_slots(layout)
            return layout.kv_capacity_tokens
        if sample is None:
            why = f"GET /metrics answered {status}"
        elif not sample.ok:
            why = sample.reason or "no known engine metrics"
        else:
            bad = sample.invalid.get(KV_CAPACITY)
            why = f"{sample.engine} reports no KV capacity" + (f" ({bad})" if bad else "")
        self._unknown(f"{why}; /props: {layout}")
        return None

    async def refresh_slots(self) -> None:
        """llama-server's slot count, when the KV capacity is not read from the engine (the
        concurrency ceiling holds either way: :meth:`_engine_slots`). Quiet: an engine that
        does not answer is logged at debug only (the KV capacity was not asked for), and one
        that answers ``/props`` with anything but llama.cpp's layout is not asked again."""
        if self._no_props:
            return
        layout = await self._slot_layout(quiet=True)
        if isinstance(layout, SlotLayout):
            self._engine_slots(layout)
        elif layout != "unreadable":
            self._no_props = True  # another engine (vLLM answers 404): /props is not llama's

    def pause(self, paused: bool) -> None:
        """A stalled engine (:mod:`~kvgate_agent.sidecar.upstream.engine_stall`) under FailOpen:
        while ``paused``, admission lets no new request in beside those in flight (the engine's
        concurrency ceiling at 1, so newcomers queue, up to their wait budgets); on resuming,
        the ceiling it had (llama.cpp's slots, or none) is restored."""
        if paused and not self._paused:
            self._paused = True
            self._slots_before = self.admission.stats().engine_concurrency
            self.admission.set_engine_concurrency(1)
        elif not paused and self._paused:
            self._paused = False
            self.admission.set_engine_concurrency(self._slots_before)

    def _engine_slots(self, layout: SlotLayout) -> None:
        """llama-server serves ``layout.slots`` requests at once and queues the rest itself
        (``llamacpp:requests_deferred``): admission never lets more than that in (while
        paused, from the resume on: :meth:`pause`)."""
        if self._paused:
            self._slots_before = layout.slots
            return
        if layout.slots != self.admission.stats().engine_concurrency:
            log.info("the engine serves %d requests at once: the concurrency ceiling", layout.slots)
            self.admission.set_engine_concurrency(layout.slots)

    async def _slot_layout(self, *, quiet: bool = False) -> SlotLayout | str:
        """llama-server's slot layout, or why there is none (a short reason; "unreadable" when
        the engine did not answer)."""
        got = await self._reads.get("/props", quiet=quiet)
        if got is None or got[0] != 200:
            return "unreadable" if got is None else f"answered {got[0]}"
        slots = await self._reads.get("/slots", quiet=quiet)  # 501 with --no-slots: /props alone
        try:
            props = json.loads(got[1])
            listed = json.loads(slots[1]) if slots is not None and slots[0] == 200 else None
            return parse_props(props, listed)
        except (ValueError, LayoutError) as exc:  # JSONDecodeError is a ValueError
            return f"not llama.cpp's ({exc})"

    def _recognised(self, engine: str | None) -> None:
        if self.engine_name != engine:
            log.info("engine recognised: %s", engine)
        self.engine_name = engine
        self.capacity_problem = None
        self.unknown_engine.value = False

    def _unknown(self, why: str) -> None:
        """The engine answers but reports no KV capacity kvgate can read: logged once (again
        only when the reason changes), ``kvgate_engine_capacity_unknown`` 1 and the reason in
        ``/readyz`` until it does. A warning either way: the policy asked for the engine's
        capacity, so admission enforces none at all, or only the policy's fallback
        (``capacity.kvCacheTokens``), which may be far from the engine's."""
        problem = f"the engine's KV capacity is not known: {why}"
        if problem != self.capacity_problem:
            enforced = self.admission.stats().kv_capacity_tokens
            if enforced is None:
                log.warning("%s; admitting without it (give capacity.kvCacheTokens)", problem)
            else:
                log.warning(
                    "%s; enforcing the policy's capacity.kvCacheTokens instead, %d tokens",
                    problem,
                    enforced,
                )
        self.capacity_problem = problem
        self.unknown_engine.value = True

    @property
    def max_model_len(self) -> int | None:
        """The engine's context per request, tokens (:attr:`context`), None until read."""
        return self.context.tokens

    def context_tokens(self, spec: RateLimitPolicySpec) -> int | None:
        """The context per request under ``spec``, tokens: the smaller of its
        ``model.maxModelLen`` and the engine's (:meth:`EngineContext.per_request`); None when
        neither is known."""
        return self.context.per_request(spec.model.max_model_len)

    async def refresh_max_model_len(self) -> None:
        """Learn the engine's context length from ``GET /v1/models`` (vLLM reports
        ``max_model_len`` per model; llama.cpp its slot's context as ``meta.n_ctx``), once, at
        start and then in the poll until read: it bounds each request with the policy's
        ``model.maxModelLen`` (:meth:`context_tokens`). Logged at debug when unreadable."""
        if self.context.tokens is not None:
            return
        try:
            async with self.server.probe().get(
                self.server.url + "/v1/models", timeout=PROBE_TIMEOUT
            ) as resp:
                data = await resp.json(content_type=None) if resp.status == 200 else None
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            log.debug("cannot read /v1/models: %s", exc)
            return
        if (tokens := models_context(data)) is not None:
            self.context.learn(tokens, self.spec().model.max_model_len)

    async def _poll(self) -> None:
        """Every second while something is unknown, else every ``poll_seconds`` (or when new
        thresholds wake it): the engine's context length until read, the KV capacity when
        asked for."""
        while True:
            await self.refresh_max_model_len()
            unknown = not self.capacity_known or (
                self.spec().model.max_model_len is None and self.max_model_len is None
            )
            wake = self._wake
            assert wake is not None
            with contextlib.suppress(TimeoutError):  # new thresholds may wake it early
                await asyncio.wait_for(wake.wait(), 1.0 if unknown else self.poll_seconds)
            wake.clear()
            if self.spec().capacity.from_engine_metrics:
                await self.refresh_capacity()
            else:
                await self.refresh_slots()


class PromptReads:
    """What one request reads of the engine, the engine room's object for the request
    pipeline: the context per request (the probe's, :meth:`context_tokens`) and the prompt's
    count: kvgate's estimate (:meth:`estimate`) or, with ``--tokenizer engine``, the engine's
    own (:meth:`exact`).

    Args:
        probe: the engine probe (its context length).
        counter: kvgate's prompt estimate, calibrated by the engine's reported usage.
        tokenizer: the engine's own counts (``--tokenizer engine``), or None.
    """

    def __init__(
        self, probe: EngineProbe, counter: PromptCounter, tokenizer: EngineTokenizer | None
    ) -> None:
        self.probe = probe
        self.counter = counter
        self.tokenizer = tokenizer
        #: Whether :meth:`exact` asks the engine (``--tokenizer engine``).
        self.asks_engine = tokenizer is not None

    @property
    def bytes_per_token(self) -> float:
        """The estimate's calibrated bytes of prompt text per token (> 0)."""
        return self.counter.bytes_per_token

    def context_tokens(self, spec: RateLimitPolicySpec) -> int | None:
        """The context per request under ``spec``, tokens: the smaller of its
        ``model.maxModelLen`` and the engine's (:meth:`EngineContext.per_request`, as
        :meth:`EngineProbe.context_tokens`); None when neither says."""
        return self.probe.context.per_request(spec.model.max_model_len)

    def estimate(self, body: Mapping[str, Any]) -> PromptCount:
        """kvgate's count of ``body``'s prompt (:meth:`PromptCounter.count`; tokens)."""
        return self.counter.count(body)

    async def exact(self, body: Mapping[str, Any], estimate: PromptCount) -> PromptCount:
        """The engine's own count of ``body``'s prompt where it answers in time
        (:meth:`EngineTokenizer.count`), else ``estimate``; ``estimate`` without
        ``--tokenizer engine``. Never raises for the engine's faults."""
        if self.tokenizer is None:
            return estimate
        return await self.tokenizer.count(body, estimate)
