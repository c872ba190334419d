"""``python -m kvgate_bench.stages``: the run, the analysis, the table (see the package)."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from kvgate_agent.contract.policy import parse_policy
from kvgate_agent.sidecar.app import Sidecar, SidecarSettings
from kvgate_agent.sidecar.cli import GC_THRESHOLDS
from kvgate_agent.sidecar.server import SidecarServer
from kvgate_bench.kit.toolkit import machine
from kvgate_bench.peers.servers import POLICY_YAML
from kvgate_bench.stages import timeline
from kvgate_bench.stages.probe import Probe, wrapper_cost_ns

#: The passes: (name, event loop, probed). ``plain``: the client's figures without the probe
#: (what the probe itself costs is the difference); ``uvloop``: the stages, on the loop the
#: sidecar ships with; ``asyncio``: the same on asyncio's own loop, whose iterations can be
#: counted (uvloop's run in C).
PASSES = {"plain": ("uvloop", False), "uvloop": ("uvloop", True), "asyncio": ("asyncio", True)}
KINDS = ("chat", "stream")
#: Rows of the table besides the stages (µs unless named otherwise).
CLIENT_TOTAL = "client-observed total via the sidecar"
DIRECT_TOTAL = "client-observed total, direct to the upstream"
ADDED = "added (median minus direct's median)"
FIRST = "first byte via the sidecar (stream: first event)"
FIRST_DIRECT = "first byte direct"
CLEAN_TOTAL = "client-observed total, the requests below"
HOP_IN = "client -> sidecar: kernel + loop wake-up"
SPAN = "sidecar span: first byte read -> answer's last write"
HOP_OUT = "sidecar -> client: kernel + wake-up + client read"
TAIL = "after the answer (off the client's path)"
ITERATIONS = "loop iterations on the path (asyncio pass)"
TASKS = "tasks created per request"
BLOCKED = "thread blocked per request cycle (ru_nvcsw)"
CALLS = "wrapped calls per request"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(prog="python -m kvgate_bench.stages", description=__doc__)
    p.add_argument("--requests", type=int, default=3000, help="measured rounds (default 3000)")
    p.add_argument("--warmup", type=int, default=300, help="unmeasured rounds first (300)")
    p.add_argument("--body", type=int, default=1024, help="chat body bytes (default 1024)")
    p.add_argument("--tokens", type=int, default=4, help="token events per stream (default 4)")
    p.add_argument("--itl-ms", type=float, default=1.0, help="ms between stream events (1)")
    p.add_argument("--stream-every", type=int, default=4,
                   help="stream in every n-th round only (default 4)")  # fmt: skip
    p.add_argument("--passes", default="plain,uvloop,asyncio",
                   help="which passes, comma-separated (default: all three)")  # fmt: skip
    p.add_argument("--json", type=Path, help="write the figures here")
    p.add_argument("--compiled", action="store_true",
                   help="serve the sidecar from the mypyc build of scripts/mypyc-modules.txt "
                   "(python -m kvgate_bench.compiled; its extension modules beside this "
                   "checkout's sources, first on the sidecar process's sys.path, as the agent "
                   "image has them) instead of the Python sources")  # fmt: skip
    p.add_argument("--build", type=Path,
                   help="with --compiled: this build folder (a kvgate_bench.compiled cache "
                   "entry) rather than the one for the current sources")  # fmt: skip
    return p.parse_args(argv)


#: Set in the process :func:`main` re-runs on a compiled build (``--compiled``).
ON_BUILD = "KVGATE_STAGES_ON_BUILD"


def on_build(argv: Sequence[str] | None, given: Path | None) -> int:
    """Run this command again in a process whose ``kvgate_agent`` is the compiled build (see
    ``--compiled``; ``given``, or the build made or found by :mod:`kvgate_bench.compiled`); its
    exit code."""
    import tempfile

    from kvgate_bench import compiled

    build = compiled.build() if given is None else given.resolve()
    with tempfile.TemporaryDirectory(prefix="kvgate-stages-") as tmp:
        path = compiled.overlay(build, Path(tmp) / "agent")
        env = {**os.environ, ON_BUILD: str(build), "PYTHONPATH": str(path)}
        args = list(sys.argv[1:] if argv is None else argv)
        cmd = [sys.executable, "-m", "kvgate_bench.stages", *args]
        return subprocess.run(cmd, env=env, check=False).returncode


async def one_pass(upstream: int, args: argparse.Namespace, probe: Probe | None) -> list[Any]:
    """Serve a sidecar (the ``peers`` policy) in front of ``upstream`` on this loop, run the
    client process against both, return its records."""
    if probe is not None:
        probe.watch_loop(asyncio.get_running_loop())
    policy = parse_policy(yaml.safe_load(POLICY_YAML))
    settings = SidecarSettings(
        upstream=f"http://127.0.0.1:{upstream}", policy=policy, engine_usage_seconds=0.0
    )
    server = SidecarServer(Sidecar(settings))
    await server.start(("127.0.0.1", 0), None)
    gc.collect()
    gc.freeze()  # as the CLI does once it serves
    gc.set_threshold(*GC_THRESHOLDS)
    if probe is not None:
        probe.clear()
    cpu = time.thread_time_ns()
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvgate_bench.stages.ends", "client",
            "--sidecar", str(server.port), "--upstream", str(upstream), "--body", str(args.body),
            "--requests", str(args.requests), "--warmup", str(args.warmup),
            "--stream-every", str(args.stream_every),
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, _ = await proc.communicate()
        cpu = time.thread_time_ns() - cpu
        if proc.returncode != 0:
            raise RuntimeError(f"the client exited with {proc.returncode}")
    finally:
        await server.cleanup()
        gc.unfreeze()
    records: list[Any] = json.loads(out)["records"]
    # the sidecar's loop thread's CPU over the whole client run (warm-up included): a figure
    # other processes' load on a shared CPU hardly moves, unlike the latencies
    records.append(["cpu", True, 0, 0, cpu, 0])
    return records


def run_pass(loop: str, upstream: int, args: argparse.Namespace, probe: Probe | None) -> list[Any]:
    """:func:`one_pass` on a fresh ``loop`` (``uvloop`` or ``asyncio``)."""
    factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    if loop == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(one_pass(upstream, args, probe))


def client_rows(records: Sequence[Any]) -> dict[str, dict[str, tuple[float, float]]]:
    """Per kind: the client's totals and first bytes through the sidecar and direct, µs."""
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for kind in KINDS:
        got: dict[str, list[float]] = {CLIENT_TOTAL: [], DIRECT_TOTAL: [], FIRST: [],
                                       FIRST_DIRECT: []}  # fmt: skip
        for name, warm, t_send, t_first, t_done, status in records:
            if warm or status != 200 or name not in (kind, f"{kind}-direct"):
                continue
            direct = name != kind
            got[DIRECT_TOTAL if direct else CLIENT_TOTAL].append((t_done - t_send) / 1e3)
            got[FIRST_DIRECT if direct else FIRST].append((t_first - t_send) / 1e3)
        rows = timeline.summary(got)
        if CLIENT_TOTAL in rows and DIRECT_TOTAL in rows:
            rows[ADDED] = (rows[CLIENT_TOTAL][0] - rows[DIRECT_TOTAL][0], float("nan"))
        out[kind] = rows
    return out


def stage_rows(records: Sequence[Any], probe: Probe) -> dict[str, dict[str, Any]]:
    """Per kind: the stages and counts of the requests the probe saw, matched with the
    client's exchanges (µs; counts per request), over the request cycles in which the
    sidecar's thread was not preempted (all of them when fewer than 50 were not)."""
    reqs = timeline.requests(probe.marks)
    via = sorted((r for r in records if r[0] in KINDS), key=lambda r: r[2])
    pairs = timeline.match(reqs, [(r[2], r[4]) for r in via])
    switches = {t: (vol, invol) for t, vol, invol in probe.blocked}
    cycle: dict[int, tuple[int, int]] = {}  # request start -> (blocked, preempted) to the next
    for a, b in itertools.pairwise(reqs):
        if a.start in switches and b.start in switches:
            (v0, i0), (v1, i1) = switches[a.start], switches[b.start]
            cycle[a.start] = (v1 - v0, i1 - i0)
    out: dict[str, dict[str, Any]] = {}
    for kind in KINDS:
        mine = [(via[i], r) for i, r in pairs if via[i][0] == kind and not via[i][1]]
        clean = [(rec, r) for rec, r in mine if cycle.get(r.start, (0, 1))[1] == 0]
        used = clean if len(clean) >= 50 else mine
        values = _values(used, probe, cycle)
        out[kind] = {
            "requests": len(mine),
            "not_preempted": len(clean),
            "stages_over": "not preempted" if used is clean else "all (too few not preempted)",
            "rows": timeline.summary(values),
            "keys_us": {k: v / 1e3 for k, v in timeline.key_medians([r for _, r in used]).items()},
        }
    return out


def _values(
    used: Sequence[tuple[Any, timeline.Request]], probe: Probe, cycle: dict[int, tuple[int, int]]
) -> dict[str, list[float]]:
    """Each row's values over ``used`` (client record, request) pairs."""
    values: dict[str, list[float]] = {}

    def add(row: str, v: float) -> None:
        values.setdefault(row, []).append(v)

    for rec, req in used:
        for name, ns in timeline.stage_values(req).items():
            add(name, ns / 1e3)
        add(CLEAN_TOTAL, (rec[4] - rec[2]) / 1e3)
        add(HOP_IN, (req.start - rec[2]) / 1e3)
        add(SPAN, req.span / 1e3)
        add(HOP_OUT, (rec[4] - req.answered) / 1e3)
        add(TAIL, sum(req.tail.values()) / 1e3)
        add(TASKS, timeline.count_between(probe.tasks, req.start, req.end))
        add(CALLS, sum(req.calls.values()))
        if probe.iterations:  # the loop turn that read the first bytes, and those after
            add(ITERATIONS, 1 + timeline.count_between(probe.iterations, req.start, req.answered))
        if req.start in cycle:
            add(BLOCKED, cycle[req.start][0])
    return values


def _shown(stage: str, cols: Sequence[dict[str, tuple[float, float]]]) -> bool:
    """A stage row is printed when some column has it (the remainder always is)."""
    return stage == timeline.UNATTRIBUTED or any(abs(c.get(stage, (0, 0))[0]) >= 0.05 for c in cols)


def render(result: dict[str, Any]) -> str:
    """The printed report (Markdown tables)."""
    lines = [f"sidecar: {result.get('build', 'pure Python sources')}", ""]
    if result.get("edges"):
        lines += ["(compiled: only calls made through Python's attribute lookup and the "
                  "transports' writes are stamped; the compiled code between them is in the "
                  "rows of the calls around it: the request head (the parse's callback, up to "
                  "the task's creation), serve glue, pipeline glue (_completion's whole "
                  "compiled path: the pipeline, the forward and the relay, the upstream pool; "
                  "for a stream, its events' waits too) and the reads)", ""]  # fmt: skip
    stage_names = [name for name, _ in timeline.STAGES] + [timeline.UNATTRIBUTED]
    top = [CLIENT_TOTAL, DIRECT_TOTAL, ADDED, FIRST, FIRST_DIRECT]
    for name, p in result["passes"].items():
        cols = {k: p["client"][k] for k in KINDS}
        lines += [f"### pass `{name}` ({p['loop']}, probe {'on' if p['probed'] else 'off'})", ""]
        if p.get("cpu_us_per_round") is not None:
            lines += [f"the sidecar's loop thread's CPU per round (a chat request, and a stream "
                      f"every --stream-every rounds; warm-up included): "
                      f"{p['cpu_us_per_round']:.0f} µs", ""]  # fmt: skip
        rows = list(top)
        if p["probed"]:
            for k in KINDS:
                cols[k] = {**cols[k], **p["stages"][k]["rows"]}
            kept = [s for s in stage_names if _shown(s, [cols[k] for k in KINDS])]
            used = ", ".join(
                f"{k} {p['stages'][k]['not_preempted']} of {p['stages'][k]['requests']}"
                for k in KINDS
            )
            lines += [f"requests whose cycle the sidecar's thread ran unpreempted: {used}", ""]
            rows += [CLEAN_TOTAL, HOP_IN, SPAN, *kept, HOP_OUT, TAIL]
            rows += [ITERATIONS, TASKS, BLOCKED, CALLS]
        shared = [*stage_names, HOP_IN, HOP_OUT, TAIL] if p["probed"] else []
        table = timeline.render(cols, rows, share_of=SPAN if p["probed"] else None, shared=shared)
        lines += [table, ""]
    passes = result["passes"]
    note = f"each wrapped call costs {result['wrapper_cost_us']:.2f} µs hot"
    if "plain" in passes and "uvloop" in passes:
        diff = [passes["uvloop"]["client"][k][CLIENT_TOTAL][0]
                - passes["plain"]["client"][k][CLIENT_TOTAL][0] for k in KINDS]  # fmt: skip
        note += (
            f"; the probe's whole cost (uvloop pass minus plain, client p50): chat "
            f"{diff[0]:.0f} µs, stream {diff[1]:.0f} µs"
        )
    lines.append(note)
    if result["missing"]:
        lines.append("not wrapped (not found): " + ", ".join(result["missing"]))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Start the upstream, run each pass, print the tables, write ``--json``."""
    args = parse_args(argv)
    if args.build is not None and not args.compiled:
        print("--build names a compiled build: use it with --compiled", file=sys.stderr)
        return 2
    if args.build is not None and not any(args.build.glob("kvgate_agent/**/*.so")):
        print(f"--build {args.build}: no compiled kvgate_agent modules there", file=sys.stderr)
        return 2
    if args.compiled and ON_BUILD not in os.environ:
        return on_build(argv, args.build)
    build = "pure Python sources"
    edges = False  # the legs are compiled: stamp their edges (Probe.boundary)
    if args.compiled:
        from kvgate_bench import compiled

        build = f"compiled ({os.environ[ON_BUILD]})"
        if plain := compiled.plain_modules():
            if args.build is None:
                print(f"--compiled, but these import as sources: {plain}", file=sys.stderr)
                return 2
            # an older build (--build), made from a shorter list: those modules interpreted
            build += f"; interpreted, not in that build: {', '.join(plain)}"
        edges = "kvgate_agent.sidecar.edge.client_conn" not in plain
    names = [n.strip() for n in args.passes.split(",") if n.strip()]
    if unknown := [n for n in names if n not in PASSES]:
        print(f"unknown passes {unknown}; choose from {list(PASSES)}", file=sys.stderr)
        return 2
    up = subprocess.Popen(
        [sys.executable, "-m", "kvgate_bench.stages.ends", "upstream",
         "--tokens", str(args.tokens), "--itl-ms", str(args.itl_ms)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    probe = Probe()
    result: dict[str, Any] = {
        "build": build,
        "edges": edges,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": dict(machine()),
        "cpus": sorted(os.sched_getaffinity(0)),
        "args": {k: str(v) for k, v in vars(args).items()},
        "passes": {},
    }
    try:
        assert up.stdout is not None
        port = int(up.stdout.readline())
        for name in names:
            loop, probed = PASSES[name]
            if probed:
                if edges:
                    probe.boundary()
                probe.install()
            print(f"pass {name}: {loop}, probe {'on' if probed else 'off'}", file=sys.stderr)
            records = run_pass(loop, port, args, probe if probed else None)
            cpu = [r[4] for r in records if r[0] == "cpu"]
            records = [r for r in records if r[0] != "cpu"]
            rounds = sum(1 for r in records if r[0] == "chat")  # warm-up included
            entry: dict[str, Any] = {"loop": loop, "probed": probed,
                                     "client": client_rows(records)}  # fmt: skip
            entry["cpu_us_per_round"] = cpu[0] / 1e3 / rounds if cpu and rounds else None
            if probed:
                entry["stages"] = stage_rows(records, probe)
            entry["errors"] = sum(1 for r in records if r[5] != 200)
            result["passes"][name] = entry
            probe.uninstall()
            probe.clear()
    finally:
        up.kill()
        up.wait()
    result["missing"] = sorted(set(probe.missing))
    result["wrapper_cost_us"] = wrapper_cost_ns() / 1e3
    print(render(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))
    return 0
