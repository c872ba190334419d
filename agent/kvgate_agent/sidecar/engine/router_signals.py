"""Signals for the routers in front of several replicas: the two gauges the main port's
``/metrics`` appends to the engine's own exposition (read by llm-d's endpoint picker through an
``engineConfigs`` entry, docs/routers.md), computed here from the admission state and the
engine's figures.

- ``kvgate_queue_depth`` (requests): the requests at this replica not yet running, each
  counted once: those in kvgate's admission queue (which never reached the engine) plus the
  engine's own waiting count as this scrape reads it (``vllm:num_requests_waiting`` and its
  kin, which holds kvgate's admitted requests the engine has not started and any sent around
  kvgate). It is never below the engine's own figure, which the endpoint picker reads by
  default. When this scrape cannot read the engine: kvgate's queue plus the engine's waiting
  requests not kvgate's, ``waiting - (in_flight - running)``, as the usage poll last read
  them (``SloState.engine_waiting``, the expected wait's figure: fresh for
  ``ENGINE_KV_TTL_S``, else 0), a lower bound.
- ``kvgate_kv_reserved_fraction`` (0..1): the KV cache reserved by the requests kvgate admitted,
  over the KV capacity it enforces, clamped to 1 (a capacity lowered below what is reserved);
  with no capacity known, the engine's own usage fraction as this scrape reports it, else 0.
  Never NaN, never absent: the endpoint picker treats a missing metric as an error and keeps
  its last value.

Pure: no I/O; the handler serving them is :mod:`kvgate_agent.sidecar.engine.router_metrics`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate_agent.admission.stats import AdmissionStats
from kvgate_agent.engines.scrape import CORE_METRICS, EngineSample

QUEUE_DEPTH = "kvgate_queue_depth"
KV_RESERVED_FRACTION = "kvgate_kv_reserved_fraction"
#: The router gauges' names: an engine exposition's own lines of these families (a kvgate
#: sidecar in front of another) are dropped, so each family appears once.
ROUTER_GAUGES = frozenset((QUEUE_DEPTH, KV_RESERVED_FRACTION))

QUEUE_DEPTH_HELP = (
    "Requests at this replica not yet running, each counted once: kvgate's admission queue "
    "plus the engine's own waiting requests"
)
KV_RESERVED_FRACTION_HELP = (
    "KV cache reserved by the requests kvgate admitted, as a fraction (0..1) of the KV capacity "
    "it enforces; without a known capacity, the engine's own KV usage fraction (0 when it "
    "reports none)"
)
#: The content type of the text exposition, when the engine's answer gives none.
TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"
_EOF = "# EOF"


@dataclass(frozen=True, slots=True)
class RouterGauges:
    """The two router gauges' values: ``queue_depth`` (requests) and ``kv_reserved_fraction``
    (0..1)."""

    queue_depth: int
    kv_reserved_fraction: float


def router_gauges(
    stats: AdmissionStats, engine: EngineSample | None, last_engine_waiting: int
) -> RouterGauges:
    """The gauges now.

    Args:
        stats: the admission state now (queue length, KV reserved and capacity).
        engine: the engine's figures read for this answer (None: not read).
        last_engine_waiting: the engine's waiting requests not kvgate's as the usage poll last
            read them (0 once stale), used when ``engine`` gives no waiting count.
    """
    waiting = None if engine is None else engine.waiting
    depth = stats.queue_length + (last_engine_waiting if waiting is None else waiting)
    capacity = stats.kv_capacity_tokens
    if capacity is not None and capacity > 0:
        fraction = min(1.0, max(0.0, stats.kv_reserved_tokens / capacity))
    elif engine is not None and engine.kv_usage is not None:
        fraction = min(1.0, max(0.0, engine.kv_usage))
    else:
        fraction = 0.0
    return RouterGauges(max(0, depth), fraction)


def render(g: RouterGauges) -> str:
    """The gauges as exposition text (HELP, TYPE and one sample each; valid in both the
    Prometheus 0.0.4 text format and OpenMetrics), newline-terminated."""
    return (
        f"# HELP {QUEUE_DEPTH} {QUEUE_DEPTH_HELP}\n"
        f"# TYPE {QUEUE_DEPTH} gauge\n"
        f"{QUEUE_DEPTH} {g.queue_depth}\n"
        f"# HELP {KV_RESERVED_FRACTION} {KV_RESERVED_FRACTION_HELP}\n"
        f"# TYPE {KV_RESERVED_FRACTION} gauge\n"
        f"{KV_RESERVED_FRACTION} {g.kv_reserved_fraction!r}\n"
    )


def _family(line: str) -> str | None:
    """The metric family a line of exposition text belongs to: a sample's name, or the name a
    ``# HELP`` / ``# TYPE`` / ``# UNIT`` line describes; None for other comments and blank
    lines."""
    if line.startswith("#"):
        parts = line.split(None, 3)
        if len(parts) >= 3 and parts[1] in ("HELP", "TYPE", "UNIT"):
            return parts[2]
        return None
    end = len(line)
    for sep in ("{", " ", "\t"):
        i = line.find(sep)
        if 0 <= i < end:
            end = i
    return line[:end] or None


def core_lines(text: str) -> str:
    """Only the lines of ``text`` of the engines' core metrics (running, waiting, usage:
    :data:`~kvgate_agent.engines.scrape.CORE_METRICS`): a vLLM exposition is mostly histograms,
    which need not be parsed to read those three on every scrape."""
    return "\n".join(ln for ln in text.splitlines() if _family(ln) in CORE_METRICS) + "\n"


def with_gauges(engine_text: str, g: RouterGauges, note: str | None = None) -> str:
    """The engine's exposition ``engine_text`` with the router gauges appended: the engine's own
    lines of those two families dropped (no family twice), before OpenMetrics' closing
    ``# EOF`` when there is one; ``note`` (why the engine's metrics are missing) as a comment
    line, which scrapers ignore."""
    lines = engine_text.splitlines()
    if any(name in engine_text for name in ROUTER_GAUGES):
        lines = [ln for ln in lines if _family(ln) not in ROUTER_GAUGES]
    eof = bool(lines) and lines[-1].strip() == _EOF
    if eof:
        lines.pop()
    head = "".join(ln + "\n" for ln in lines)
    if note is not None:
        head += "# kvgate: " + " ".join(note.split()) + "\n"
    return head + render(g) + (_EOF + "\n" if eof else "")
