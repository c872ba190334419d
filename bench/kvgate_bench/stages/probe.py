"""The instrumentation of ``python -m kvgate_bench.stages``: the sidecar's per-request steps
wrapped at run time (no agent code changed), each call stamped with
``time.perf_counter_ns`` into :attr:`Probe.marks` (see :mod:`kvgate_bench.stages.timeline`),
and the event loop's own work counted: tasks created (a task factory), loop iterations (the
asyncio loop's ``_run_once`` wrapped; uvloop's runs in C and is not counted) and the times the
sidecar's thread blocked or was preempted (``ru_nvcsw``, ``ru_nivcsw``, sampled as each
client read arrives).

The wrappers replace class attributes and module globals, so they take effect on the
Python sources only (a mypyc-compiled module calls its functions natively) and must be in place
before the sidecar is built (some methods are bound at construction). Each wrapped call costs
about 0.3-0.6 µs of its own; the run measures the same load without the probe to say how much.

On a compiled build (``--compiled``) only the calls made through Python's attribute lookup are
stamped: the loop's into the protocols (``data_received``), the compiled code's into the
modules that stay interpreted (identity, the estimate, ``AsyncAdmission``, the metrics) and the
interpreted code's into compiled ones (``AdmissionController.submit``). :meth:`Probe.boundary`
then stamps the rest at the edges of the compiled code: the handler task's coroutine
(:data:`END`, through the task factory), the client transport's ``write`` (:data:`SEND`), the
upstream transport's ``writelines`` (``up.write``, then a :data:`WAIT` until the upstream's
first bytes arrive), each transport handed to the compiled protocol wrapped in a stamping
proxy; the compiled code between them is its enclosing stamped call's (mostly
``RequestPipeline._completion``'s: the route hands the listener the bound method).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import importlib
import resource
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from kvgate_bench.stages.timeline import END, SEND, START, WAIT, Mark

#: What is wrapped: (module, attribute path in it, label, a coroutine function). Several
#: functions may share a label (their times add up); labels are the keys of
#: :data:`kvgate_bench.stages.timeline.STAGES`.
TARGETS: tuple[tuple[str, str, str, bool], ...] = (
    ("kvgate_agent.sidecar.edge.client_conn", "ClientConnection.data_received", START, False),
    ("kvgate_agent.sidecar.edge.client_parse", "RequestParser.on_headers_complete", "req.head",
     False),
    ("kvgate_agent.sidecar.edge.client_conn", "ClientConnection._start", "conn.task", False),
    ("kvgate_agent.sidecar.edge.client_conn", "ClientConnection._serve", END, True),
    ("kvgate_agent.sidecar.edge.client_conn", "ClientConnection._answer", "serve.answer", False),
    ("kvgate_agent.sidecar.edge.client_conn", "response_bytes", "answer.head", False),
    ("kvgate_agent.sidecar.edge.client_request", "head_bytes", "answer.head", False),
    ("kvgate_agent.sidecar.edge.client_transport", "ClientTransport.send", SEND, False),
    ("kvgate_agent.sidecar.edge.client_conn", "ClientConnection._next", "conn.next", False),
    ("kvgate_agent.sidecar.pipeline", "RequestPipeline._completion", "pipeline", True),
    ("kvgate_agent.sidecar.identity.identity", "Authenticator.who", "identity", False),
    ("kvgate_agent.sidecar.upstream.forward", "Forwarder.read_body", "body.read", True),
    ("kvgate_agent.sidecar.reading.apis.openai", "OpenAI.parse", "body.parse", False),
    ("kvgate_agent.sidecar.engine.probe", "PromptReads.estimate", "estimate", False),
    ("kvgate_agent.sidecar.pipeline", "RequestPipeline._admit", "admit.build", True),
    ("kvgate_agent.admission.async_admission", "AsyncAdmission.admit", "admit.async", True),
    ("kvgate_agent.admission.controller", "AdmissionController.submit", "admit.submit", False),
    ("kvgate_agent.sidecar.metrics", "SidecarMetrics.count_decision", "metrics", False),
    ("kvgate_agent.sidecar.metrics", "SidecarMetrics.count_tokens", "metrics", False),
    ("kvgate_agent.sidecar.reading.responses", "admitted_headers", "up.build", False),
    ("kvgate_agent.sidecar.reading.request", "ParsedRequest.upstream_body", "up.build", False),
    ("kvgate_agent.sidecar.pipeline", "identity_headers", "up.build", False),
    ("kvgate_agent.sidecar.upstream.forward", "admitted_request_headers", "up.build", False),
    ("kvgate_agent.sidecar.upstream.forward", "Forwarder.admitted", "forward", True),
    ("kvgate_agent.sidecar.upstream.forward", "Forwarder._exchange", "forward", True),
    ("kvgate_agent.sidecar.upstream.upstream", "UpstreamPool.request", "up.build", True),
    ("kvgate_agent.sidecar.upstream.upstream", "UpstreamPool._acquire", "up.acquire", True),
    ("kvgate_agent.sidecar.upstream.upstream", "UpstreamPool._send", "up.write", True),
    ("kvgate_agent.sidecar.upstream.upstream_conn", "UpstreamConnection.wait", WAIT, True),
    ("kvgate_agent.sidecar.upstream.upstream_conn", "UpstreamConnection.data_received",
     "up.read", False),
    ("kvgate_agent.sidecar.upstream.forward", "forward_headers", "relay.headers", False),
    ("kvgate_agent.sidecar.upstream.forward", "read_capped", "relay.body", True),
    ("kvgate_agent.sidecar.upstream.upstream", "UpstreamResponse.read_any", "relay.body", True),
    ("kvgate_agent.sidecar.reading.apis.openai", "OpenAI.body_usage", "relay.usage", False),
    ("kvgate_agent.sidecar.upstream.forward", "Forwarder._settle", "release.settle", False),
    ("kvgate_agent.admission.async_admission", "AsyncAdmission.release", "release.admission",
     False),
    ("kvgate_agent.sidecar.upstream.forward", "relay_stream", "relay.stream", True),
    ("kvgate_agent.sidecar.reading.sse", "StreamAccountant.feed", "relay.sse", False),
    ("kvgate_agent.sidecar.edge.client_request", "StreamOut.prepare", "stream.head", True),
    ("kvgate_agent.sidecar.edge.client_request", "StreamOut.write", "stream.write", True),
    ("kvgate_agent.sidecar.edge.client_request", "StreamOut.write_eof", "stream.eof", True),
    ("kvgate_agent.admission.live", "LiveCorrection.observe_tokens", "observe", False),
)  # fmt: skip


@dataclass
class Probe:
    """What one probed pass records (times: ``perf_counter_ns``, CLOCK_MONOTONIC on Linux,
    comparable with the client process's stamps)."""

    marks: list[Mark] = field(default_factory=list)
    #: When each task was created (the loop's task factory).
    tasks: list[int] = field(default_factory=list)
    #: When each asyncio loop iteration began (empty on uvloop).
    iterations: list[int] = field(default_factory=list)
    #: (time, voluntary and involuntary context switches of the loop's thread so far) at
    #: each client read: the thread blocked, or was preempted (a request cycle preempted is
    #: left out of the stages: on a shared CPU another process's time lands in some stage).
    blocked: list[tuple[int, int, int]] = field(default_factory=list)
    #: Targets that were not found (the agent changed): left unwrapped, named in the report.
    missing: list[str] = field(default_factory=list)
    _undo: list[tuple[object, str, object]] = field(default_factory=list)

    #: Stamp at the edges of compiled code too (:meth:`boundary`).
    edges: bool = False
    _waiting: bool = False

    def clear(self) -> None:
        """Forget what was recorded (the wrappers stay)."""
        self.marks.clear()
        self.tasks.clear()
        self.iterations.clear()
        self.blocked.clear()

    # ---------------------------------------------------------------- wrapping

    def install(self) -> None:
        """Wrap every :data:`TARGETS` entry (once; :meth:`uninstall` puts them back)."""
        for module, path, label, is_async in TARGETS:
            try:
                owner: object = importlib.import_module(module)
                *parents, name = path.split(".")
                for p in parents:
                    owner = getattr(owner, p)
                fn = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            except (ImportError, AttributeError, KeyError):
                self.missing.append(f"{module}:{path}")
                continue
            if isinstance(fn, staticmethod | classmethod | property):
                self.missing.append(f"{module}:{path} (not a plain function)")
                continue
            if label == START:
                wrapped = self._reads(fn)
            elif self.edges and label == "up.read":
                wrapped = self._upstream_reads(fn)
            else:
                wrapped = self._coro(fn, label) if is_async else self._sync(fn, label)
            self._undo.append((owner, name, fn))
            setattr(owner, name, wrapped)

    def boundary(self) -> None:
        """Stamp at the edges of compiled code (see the module docstring): the client and
        upstream connections' ``connection_made`` hand the compiled protocol a stamping proxy
        of their transport, and :meth:`watch_loop`'s task factory wraps the handler's
        coroutine in :data:`END`. Call before :meth:`install`."""
        self.edges = True
        for module, path, make in (
            ("kvgate_agent.sidecar.edge.client_conn", "ClientConnection", self._client_side),
            ("kvgate_agent.sidecar.upstream.upstream_conn", "UpstreamConnection",
             self._upstream_side),
        ):  # fmt: skip
            cls = getattr(importlib.import_module(module), path)
            fn = cls.__dict__["connection_made"]

            def connection_made(proto: Any, transport: Any, fn: Any = fn, make: Any = make) -> None:
                fn(proto, make(transport))

            self._undo.append((cls, "connection_made", fn))
            setattr(cls, "connection_made", connection_made)  # noqa: B010

    def _client_side(self, transport: Any) -> Any:
        now, add = time.perf_counter_ns, self.marks.append
        inner = transport.write

        def write(data: bytes) -> None:
            add((now(), 1, SEND))
            try:
                inner(data)
            finally:
                add((now(), -1, SEND))

        return _Stamped(transport, {"write": write})

    def _upstream_side(self, transport: Any) -> Any:
        now, add = time.perf_counter_ns, self.marks.append
        inner = transport.writelines

        def writelines(data: Any) -> None:
            add((now(), 1, "up.write"))
            try:
                inner(data)
            finally:
                add((now(), -1, "up.write"))
                add((now(), 1, WAIT))
                self._waiting = True

        return _Stamped(transport, {"writelines": writelines})

    def _upstream_reads(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """The upstream connection's ``data_received`` on a compiled build: it ends the
        :data:`WAIT` its request's write began."""
        now, add = time.perf_counter_ns, self.marks.append

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = now()
            if self._waiting:
                self._waiting = False
                add((t, -1, WAIT))
            add((t, 1, "up.read"))
            try:
                return fn(*args, **kwargs)
            finally:
                add((now(), -1, "up.read"))

        return wrapper

    def uninstall(self) -> None:
        """Put every wrapped function back."""
        for owner, name, fn in reversed(self._undo):
            setattr(owner, name, fn)
        self._undo.clear()
        self.edges = self._waiting = False

    def _sync(self, fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        now, add = time.perf_counter_ns, self.marks.append

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            add((now(), 1, label))
            try:
                return fn(*args, **kwargs)
            finally:
                add((now(), -1, label))

        return wrapper

    def _coro(
        self, fn: Callable[..., Coroutine[Any, Any, Any]], label: str
    ) -> Callable[..., Coroutine[Any, Any, Any]]:
        now, add = time.perf_counter_ns, self.marks.append

        @functools.wraps(fn)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            add((now(), 1, label))
            try:
                return await fn(*args, **kwargs)
            finally:
                add((now(), -1, label))

        return wrapper

    def _reads(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """The client connection's ``data_received``: stamped, and the thread's context
        switches sampled before the stamp (outside the request's span)."""
        now, add, blocked = time.perf_counter_ns, self.marks.append, self.blocked
        usage, who = resource.getrusage, resource.RUSAGE_THREAD

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            ru = usage(who)
            t = now()
            blocked.append((t, ru.ru_nvcsw, ru.ru_nivcsw))
            add((t, 1, START))
            try:
                return fn(*args, **kwargs)
            finally:
                add((now(), -1, START))

        return wrapper

    # ---------------------------------------------------------------- the loop

    def watch_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Count ``loop``'s tasks (a task factory) and, on asyncio's own loop, its
        iterations (``_run_once`` wrapped)."""
        now, tasks = time.perf_counter_ns, self.tasks
        serve = self._coro(_await, END) if self.edges else None

        def factory(
            loop: asyncio.AbstractEventLoop,
            coro: Coroutine[Any, Any, Any],
            context: contextvars.Context | None = None,
        ) -> asyncio.Task[Any]:
            tasks.append(now())
            if serve is not None and "_serve" in type(coro).__name__:
                coro = serve(coro)  # the compiled ClientConnection._serve
            return asyncio.Task(coro, loop=loop, context=context)

        loop.set_task_factory(factory)  # type: ignore[arg-type]
        run_once = getattr(loop, "_run_once", None)
        if isinstance(loop, asyncio.BaseEventLoop) and run_once is not None:
            iterations = self.iterations

            def counted() -> None:
                iterations.append(now())
                run_once()

            loop._run_once = counted  # type: ignore[attr-defined]


async def _await(coro: Coroutine[Any, Any, Any]) -> Any:
    return await coro


class _Stamped:
    """A transport with some methods replaced (:meth:`Probe.boundary`), the rest its own."""

    def __init__(self, transport: Any, methods: dict[str, Callable[..., Any]]) -> None:
        self.__dict__.update(methods)
        self._transport = transport

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def wrapper_cost_ns(calls: int = 20000) -> float:
    """ns one sync wrapper adds to a call, hot (a wrapped no-op against the bare one, the best
    of five runs of ``calls``): what each wrapped call adds at least; on the request path,
    cold, it adds more (the run's ``plain`` pass against ``uvloop`` says how much in all)."""

    def noop() -> None:
        return None

    probe = Probe()
    wrapped = probe._sync(noop, "calibration")
    best: list[float] = []
    for fn in (noop, wrapped):
        runs = []
        for _ in range(5):
            t = time.perf_counter_ns()
            for _ in range(calls):
                fn()
            runs.append((time.perf_counter_ns() - t) / calls)
            probe.marks.clear()
        best.append(min(runs))
    return best[1] - best[0]
