"""Who may read which of the sidecar's own metrics: the whole registry on the admin port, and on
the clients' port, where the tenants are named by credentials the sidecar checks (``tenants.
header: authorization``: API keys, JWTs), the registry less every series of a named tenant.

An unauthenticated caller of the clients' port must not learn another tenant's name, its
decisions, tokens or bucket levels: with identity on, those series stay on the admin port
(``--admin-listen``), and ``/kvgate/metrics`` on the clients' port keeps the series that name
no tenant (the totals, the admission state, and the refusals before admission, whose tenant
label is empty).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

#: The ``Content-Type`` of both expositions: what :func:`generate_latest` writes (its default
#: escaping keeps every name classic) is text format 0.0.4, labelled so, as the clients' port's
#: ``/metrics`` fallback is; not ``CONTENT_TYPE_LATEST``, which prometheus_client 0.22 moved to
#: ``version=1.0.0`` (the UTF-8 names' format) for the same bytes.
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

#: The comment line that opens the clients' port exposition when per-tenant series are left
#: out (a ``#`` line that is neither HELP nor TYPE: ignored by Prometheus's text parser).
WITHHELD = (
    b"# kvgate: tenants are named by credentials: per-tenant series are served on the admin "
    b"port (--admin-listen) only\n"
)


class _WithoutTenants(Collector):
    """The metric families of ``registry`` without the samples whose ``tenant`` label is not
    empty (a family left with no sample keeps its HELP and TYPE)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            kept = Metric(family.name, family.documentation, family.type, family.unit)
            kept.samples = [s for s in family.samples if not s.labels.get("tenant")]
            yield kept


class MetricsView:
    """The expositions of one registry: :meth:`admin` (everything) and :meth:`clients` (less
    the per-tenant series when ``tenants_private``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._public = CollectorRegistry(auto_describe=False)
        self._public.register(_WithoutTenants(registry))

    def admin(self) -> bytes:
        """The whole registry, Prometheus text format 0.0.4."""
        return generate_latest(self.registry)

    def clients(self, tenants_private: bool) -> bytes:
        """The exposition for the clients' port: :meth:`admin`'s, or with ``tenants_private``
        (tenants named by credentials) :data:`WITHHELD` and the series that name no tenant."""
        if not tenants_private:
            return self.admin()
        return WITHHELD + generate_latest(self._public)
