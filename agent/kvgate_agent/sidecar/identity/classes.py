"""A tenant's class (``spec.tenants.classes``, :mod:`kvgate_agent.contract.classes`): the
resolution from a tenant name to the weight, priority and TTFT SLO its requests are admitted
with. Pure: no I/O, built once per policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvgate_agent.contract.classes import DEFAULT_CLASS, TenantClassesSpec, TenantClassSpec


@dataclass(frozen=True, slots=True)
class TenantClass:
    """A class as admission uses it.

    ``name``: the class's name (``default`` for the implicit default class). ``weight``: the
    fair-share weight, > 0. ``priority``: in [-1000, 1000], its requests' priority before the
    priority header's rule. ``ttft_slo_seconds``: the class's TTFT SLO, seconds; ``math.inf``
    for a batch class (no latency SLO); None where the class states none, so the policy-wide
    rule applies (``slo.ttftSeconds`` for priority >= ``slo.minPriority``).
    """

    name: str
    weight: float = 1.0
    priority: int = 0
    ttft_slo_seconds: float | None = None

    @classmethod
    def of(cls, spec: TenantClassSpec) -> TenantClass:
        """The class ``spec`` (one ``tenants.classes[]`` entry) declares."""
        ttft = math.inf if spec.batch else None if spec.slo is None else spec.slo.ttft_seconds
        return cls(spec.name, spec.weight, spec.priority, ttft)


#: The implicit default class: weight 1, priority 0, the policy's ``slo`` rule.
IMPLICIT_DEFAULT = TenantClass(DEFAULT_CLASS)


class ClassResolver:
    """Maps a tenant name to its :class:`TenantClass`, built once from a policy's
    ``spec.tenants``.

    First match wins: a name in some class's ``match.tenants`` (a dict, O(1)); else the longest
    ``match.prefixes`` entry the name starts with (one dict lookup per distinct prefix length,
    longest first: O(len(name)) lookups at most); else the default class (``defaultClass``, or
    the class named ``default``, implicit when not declared). Answers are cached per tenant;
    the cache holds at most ``cache_size`` tenants and starts over when full, so endless
    tenant names cannot grow it. :meth:`named` answers a class by its name instead (an API
    key's ``class``, which takes precedence over the match rules).
    """

    def __init__(self, tenants: TenantClassesSpec, cache_size: int = 4096) -> None:
        declared = {c.name: TenantClass.of(c) for c in tenants.classes}
        self.default = declared.get(tenants.default_class or DEFAULT_CLASS, IMPLICIT_DEFAULT)
        #: Every class a tenant can resolve to: the declared ones and the default.
        self.classes = (
            *declared.values(),
            *(() if self.default.name in declared else (self.default,)),
        )
        self._by_name = {c.name: c for c in self.classes}
        self._names = {t: declared[c.name] for c in tenants.classes for t in c.match.tenants}
        self._prefixes = {p: declared[c.name] for c in tenants.classes for p in c.match.prefixes}
        self._lengths = sorted({len(p) for p in self._prefixes}, reverse=True)
        self._cache: dict[str, TenantClass] = {}
        self._cache_size = cache_size

    def named(self, name: str) -> TenantClass | None:
        """The class called ``name`` (a declared class, or the default class by its name); None
        when the policy declares no class of that name."""
        return self._by_name.get(name)

    def __call__(self, tenant: str) -> TenantClass:
        """The class of ``tenant`` (any string; never raises)."""
        found = self._cache.get(tenant)
        if found is not None:
            return found
        found = self._names.get(tenant)
        if found is None:
            found = self.default
            for n in self._lengths:
                if n <= len(tenant) and (hit := self._prefixes.get(tenant[:n])) is not None:
                    found = hit
                    break
        if len(self._cache) >= self._cache_size:
            self._cache.clear()
        self._cache[tenant] = found
        return found


def class_names(tenants: TenantClassesSpec) -> frozenset[str]:
    """The names a request's class may be given by under ``tenants``: the declared classes'
    and the default class's (``defaultClass``, else ``default``, implicit when undeclared)."""
    return frozenset({c.name for c in tenants.classes} | {tenants.default_class or DEFAULT_CLASS})
