"""kvgate in front of a real engine: llama.cpp's llama-server (issues 24 and 33).

``python -m kvgate_bench.real_engine`` (:mod:`kvgate_bench.real_engine.__main__`) calibrates the
SLO, the engine profile and the capacity on the server, runs ``none``, a tuned concurrency cap,
a tuned token bucket, ``kvgate`` and ``kvgate-empty`` over real HTTP, each arm on a fresh
llama-server with its prompt cache off, and compares each row with its virtual twin on the
fitted profile; resumable (``--resume``), its verdict printed from the file (``--report``).

The pure parts: the plan (:mod:`~kvgate_bench.real_engine.plan`), the calibration's arithmetic
(:mod:`~kvgate_bench.real_engine.calibration`, :mod:`~kvgate_bench.real_engine.profile_fit`),
the rows and their intervals (:mod:`~kvgate_bench.real_engine.rows`,
:mod:`~kvgate_bench.real_engine.stats`), the resume file
(:mod:`~kvgate_bench.real_engine.resume`), the twin's agreement
(:mod:`~kvgate_bench.real_engine.agreement`), the verdict
(:mod:`~kvgate_bench.real_engine.verdict`) and the printed lines
(:mod:`~kvgate_bench.real_engine.report`). What is sent:
:mod:`~kvgate_bench.real_engine.prompts`; the HTTP client:
:mod:`~kvgate_bench.real_engine.client` (the sidecar:
:mod:`~kvgate_bench.real_engine.sidecar_arm`, its limit:
:mod:`~kvgate_bench.real_engine.limit_trace`); the server:
:mod:`~kvgate_bench.real_engine.engine`. The run's steps: the options
(:mod:`~kvgate_bench.real_engine.cli`), the calibration on the server
(:mod:`~kvgate_bench.real_engine.calibration_run`), the sweep and the cells
(:mod:`~kvgate_bench.real_engine.cells`) and their virtual twin
(:mod:`~kvgate_bench.real_engine.virtual`).
"""
