"""Smoke runs of the hot-path benchmarks (tiny iteration counts; the figures are not judged):
``bench_hotpath`` times every operation it lists and its operations do what they claim, and
``bench_decision --no-mypyc`` reports ``submit`` from the pure-Python core."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvgate_agent.sidecar.reading.sse import StreamAccountant
from kvgate_bench import bench_decision, bench_hotpath


def test_bench_hotpath_times_every_operation(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    assert bench_hotpath.main(["--iterations", "20", "--rounds", "2", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert [f["name"] for f in figures] == [op.name for op in bench_hotpath.operations()]
    assert all(f["median_us"] > 0 and f["calls"] == 40 for f in figures)


def test_bench_hotpath_bodies_and_chunks_are_what_they_claim() -> None:
    b = bench_hotpath.bodies()
    assert 900 <= len(b["1k"]) <= 1100 and 15_000 <= len(b["16k"]) <= 17_000
    assert b" " in b["1k-spaced"] and json.loads(b["1k-spaced"]) == json.loads(b["1k"])
    sent = bench_hotpath.upstream_op(b["1k-noopts"])()
    assert isinstance(sent, bytes) and json.loads(sent)["stream_options"] == {"include_usage": True}
    acct = StreamAccountant(True)
    assert acct.feed(bench_hotpath.VLLM_CHUNK) == bench_hotpath.VLLM_CHUNK
    assert acct.openai.content_deltas == 1


def test_bench_decision_reports_pure_submit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "submit.json"
    argv = ["--no-mypyc", "--no-profile", "--iterations", "300", "--warmup", "30"]
    assert bench_decision.main([*argv, "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["compiled"] is False and got["submit_net_p50_us"] > 0
    assert "Admission decision (submit, pure Python)" in capsys.readouterr().out
