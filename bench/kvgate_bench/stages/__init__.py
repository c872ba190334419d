"""``python -m kvgate_bench.stages``: where the sidecar's added latency goes at c=1 (issue 37),
per stage, on one request at a time.

One process serves the sidecar of this checkout (its Python sources, the own server leg, the
``peers`` policy, :class:`~kvgate_agent.sidecar.server.SidecarServer` as the CLI serves it, the
collector's thresholds as the CLI sets them) on an event loop of its own; a fast loopback
upstream and the client are processes of their own (:mod:`kvgate_bench.stages.ends`). The client
sends, one at a time, a 1 KB chat POST through the sidecar, the same straight to the upstream,
and both streamed, ``--requests`` rounds after ``--warmup``.

The sidecar's per-request steps are wrapped at run time (:mod:`kvgate_bench.stages.probe`: no
agent code changes) and stamped with ``time.perf_counter_ns``; the stamps are cut into stages
(:mod:`kvgate_bench.stages.timeline`), matched with the client's own stamps (same clock, another
process) and reported as median and p90 µs per stage, with the unattributed remainder, the
loop iterations, tasks and blocking waits per request, and the client-observed total against
the direct one measured in the same pass. Three passes: ``plain`` (uvloop, no probe: the
client's figures as shipped, so the probe's own cost shows), ``uvloop`` (the stages) and
``asyncio`` (the stages on asyncio's loop, whose iterations can be counted).

``--json FILE`` writes every figure, and each raw key's median (what the remainder is made of).
``--compiled`` serves the sidecar from the mypyc build instead (:mod:`kvgate_bench.compiled`:
its extension modules beside this checkout's sources, first on the sidecar process's
``sys.path``, as the agent image has them; ``--build DIR`` names a build), where the probe
stamps only the calls Python's attribute lookup makes and the compiled code's edges
(:meth:`~kvgate_bench.stages.probe.Probe.boundary`).
"""
