"""kvgate in front of a real engine: llama.cpp's llama-server (issue 24).

``python -m kvgate_bench.real_engine`` (:mod:`kvgate_bench.real_engine.__main__`) calibrates the
SLO and the capacity on the server, runs ``none``, a tuned concurrency cap, a tuned token bucket
and kvgate over real HTTP, and compares each with the virtual benchmark on a step-time model
fitted to the same server. The pure parts: :mod:`~kvgate_bench.real_engine.calibration` and
:mod:`~kvgate_bench.real_engine.report`; the HTTP client: :mod:`~kvgate_bench.real_engine.client`;
the server: :mod:`~kvgate_bench.real_engine.engine`. The run's steps: the options
(:mod:`~kvgate_bench.real_engine.cli`), the calibration on the server
(:mod:`~kvgate_bench.real_engine.calibration_run`), the cells through the arms
(:mod:`~kvgate_bench.real_engine.cells`) and their virtual counterpart
(:mod:`~kvgate_bench.real_engine.virtual`).
"""
