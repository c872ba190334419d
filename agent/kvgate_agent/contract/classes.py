"""Tenant classes: ``spec.tenants.classes[]`` and ``spec.tenants.defaultClass`` of a
RateLimitPolicy (:mod:`kvgate_agent.contract.policy` holds the rest of the manifest).

A class groups tenants by name (``match.tenants``) and name prefix (``match.prefixes``) and gives
them a fair-share ``weight``, a ``priority`` and a latency target: ``slo`` (``ttftSeconds``,
``tpotSeconds``) or ``batch: true`` (no latency SLO). A tenant no class matches belongs to the
``defaultClass``; left unset, that is the class named ``default``: declared or, when none is, an
implicit one (weight 1, priority 0, the policy's own ``slo`` rule).

Matching (first match wins): a tenant name listed in ``match.tenants`` over any prefix; then the
longest ``match.prefixes`` entry the name starts with; else the default class. No tenant name and
no prefix may be claimed by two classes, so the match never depends on the classes' order.

Errors are raised as ``ValueError`` from pydantic validators; :func:`~kvgate_agent.contract.policy.
parse_policy` reports them by manifest path (``spec.tenants.classes: ...``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Annotated

from pydantic import Field, model_validator

from kvgate_agent.contract.base import ContractModel

#: Priorities a request or a class may carry (the sidecar refuses a priority header outside it
#: with 400).
MIN_PRIORITY = -1000
MAX_PRIORITY = 1000

#: The class of tenants no class matches, when ``tenants.defaultClass`` is unset.
DEFAULT_CLASS = "default"

#: Bounds on the lists: they keep the CRD's CEL rules (every tenant name and prefix claimed by
#: one class only, a quadratic check) within the API server's cost budget.
MAX_CLASSES = 16
MAX_CLASS_TENANTS = 32
MAX_CLASS_PREFIXES = 16
#: Longest tenant name a class can match (a longer header value is hashed, see
#: ``kvgate_agent.sidecar.identity.tenants.MAX_TENANT_LEN``).
MAX_TENANT_NAME = 128

ClassName = Annotated[
    str, Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
]
#: A tenant name as the sidecar names tenants: no whitespace at either end (header values are
#: stripped, so such a name could never match).
TenantName = Annotated[str, Field(min_length=1, max_length=MAX_TENANT_NAME, pattern=r"^\S(.*\S)?$")]
TenantPrefix = Annotated[str, Field(min_length=1, max_length=MAX_TENANT_NAME, pattern=r"^\S")]


def _no_repeats(kind: str, values: Sequence[str]) -> None:
    seen: set[str] = set()
    for v in values:
        if v in seen:
            raise ValueError(f"{kind} {v!r} is listed twice")
        seen.add(v)


class ClassMatch(ContractModel):
    """Which tenants a class claims: ``tenants``, exact tenant names (at most 32), and
    ``prefixes``, tenant-name prefixes (at most 16; ``team-x-`` claims ``team-x-a``). Names are
    tenant keys as the sidecar derives them (``tenants.header``'s value, ``key-<hash>`` with
    ``authorization``). Both empty: the class claims no tenant by name (a default class)."""

    tenants: Annotated[list[TenantName], Field(max_length=MAX_CLASS_TENANTS)] = Field(
        default_factory=list
    )
    prefixes: Annotated[list[TenantPrefix], Field(max_length=MAX_CLASS_PREFIXES)] = Field(
        default_factory=list
    )

    @model_validator(mode="after")
    def _no_repeats(self) -> ClassMatch:
        _no_repeats("tenant", self.tenants)
        _no_repeats("prefix", self.prefixes)
        return self


class ClassSloSpec(ContractModel):
    """A class's latency targets, seconds; an unset one falls back to the policy's ``slo``.

    ``ttftSeconds`` in (0, 3600]: the time-to-first-token SLO of this class's requests (their
    queue-wait budget, as ``slo.ttftSeconds`` for the policy), whatever their priority.
    ``tpotSeconds`` in (0, 10]: the time per output token this class wants; the pod has one
    adaptive concurrency limit, driven by the tightest of the policy's and the classes'
    ``tpotSeconds``.
    """

    ttft_seconds: Annotated[float, Field(gt=0, le=3600, allow_inf_nan=False)] | None = None
    tpot_seconds: Annotated[float, Field(gt=0, le=10, allow_inf_nan=False)] | None = None


class TenantClassSpec(ContractModel):
    """One tenant class.

    ``name``: a DNS label, unique among the classes. ``match``: the tenants it claims
    (:class:`ClassMatch`). ``weight``: its tenants' fair-share weight, in (0, 1000] (default
    1): backlogged tenants are served in proportion to their weights. ``priority``: its
    requests' priority, in [-1000, 1000] (default 0; higher first, negative sheddable), which a
    request's priority header may only lower unless ``priority.trusted``. ``slo``: its latency
    targets (:class:`ClassSloSpec`); or ``batch: true``, no latency SLO (its requests are never
    refused for their expected wait); neither: the policy's ``slo`` rule applies; both: refused.
    """

    name: ClassName
    match: ClassMatch = Field(default_factory=ClassMatch)
    weight: Annotated[float, Field(gt=0, le=1000, allow_inf_nan=False)] = 1.0
    priority: Annotated[int, Field(ge=MIN_PRIORITY, le=MAX_PRIORITY)] = 0
    slo: ClassSloSpec | None = None
    batch: bool = False

    @model_validator(mode="after")
    def _batch_or_slo(self) -> TenantClassSpec:
        if self.batch and self.slo is not None:
            raise ValueError("a class is batch (no latency SLO) or has an slo, not both")
        return self


TenantClasses = Annotated[list[TenantClassSpec], Field(max_length=MAX_CLASSES)]


def _claimed_once(kind: str, claims: Iterable[tuple[str, str]]) -> None:
    owner: dict[str, str] = {}
    for value, cls in claims:
        if value in owner:
            raise ValueError(
                f"{kind} {value!r} is claimed by classes {owner[value]} and {cls}: "
                f"a {kind} may belong to one class only"
            )
        owner[value] = cls


def check_classes(classes: Sequence[TenantClassSpec], default_class: str | None) -> None:
    """The rules across classes: unique names; no tenant name and no prefix claimed by two
    classes; ``default_class`` (``tenants.defaultClass``) names a declared class, or is
    :data:`DEFAULT_CLASS` (the implicit class when none of that name is declared).

    Raises:
        ValueError: the first rule broken, naming the class, tenant or prefix.
    """
    names = [c.name for c in classes]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"classes names must be unique: {name!r} is used twice")
    _claimed_once("tenant", ((t, c.name) for c in classes for t in c.match.tenants))
    _claimed_once("prefix", ((p, c.name) for c in classes for p in c.match.prefixes))
    if default_class is not None and default_class != DEFAULT_CLASS and default_class not in names:
        raise ValueError(
            f"defaultClass {default_class!r} names no class in classes "
            f"(declared: {', '.join(names) or 'none'})"
        )


class TenantClassesSpec(ContractModel):
    """The tenant-class fields of ``spec.tenants`` (a base of
    :class:`~kvgate_agent.contract.policy.TenantsSpec`).

    ``classes``: at most 16 :class:`TenantClassSpec`, names unique, no tenant name or prefix
    claimed by two. ``defaultClass``: the class of tenants no class matches; unset, the class
    named ``default`` (declared, or else implicit: weight 1, priority 0, the policy's ``slo``).
    """

    classes: TenantClasses = Field(default_factory=list)
    default_class: ClassName | None = None

    @model_validator(mode="after")
    def _classes_agree(self) -> TenantClassesSpec:
        check_classes(self.classes, self.default_class)
        return self
