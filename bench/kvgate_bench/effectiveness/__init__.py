"""Admission effectiveness in virtual time: seeded workloads, the engine model, arms in front of
it (no admission, a tuned concurrency cap, per-tenant token buckets, llm-d's saturation
shedding, today's kvgate), and goodput against SLOs. Run ``python -m kvgate_bench.effectiveness``
(see :mod:`kvgate_bench.effectiveness.__main__`).

The rooms, each a sub-package, lower ones first (none imports a higher one):

- :mod:`.model`: the engine model and the workloads: schedules (``schedule``, ``workloads``,
  ``sessions``), the virtual-time driver and its arm interface (``driver``, ``gate``), the
  engines a ``--profile`` names (``engines``) and a run's figures (``metrics``);
- :mod:`.arms`: what a platform team would put in front of the engine (``registry`` names and
  builds them; the baselines, kvgate's arms);
- this package's own modules, the sweep: ``calibration`` (load 1), ``runner`` (workload x load x
  arm x setting x seed, the best of each arm), ``replay`` (reject precision, Retry-After error)
  and ``__main__`` (the command);
- :mod:`.pool`: N replicas behind a router on one virtual clock (``--replicas``);
- :mod:`.realtime`: the same schedule over HTTP through the sidecar and kvgate-sim;
- :mod:`.report`: the printed tables, the plots, the progress line.
"""
