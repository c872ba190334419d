"""The added-latency benchmark's client side: the upstream and the sidecar started as child
processes (:func:`processes`, the sidecar enforcing :data:`POLICY_YAML`) and one keep-alive
connection per path over a raw socket (:class:`RawHTTP`, :func:`build_request`), timed in
nanoseconds.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from kvgate_agent.contract.api import API_VERSION
from kvgate_bench.bench_latency.upstream import MODEL, TENANT, json_bytes
from kvgate_bench.kit.processes import Proc, sidecar_argv, start, stop_all
from kvgate_bench.kit.toolkit import free_port


class RawHTTP:
    """A minimal HTTP/1.1 keep-alive client over one socket, for timing.

    It sends pre-built request bytes and reads one response: ``Content-Length`` or chunked
    bodies, nothing else (enough for aiohttp servers). :meth:`roundtrip` returns nanoseconds to
    the first occurrence of ``marker`` in the body (or to the end) and to the end.
    """

    def __init__(self, host: str, port: int) -> None:
        self.sock = socket.create_connection((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray(1 << 16)
        self.view = memoryview(self.buf)

    def close(self) -> None:
        """Close the connection."""
        self.sock.close()

    def roundtrip(self, request: bytes, marker: bytes | None = None) -> tuple[int, int, int]:
        """Send ``request`` and read the whole response.

        Returns:
            (status, ns to the first ``marker`` byte in the body or to the end, ns to the end).
        """
        clock = time.perf_counter_ns
        sock, view = self.sock, self.view
        t0 = clock()
        sock.sendall(request)
        n = 0
        first = 0
        header_end: int | None = None  # offset of the blank line ending the headers
        total: int | None = None  # bytes of the whole response, when Content-Length gives it
        chunked = False
        while True:
            got = sock.recv_into(view[n:])
            if got == 0:
                raise ConnectionError("server closed the connection")
            n += got
            data = self.buf[:n]
            if header_end is None:
                found = data.find(b"\r\n\r\n")
                if found < 0:
                    continue
                header_end = found
                head = bytes(data[:header_end]).lower()
                chunked = b"transfer-encoding: chunked" in head
                if not chunked:
                    i = head.find(b"content-length:")
                    if i < 0:
                        raise ValueError("response without Content-Length or chunked encoding")
                    end = head.find(b"\r\n", i)
                    length = int(head[i + 15 : end if end >= 0 else len(head)])
                    total = header_end + 4 + length
            if marker is not None and not first and data.find(marker, header_end) >= 0:
                first = clock()
            if (total is not None and n >= total) or (chunked and data.endswith(b"\r\n0\r\n\r\n")):
                end_ns = clock()
                break
            if n == len(self.buf):
                raise ValueError("response larger than the client buffer")
        status = int(bytes(self.buf[9:12]))
        return status, (first or end_ns) - t0, end_ns - t0


def build_request(port: int, stream: bool, path: str = "/v1/chat/completions") -> bytes:
    """The request bytes sent on every path: a small chat completion (~200 B body)."""
    body: dict[str, object] = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Say hello in one short sentence, please."},
        ],
        "max_tokens": 16,
    }
    if stream:
        body["stream"] = True
    raw = json_bytes(body)
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nx-kvgate-tenant: {TENANT}\r\n"
        f"Content-Length: {len(raw)}\r\n\r\n"
    ).encode() + raw


POLICY_YAML = (
    f"apiVersion: {API_VERSION}\n"
    + """\
kind: RateLimitPolicy
metadata:
  name: bench-latency
spec:
  model: {numLayers: 32, numKVHeads: 8, headDim: 128, kvCacheDtype: bf16, blockSize: 16,
          maxModelLen: 8192}
  capacity: {kvCacheTokens: 262144}
  concurrency: {maxRequests: 64}
  tenants: {header: x-kvgate-tenant, defaultMaxTokens: 512, maxTokensCap: 2048}
  rateLimits:
    - {name: per-tenant, per: Tenant, requestsPerMinute: 10000000, tokensPerMinute: 10000000000}
  cost: {perRequest: 16, promptTokenWeight: 1, outputTokenWeight: 1}
  queue: {maxLength: 64, maxWaitSeconds: 10, order: FIFO}
  overload: {actions: [Queue, Reject]}
"""
)


@contextlib.contextmanager
def processes(workdir: Path, profile: Path | None = None) -> Iterator[tuple[int, int]]:
    """Start the upstream and the sidecar as child processes; yields (upstream, sidecar) ports
    and stops both (SIGTERM, then SIGKILL) on exit. With ``profile``, the sidecar runs under
    cProfile and writes its stats there when it exits."""
    up_port, sc_port = free_port(), free_port()
    policy = workdir / "policy.yaml"
    policy.write_text(POLICY_YAML)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs: list[Proc] = []
    try:
        procs.append(
            start(
                [sys.executable, "-m", "kvgate_bench.bench_latency", "--serve-upstream",
                 "--port", str(up_port)],
                workdir / "upstream.log", env=env, port=up_port, timeout=20.0,
            )
        )  # fmt: skip
        sidecar = sidecar_argv(
            "--log-level", "WARNING", "--passthrough-path", "/bench/chat",
            upstream=f"http://127.0.0.1:{up_port}", policy=policy, port=sc_port, profile=profile,
        )  # fmt: skip
        procs.append(start(sidecar, workdir / "sidecar.log", env=env, port=sc_port, timeout=20.0))
        yield up_port, sc_port
    finally:
        stop_all(p.popen for p in procs)
