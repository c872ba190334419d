"""``python -m kvgate_bench.bench_latency``: the latency the kvgate sidecar adds to a request.

Three processes on loopback:

* an upstream that answers at once with a fixed small OpenAI response (a minimal aiohttp server
  on uvloop, started as ``python -m kvgate_bench.bench_latency --serve-upstream``), so the
  model server's own time is small and stable;
* the sidecar, the real CLI (``python -m kvgate_agent sidecar``), enforcing a realistic policy:
  one per-tenant limit with generous budgets, a concurrency cap and a KV capacity;
* the client, this process: one persistent keep-alive connection per path over a raw socket
  (the same code and the same bytes for both paths, so the client's own overhead cancels),
  sequential requests, warm-up first, then direct and via-sidecar requests interleaved in
  blocks so that drift (CPU frequency, noisy neighbours) hits both alike.

Reported: p50/p99 of direct and via-sidecar round trips, the added latency as the difference of
the percentiles (a percentile of paired differences would mix unrelated tails), and ratios; for
streaming requests the same for the time to the first content byte (TTFT) and the whole stream.
Targets: added p50 ≤ 0.35 ms, added p99 ≤ 1 ms (non-streaming).

Units: milliseconds in the output; nanoseconds internally.

The modules: ``upstream`` (the canned upstream), ``client`` (the processes and the raw-socket
client) and ``measure`` (the measurement, its report and ``main``).
"""
