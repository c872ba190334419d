"""The engine room's own metrics, on the sidecar's one registry (issue 35: each room owns its
metrics): at scrape time ``kvgate_engine_capacity_unknown`` and, with ``--tokenizer engine``,
``kvgate_engine_prompt_counts_total{source}``."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from kvgate_agent.sidecar.upstream import Flag, FlagGauge


class _PromptCountCollector(Collector):
    """``kvgate_engine_prompt_counts_total{source}`` from ``--tokenizer engine``'s tallies."""

    def __init__(self, answered: Mapping[str, int]) -> None:
        self.answered = answered

    def collect(self) -> Iterator[CounterMetricFamily]:
        c = CounterMetricFamily(
            "kvgate_engine_prompt_counts",
            "Prompts counted with --tokenizer engine, by source: engine (its /tokenize), cache "
            "(its earlier answer), estimate (the engine slow, down or failing), unsupported (a "
            "prompt it cannot count: token ids, list prompts, images)",
            labels=["source"],
        )
        for source, n in self.answered.items():
            c.add_metric([source], n)
        yield c


class EngineMetrics:
    """What the engine room reads of the model server, exported on ``registry``:
    :attr:`capacity_unknown` set by the engine probe, and the engine tokenizer's tallies once
    :meth:`attach_prompt_counts` is called."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        #: The engine's KV capacity is asked for but unreadable although it answers
        #: (``kvgate_engine_capacity_unknown``); set by the engine probe.
        self.capacity_unknown = Flag(False)
        registry.register(
            FlagGauge(
                "kvgate_engine_capacity_unknown",
                "1 while capacity.fromEngineMetrics is asked but the model server answers "
                "without a KV capacity kvgate can read (an unknown engine); /readyz says why",
                self.capacity_unknown,
            )
        )

    def attach_prompt_counts(self, answered: Mapping[str, int]) -> None:
        """Export ``--tokenizer engine``'s tallies by source (``answered``, read at scrape
        time: :attr:`EngineTokenizer.answered
        <kvgate_agent.sidecar.engine.engine_tokens.EngineTokenizer.answered>`)."""
        self._registry.register(_PromptCountCollector(answered))
