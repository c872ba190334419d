"""``python -m kvgate_bench.compiled``: build kvgate's mypyc-compiled modules as the agent image
does (``scripts/build-mypyc``, the modules of ``scripts/mypyc-modules.txt``) into a cache, and
check that the compiled admission core decides exactly as the pure-Python one.

The build goes to ``~/.cache/kvgate/mypyc/<hash>`` (``$KVGATE_MYPYC_CACHE`` overrides the
parent), the hash covering the compiled modules and every kvgate_agent module they import, the
module list, the build script and the mypy version, so a stale build is never reused; it takes
about two and a half minutes of CPU. :func:`decision_trace` is a seeded workload on one
controller with an injected clock (submits across tenants, priorities and sizes that reach
admitted, degraded, queued and refused outcomes, releases, token observations, queue pumps);
``--compare`` runs it in a subprocess on the compiled build and in this process on the sources,
and exits 1 if any decision differs; so with the request bodies' decoding (:func:`body_trace`)
and with HTTP exchanges through a sidecar whose server leg, upstream leg and pipeline are the
compiled modules (:func:`kvgate_bench.compiled_http.http_trace`, chat and streamed requests
among them).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

from kvgate_bench.compiled_http import http_trace as http_trace

REPO = Path(__file__).resolve().parents[2]
AGENT = REPO / "agent" / "kvgate_agent"
BUILD_SCRIPT = REPO / "scripts" / "build-mypyc"
MODULES_FILE = REPO / "scripts" / "mypyc-modules.txt"


def module_paths() -> list[str]:
    """The listed modules, as paths under the package's parent (``kvgate_agent/...py``)."""
    out = []
    for line in MODULES_FILE.read_text().splitlines():
        path = line.split("#", 1)[0].strip()
        if path:
            out.append(path)
    return out


def module_names() -> list[str]:
    """The listed modules' dotted names."""
    return [p.removesuffix(".py").replace("/", ".") for p in module_paths()]


def _sources() -> list[Path]:
    """The listed modules and every kvgate_agent module they import, transitively: what a
    compiled module's code and types come from."""
    seen: set[Path] = set()
    todo = [AGENT.parent / p for p in module_paths()]
    while todo:
        path = todo.pop()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvgate_agent"):
                base = AGENT.parent / Path(*(node.module or "").split("."))
                todo += [base.with_suffix(".py"), base / "__init__.py"]
                todo += [base / f"{a.name}.py" for a in node.names]
    return sorted(seen)


def build_hash() -> str:
    """A digest of everything a build depends on (the compiled modules and what they import,
    the list, the script, the mypy version)."""
    h = hashlib.sha256()
    for path in _sources():
        h.update(str(path.relative_to(AGENT)).encode() + b"\0" + path.read_bytes())
    h.update(MODULES_FILE.read_bytes() + BUILD_SCRIPT.read_bytes())
    h.update(metadata.version("mypy").encode())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    """Where the build for the current sources lives (it may not exist yet)."""
    root = Path(os.environ.get("KVGATE_MYPYC_CACHE", Path.home() / ".cache" / "kvgate" / "mypyc"))
    return root / build_hash()


def cached() -> Path | None:
    """The finished build for the current sources, or None."""
    d = cache_dir()
    return d if (d / "done").exists() else None


def build() -> Path:
    """The build for the current sources, made now (``scripts/build-mypyc``) unless cached.

    Raises:
        RuntimeError: the build failed (its output in the message).
    """
    got = cached()
    if got is not None:
        return got
    d = cache_dir()
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    shutil.copytree(AGENT, d / "kvgate_agent", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    env = {**os.environ, "MYPYC": str(Path(sys.executable).parent / "mypyc")}
    run = subprocess.run(
        [str(BUILD_SCRIPT), str(d), sys.executable], env=env, capture_output=True, text=True
    )
    if run.returncode != 0:
        raise RuntimeError(f"build-mypyc failed:\n{run.stdout[-3000:]}{run.stderr[-3000:]}")
    (d / "done").write_text(run.stdout)
    return d


def decision_trace(seed: int = 7, steps: int = 3000) -> list[list[object]]:
    """Every decision of a seeded workload on one controller (injected clock), as JSON-ready
    rows: ``[step, operation, outcome, reason, status, max_tokens, retry_after (ms), queue
    length, in flight, KV reserved]``."""
    from kvgate_agent.admission import AdmissionConfig, AdmissionController, AdmissionRequest
    from kvgate_agent.admission.decision import Ticket, Waiter
    from kvgate_agent.contract.policy import parse_policy
    from kvgate_bench.decision_inputs import POLICY
    from kvgate_bench.kit.toolkit import FakeClock

    policy = json.loads(json.dumps(POLICY))
    spec = policy["spec"]
    spec["capacity"] = {"kvCacheTokens": 150_000}
    spec["concurrency"] = {"maxRequests": 24}
    spec["rateLimits"][0].update(requestsPerMinute=600, tokensPerMinute=400_000)
    clock = FakeClock(1000.0)
    ctl = AdmissionController(AdmissionConfig.from_policy(parse_policy(policy).spec), clock)
    rnd = random.Random(seed)
    # The prompts' block hashes (prefix-aware reservations) and the engine's cached tokens,
    # drawn apart so that the rest of the trace is the same with or without them.
    prefixes = random.Random(seed + 1)
    tickets: list[Ticket] = []
    waiters: list[Waiter] = []
    rows: list[list[object]] = []

    def row(i: int, op: str, d: object) -> None:
        outcome = getattr(d, "outcome", None)
        reason = getattr(d, "reason", None)
        rows.append([
            i, op, getattr(outcome, "value", None), getattr(reason, "value", None),
            getattr(d, "status", None), getattr(d, "max_tokens", None),
            round(1000 * (getattr(d, "retry_after", 0.0) or 0.0)),
            ctl.stats().queue_length, ctl.stats().in_flight, ctl.stats().kv_reserved_tokens,
        ])  # fmt: skip

    for i in range(steps):
        clock.advance(rnd.choice((0.0, 0.001, 0.01, 0.1, 0.5)))
        pick = rnd.random()
        if pick < 0.45:
            req = AdmissionRequest(
                f"t{rnd.randrange(12)}",
                rnd.choice((10, 200, 2000, 9000, 160_000)),
                rnd.choice((16, 256, 1024, 4096, 20_000)),
                rnd.randrange(3),
                rnd.choice((1, 1, 2)),
            )
            if prefixes.random() < 0.5:
                conv = prefixes.randrange(6) * 100_000
                req.prefix_blocks = list(range(conv, conv + req.prompt_tokens // 16))
            d = ctl.submit(req)
            row(i, "submit", d)
            if d.ticket is not None:
                tickets.append(d.ticket)
            elif d.waiter is not None:
                waiters.append(d.waiter)
        elif pick < 0.8 and tickets:
            t = tickets.pop(rnd.randrange(len(tickets)))
            cached = prefixes.choice((None, 0, t.prefix_run, t.prompt_tokens))
            ctl.release(
                t,
                completion_tokens=rnd.randrange(0, 600),
                prompt_tokens=None,
                cached_tokens=cached,
            )
            row(i, "release", None)
        elif pick < 0.9 and tickets:
            ctl.live.observe_tokens(rnd.choice(tickets), rnd.randrange(0, 800))
            row(i, "observe", None)
        else:
            ctl.pump()
            for w in ctl.take_resolved():
                got = w.decision
                row(i, "resolved", got)
                if got is not None and got.ticket is not None:
                    tickets.append(got.ticket)
            waiters = [w for w in waiters if w.decision is None]
    return rows


#: Request bodies :func:`body_trace` decodes: accepted ones, and one for each way a body is
#: refused with 400 (not UTF-8, not JSON, not an object, a constant, a number past a double's
#: range, a repeated key, on msgspec's fast path and on the reference's).
BODIES: tuple[bytes, ...] = (
    b'{"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}',
    b'{"a": 1.5e3, "b": [1, 2, {"c": null}], "d": 123456789012345678901234567890}',
    b'{"temperature": 1e400}',
    b'{"a": [-1e400]}',
    b'{"max_tokens": 1, "max_tokens": 2}',
    b'{"a": {"k": 1, "k": 2}}',
    b'{"a": NaN}',
    b'{"a": Infinity}',
    b"[1, 2]",
    b'{"a": 1',
    b"\xff\xfe",
    b'{"a": "\\ud800", "b": 1e400}',
)


def body_trace() -> list[list[object]]:
    """Each of :data:`BODIES` through the sidecar's body decoding
    (:func:`~kvgate_agent.sidecar.reading.jsonbody.decode_object`): ``["ok", keys]`` or ``[status,
    param, message]`` of the 400, as JSON-ready rows."""
    from kvgate_agent.sidecar.reading.jsonbody import decode_object
    from kvgate_agent.sidecar.reading.openai_errors import RequestError

    rows: list[list[object]] = []
    for raw in BODIES:
        try:
            rows.append(["ok", sorted(decode_object(raw))])
        except RequestError as exc:
            rows.append([exc.status, exc.param, exc.message])
    return rows


def compiled_trace(build_dir: Path, seed: int, steps: int) -> list[list[object]]:
    """:func:`decision_trace` run in a subprocess on the compiled build (which it checks is
    what imports).

    Raises:
        RuntimeError: the subprocess failed or did not import the compiled modules.
    """
    return _on_build(build_dir, f"compiled.decision_trace({seed}, {steps})")


def compiled_body_trace(build_dir: Path) -> list[list[object]]:
    """:func:`body_trace` run in a subprocess on the compiled build (see :func:`compiled_trace`;
    raises the same)."""
    return _on_build(build_dir, "compiled.body_trace()")


def overlay(build_dir: Path, dest: Path) -> Path:
    """``dest`` (made afresh) holding this checkout's ``kvgate_agent`` sources with the
    extension modules of ``build_dir`` (:func:`build`) over them: what the agent image installs,
    for a ``PYTHONPATH``. A build is keyed by the compiled modules and what they import, so its
    copy of the other modules may be older than the checkout's; the overlay takes those from
    the checkout. Returns ``dest``."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(
        AGENT, dest / "kvgate_agent", ignore=shutil.ignore_patterns("__pycache__", "*.so")
    )
    for so in build_dir.glob("*.so"):  # mypyc's shared runtime module
        shutil.copy2(so, dest / so.name)
    for so in (build_dir / "kvgate_agent").rglob("*.so"):
        shutil.copy2(so, dest / so.relative_to(build_dir))
    return dest


def compiled_http_trace(build_dir: Path, workdir: Path) -> list[list[object]]:
    """:func:`http_trace` run in a subprocess on the compiled build (the overlay of
    ``build_dir`` over this checkout's sources, made in ``workdir``: the sidecar imports more
    than the compiled modules); raises as :func:`compiled_trace`."""
    return _on_build(overlay(build_dir, workdir / "agent"), "compiled.http_trace()")


def _on_build(build_dir: Path, call: str) -> list[list[object]]:
    """The JSON rows ``call`` (an expression over this module, named ``compiled``) returns in a
    subprocess whose imports come from ``build_dir``."""
    code = (
        "import json, sys\n"
        "from kvgate_bench import compiled\n"
        "plain = compiled.plain_modules()\n"
        "if plain: sys.exit(f'not compiled: {plain}')\n"
        f"print(json.dumps({call}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(build_dir)}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"compiled {call} failed: {run.stdout[-2000:]}{run.stderr[-2000:]}")
    rows: list[list[object]] = json.loads(run.stdout)
    return rows


def plain_modules() -> list[str]:
    """The listed modules that import as Python source here (none on a compiled build)."""
    import importlib

    return [
        n for n in module_names() if not (importlib.import_module(n).__file__ or "").endswith(".so")
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: build (or find) the compiled modules; with ``--compare`` also check the
    decisions. Returns 1 when they differ."""
    p = argparse.ArgumentParser(prog="python -m kvgate_bench.compiled", description=__doc__)
    p.add_argument("--compare", action="store_true", help="compare compiled and pure decisions")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--steps", type=int, default=3000)
    args = p.parse_args(argv)
    d = build()
    print(f"compiled build: {d}")
    if not args.compare:
        return 0
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        http = compiled_http_trace(d, Path(tmp))
    for what, pure, comp in (
        (
            "decisions",
            decision_trace(args.seed, args.steps),
            compiled_trace(d, args.seed, args.steps),
        ),
        ("request bodies", body_trace(), compiled_body_trace(d)),
        ("HTTP exchanges through a sidecar", http_trace(), http),
    ):
        diff = next((i for i, (a, b) in enumerate(zip(pure, comp, strict=True)) if a != b), None)
        if diff is None:
            print(f"{len(pure)} {what}: compiled and pure agree")
        else:
            failed = 1
            print(f"{what} {diff} differs: pure {pure[diff]}, compiled {comp[diff]}")
    return failed


if __name__ == "__main__":
    sys.exit(main())
