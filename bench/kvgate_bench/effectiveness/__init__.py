"""Admission effectiveness in virtual time: seeded workloads, the engine model, arms in front of
it (no admission, a tuned concurrency cap, per-tenant token buckets, llm-d's saturation
shedding, today's kvgate), and goodput against SLOs. Run ``python -m kvgate_bench.effectiveness``
(see :mod:`kvgate_bench.effectiveness.__main__`).

Modules: :mod:`.workloads` (schedules; :mod:`.sessions`: the ``multi-turn`` workload's
sessions), :mod:`.driver` (the virtual-time loop and the arm
interface), :mod:`.arms`, :mod:`.metrics`, :mod:`.runner` (calibration, sweeps, tuning).
"""
