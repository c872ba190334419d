"""``python -m kvgate_bench.real_engine --report FILE`` on resume files (no clock, no server):
its refusals, what it says is left, what it will not call a verdict, and ``--seeds`` /
``--cells``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvgate_bench.real_engine import resume
from kvgate_bench.real_engine.__main__ import main

PREFIX = "python -m kvgate_bench.real_engine: error: "


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("", "empty file"),
        ("  \n", "empty file"),
        ("[1", "not JSON"),
        ('{"kind": "other"}', "not a kvgate-real-engine resume file"),
        ('{"kind": "kvgate-real-engine", "version": 1}', "'config' is missing or not an object"),
        ('{"kind": "kvgate-real-engine", "version": 7}', "version 7, not 1"),
        (
            json.dumps({**resume.new_doc({}, 1), "cells": [{"cell": "multi-tenant:2"}]}),
            "cells[0] lacks its cell, seed or rows",
        ),
        (
            json.dumps(
                {
                    **resume.new_doc({}, 1),
                    "cells": [
                        {
                            "cell": "multi-tenant:2",
                            "seed": 2,
                            "rows": [{"arm": a, "good_tokens": [1.0]} for a in ("none", "kvgate")],
                        }
                    ],
                }
            ),
            "malformed resume file (KeyError: 'span_s')",
        ),
    ],
)
def test_a_bad_file_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, words: str
) -> None:
    path = tmp_path / "real.json"
    path.write_text(text)
    assert main(["--report", str(path)]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith(f"{PREFIX}--report {path}: ")
    assert out.err.count("\n") == 1 and words in out.err, out.err


def test_a_missing_file_is_refused_the_same_way(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--report", str(tmp_path / "absent.json")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == f"{PREFIX}--report {tmp_path / 'absent.json'}: no such file\n"
