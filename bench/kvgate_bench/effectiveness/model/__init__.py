"""The engine model and the workloads: what every effectiveness run is made of.

``schedule`` (a schedule's records and the draws the workloads share), ``workloads`` (the open
workloads and :func:`~kvgate_bench.effectiveness.model.workloads.generate` for every workload),
``sessions`` (``multi-turn``'s closed-loop sessions), ``gate`` (what the driver offers an arm and
records of a run), ``driver`` (one schedule through one arm into the engine model on a virtual
clock), ``engines`` (the engine a ``--profile`` names, with its SLO) and ``metrics`` (a run's
goodput, SLO attainment, latencies, preemptions, fairness). Nothing here knows an arm but by its
interface (:class:`~kvgate_bench.effectiveness.model.gate.Arm`).
"""
