"""The real-time demo's results and their report (:mod:`kvgate_bench.demo.http`): one run's
outcome (:class:`RunResult`), both runs (:class:`DemoReport`), and the printed table and
takeaway, every figure computed from the runs (pure: no I/O).

Units: times in seconds unless named ``_ms``; sizes in tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvgate_agent.contract.policy import LimitScope, RateLimitPolicy
from kvgate_bench.demo.common import row
from kvgate_bench.demo.http_schedule import MODEL, TENANTS, DemoConfig
from kvgate_bench.demo.loadgen import RequestResult, RequestSpec, TenantSummary, summarize

Mode = Literal["direct", "kvgate"]


@dataclass(slots=True)
class RunResult:
    """One run of the schedule.

    Attributes:
        mode: ``direct`` or ``kvgate``.
        results: one per scheduled request, in schedule order.
        preemptions: the simulator's preemptions by tenant header.
        wall: seconds from the first request to the last response.
        sim_stats: the simulator's ``/sim/stats`` at the end.
    """

    mode: Mode
    results: list[RequestResult]
    preemptions: dict[str, int]
    wall: float
    sim_stats: dict[str, object] = field(default_factory=dict)

    def summaries(self) -> dict[str, TenantSummary]:
        """Per-tenant summaries (see :func:`kvgate_bench.demo.loadgen.summarize`), total under
        "*"."""
        return summarize(self.results, TENANTS)

    @property
    def preemptions_total(self) -> int:
        """All preemptions in this run."""
        return sum(self.preemptions.values())


@dataclass(slots=True)
class DemoReport:
    """Both runs of one demo."""

    config: DemoConfig
    policy: RateLimitPolicy
    schedule: list[RequestSpec]
    direct: RunResult
    kvgate: RunResult

    def offered_per_minute(self, tenant: str) -> float:
        """Cost units per minute the schedule offers for ``tenant``, priced with the policy's
        cost weights at the requested max_tokens (what admission charges up front)."""
        cost = self.policy.spec.cost
        total = sum(
            cost.of(r.prompt_tokens, r.max_tokens) for r in self.schedule if r.tenant == tenant
        )
        return total * 60.0 / self.config.duration

    def tenant_budget_per_minute(self) -> float | None:
        """The smallest per-tenant ``tokensPerMinute`` of the policy, if any."""
        rates = [
            rl.tokens_per_minute
            for rl in self.policy.spec.rate_limits
            if rl.per is LimitScope.TENANT and rl.tokens_per_minute is not None
        ]
        return min(rates) if rates else None


def _secs(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"


COLUMNS = (
    "tenant",
    "run",
    "requests",
    "completed",
    "preemptions",
    "TTFT p50",
    "TTFT p99",
    "tokens",
    "429s",
    "degraded",
    "queued",
    "failed",
)


def report_rows(report: DemoReport) -> list[list[str]]:
    """The table's rows (strings), two per tenant (without / with kvgate) plus the totals."""
    rows = []
    d_sum, k_sum = report.direct.summaries(), report.kvgate.summaries()
    for tenant in (*TENANTS, "*"):
        for label, run, sums in (
            ("without", report.direct, d_sum),
            ("kvgate", report.kvgate, k_sum),
        ):
            s = sums[tenant]
            pre = run.preemptions_total if tenant == "*" else run.preemptions.get(tenant, 0)
            rows.append(
                [
                    "all" if tenant == "*" else tenant,
                    label,
                    str(s.requests),
                    str(s.completed),
                    str(pre),
                    _secs(s.ttft_p50),
                    _secs(s.ttft_p99),
                    str(s.completion_tokens),
                    str(s.rejected_429),
                    str(s.degraded),
                    str(s.queued),
                    str(s.failed + s.rejected_other),
                ]
            )
    return rows


def format_table(rows: Sequence[Sequence[str]], header: Sequence[str] = COLUMNS) -> str:
    """A plain-text table: first two columns left-aligned, the rest right-aligned; a blank line
    between tenants."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    out = [row(header, widths), "  ".join("-" * w for w in widths)]
    prev = None
    for r in rows:
        if prev is not None and r[0] != prev:
            out.append("")
        out.append(row(r, widths))
        prev = r[0]
    return "\n".join(out)


def _ratio(before: float, after: float) -> str:
    if after <= 0:
        return "all"
    return f"{before / after:.0f}x"


def takeaway(report: DemoReport) -> list[str]:
    """Two or three plain-English sentences computed from the numbers (nothing hard-coded)."""
    d, k = report.direct, report.kvgate
    ds, ks = d.summaries(), k.summaries()
    lines = []
    pd, pk = d.preemptions_total, k.preemptions_total
    if pd > pk:
        cut = "none" if pk == 0 else f"{pk} ({_ratio(pd, pk)} fewer)"
        lines.append(
            f"Without kvgate the engine preempted {pd} times as its KV pool overflowed; "
            f"with kvgate reserving each request's KV at admission: {cut}."
        )
    elif pd == pk == 0:
        lines.append(
            "The load never overflowed the KV pool (no preemptions either way): "
            "raise --duration or the load to see kvgate's effect."
        )
    else:
        lines.append(f"Preemptions went from {pd} without kvgate to {pk} with it.")
    c_d, c_k = ds["chat"], ks["chat"]
    if c_d.ttft_p99 is not None and c_k.ttft_p99 is not None:
        if c_k.ttft_p99 < c_d.ttft_p99:
            lines.append(
                f"The chat tenant's p99 time to first token fell from {_secs(c_d.ttft_p99)} "
                f"to {_secs(c_k.ttft_p99)} (p50 {_secs(c_d.ttft_p50)} -> "
                f"{_secs(c_k.ttft_p50)}): the heavy tenants can no longer crowd it out."
            )
        else:
            lines.append(
                f"The chat tenant's p99 time to first token went from {_secs(c_d.ttft_p99)} "
                f"to {_secs(c_k.ttft_p99)}: admission did not protect it in this run."
            )
    lo = ks["long-output"]
    if lo.requests:
        rejected = lo.rejected_429 + lo.rejected_other
        offered = report.offered_per_minute("long-output")
        budget = report.tenant_budget_per_minute()
        load = (
            f"offering {offered / 1000:.0f}k tokens/min against a {budget / 1000:.0f}k budget"
            if budget is not None
            else f"offering {offered / 1000:.0f}k tokens/min"
        )
        tok_d, tok_k = ds["*"].completion_tokens, ks["*"].completion_tokens
        price = (
            f"the price: {100 * (tok_d - tok_k) / tok_d:.0f}% fewer tokens delivered in total"
            if tok_d > tok_k
            else f"{tok_k} tokens delivered in total vs {tok_d} without"
        )
        no_retry_after = sum(
            1
            for r in k.results
            if r.tenant == "long-output" and r.status == 429 and r.retry_after is None
        )
        how = (
            "with Retry-After" if no_retry_after == 0 else f"({no_retry_after} without Retry-After)"
        )
        lines.append(
            f"long-output ({load}): {lo.degraded} of {lo.requests} requests degraded "
            f"(max_tokens clamped), {lo.queued} queued, {rejected} rejected {how}; {price}."
        )
    return lines


def format_report(report: DemoReport) -> str:
    """The whole printed report: set-up, the table, wall times and the takeaway."""
    cfg = report.config
    d, k = report.direct, report.kvgate
    head = (
        f"kvgate demo: {len(report.schedule)} requests from {len(TENANTS)} tenants over "
        f"{cfg.duration:g} s (bursts of {cfg.burst_length:g} s every {cfg.burst_period:g} s, "
        f"seed {cfg.seed}),\n"
        f"sent to kvgate-sim ({MODEL}, KV pool {cfg.kv_capacity_tokens} tokens, "
        f"{cfg.decode_ms:g} ms per decode step), without and with the kvgate sidecar "
        f"({cfg.policy_path.name})."
    )
    tps_d = d.summaries()["*"].completion_tokens / max(d.wall, 1e-9)
    tps_k = k.summaries()["*"].completion_tokens / max(k.wall, 1e-9)
    tail = (
        f"Run time: {d.wall:.1f} s without kvgate, {k.wall:.1f} s with; "
        f"tokens delivered per second: {tps_d:.0f} without, {tps_k:.0f} with."
    )
    return "\n\n".join([head, format_table(report_rows(report)), tail, "\n".join(takeaway(report))])
