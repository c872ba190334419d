"""``python -m kvgate_bench.trace_request``: one streamed chat completion through an in-process
sidecar, traced; the files it enters are the ones along the request's path (docs/architecture.md
records the count)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvgate_bench.trace_request import main, trace


async def test_one_streamed_completion_is_traced_along_its_path() -> None:
    t = await trace(warmup=1)
    assert t.status == 200
    files = set(t.files)
    # The request's path: the edge, who it is, its reading, the pipeline, admission, upstream.
    for f in (
        "sidecar/pipeline.py",
        "sidecar/identity/identity.py",
        "sidecar/reading/request.py",
        "sidecar/upstream/forward.py",
        "admission/async_admission.py",
    ):
        assert f in files, sorted(files)
    assert "sidecar/pipeline.py:RequestPipeline._completion" in t.calls
    assert not any(f.startswith("node/") for f in files)  # the other role is never entered
    rooms = t.rooms()
    assert {"sidecar", "sidecar/edge", "sidecar/identity", "admission"} <= set(rooms)
    assert sum(len(v) for v in rooms.values()) == len(files)
    assert t.switches >= len(files) - 1


def test_the_cli_writes_its_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "trace.json"
    assert main(["--warmup", "1", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["status"] == 200 and got["files"] == sum(len(v) for v in got["rooms"].values())
    assert f"entered {got['files']} kvgate_agent files" in capsys.readouterr().out
