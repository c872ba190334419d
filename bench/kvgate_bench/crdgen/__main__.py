"""``python -m kvgate_bench.crdgen [--check]`` (``scripts/gen-crds``): write the CRDs, or check the
committed copies; the exit status (0; 1: a copy differs under ``--check``; 2: a source and a
model disagree)."""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence

from kvgate_bench.crdgen.crds import COPIES, REPO, generate_all
from kvgate_bench.crdgen.splice import SourceError


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="scripts/gen-crds",
        description="Generate crds/*.yaml and charts/kvgate/crds/*.yaml from the pydantic "
        "models of agent/kvgate_agent/contract/ and the sources in crds/source/.",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 when a committed copy differs from what would be written",
    )
    args = p.parse_args(argv)
    try:
        crds = generate_all()
    except SourceError as exc:
        print(f"gen-crds: {exc}", file=sys.stderr)
        return 2
    stale = 0
    for directory in COPIES:
        for name, text in crds.items():
            path = directory / name
            now = path.read_text() if path.exists() else ""
            if now == text:
                continue
            rel = path.relative_to(REPO)
            if args.check:
                stale += 1
                diff = difflib.unified_diff(
                    now.splitlines(), text.splitlines(), f"{rel} (committed)", f"{rel} (generated)",
                    lineterm="", n=1,
                )  # fmt: skip
                print("\n".join(list(diff)[:40]), file=sys.stderr)
            else:
                path.write_text(text)
                print(f"wrote {rel}")
    if stale:
        print(f"gen-crds: {stale} CRD file(s) differ from their sources: run scripts/gen-crds",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
