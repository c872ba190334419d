"""The shared test and benchmark toolkit: the fake clocks, Prometheus reading, polling."""

from __future__ import annotations

import datetime as dt
import os
import platform

import pytest

from kvgate_bench.kit.toolkit import (
    FakeClock,
    FakeUtcClock,
    machine,
    parse_samples,
    poll_until,
    sample_sum,
    sample_value,
    samples_by_labels,
    series,
    wait_until,
)

TEXT = """# HELP kvgate_tokens_total Tokens.
# TYPE kvgate_tokens_total counter
kvgate_tokens_total{kind="completion",tenant="a"} 3.0
kvgate_tokens_total{kind="prompt",tenant="a"} 7.0
kvgate_tokens_total{kind="completion",tenant="b"} 2.0
# HELP kvgate_in_flight_requests In flight.
# TYPE kvgate_in_flight_requests gauge
kvgate_in_flight_requests 0.0
# HELP kvgate_wait_seconds Wait.
# TYPE kvgate_wait_seconds histogram
kvgate_wait_seconds_bucket{le="1.0"} 1.0
kvgate_wait_seconds_bucket{le="+Inf"} 2.0
kvgate_wait_seconds_sum 1.5
kvgate_wait_seconds_count 2.0
"""


def test_fake_clock_moves_only_when_told() -> None:
    clock = FakeClock(10.0)
    assert clock() == clock.monotonic() == clock.time() == 10.0
    clock.advance(2.5)
    clock.sleep(0.5)
    clock.now += 1
    assert clock() == 14.0
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    utc = FakeUtcClock(t0)
    utc.advance(dt.timedelta(days=1))
    assert utc() == t0 + dt.timedelta(days=1)


def test_samples_series_and_lookups() -> None:
    samples = parse_samples(TEXT)
    assert sample_value(samples, "kvgate_tokens_total", tenant="a") == 3.0
    assert sample_value(samples, "kvgate_tokens_total", tenant="c") is None
    assert sample_sum(samples, "kvgate_tokens_total", kind="completion") == 5.0
    assert sample_sum(samples, "nothing") == 0.0
    g = series(samples)
    assert g['kvgate_tokens_total{kind="prompt",tenant="a"}'] == 7.0
    assert g["kvgate_in_flight_requests"] == 0.0
    assert g['kvgate_wait_seconds_bucket{le="+Inf"}'] == 2.0
    by = samples_by_labels(samples)
    assert by[("kvgate_tokens_total", (("kind", "completion"), ("tenant", "b")))] == 2.0


def test_parse_samples_keeps_only_the_names_asked_for() -> None:
    got = parse_samples(TEXT, ("kvgate_wait_seconds_sum", "kvgate_in_flight_requests"))
    assert sorted((s.name, s.value) for s in got) == [
        ("kvgate_in_flight_requests", 0.0),
        ("kvgate_wait_seconds_sum", 1.5),
    ]


def test_waits_return_at_once_when_the_condition_holds() -> None:
    assert wait_until(lambda: {"a": 1}, 0.0, "a dict") == {"a": 1}
    assert poll_until(lambda: 3, lambda n: n == 3, 0.0) == 3
    assert poll_until(lambda: 4, lambda n: n == 3, 0.0) == 4  # the last reading, no raise
    with pytest.raises(TimeoutError, match="nothing"):
        wait_until(lambda: None, 0.0, "nothing", interval=0.0)


def test_machine_names_cpu_memory_kernel_and_python() -> None:
    rows = dict(machine())
    assert set(rows) == {"CPU", "memory", "kernel", "Python"}
    assert rows["CPU"].endswith(f"{os.cpu_count()} vCPUs")
    assert rows["memory"].endswith(" GiB") and int(rows["memory"].split()[0]) >= 0
    assert rows["Python"] == platform.python_version()
