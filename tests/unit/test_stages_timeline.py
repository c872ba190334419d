"""The stage arithmetic of ``python -m kvgate_bench.stages`` (``kvgate_bench.stages.timeline``):
marks into intervals, requests, stages and the unattributed remainder, on hand-made marks (no
clock), and the probe's wrappers' marks."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvgate_bench.stages import timeline
from kvgate_bench.stages.probe import Probe
from kvgate_bench.stages.timeline import Mark

#: One non-streamed request as the probe records it (ns): the read, the task's first step,
#: the pipeline with the estimate, the upstream write and its wait (the upstream's answer read
#: inside it), the answer written, then the bookkeeping after the answer.
ONE: list[Mark] = [
    (100, 1, "conn.read"),
    (110, 1, "conn.task"),
    (115, -1, "conn.task"),
    (120, -1, "conn.read"),
    (150, 1, "serve"),  # 30 ns: the loop turn to the task's first step
    (155, 1, "pipeline"),
    (160, 1, "estimate"),
    (170, -1, "estimate"),
    (175, 1, "up.write"),
    (180, 1, "wait"),
    (280, 1, "up.read"),  # 100 ns idle: the upstream's turn
    (290, -1, "up.read"),
    (297, -1, "wait"),  # 7 ns: the task resumed
    (300, -1, "up.write"),
    (310, -1, "pipeline"),
    (320, 1, "client.send"),
    (330, -1, "client.send"),
    (340, 1, "conn.next"),
    (345, -1, "conn.next"),
    (350, -1, "serve"),
]


def shifted(marks: list[Mark], by: int) -> list[Mark]:
    return [(t + by, sign, label) for t, sign, label in marks]


def test_each_interval_goes_to_the_innermost_call_or_a_named_gap() -> None:
    keys: dict[str, int] = {}
    for lo, hi, key in timeline.attribute(ONE):
        keys[key] = keys.get(key, 0) + hi - lo
    assert keys["conn.read"] == 10 + 5  # its own time, the task creation's left out
    assert keys["conn.task"] == 5
    assert keys["gap conn.read- > serve+"] == 30
    assert keys["estimate"] == 10
    assert keys["pipeline"] == 5 + 5 + 10  # before, between and after its children
    assert keys["up.write"] == 5 + 3
    assert keys["wait[up.write]:idle"] == 100
    assert keys["up.read"] == 10
    assert keys["wait[up.write]:wake"] == 7
    assert sum(keys.values()) == ONE[-1][0] - ONE[0][0]


def test_a_wait_between_two_inner_calls_is_mid() -> None:
    marks: list[Mark] = [
        (0, 1, "relay.body"),
        (1, 1, "wait"),
        (5, 1, "up.read"),
        (6, -1, "up.read"),
        (9, 1, "up.read"),
        (10, -1, "up.read"),
        (12, -1, "wait"),
        (13, -1, "relay.body"),
    ]
    keys = {key: hi - lo for lo, hi, key in timeline.attribute(marks) if key.startswith("wait")}
    assert keys == {
        "wait[relay.body]:idle": 4,
        "wait[relay.body]:mid": 3,
        "wait[relay.body]:wake": 2,
    }


def test_an_end_without_its_start_is_skipped_and_an_end_closes_what_opened_above() -> None:
    marks: list[Mark] = [(0, -1, "x"), (1, 1, "a"), (2, 1, "b"), (4, -1, "a"), (6, 1, "c")]
    got = timeline.attribute(marks)
    assert got == [(0, 1, "gap x- > a+"), (1, 2, "a"), (2, 4, "b"), (4, 6, "gap a- > c+")]


def test_requests_are_cut_at_the_read_after_the_last_task_ended() -> None:
    idle: list[Mark] = [(50, 1, "conn.next"), (60, -1, "conn.next")]  # before any request
    marks = idle + ONE + shifted(ONE, 1000)
    reqs = timeline.requests(marks)
    assert [(r.start, r.answered, r.end) for r in reqs] == [(100, 330, 350), (1100, 1330, 1350)]
    r = reqs[0]
    assert r.span == 230
    assert r.tail == {"serve": 10 + 5, "conn.next": 5}  # after the answer's write
    assert r.path["client.send"] == 10
    assert r.calls["up.read"] == 1 and sum(r.calls.values()) == 10


def test_a_second_read_while_the_task_runs_stays_in_its_request() -> None:
    more = [*ONE[:6], (200, 1, "conn.read"), (201, -1, "conn.read"), *ONE[6:]]
    more.sort(key=lambda m: m[0])
    reqs = timeline.requests(more)
    assert len(reqs) == 1 and reqs[0].calls["conn.read"] == 2


def test_stages_sum_to_the_span_with_the_remainder_unattributed() -> None:
    r = timeline.requests(ONE)[0]
    values = timeline.stage_values(r)
    assert values["loop turn: task's first step"] == 30
    assert values["wait for upstream first byte"] == 100
    assert values["loop turn: resume after upstream headers"] == 7
    assert values["client write (transport.write)"] == 10
    assert sum(values.values()) == r.span
    assert values["serve glue (route, _answer)"] == 5 + 10
    assert values[timeline.UNATTRIBUTED] == 0  # every key of this request has its stage


def test_a_key_no_stage_names_is_unattributed() -> None:
    marks = [*ONE[:15], (311, 1, "mystery"), (316, -1, "mystery"), *ONE[15:]]
    values = timeline.stage_values(timeline.requests(marks)[0])
    assert values[timeline.UNATTRIBUTED] == 5


def test_counts_and_matching() -> None:
    assert timeline.count_between([1, 2, 2, 5, 9], 2, 5) == 3
    reqs = timeline.requests(ONE + shifted(ONE, 1000))
    sent = [(90, 400), (600, 700), (1095, 1400)]
    assert [(i, r.start) for i, r in timeline.match(reqs, sent)] == [(0, 100), (2, 1100)]
    assert timeline.match(reqs, [(101, 400)]) == []


def test_summary_and_render() -> None:
    rows = timeline.summary({"a": [1.0, 2.0, 3.0, 4.0, 5.0], "none": []})
    assert rows == {"a": (3.0, 4.6)}
    text = timeline.render(
        {"chat": {"a": (3.0, 4.6), "span": (12.0, 20.0)}}, ["a", "span", "b"],
        share_of="span", shared=["a"],
    )  # fmt: skip
    lines = text.splitlines()
    assert lines[0] == "| stage | chat p50 | chat p90 | chat % of p50 span |"
    assert lines[2] == "| a | 3.0 | 4.6 | 25.0 |"
    assert lines[3] == "| span | 12.0 | 20.0 |  |"
    assert lines[4] == "| b |  |  |  |"


def test_the_probe_wrappers_mark_calls_and_coroutines() -> None:
    probe = Probe()

    def add(a: int, b: int) -> int:
        return a + b

    async def twice(x: int) -> int:
        await asyncio.sleep(0)
        return 2 * x

    assert probe._sync(add, "add")(1, 2) == 3
    assert asyncio.run(probe._coro(twice, "twice")(4)) == 8
    assert [(sign, label) for _, sign, label in probe.marks] == [
        (1, "add"),
        (-1, "add"),
        (1, "twice"),
        (-1, "twice"),
    ]
    assert all(a[0] <= b[0] for a, b in zip(probe.marks, probe.marks[1:], strict=False))


def test_a_build_folder_is_refused_without_compiled_or_without_compiled_modules(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--build`` names a compiled build: alone, or naming a folder with no compiled
    ``kvgate_agent`` module, the run exits 2 before starting anything (instead of measuring the
    sources under a "compiled" label)."""
    from kvgate_bench.stages import run

    assert run.main(["--build", str(tmp_path), "--passes", "plain"]) == 2
    assert "use it with --compiled" in capsys.readouterr().err
    assert run.main(["--compiled", "--build", str(tmp_path), "--passes", "plain"]) == 2
    assert "no compiled kvgate_agent modules there" in capsys.readouterr().err
