"""The upstream room's own metrics, on the sidecar's one registry (issue 35: each room owns its
metrics): ``kvgate_upstream_errors_total{kind}`` (every kind of :data:`UPSTREAM_ERROR_KINDS`
pre-set to 0), ``kvgate_upstream_resends_total`` and, at scrape time, ``kvgate_upstream_up``;
and :class:`FlagGauge`, the 0/1 gauge read from a :class:`Flag` that other rooms export
their flags with."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvgate_agent.sidecar.upstream.model_server import Flag

#: The kinds of ``kvgate_upstream_errors_total``, each exported at 0 from the start so that a
#: rate over them is 0, not absent, before the first error
#: (https://prometheus.io/docs/practices/instrumentation/#avoid-missing-metrics).
UPSTREAM_ERROR_KINDS = ("connect", "timeout", "status_5xx", "upstream_error")


class FlagGauge(Collector):
    """A 0/1 gauge ``name`` (help text ``doc``) read from ``flag`` at scrape time."""

    def __init__(self, name: str, doc: str, flag: Flag) -> None:
        self.name, self.doc, self.flag = name, doc, flag

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(self.name, self.doc, value=1.0 if self.flag.value else 0.0)


class UpstreamMetrics:
    """The exchanges with the model server, exported on ``registry``: :attr:`errors` and
    :attr:`resends` counted by the upstream room (its forwarding, pass-through and connection
    pool), :attr:`ok` set by each exchange and by the engine probe's ``/health`` checks.

    ``kvgate_upstream_up`` is registered by :meth:`export_up`, a step of its own so that the
    sidecar's composition keeps it where the exposition has always had it (after admission's
    gauges)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        #: ``kvgate_upstream_errors_total{kind}`` (:data:`UPSTREAM_ERROR_KINDS`: connect,
        #: timeout, status_5xx, upstream_error), each 0 from the start.
        self.errors = Counter(
            "kvgate_upstream_errors", "Upstream failures by kind", ["kind"], registry=registry
        )
        for kind in UPSTREAM_ERROR_KINDS:
            self.errors.labels(kind)
        #: ``kvgate_upstream_resends_total``: admitted requests sent once more on a fresh
        #: connection, the reused one having been closed at once with no byte of answer.
        self.resends = Counter(
            "kvgate_upstream_resends",
            "Admitted requests sent again on a fresh connection: the reused one was closed "
            "at once, with no byte of answer (a stale keep-alive connection)",
            registry=registry,
        )
        #: Whether the last exchange with the model server succeeded (``kvgate_upstream_up``).
        self.ok = Flag(True)

    def export_up(self) -> None:
        """Register ``kvgate_upstream_up`` (1 while :attr:`ok`, read at scrape time)."""
        self._registry.register(
            FlagGauge("kvgate_upstream_up", "1 when the last upstream exchange succeeded", self.ok)
        )
