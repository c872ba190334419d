"""The harness logic of ``python -m kvgate_bench.peers`` without apt, nginx, wrk or LiteLLM:
wrk's report parsing, the chat bodies, the SSE chunk counter, the server configurations, the
report's ratios and the docs section it replaces."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import pytest
import yaml

from kvgate_agent.contract.policy import parse_policy
from kvgate_bench.kit.doc_block import BrokenMarkers, ForeignText, check_block, find_block
from kvgate_bench.peers import bench as peers
from kvgate_bench.peers import report as rep
from kvgate_bench.peers.load import (
    EventCounter,
    IdleResult,
    StreamResult,
    StreamRow,
    WrkError,
    WrkResult,
    chat_body,
    lua_script,
    parse_time_us,
    parse_wrk,
    read_response,
    run_wrk,
    wrk_command,
)
from kvgate_bench.peers.servers import (
    POLICY_YAML,
    RESPONSE_JSON,
    litellm_config,
    nginx_direct_conf,
    nginx_proxy_conf,
)

# wrk 4.1.0's report, as printed with --latency and a Lua script setting the body.
WRK_OUTPUT = """\
Running 10s test @ http://127.0.0.1:41234/v1/chat/completions
  1 threads and 32 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     9.44ms    2.12ms  41.27ms   87.50%
    Req/Sec     3.40k   211.53     3.71k    81.00%
  Latency Distribution
     50%    9.10ms
     75%   10.02ms
     90%   11.31ms
     99%   17.80ms
  33862 requests in 10.01s, 17.28MB read
  Socket errors: connect 0, read 2, write 0, timeout 1
  Non-2xx or 3xx responses: 5
Requests/sec:   3383.28
Transfer/sec:      1.73MB
"""


def test_parse_wrk_reads_percentiles_rps_and_errors() -> None:
    r = parse_wrk(WRK_OUTPUT)
    assert r == WrkResult(
        p50_us=9100.0, p99_us=17800.0, rps=3383.28, requests=33862, non2xx=5, socket_errors=3
    )
    assert r.errors == 8


def test_parse_wrk_without_errors_and_in_microseconds() -> None:
    text = WRK_OUTPUT.replace("  Socket errors: connect 0, read 2, write 0, timeout 1\n", "")
    text = text.replace("  Non-2xx or 3xx responses: 5\n", "").replace("9.10ms", "85.00us")
    r = parse_wrk(text)
    assert (r.p50_us, r.errors) == (85.0, 0)


def test_parse_wrk_refuses_a_failed_run() -> None:
    with pytest.raises(WrkError, match="latency distribution"):
        parse_wrk("unable to connect to 127.0.0.1:1 Connection refused\n")


@pytest.mark.parametrize(
    ("text", "us"), [("85.00us", 85.0), ("1.23ms", 1230.0), ("2.00s", 2e6), ("1.50m", 90e6)]
)
def test_parse_time_us(text: str, us: float) -> None:
    assert parse_time_us(text) == pytest.approx(us)


def test_parse_time_refuses_other_units() -> None:
    with pytest.raises(WrkError):
        parse_time_us("3 parsecs")


@pytest.mark.parametrize("size", [1024, 16384, 204800])
def test_chat_body_has_the_size_and_is_a_chat_request(size: int) -> None:
    body = chat_body(size)
    assert abs(len(body) - size) <= 2
    doc = json.loads(body)
    assert doc["messages"][-1]["role"] == "user" and doc["max_tokens"] == 16
    assert "stream" not in doc and json.loads(chat_body(size, stream=True))["stream"] is True


def test_lua_script_and_wrk_command_pin_and_post() -> None:
    script = lua_script(Path("/w/b.json"))
    assert 'wrk.method = "POST"' in script and "x-kvgate-tenant" in script
    assert 'io.open("/w/b.json", "rb")' in script
    cmd = wrk_command("wrk", "http://h/", Path("/w/s.lua"), connections=32, seconds=3, cpu=0)
    assert cmd[:3] == ["taskset", "-c", "0"] and "-c32" in cmd and "--latency" in cmd


def test_event_counter_counts_data_events_across_any_split() -> None:
    stream = (
        b"".join(b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n' for _ in range(5))
        + b"data: [DONE]\n\n"
    )
    for step in (1, 2, 3, 5, 7, 64):
        c = EventCounter()
        for i in range(0, len(stream), step):
            c.feed(stream[i : i + step])
        assert c.count == 5, step


def test_read_response_decodes_chunked_and_content_length() -> None:
    async def go() -> tuple[int, bytes, int, bytes]:
        reader = asyncio.StreamReader()
        reader.feed_data(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5\r\ndata:\r\n3;x=1\r\n ab\r\n0\r\n\r\n"
            b"HTTP/1.1 429 Too Many\r\nContent-Length: 4\r\n\r\nnope"
        )
        got1: list[bytes] = []
        got2: list[bytes] = []
        s1 = await read_response(reader, got1.append)
        s2 = await read_response(reader, got2.append)
        return s1, b"".join(got1), s2, b"".join(got2)

    assert asyncio.run(go()) == (200, b"data: ab", 429, b"nope")


def test_server_configs() -> None:
    direct = nginx_direct_conf(Path("/w"), 8001)
    assert "return 200 '" + RESPONSE_JSON + "'" in direct and "listen 127.0.0.1:8001" in direct
    json.loads(RESPONSE_JSON)
    proxy = nginx_proxy_conf(Path("/w"), {8002: 8001, 8003: 9000})
    assert proxy.count("proxy_buffering off;") == 2 and "keepalive 512" in proxy
    assert "server 127.0.0.1:9000" in proxy and 'proxy_set_header Connection ""' in proxy
    lite = yaml.safe_load(litellm_config(8001))
    assert lite["model_list"][0]["litellm_params"]["api_base"] == "http://127.0.0.1:8001/v1"
    assert "general_settings" not in lite  # no master_key, no database_url


def test_the_sidecar_policy_is_valid_and_admits_a_200_kb_prompt() -> None:
    policy = parse_policy(yaml.safe_load(POLICY_YAML))
    spec = policy.spec
    assert spec.model.max_model_len is not None and spec.model.max_model_len >= 65536
    assert spec.capacity.kv_cache_tokens is not None and spec.rate_limits


def _cell(arm: str, p50: float, rps: float, body: int = 1024, c: int = 1) -> rep.Cell:
    return rep.Cell(arm, body, c, WrkResult(p50, p50 * 2, rps, int(rps * 10), 0, 0))


def test_report_added_latency_and_ratios() -> None:
    cells = [
        _cell(rep.DIRECT, 85, 141000),
        _cell(rep.NGINX, 100, 56600),
        _cell(rep.LITELLM, 13640, 92),
        _cell(rep.KVGATE, 577, 3393),
    ]
    rows = rep.load_rows(cells)
    assert [r[2] for r in rows] == [rep.DIRECT, rep.NGINX, rep.LITELLM, rep.KVGATE]
    assert rows[0][4] == "-" and rows[1][4] == "+15 us" and rows[3][4] == "+492 us"
    assert rows[2][4] == "+13.55 ms"
    (ratio,) = rep.ratio_rows(cells)
    assert ratio == ["1 KB", "1", "0.060", "32.8x", "36.9x", "23.6x"]


def test_render_and_section_replacement() -> None:
    report = rep.Report(
        header=[("date", "2026-12-01 17:00 UTC")],
        cells=[_cell(rep.DIRECT, 85, 141000), _cell(rep.KVGATE, 577, 3393)],
        streams=[StreamRow("kvgate", 10, StreamResult(256, 10.0, 220000, 6.5, 90000, 0))],
        idle=IdleResult(1000, 50000, 70480),
        notes=["a note"],
    )
    md = rep.render(report, markdown=True)
    assert "| 1 KB | 1 | kvgate | 577 us | +492 us |" in md
    assert "29.5 us" in md and "20.00 MiB per 1,000" in md
    assert "kvgate" in rep.render(report, markdown=False)
    doc = "# Benchmarks\n\nintro\n"
    once = rep.replace_section(doc, md, title="## Peers")
    assert once.startswith(doc.rstrip("\n")) and once.count(rep.MARKERS.begin_prefix) == 1
    twice = rep.replace_section(once + "\n## Later section\n", "new body", title="## Peers")
    assert "new body" in twice and "577 us" not in twice and twice.endswith("## Later section\n")
    with pytest.raises(BrokenMarkers, match="no end marker"):
        rep.replace_section(doc + rep.MARKERS.begin("0" * 16) + "\n", "x", title="t")
    # another session's section written inside the block survives: the run refuses
    foreign = twice.replace("new body", "new body\n\n## Another section\n\nits figures")
    with pytest.raises(ForeignText, match="--force"):
        rep.replace_section(foreign, "newer body", title="## Peers")
    assert "its figures" not in rep.replace_section(foreign, "x", title="## Peers", force=True)


def test_the_docs_peers_block_is_the_last_runs_own() -> None:
    """Text written inside the section of ``docs/benchmarks.md`` that ``peers`` rewrites would be
    erased by its next run (issue 33): the block as it stands must hash to its marker."""
    doc = peers.DOCS.read_text(encoding="utf-8")
    found = find_block(doc, rep.MARKERS, name=str(peers.DOCS))
    assert found is not None and found.recorded is not None
    assert found.content.lstrip().startswith(peers.TITLE + "\n")
    check_block(doc, rep.MARKERS, name=str(peers.DOCS))


def test_main_refuses_before_measuring_and_leaves_the_docs_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    measured: list[bool] = []

    def fake_run(args: object) -> rep.Report:
        measured.append(True)
        return rep.Report([("date", "today")], [], [], None, ["a note"])

    monkeypatch.setattr(peers, "run", fake_run)
    monkeypatch.setattr(signal, "signal", lambda *a: None)
    docs = tmp_path / "benchmarks.md"
    docs.write_text(rep.replace_section("# B\n", "old run", title=peers.TITLE) + "## After\n")
    edited = docs.read_text().replace("old run", "old run\n\n## Mine\n\nmy figures")
    docs.write_text(edited)
    assert peers.main(["--docs", str(docs)]) == 1
    assert not measured and docs.read_text() == edited
    err = capsys.readouterr().err
    assert str(docs) in err and "outside the markers" in err and "nothing measured" in err
    assert peers.main(["--docs", str(docs), "--no-write"]) == 0 and docs.read_text() == edited
    assert peers.main(["--docs", str(docs), "--force"]) == 0
    new = docs.read_text()
    assert "my figures" not in new and "a note" in new and new.endswith("## After\n")
    assert peers.main(["--docs", str(docs)]) == 0  # its own block now


def test_a_cell_without_answers_has_no_percentiles_or_ratios() -> None:
    stuck = rep.Cell(rep.LITELLM, 1024, 32, WrkResult(0, 0, 0, 0, 0, 0))
    cells = [_cell(rep.DIRECT, 85, 141000, c=32), stuck, _cell(rep.KVGATE, 577, 3393, c=32)]
    rows = rep.load_rows(cells)
    assert rows[1][2:5] == [rep.LITELLM, "-", "-"] and rows[1][-1] == "0 (no answer)"
    assert rep.ratio_rows(cells)[0][4:] == ["-", "-"]


def test_run_wrk_parses_and_keeps_the_raw_report(tmp_path: Path) -> None:
    report = tmp_path / "report.txt"
    report.write_text(WRK_OUTPUT)
    raw = tmp_path / "raw.txt"
    assert run_wrk(["cat", str(report)], timeout=30, save=raw).rps == 3383.28
    assert raw.read_text().startswith("cat ") and "Requests/sec" in raw.read_text()
    with pytest.raises(WrkError, match="exited 1"):
        run_wrk(["cat", str(tmp_path / "missing")], timeout=30)


def test_the_targets_table_gives_the_own_legs_ratio_and_a_verdict() -> None:
    cells = [
        _cell(rep.DIRECT, 100, 9000, c=1),
        _cell(rep.KVGATE, 240, 2400, c=1),  # 2.4x direct's p50: met (<= 2.5)
        _cell(rep.NGINX, 1000, 20000, c=32),
        _cell(rep.KVGATE, 5000, 3000, c=32),  # 0.15x nginx's rps: missed (>= 0.2)
    ]
    streams = [
        StreamRow(rep.KVGATE, 10, StreamResult(256, 10.0, 100000, 2.8, 80000, 0)),
        StreamRow(rep.NGINX, 10, StreamResult(256, 10.0, 100000, 2.0, 10000, 0)),
    ]
    rows = rep.target_rows(cells, streams, IdleResult(1000, 50000, 55000))
    assert [r[0] for r in rows] == [t[0] for t in rep.TARGETS]
    assert len(rep.TARGET_HEAD) == 3 and "aiohttp" not in " ".join(rep.ARMS)
    assert rows[0][2:] == ["2.40x (met)"]
    assert rows[1][2:] == ["0.150 (missed)"]
    assert rows[2][2:] == ["1.40x (met)"]  # 28 us / 20 us per chunk
    assert rows[3][2:] == ["-"]  # no 16 KB cell at c=256 in this run
    assert rows[4][2:] == ["5.0 KiB (met)"]
