"""The resume file of ``python -m kvgate_bench.real_engine --resume FILE``: what a run has
finished, so that the next invocation goes on where it stopped (pure, but for :func:`load`,
:func:`save` and :func:`hold`).

The document (JSON)::

    {"kind": "kvgate-real-engine", "version": 1,
     "config": {...},        # the options a result depends on (model, slots, lengths, sizes)
     "tune_seed": 1,
     "calibration": {...},   # the first invocation's, reused (null until measured)
     "profile": {...},       # the engine profile fitted by the calibration (null until then)
     "sweeps": {"multi-tenant:2": [{"arm", "params", "row"}, ...]},  # the tune seed's runs
     "tuned": {"multi-tenant:2": {"concurrency-cap": {...}, "token-bucket": {...}}},
     "runs": [{"cell", "seed", "arm", "row"}, ...],   # arms of cells not finished yet
     "cells": [{"cell", "workload", "load", "seed", "rows", "virtual", "comparison", ...}],
     "replaced": [{"cell", "seed", "arm", "row", "why"}, ...],  # rows --rerun set aside
     "invocations": [{"started", "wall_s", "units"}, ...]}

A cell (one workload at one load on one seed) is finished when every arm ran; its ``runs``
then move into ``cells`` with the virtual twin's rows. :func:`save` writes atomically (a
temporary file in the same folder, then ``os.replace``) after merging what the file on disk
holds (:func:`merge`), so a file is never half-written and two invocations' results add up.

``--rerun ARMS`` (:func:`reopen`) reopens a finished cell: the named arms' rows move to
``replaced`` (kept, with why), the other arms' rows back to ``runs``, and the next invocation
runs only the named arms, on fresh servers, and closes the cell again (its twin recomputed).
It is for an arm whose code changed after it ran (a kvgate arm after an admission change: the
baselines' rows stay valid). A reopened file is written over, not merged (:func:`write`):
no other invocation may be writing the same file then, and :func:`hold` makes sure of it.
"""

from __future__ import annotations

import copy
import fcntl
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

KIND = "kvgate-real-engine"
VERSION = 1


def jsonable(x: Any) -> Any:
    """``x`` as JSON reads it back (tuples as lists, keys as strings): what the file will hold,
    so that a document compares equal before and after a save."""
    return json.loads(json.dumps(x, default=str))


def new_doc(config: Mapping[str, Any], tune_seed: int) -> dict[str, Any]:
    """An empty resume document for a run with ``config`` tuned on ``tune_seed``."""
    return {
        "kind": KIND,
        "version": VERSION,
        "config": dict(config),
        "tune_seed": tune_seed,
        "calibration": None,
        "profile": None,
        "sweeps": {},
        "tuned": {},
        "runs": [],
        "cells": [],
        "invocations": [],
    }


def check(doc: Mapping[str, Any], config: Mapping[str, Any], tune_seed: int) -> None:
    """Raise ``ValueError`` (one line) when ``doc`` is not a resume document of this version,
    or was made with another ``config`` (a key both have, with another value) or tune seed."""
    if doc.get("kind") != KIND or doc.get("version") != VERSION:
        raise ValueError(f"not a {KIND} resume file of version {VERSION}")
    if doc.get("tune_seed") != tune_seed:
        raise ValueError(
            f"the resume file was tuned on seed {doc.get('tune_seed')}, not {tune_seed}"
        )
    old = doc.get("config") or {}
    for k, v in config.items():
        if k in old and old[k] != v:
            raise ValueError(f"the resume file was made with {k}={old[k]!r}, not {v!r}")


def finished(doc: Mapping[str, Any]) -> set[tuple[str, int]]:
    """The finished (cell, seed) pairs."""
    return {(c["cell"], int(c["seed"])) for c in doc["cells"]}


def run_row(doc: Mapping[str, Any], cell: str, seed: int, arm: str) -> dict[str, Any] | None:
    """The row of ``arm`` on (``cell``, ``seed``) when it ran and its cell is not finished."""
    for r in doc["runs"]:
        if r["cell"] == cell and int(r["seed"]) == seed and r["arm"] == arm:
            return dict(r["row"])
    return None


def add_run(doc: dict[str, Any], cell: str, seed: int, arm: str, row: Mapping[str, Any]) -> None:
    """Record ``arm``'s ``row`` on (``cell``, ``seed``) (replacing an earlier one)."""
    doc["runs"] = [
        r
        for r in doc["runs"]
        if not (r["cell"] == cell and int(r["seed"]) == seed and r["arm"] == arm)
    ]
    doc["runs"].append({"cell": cell, "seed": seed, "arm": arm, "row": jsonable(row)})


def sweep_row(
    doc: Mapping[str, Any], cell: str, arm: str, params: Mapping[str, Any]
) -> dict[str, Any] | None:
    """The tune seed's row of ``arm`` at ``params`` on ``cell``, when it ran."""
    for s in doc["sweeps"].get(cell, ()):
        if s["arm"] == arm and s["params"] == dict(params):
            return dict(s["row"])
    return None


def add_sweep(
    doc: dict[str, Any], cell: str, arm: str, params: Mapping[str, Any], row: Mapping[str, Any]
) -> None:
    """Record the tune seed's ``row`` of ``arm`` at ``params`` on ``cell``."""
    runs = [
        s for s in doc["sweeps"].get(cell, ()) if not (s["arm"] == arm and s["params"] == params)
    ]
    entry = {"arm": arm, "params": jsonable(params), "row": jsonable(row)}
    doc["sweeps"][cell] = [*runs, entry]


def close_cell(doc: dict[str, Any], entry: Mapping[str, Any]) -> None:
    """Move a finished cell (``entry``: its ``cell``, ``seed``, ``rows``, ...) into ``cells``
    and drop its arms from ``runs``."""
    cell, seed = entry["cell"], int(entry["seed"])
    doc["runs"] = [r for r in doc["runs"] if not (r["cell"] == cell and int(r["seed"]) == seed)]
    doc["cells"] = [c for c in doc["cells"] if not (c["cell"] == cell and int(c["seed"]) == seed)]
    doc["cells"].append(jsonable(entry))


def reopen(doc: dict[str, Any], cell: str, seed: int, arms: tuple[str, ...], why: str) -> list[str]:
    """Reopen the finished (``cell``, ``seed``) of ``doc`` so that ``arms`` run again (module
    docstring): the arms' rows into ``replaced`` with ``why``, the other rows into ``runs``.
    Returns the arms set aside (those the cell had); [] when the cell is not finished."""
    found = [c for c in doc["cells"] if c["cell"] == cell and int(c["seed"]) == seed]
    if not found:
        return []
    c = found[0]
    doc["cells"] = [x for x in doc["cells"] if x is not c]
    out: list[str] = []
    for row in c["rows"]:
        arm = row["arm"]
        if arm in arms:
            entry = {"cell": cell, "seed": seed, "arm": arm, "row": row, "why": why}
            doc.setdefault("replaced", []).append(jsonable(entry))
            out.append(arm)
        else:
            add_run(doc, cell, seed, arm, row)
    return out


def merge(base: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """``new`` merged into a copy of ``base`` (the file on disk): ``new``'s calibration,
    profile and tuning where ``base`` has none; finished cells, runs and sweep rows by key,
    ``new``'s replacing ``base``'s; a run whose cell is finished in either dropped;
    invocations and replaced rows concatenated (each once). Raises ``ValueError`` when the
    two were made with other configs or tune seeds, or hold different calibrations."""
    check(base, new["config"], int(new["tune_seed"]))
    out = copy.deepcopy(dict(base))
    for k in ("calibration", "profile"):
        if out.get(k) is None:
            out[k] = copy.deepcopy(new.get(k))
        elif new.get(k) is not None and new[k] != out[k]:
            raise ValueError(f"the two resume documents hold different {k}s")
    for cell, tuned in new["tuned"].items():
        out["tuned"].setdefault(cell, copy.deepcopy(tuned))
    for cell, sweep in new["sweeps"].items():
        for s in sweep:
            add_sweep(out, cell, s["arm"], s["params"], s["row"])
    for c in new["cells"]:
        close_cell(out, c)
    done = finished(out)
    for r in new["runs"]:
        if (r["cell"], int(r["seed"])) not in done:
            add_run(out, r["cell"], int(r["seed"]), r["arm"], r["row"])
    if new.get("replaced"):
        _concat_once(out.setdefault("replaced", []), new["replaced"])
    _concat_once(out["invocations"], new["invocations"])
    return out


def _concat_once(into: list[Any], more: Any) -> None:
    """Append to ``into`` each entry of ``more`` it does not hold yet (equal as JSON)."""
    seen = {json.dumps(x, sort_keys=True) for x in into}
    for x in more:
        if json.dumps(x, sort_keys=True) not in seen:
            into.append(copy.deepcopy(x))


#: The top-level keys a resume document must hold, with their JSON types.
SHAPE: tuple[tuple[str, type, str], ...] = (
    ("config", dict, "an object"),
    ("tune_seed", int, "an integer"),
    ("tuned", dict, "an object"),
    ("sweeps", dict, "an object"),
    ("runs", list, "a list"),
    ("cells", list, "a list"),
)


def validate(doc: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` (one line) when ``doc`` is not a resume document of this version
    with the module docstring's shape: :data:`SHAPE`'s keys, each finished cell an object with
    its ``cell``, integer ``seed`` and ``rows`` (objects naming their ``arm``), each run an
    object with its ``cell``, ``seed``, ``arm`` and ``row``."""
    if doc.get("version") != VERSION:
        raise ValueError(f"version {doc.get('version')!r}, not {VERSION}")
    for key, kind, name in SHAPE:
        if not isinstance(doc.get(key), kind) or isinstance(doc.get(key), bool):
            raise ValueError(f"malformed: {key!r} is missing or not {name}")
    for i, c in enumerate(doc["cells"]):
        ok = isinstance(c, dict) and isinstance(c.get("cell"), str)
        ok = ok and isinstance(c.get("seed"), int) and isinstance(c.get("rows"), list)
        if not ok or not all(isinstance(r, dict) and "arm" in r for r in c["rows"]):
            raise ValueError(f"malformed: cells[{i}] lacks its cell, seed or rows")
    for i, r in enumerate(doc["runs"]):
        if not isinstance(r, dict) or not {"cell", "seed", "arm", "row"} <= set(r):
            raise ValueError(f"malformed: runs[{i}] lacks its cell, seed, arm or row")


def load(path: Path) -> dict[str, Any] | None:
    """The resume document at ``path``; None when there is no file. Raises ``ValueError`` for
    a file that is empty, not JSON or not such a document."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    if not text.strip():
        raise ValueError(f"{path}: empty file")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(doc, dict) or doc.get("kind") != KIND:
        raise ValueError(f"{path}: not a {KIND} resume file")
    return doc


def save(path: Path, doc: Mapping[str, Any]) -> dict[str, Any]:
    """Write ``doc`` merged into what ``path`` holds (:func:`merge`) atomically (module
    docstring); returns what was written."""
    on_disk = load(path)
    out = merge(on_disk, doc) if on_disk is not None else copy.deepcopy(dict(doc))
    return write(path, out)


def write(path: Path, doc: Mapping[str, Any]) -> dict[str, Any]:
    """Write ``doc`` to ``path`` atomically, over what it holds (no merge: a reopened file,
    :func:`reopen`); returns what was written."""
    out = copy.deepcopy(dict(doc))
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or Path("."))
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(out, fh, indent=1, default=str)
            fh.write("\n")
        os.chmod(tmp, 0o644)  # mkstemp's 0600 is for secrets; this is a report
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def hold(path: Path, exclusive: bool) -> int:
    """Lock the resume file ``path`` for this invocation: an advisory ``flock`` on the file
    ``.NAME.lock`` beside it, shared by invocations that merge their rows (:func:`save`, any
    number at once), exclusive for one that reopens cells (``--rerun``: :func:`write` goes
    over the file, so no other invocation may hold it). Returns the lock's file descriptor,
    held until it is closed or the process ends. Raises ``ValueError`` (one line) when another
    invocation holds the lock in a way this one cannot share."""
    lock = path.with_name(f".{path.name}.lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        who = "another invocation runs on it" if exclusive else "a --rerun invocation holds it"
        raise ValueError(f"{path}: {who} ({lock})") from None
    return fd
